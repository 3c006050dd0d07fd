"""Generation tokens/s with and without the fact-check link, per acceptance policy: the engine in
this process, a real worker beside it, interleaved item by item."""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import redis

from draftmesh.bench.factcheck.workers import (
    PROG,
    RunningWorker,
    clear_annotations,
    drain,
)
from draftmesh.bench.items import prepare_items
from draftmesh.bench.report import progress
from draftmesh.bench.stats import distribution, geometric_mean
from draftmesh.bench.workload import load_workload
from draftmesh.config import DraftmeshConfig
from draftmesh.draft import registry
from draftmesh.factcheck.client import FactCheckClient
from draftmesh.io_struct import GenerationRequest, SpeculationParams
from draftmesh.verify.engine import decoder_from_config, load_target
from draftmesh.verify.factcheck_link import FactCheckLink

WARMUP_TOKENS = 8


class TimedFlags:
    """Wraps the link as the decoder's flag provider and times every call."""

    def __init__(self, link: Any) -> None:
        self.link = link
        self.ms: list[float] = []
        self.flagged_calls = 0

    def __call__(self, ctx: Any, tree: Any) -> frozenset[int]:
        t0 = time.perf_counter()
        flagged = self.link(ctx, tree)
        self.ms.append((time.perf_counter() - t0) * 1000)
        if flagged:
            self.flagged_calls += 1
        return flagged


@dataclass(frozen=True)
class Arm:
    policy: str
    link: bool

    @property
    def name(self) -> str:
        return f"{self.policy}:{'on' if self.link else 'off'}"


@dataclass
class ArmRun:
    item_id: str
    arm: str
    repeat: int
    tokens: int
    seconds: float
    steps: int
    lenient_tokens: int
    link_calls: int = 0
    link_ms: list[float] = field(default_factory=list)
    flagged_calls: int = 0
    output_ms: float | None = None
    output_status: str | None = None
    drafts_submitted: int = 0
    drafts_skipped: int = 0
    worker_cpu_s: float | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)
    text: str = field(default="", repr=False)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def select_items(items: Sequence[Any], n: int) -> list[Any]:
    """The first item of each kind (in order of first appearance), then the second, ... up to n."""
    by_kind: dict[str, list[Any]] = {}
    for item in items:
        by_kind.setdefault(item.kind, []).append(item)
    picked: list[Any] = []
    depth = 0
    while len(picked) < n and any(len(v) > depth for v in by_kind.values()):
        for group in by_kind.values():
            if depth < len(group) and len(picked) < n:
                picked.append(group[depth])
        depth += 1
    return picked


