"""engine.cost_cache: the forward's measured costs are timed once per machine, weights, threads and
code, and read back by the next target; anything else in the fingerprint measures afresh, a broken
entry is measured over, and the directory keeps a bounded number of files."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from draftmesh import compute, cost_cache
from draftmesh.backend import _MEASUREMENT, TorchTarget
from tiny_models import tiny_target

MEASURERS = ("measure_cost_curve", "measure_batch_cost", "measure_key_cost")


def _count_measurements(monkeypatch) -> list[str]:
    calls: list[str] = []
    for name in MEASURERS:
        real = getattr(TorchTarget, name)

        def counting(self, *a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(TorchTarget, name, counting)
    return calls


def _target(cache, **kw) -> TorchTarget:
    target = tiny_target("llama", dtype=torch.float32, **kw)
    target.cost_cache = str(cache) if cache is not None else None
    return target


def test_the_second_target_reads_what_the_first_measured(tmp_path, monkeypatch):
    calls = _count_measurements(monkeypatch)
    first = _target(tmp_path)
    first.ensure_costs()
    assert sorted(calls) == sorted(MEASURERS) and not first.costs_from_cache
    assert len(list(tmp_path.glob("forward-costs-*.json"))) == 1

    calls.clear()
    second = _target(tmp_path)
    second.ensure_costs()
    assert calls == [] and second.costs_from_cache
    assert second.cost_curve == first.cost_curve and second.batch_cost == first.batch_cost
    assert second.key_cost == first.key_cost
    assert 0 < second.step_seconds < 1 and 0 < second.batch_step_seconds < 1  # timed here (next test)

    calls.clear()
    alone = _target(None)  # no cache: measured, whatever a directory holds
    alone.ensure_costs()
    assert sorted(calls) == sorted(MEASURERS) and not alone.costs_from_cache


def test_the_tables_unit_is_timed_by_the_reader(tmp_path):
    """The tables are ratios; the seconds of their unit are the reading process's own: an entry
    written under other load (here: absurd units) does not skew the budget's conversions."""
    writer = _target(tmp_path)
    writer.ensure_costs()
    (entry,) = tmp_path.glob("forward-costs-*.json")
    data = json.loads(entry.read_text())
    data["costs"]["step_seconds"], data["costs"]["batch_step_seconds"] = 123.0, 456.0
    entry.write_text(json.dumps(data))
    reader = _target(tmp_path)
    reader.ensure_costs()
    assert reader.costs_from_cache and reader.batch_cost == writer.batch_cost
    assert 0 < reader.step_seconds < 1 and 0 < reader.batch_step_seconds < 1


def test_other_weights_threads_or_measurement_get_their_own_entry(tmp_path, monkeypatch):
    model = tiny_target("llama", dtype=torch.float32).model
    key = cost_cache.fingerprint(model, threads=1, measurement=_MEASUREMENT)
    assert key == cost_cache.fingerprint(model, threads=1, measurement=_MEASUREMENT)
    assert key != cost_cache.fingerprint(model, threads=2, measurement=_MEASUREMENT)
    assert key != cost_cache.fingerprint(model, threads=1, measurement={**_MEASUREMENT, "context": 64})
    assert key != cost_cache.fingerprint(tiny_target("llama", dtype=torch.float32, seed=1).model, threads=1,
                                         measurement=_MEASUREMENT)  # same shapes, other weights
    assert key != cost_cache.fingerprint(tiny_target("llama", dtype=torch.float64).model, threads=1,
                                         measurement=_MEASUREMENT)

    calls = _count_measurements(monkeypatch)
    _target(tmp_path).ensure_costs()
    calls.clear()
    other = _target(tmp_path, seed=1)
    other.ensure_costs()
    assert sorted(calls) == sorted(MEASURERS) and not other.costs_from_cache
    assert len(list(tmp_path.glob("forward-costs-*.json"))) == 2

    calls.clear()
    width = compute.get_threads()
    compute.set_threads(width + 1)
    try:
        wider = _target(tmp_path)
        wider.ensure_costs()
    finally:
        compute.set_threads(width)
    assert sorted(calls) == sorted(MEASURERS) and not wider.costs_from_cache


def test_a_broken_entry_is_measured_over(tmp_path, monkeypatch):
    _target(tmp_path).ensure_costs()
    (entry,) = tmp_path.glob("forward-costs-*.json")
    for broken in ("{not json", json.dumps({"format": cost_cache.FORMAT, "key": entry.stem[len("forward-costs-"):],
                                            "costs": {"cost_curve": {}}})):
        entry.write_text(broken)
        calls = _count_measurements(monkeypatch)
        target = _target(tmp_path)
        target.ensure_costs()
        assert sorted(calls) == sorted(MEASURERS) and not target.costs_from_cache
        assert cost_cache.load(tmp_path, entry.stem[len("forward-costs-"):]) is not None  # rewritten whole
        monkeypatch.undo()


