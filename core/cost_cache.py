"""The forward's measured costs, kept on disk for the next process on the same machine.

``TorchTarget.ensure_costs`` times the forward before a replica serves (the batch-1 cost curve,
the batched table and the per-key slopes the budget weighs): ~18 s for SmolLM2-135M on 2 CPU
threads, far more on one. Every replica restart, every ``draftmesh serve`` and every bench process
paid it again, for numbers that depend only on the machine, the weights and the code. With
``engine.cost_cache`` set, the first process measures and writes them here, and later ones with the
same fingerprint read them instead (a replica that restarts or scales out on an identical node is
ready ~18 s sooner). The tables are ratios to a one-token step; that step itself is timed again
by the reading process (~1 s), since the budget turns measured seconds into it.

The fingerprint covers everything the timings depend on: the weights (a sample of every
parameter), the model config, dtype, device, torch's thread count, torch's version, the CPU (model
name, usable cores), the measurement's own constants, and the code that runs the forward (this
package's backend sources and native kernels, by content). Any change measures afresh. What it
cannot see is load: a cache written on a busy machine is read on a quiet one, so leave it unset
where the costs must be measured in the run (``draftmesh bench`` figures for BENCHMARKS).

Processes sharing a directory measure one at a time (``measuring``: a lock file): replicas that
start together on one machine would otherwise time their forwards on the same cores at once, each
slowed by the others, and store those skewed tables for every later start. The one that waited
reads what the first stored.

The directory holds at most ``MAX_ENTRIES`` files of a few KB (oldest removed first) and one empty
lock file: its byte bound.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from draftmesh import compute

log = logging.getLogger(__name__)

FORMAT = 1
MAX_ENTRIES = 32
"""Files kept in a cache directory (each a few KB): one per machine/model/threads combination."""
_PREFIX = "forward-costs-"
_LOCK = ".measuring.lock"
LOCK_WAIT_S = 300.0
"""How long a process waits for another's measurement before it measures beside it (at one thread
SmolLM2's take ~36 s; a few replicas in line fit)."""
_CODE_FILES = ("backend.py", "batch_kv.py", "direct_decoder.py", "tree_attention.py", "packed_linear.py",
               "compute.py", "cost_cache.py")


@dataclass(frozen=True)
class MeasuredCosts:
    """What ``TorchTarget.ensure_costs`` measures (see its fields there)."""

    cost_curve: dict[int, float]
    step_seconds: float | None
    batch_cost: dict[int, dict[int, float]]
    batch_step_seconds: float | None
    key_cost: tuple[float, float]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "MeasuredCosts":
        curve = {int(k): float(v) for k, v in data["cost_curve"].items()}
        table = {int(r): {int(k): float(v) for k, v in row.items()} for r, row in data["batch_cost"].items()}
        key = data["key_cost"]
        if not curve or not table or len(key) != 2:
            raise ValueError("incomplete cost entry")
        return cls(cost_curve=curve, step_seconds=_opt_float(data["step_seconds"]), batch_cost=table,
                   batch_step_seconds=_opt_float(data["batch_step_seconds"]), key_cost=(float(key[0]), float(key[1])))


def _opt_float(value) -> float | None:
    return None if value is None else float(value)


def _code_digest() -> str:
    here = Path(__file__).resolve().parent
    h = hashlib.sha256()
    files = [here / name for name in _CODE_FILES] + sorted(here.glob("_*.so"))
    for path in files:
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def fingerprint(model: torch.nn.Module, *, threads: int, measurement: dict[str, Any]) -> str:
    """A digest of everything a forward's timings depend on, but load (see the module docstring);
    ``threads``: the width the forward runs at (the compute thread's, ``draftmesh.compute``)."""
    h = hashlib.sha256()
    cfg = model.config.to_json_string() if hasattr(model.config, "to_json_string") else repr(model.config)
    params = list(model.parameters())
    head = {
        "format": FORMAT, "config": cfg, "dtype": str(params[0].dtype), "device": str(params[0].device),
        "threads": threads, "torch": torch.__version__, "cpu": compute.cpu_model(), "cores": compute.usable_cpus(),
        "machine": platform.machine(), "measurement": measurement, "code": _code_digest(),
        "params": [list(p.shape) for p in params],
    }
    h.update(json.dumps(head, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for p in params:  # a sample of every tensor: another checkpoint of the same shapes differs here
            h.update(p.detach().reshape(-1)[:256].float().cpu().numpy().tobytes())
    return h.hexdigest()[:32]


def load(directory: str | os.PathLike, key: str) -> MeasuredCosts | None:
    """The costs stored under ``key``, or None (absent, unreadable or from another format)."""
    path = Path(directory) / f"{_PREFIX}{key}.json"
    try:
        data = json.loads(path.read_text())
        if data.get("format") != FORMAT or data.get("key") != key:
            return None
        return MeasuredCosts.from_json(data["costs"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextlib.contextmanager
def measuring(directory: str | os.PathLike, wait_s: float = LOCK_WAIT_S) -> Iterator[bool]:
    """Hold the directory's measuring lock (an exclusive ``flock``, released with the process if it
    dies): whether it was had. Not had, after ``wait_s`` or when the directory cannot hold a lock
    file, the caller goes on without it: a start is never blocked for good by another's."""
    try:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / _LOCK, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        log.warning("cannot lock %s (%s): measuring without waiting for other processes", directory, exc)
        yield False
        return
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    log.warning("another process has measured in %s for over %.0fs: measuring beside it", directory, wait_s)
                    held = False
                    break
                time.sleep(0.1)
        try:
            yield held
        finally:
            if held:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def store(directory: str | os.PathLike, key: str, costs: MeasuredCosts) -> Path:
    """Write the entry atomically (concurrent replicas may race: last one wins, both are whole),
    then keep only the ``MAX_ENTRIES`` newest."""
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{_PREFIX}{key}.json"
    body = json.dumps({"format": FORMAT, "key": key, "measured_at": time.time(), "costs": costs.to_json()})
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(body)
        os.chmod(tmp, 0o644)  # readable by the replicas of another user, like any cache of this machine
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _prune(folder)
    return path


def _prune(folder: Path) -> None:
    entries = []
    for p in folder.glob(f"{_PREFIX}*.json"):
        try:
            entries.append((p.stat().st_mtime, p))
        except OSError:
            continue
    entries.sort(reverse=True)
    for _, p in entries[MAX_ENTRIES:]:
        p.unlink(missing_ok=True)