class GenerationBench:
    def __init__(self, args: argparse.Namespace, cfg: DraftmeshConfig, redis_url: str, worker: RunningWorker) -> None:
        self.args = args
        self.redis_url = redis_url
        self.worker = worker
        self.cfg = cfg.replace(serve={"redis_url": None})  # the answer store in memory: fresh per pass
        self.target = load_target(cfg.engine)
        items = select_items(load_workload(args.workload), args.items)
        self.items = prepare_items(items, self.target, args.max_new_tokens)
        self.arms = [Arm(args.policy, False), Arm(args.policy, True)]
        if args.policy != "exact":
            self.arms += [Arm("exact", False), Arm("exact", True)]
        self.redis = redis.Redis.from_url(redis_url)
        self._links: dict[str, TimedFlags] = {}

    def close(self) -> None:
        self.redis.close()

    def _fresh(self) -> dict[str, Any]:
        """New decoders (fresh draft sources) and new links (fresh clients) for every arm."""
        for flags in self._links.values():
            flags.link.client.close()
        self._links = {}
        decoders = {}
        for arm in self.arms:
            flags = None
            if arm.link:
                client = FactCheckClient(self.redis_url, self.worker.config)  # the serving defaults
                flags = self._links[arm.name] = TimedFlags(FactCheckLink(client, self.target.tokenizer))
            decoders[arm.name] = decoder_from_config(self.target, self.cfg, flag_provider=flags)
        return decoders

    def _run(self, decoder: Any, arm: Arm, item: Any, repeat: int, max_new_tokens: int | None = None) -> ArmRun:
        if not drain(self.redis, self.worker.names):
            raise RuntimeError("the worker did not catch up within 120 s")
        flags = self._links.get(arm.name)
        calls_before = len(flags.ms) if flags else 0
        flagged_before = flags.flagged_calls if flags else 0
        request_id = f"{item.id}-{arm.policy}-{'on' if arm.link else 'off'}-r{repeat}-{uuid.uuid4().hex[:6]}"
        req = GenerationRequest(
            prompt_ids=item.prompt_ids, max_new_tokens=max_new_tokens or item.max_new_tokens, request_id=request_id,
            documents=item.item.corpus, speculation=SpeculationParams(policy=arm.policy),
        )  # fmt: skip
        cpu0 = self.worker.cpu_s()
        t0 = time.perf_counter()
        res = decoder.generate(req)
        seconds = time.perf_counter() - t0
        cpu1 = self.worker.cpu_s()
        run = ArmRun(item.id, arm.name, repeat, len(res.token_ids), seconds, len(res.steps), res.lenient_tokens,
                     token_ids=list(res.token_ids), text=res.text)  # fmt: skip
        if cpu0 is not None and cpu1 is not None:
            run.worker_cpu_s = round(cpu1 - cpu0, 3)
        if flags is not None:
            run.link_ms = flags.ms[calls_before:]
            run.link_calls = len(run.link_ms)
            run.flagged_calls = flags.flagged_calls - flagged_before
            t1 = time.perf_counter()
            report = flags.link.annotate_output(request_id, res.text, self.args.output_wait_s)
            run.output_ms = (time.perf_counter() - t1) * 1000
            run.output_status = report.status
            run.drafts_submitted, run.drafts_skipped = report.drafts_submitted, report.drafts_skipped
        return run

    def execute(self) -> list[ArmRun]:
        args = self.args
        progress(PROG, f"generation: warm-up ({len(self.arms)} arms)")
        decoders = self._fresh()  # the first build measures the target's cost curve
        for arm in self.arms:
            self._run(decoders[arm.name], arm, self.items[0], -1, max_new_tokens=WARMUP_TOKENS)
        runs: list[ArmRun] = []
        for repeat in range(args.repeats):
            clear_annotations(self.redis, self.worker.names)
            decoders = self._fresh()
            progress(PROG, f"generation: pass {repeat + 1}/{args.repeats} ({len(self.items)} items x {len(self.arms)} arms)")
            for i, item in enumerate(self.items):
                shift = (repeat + i) % len(self.arms)
                for arm in self.arms[shift:] + self.arms[:shift]:
                    runs.append(self._run(decoders[arm.name], arm, item, repeat))
        drain(self.redis, self.worker.names)
        for flags in self._links.values():
            flags.link.client.close()
        return runs

    def meta(self) -> dict[str, Any]:
        return {
            "model": self.cfg.engine.model,
            "threads": self.cfg.engine.threads,
            "dtype": str(self.target.dtype).replace("torch.", ""),
            "workload": str(self.args.workload),
            "items": [{"id": p.id, "kind": p.kind, "prompt_tokens": len(p.prompt_ids),
                       "max_new_tokens": p.max_new_tokens} for p in self.items],  # fmt: skip
            "arms": [a.name for a in self.arms],
            "repeats": self.args.repeats,
            "output_wait_s": self.args.output_wait_s,
            "sources": "default (" + ",".join(_default_sources()) + ")",
        }


def _default_sources() -> list[str]:
    return list(registry.DEFAULT_SOURCES)