def test_an_unwritable_cache_costs_only_the_measurement(tmp_path, caplog):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the directory should be")
    target = _target(blocker)
    with caplog.at_level(logging.WARNING, logger="draftmesh.backend"):
        target.ensure_costs()
    assert target.cost_curve and target.batch_cost and target.key_cost is not None
    assert "could not keep the measured forward costs" in caplog.text


def test_the_directory_keeps_the_newest_entries_only(tmp_path):
    costs = cost_cache.MeasuredCosts(cost_curve={1: 1.0, 2: 1.5}, step_seconds=0.03, batch_cost={2: {2: 1.1}},
                                     batch_step_seconds=0.03, key_cost=(1e-4, 4e-5))
    for i in range(cost_cache.MAX_ENTRIES + 5):
        path = cost_cache.store(tmp_path, f"k{i:03d}", costs)
        os.utime(path, (1_000_000 + i, 1_000_000 + i))  # distinct ages, oldest first
    kept = sorted(p.name for p in tmp_path.glob("forward-costs-*.json"))
    assert kept == [f"forward-costs-k{i:03d}.json" for i in range(5, cost_cache.MAX_ENTRIES + 5)]
    assert not list(tmp_path.glob(".tmp-*"))
    assert sum(p.stat().st_size for p in tmp_path.iterdir()) < cost_cache.MAX_ENTRIES * 4096
    assert cost_cache.load(tmp_path, "k036") == costs


def test_the_engine_config_reaches_the_loaded_target(tmp_path, monkeypatch):
    from draftmesh.bench.runners import load_target_spec
    from draftmesh.config import EngineConfig, load_config
    from draftmesh.verify.engine import load_target

    cfg = load_config(env={"DRAFTMESH_COST_CACHE": str(tmp_path)})
    assert cfg.engine.cost_cache == str(tmp_path)
    assert load_config(env={}).engine.cost_cache is None
    loaded = []
    monkeypatch.setattr(TorchTarget, "load", classmethod(lambda cls, spec, **kw: loaded.append((spec, kw))))
    load_target(cfg.engine)
    load_target_spec("some-model", EngineConfig(cost_cache=str(tmp_path)))
    assert [kw["cost_cache"] for _, kw in loaded] == [str(tmp_path), str(tmp_path)]


def test_processes_sharing_a_directory_measure_one_at_a_time(tmp_path, monkeypatch):
    """Replicas starting together would time their forwards on the same cores at once and store
    skewed tables: the second waits for the first's measurement and reads it."""
    import threading

    first = _target(None)
    first.ensure_costs()  # measured without the cache, stored below while the lock is held
    calls = _count_measurements(monkeypatch)
    second = _target(tmp_path)
    done = threading.Event()
    with cost_cache.measuring(tmp_path) as held:
        assert held
        waiter = threading.Thread(target=lambda: (second.ensure_costs(), done.set()))
        waiter.start()
        assert not done.wait(0.5), "the second target did not wait for the lock"
        key = cost_cache.fingerprint(first.model, threads=compute.get_threads(), measurement=_MEASUREMENT)
        cost_cache.store(tmp_path, key, cost_cache.MeasuredCosts(
            cost_curve=first.cost_curve, step_seconds=first.step_seconds, batch_cost=first.batch_cost,
            batch_step_seconds=first.batch_step_seconds, key_cost=(first.key_cost.row, first.key_cost.token)))
    waiter.join(60)
    assert done.is_set() and calls == [] and second.costs_from_cache
    assert second.batch_cost == first.batch_cost


def test_the_lock_is_given_up_after_its_wait(tmp_path):
    import threading
    import time

    with cost_cache.measuring(tmp_path) as held:
        assert held
        got: list = []

        def other():
            t0 = time.monotonic()
            with cost_cache.measuring(tmp_path, wait_s=0.3) as h:
                got.append((h, time.monotonic() - t0))

        t = threading.Thread(target=other)
        t.start()
        t.join(10)
    assert got and got[0][0] is False and got[0][1] >= 0.3
    with cost_cache.measuring(tmp_path, wait_s=0) as held:  # released with its holder
        assert held
    assert [p.name for p in tmp_path.iterdir()] == [".measuring.lock"]