def summarize_generation(runs: Sequence[ArmRun], policies: Sequence[str]) -> dict[str, Any]:
    """Per policy: tokens/s with and without the link, their ratio, link and output costs."""
    out: dict[str, Any] = {}
    for policy in policies:
        off, on = f"{policy}:off", f"{policy}:on"
        items = list(dict.fromkeys(r.item_id for r in runs if r.arm in (off, on)))
        per_item = []
        for item in items:
            a = [r for r in runs if r.item_id == item and r.arm == off]
            b = [r for r in runs if r.item_id == item and r.arm == on]
            if not a or not b:
                continue
            tps_off = statistics.median(r.tokens_per_s for r in a)
            tps_on = statistics.median(r.tokens_per_s for r in b)
            first_a = min(a, key=lambda r: r.repeat)
            first_b = min(b, key=lambda r: r.repeat)
            per_item.append({
                "item": item, "tokens_per_s_off": round(tps_off, 3), "tokens_per_s_on": round(tps_on, 3),
                "ratio": round(tps_on / tps_off, 4) if tps_off > 0 else None,
                "tokens_off": first_a.tokens, "tokens_on": first_b.tokens,
                "identical_output": first_a.token_ids == first_b.token_ids,
                "lenient_off": statistics.median(r.lenient_tokens for r in a),
                "lenient_on": statistics.median(r.lenient_tokens for r in b),
            })  # fmt: skip
        repeats = sorted({r.repeat for r in runs})
        per_repeat = []
        for rep in repeats:
            a = [r for r in runs if r.repeat == rep and r.arm == off]
            b = [r for r in runs if r.repeat == rep and r.arm == on]
            if a and b and sum(r.seconds for r in a) > 0:
                pooled_a = sum(r.tokens for r in a) / sum(r.seconds for r in a)
                pooled_b = sum(r.tokens for r in b) / sum(r.seconds for r in b)
                per_repeat.append(round(pooled_b / pooled_a, 4))
        on_runs = [r for r in runs if r.arm == on]
        off_runs = [r for r in runs if r.arm == off]
        link_ms = [ms for r in on_runs for ms in r.link_ms]
        gen_s_on = sum(r.seconds for r in on_runs)

        def pooled(rs: Sequence[ArmRun]) -> float | None:
            s = sum(r.seconds for r in rs)
            return round(sum(r.tokens for r in rs) / s, 3) if s > 0 else None

        cpu = [r.worker_cpu_s for r in on_runs if r.worker_cpu_s is not None]
        out[policy] = {
            "items": len(per_item),
            "tokens_per_s_off": pooled(off_runs),
            "tokens_per_s_on": pooled(on_runs),
            "ratio_on_off": round(geometric_mean([p["ratio"] for p in per_item if p["ratio"]]) or 0, 4) or None,
            "ratio_per_repeat": per_repeat,
            "per_item": per_item,
            "identical_outputs": sum(p["identical_output"] for p in per_item),
            "link_calls": len(link_ms),
            "link_ms_per_step": distribution(link_ms),
            "link_share_of_generation": round(sum(link_ms) / 1000 / gen_s_on, 5) if gen_s_on > 0 else None,
            "flagged_steps": sum(r.flagged_calls for r in on_runs),
            "steps_on": sum(r.steps for r in on_runs),
            "lenient_tokens_off": sum(r.lenient_tokens for r in off_runs),
            "lenient_tokens_on": sum(r.lenient_tokens for r in on_runs),
            "drafts_submitted": sum(r.drafts_submitted for r in on_runs),
            "drafts_skipped": sum(r.drafts_skipped for r in on_runs),
            "worker_cpu_s_during_generation": round(sum(cpu), 3) if cpu else None,
            "worker_cpu_share_of_generation": round(sum(cpu) / gen_s_on, 5) if cpu and gen_s_on > 0 else None,
            "annotate_output_ms": distribution([r.output_ms for r in on_runs if r.output_ms is not None]),
            "annotate_output_status": _count(r.output_status for r in on_runs if r.output_status),
        }
    return out


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return counts


def _run_to_json(r: ArmRun) -> dict[str, Any]:
    return {
        "item": r.item_id, "arm": r.arm, "repeat": r.repeat, "tokens": r.tokens, "seconds": round(r.seconds, 4),
        "tokens_per_s": round(r.tokens_per_s, 3), "steps": r.steps, "lenient_tokens": r.lenient_tokens,
        "link_calls": r.link_calls, "link_ms": distribution(r.link_ms) if r.link_calls else None,
        "flagged_steps": r.flagged_calls, "annotate_output_ms": None if r.output_ms is None else round(r.output_ms, 3),
        "annotate_output_status": r.output_status, "drafts_submitted": r.drafts_submitted,
        "drafts_skipped": r.drafts_skipped, "worker_cpu_s": r.worker_cpu_s,
        **({"text": r.text} if r.repeat == 0 else {}),
    }  # fmt: skip
