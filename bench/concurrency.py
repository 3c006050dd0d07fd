"""`draftmesh bench --concurrency 1,2,4,8`: a closed-loop load generator over the workload.

For each concurrency C and method, C client threads keep C requests in flight (each takes the
next item as soon as its last one ends) until every item has run once; the pass reports the
aggregate completion tokens/s, per-request p50/p95 latency and time to first token, and the
batch's mean rows and tokens per forward. Methods, side by side in one run, each pass on a
fresh engine (no answer store or learned state carried between passes), interleaved over
repeats, medians kept:

- ``plain-serial``: no speculation, one request at a time (``max_batch_rows`` 1): what a
  replica did before continuous batching.
- ``plain``: batched, no speculation.
- ``draftmesh``: batched, default sources, one tree budget across the batch.
- ``draftmesh-oracle`` (asked for with ``--methods``, after ``plain-serial`` or ``plain``): as
  ``draftmesh``, but of the sources' candidate nodes the budget is given only those on the item's
  plain greedy output (``bench.oracle``): the most any choice of nodes makes of these sources.
- ``vllm`` (asked for with ``--methods``): vLLM's offline engine in its own environment, the
  closed loop run inside its worker on its own continuous batching (``vllm_runner.closed_loop_pass``).

Every greedy output is compared with the same item's ``plain-serial`` output (batch-1 plain
decoding). A prefill probe measures a short request's time to first token alone and while a
long prompt is being prefilled.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from draftmesh.bench.items import PreparedItem
from draftmesh.bench.methods import MESH_PAIRS
from draftmesh.bench.oracle import OracleTreeBuilder
from draftmesh.bench.report import fmt
from draftmesh.config import DEFAULT_SOURCE_DEADLINE_S, BuilderConfig, EngineConfig
from draftmesh.io_struct import GenerationRequest, GenerationResult, StepEvent
from draftmesh.verify.engine import batch_limits, build_decoder, prefix_pool

PLAIN_SERIAL, PLAIN, DRAFTMESH, ORACLE, VLLM = "plain-serial", "plain", "draftmesh", "draftmesh-oracle", "vllm"
CONCURRENCY_METHODS = (PLAIN_SERIAL, PLAIN, DRAFTMESH)
"""The default methods; ``ORACLE`` and ``VLLM`` are added where asked for (vLLM needs ``make vllm-env``)."""


@dataclass
class PassResult:
    method: str
    concurrency: int
    seconds: float
    tokens: int
    latencies: list[float]
    first_token: list[float]
    outputs: dict[str, tuple[int, ...]]
    batch: dict[str, Any] = field(default_factory=dict)
    steady_seconds: float | None = None
    """From the pass's start until a client first found no item left: while C requests were in flight.
    After it the pass drains (fewer and fewer requests: a 30-item workload's tail is a large share
    of a pass at C=8, and it is longest for the method whose fast requests leave its slow ones
    alone). At C=1 it is the whole pass. None when there were fewer items than C."""
    steady_tokens: int | None = None
    """Completion tokens emitted within ``steady_seconds``."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def steady_tokens_per_s(self) -> float | None:
        """Aggregate tokens/s while C requests were in flight (``steady_seconds``)."""
        if self.steady_seconds is None or self.steady_tokens is None or self.steady_seconds <= 0:
            return None
        return self.steady_tokens / self.steady_seconds


def concurrency_methods(text: str | None) -> list[str]:
    """The ``--methods`` of ``--concurrency`` (default: ``CONCURRENCY_METHODS``), in the given order."""
    if not text:
        return list(CONCURRENCY_METHODS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    valid = (*CONCURRENCY_METHODS, ORACLE, VLLM)
    bad = [n for n in names if n not in valid]
    if bad or not names:
        raise ValueError(f"--methods with --concurrency: unknown {', '.join(bad) or '(none)'}; valid: {', '.join(valid)}")
    names = list(dict.fromkeys(names))
    if ORACLE in names and not {PLAIN_SERIAL, PLAIN} & set(names[: names.index(ORACLE)]):
        raise ValueError(f"--methods with --concurrency: {ORACLE} reads each item's plain greedy output, so "
                         f"{PLAIN_SERIAL} or {PLAIN} must come before it")
    return names


def _decoder(method: str, target, engine: EngineConfig, builder: BuilderConfig, source_options,
             source_deadline_s: float | None = DEFAULT_SOURCE_DEADLINE_S,
             plain_outputs: Mapping[str, Sequence[int]] | None = None, pooled: bool = True):
    """``plain_outputs``: item id -> its plain greedy output, which ``ORACLE`` reads. ``pooled``: with the
    engine's prefix pool (finished requests' KV for later prompts that begin alike)."""
    limits = batch_limits(engine)
    if method == PLAIN_SERIAL:
        limits = dataclasses.replace(limits, max_rows=1)
    sources = None if method in (DRAFTMESH, ORACLE) else ()
    decoder = build_decoder(target, sources, source_options=source_options, builder_config=builder,
                            batch_limits=limits, source_deadline_s=source_deadline_s,
                            kv_pool=prefix_pool(engine) if pooled else None)
    if method == ORACLE:
        decoder.builder = OracleTreeBuilder(decoder.builder, plain_outputs or {})
    return decoder


def _request(item: PreparedItem) -> GenerationRequest:
    return GenerationRequest(prompt_ids=item.prompt_ids, max_new_tokens=item.max_new_tokens, request_id=item.id,
                             session_id=item.item.session, documents=item.item.corpus)


class EngineLoad:
    """The in-process decoder as a load target: what ``run_pass`` drives (``MeshLoad`` is the mesh's)."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder

    def warm(self, item: PreparedItem) -> None:
        self.decoder.generate(dataclasses.replace(_request(item), max_new_tokens=min(4, item.max_new_tokens),
                                                  request_id="warmup"))

    def stream(self, item: PreparedItem) -> Iterator[tuple[str, Any]]:
        """("step", tokens of the step) per step, then ("result", the output's token ids)."""
        for event in self.decoder.stream(_request(item)):
            if isinstance(event, StepEvent):
                yield "step", len(event.token_ids)
            elif isinstance(event, GenerationResult):
                yield "result", tuple(event.token_ids)

    def batch_stats(self) -> dict[str, Any] | None:
        return self.decoder.batch_stats()

    def close(self) -> None:
        self.decoder.close()


def run_pass(load, method: str, items: Sequence[PreparedItem], concurrency: int) -> PassResult:
    """Every item once, ``concurrency`` in flight, on ``load`` (``EngineLoad``, ``MeshLoad``; fresh)."""
    load.warm(items[0])
    before = load.batch_stats()
    queue = list(items)
    lock = threading.Lock()
    latencies: list[float] = []
    first: list[float] = []
    outputs: dict[str, tuple[int, ...]] = {}
    tokens = [0]
    emitted: list[tuple[float, int]] = []  # (when, tokens) of every step event
    drained: list[float] = []  # when clients found no item left: from the first, fewer than C in flight
    errors: list[BaseException] = []

    def client() -> None:
        while True:
            with lock:
                if not queue or errors:
                    drained.append(time.perf_counter())
                    return
                item = queue.pop(0)
            t0 = time.perf_counter()
            ttft = None
            try:
                for kind, value in load.stream(item):
                    if kind == "step":
                        emitted.append((time.perf_counter(), value))  # list.append: atomic
                    if kind == "step" and ttft is None and value:
                        ttft = time.perf_counter() - t0
                    if kind == "result":
                        with lock:
                            latencies.append(time.perf_counter() - t0)
                            first.append(ttft if ttft is not None else latencies[-1])
                            outputs[item.id] = value
                            tokens[0] += len(value)
            except BaseException as exc:  # noqa: BLE001 - reported after the pass
                with lock:
                    errors.append(exc)

    threads = [threading.Thread(target=client, name=f"bench-client-{i}") for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    after = load.batch_stats()
    batch: dict[str, Any] = {"forwards": None, "mean_rows": None, "mean_tokens_per_forward": None,
                             "speculating_share": None, "kv_bytes_allocated": None,
                             "step_ms": None, "forward_ms": None, "busy_share": None, "reused_prompt_tokens": None}
    if before is not None and after is not None:  # (a mesh not started by the bench: not visible)
        keys = ("steps", "forward_rows", "forward_tokens", "drafted_rows", "step_s", "forward_s")
        steps, rows, toks, spec, step_s, forward_s = (after[k] - before[k] for k in keys)
        batch = {"forwards": steps, "mean_rows": rows / steps if steps else 0.0,
                 "mean_tokens_per_forward": toks / steps if steps else 0.0,
                 "speculating_share": spec / rows if rows else 0.0, "kv_bytes_allocated": after["kv_bytes_allocated"],
                 # a step's time, and the forward's part of it: the rest is drafting, accepting, emitting
                 # and whatever else holds the replica's GIL (through the mesh: its event loop)
                 "step_ms": 1e3 * step_s / steps if steps else 0.0,
                 "forward_ms": 1e3 * forward_s / steps if steps else 0.0,
                 # the share of the pass's wall time spent inside steps: the rest is the batch waiting
                 # for its callers (a step handed between threads, requests arriving through the mesh)
                 "busy_share": step_s / seconds if seconds else 0.0,
                 # prompt tokens whose KV the pass's requests copied from the prefix pool instead of prefilling
                 "reused_prompt_tokens": after.get("prefix_reused_tokens", 0) - before.get("prefix_reused_tokens", 0),
                 # per batch size, what the pass's trees cost against the warm-up table (the budget's correction)
                 "tree_cost_factors": after.get("tree_cost_factors")}
    steady_s = steady_tokens = None
    if len(items) >= concurrency and drained:
        steady_s = drained[0] - t0
        steady_tokens = sum(n for when, n in emitted if when <= drained[0])
    return PassResult(method, concurrency, seconds, tokens[0], latencies, first, outputs, batch,
                      steady_seconds=steady_s, steady_tokens=steady_tokens)


def _median(values) -> float | None:
    """The median, or None where a pass could not see the value (a mesh the bench did not start)."""
    values = list(values)
    return None if not values or any(v is None for v in values) else statistics.median(values)


def _max(values) -> float | None:
    values = list(values)
    return None if not values or any(v is None for v in values) else max(values)


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def prefill_probe(target, engine: EngineConfig, builder: BuilderConfig, long_tokens: int, repeats: int) -> dict[str, Any]:
    """A short request's time to first token alone, and while a ``long_tokens`` prompt prefills."""
    # no prefix pool: a repeat of the long prompt would find it cached and prefill nothing
    decoder = _decoder(PLAIN, target, engine, builder, None, pooled=False)
    gen = random.Random(0)
    low = min(100, target.vocab_size // 2)
    long_ids = tuple(gen.randrange(low, min(target.vocab_size, 20000)) for _ in range(long_tokens))
    short = GenerationRequest(tuple(target.tokenizer.encode("The capital of France is")), max_new_tokens=4)

    def ttft(req) -> float:
        t0 = time.perf_counter()
        for event in decoder.stream(req):
            if isinstance(event, StepEvent) and event.token_ids:
                return time.perf_counter() - t0
        return time.perf_counter() - t0

    ttft(short)
    alone, beside = [], []
    for _ in range(repeats):
        alone.append(ttft(short))
        started = threading.Event()
        long_req = GenerationRequest(long_ids, max_new_tokens=2)

        def run_long():
            events = decoder.stream(long_req)
            started.set()
            for _ in events:
                pass

        th = threading.Thread(target=run_long)
        th.start()
        started.wait()
        time.sleep(0.05)  # the long prompt is in the batch, prefilling
        beside.append(ttft(short))
        th.join()
    a, b = statistics.median(alone), statistics.median(beside)
    return {"long_prompt_tokens": long_tokens, "prefill_chunk": engine.prefill_chunk, "ttft_alone_s": a,
            "ttft_beside_long_prefill_s": b, "ratio": b / a if a else None}


def run_concurrency(target, items: Sequence[PreparedItem], levels: Sequence[int], methods: Sequence[str], *,
                    engine: EngineConfig, builder: BuilderConfig, source_options=None,
                    source_deadline_s: float | None = DEFAULT_SOURCE_DEADLINE_S, repeats: int = 1,
                    probe_tokens: int | None = 2048, progress=print,
                    loads: dict[str, Callable[[], Any]] | None = None,
                    external: Mapping[str, Callable[[Sequence[PreparedItem], int], PassResult]] | None = None,
                    ) -> dict[str, Any]:
    """``loads``: a fresh load target per pass of the methods that do not run on an in-process decoder
    (the mesh's, ``MeshLoad``); the others get a fresh in-process decoder each pass. ``external``:
    methods whose whole pass another engine runs, ``run(items, concurrency) -> PassResult`` (vLLM)."""
    loads = loads or {}
    external = dict(external or {})
    target.ensure_costs()
    runs: dict[tuple[str, int], list[PassResult]] = {}
    plain_outputs: dict[str, tuple[int, ...]] = {}  # what ORACLE reads: the first plain pass's of each item
    for rep in range(repeats):
        for c in levels:
            for m in methods:
                if m in external:
                    res = external[m](items, c)
                    runs.setdefault((m, c), []).append(res)
                    progress(f"  pass {rep + 1}/{repeats} C={c} {m}: {res.tokens_per_s:.1f} tok/s")
                    continue
                load = loads[m]() if m in loads else EngineLoad(_decoder(m, target, engine, builder, source_options,
                                                                                    source_deadline_s, plain_outputs))
                try:
                    res = run_pass(load, m, items, c)
                finally:
                    load.close()
                if m in (PLAIN_SERIAL, PLAIN):
                    for k, v in res.outputs.items():
                        plain_outputs.setdefault(k, v)
                runs.setdefault((m, c), []).append(res)
                progress(f"  pass {rep + 1}/{repeats} C={c} {m}: {res.tokens_per_s:.1f} tok/s")
    reference: dict[str, tuple[int, ...]] = {}
    for (m, c), passes in sorted(runs.items(), key=lambda kv: kv[0][1]):
        if m == PLAIN_SERIAL:
            for p in passes:
                for k, v in p.outputs.items():
                    reference.setdefault(k, v)
    rows = []
    prompt_tokens = sum(len(it.prompt_ids) - 1 for it in items) or 1  # what a pass could prefill
    for (m, c), passes in runs.items():
        tps = [p.tokens_per_s for p in passes]
        steady = [p.steady_tokens_per_s for p in passes]
        steady = steady if all(x is not None for x in steady) else None
        lat = [x for p in passes for x in p.latencies]
        ttf = [x for p in passes for x in p.first_token]
        # None: no plain-serial pass ran, so nothing was compared (not "none identical")
        same = sum(1 for p in passes for k, v in p.outputs.items() if reference.get(k) == v) if reference else None
        total = sum(len(p.outputs) for p in passes)
        rows.append({
            "method": m, "concurrency": c, "tokens_per_s": statistics.median(tps), "tokens_per_s_runs": tps,
            "steady_tokens_per_s": statistics.median(steady) if steady else None, "steady_tokens_per_s_runs": steady,
            "latency_p50_s": _pct(lat, 0.5), "latency_p95_s": _pct(lat, 0.95),
            "ttft_p50_s": _pct(ttf, 0.5), "ttft_p95_s": _pct(ttf, 0.95),
            "mean_rows": _median(p.batch.get("mean_rows") for p in passes),
            "mean_tokens_per_forward": _median(p.batch.get("mean_tokens_per_forward") for p in passes),
            "speculating_share": _median(p.batch.get("speculating_share") for p in passes),
            "kv_bytes_allocated": _max(p.batch.get("kv_bytes_allocated") for p in passes),
            "step_ms": _median(p.batch.get("step_ms") for p in passes),
            "forward_ms": _median(p.batch.get("forward_ms") for p in passes),
            "busy_share": _median(p.batch.get("busy_share") for p in passes),
            "reused_prompt_share": _median(p.batch["reused_prompt_tokens"] / prompt_tokens
                                           if p.batch.get("reused_prompt_tokens") is not None else None for p in passes),
            "tree_cost_factors": passes[-1].batch.get("tree_cost_factors"),
            "identical_to_plain_serial": same, "outputs": total,
        })
    rows.sort(key=lambda r: (r["concurrency"], methods.index(r["method"])))
    out: dict[str, Any] = {"levels": list(levels), "methods": list(methods), "repeats": repeats, "rows": rows,
                           "kv_bytes_per_token": target.new_batch_cache(1 << 20).bytes_per_token,
                           "batch_cost": {str(r): {str(k): round(v, 3) for k, v in c.items()}
                                          for r, c in target.batch_cost.items()},
                           "cost_curve": {str(k): round(v, 3) for k, v in target.cost_curve.items()},
                           "key_cost": dataclasses.asdict(target.key_cost) if target.key_cost else None,
                           "same_run_ratios": _ratios_json(rows, "tokens_per_s"),
                           "steady_same_run_ratios": _ratios_json(rows, "steady_tokens_per_s")}
    if probe_tokens:
        progress(f"  prefill probe: {probe_tokens}-token prompt")
        out["prefill_probe"] = prefill_probe(target, engine, builder, min(probe_tokens, target.max_context - 16),
                                             repeats=max(3, repeats))
    return out


SAME_RUN_PAIRS = ((DRAFTMESH, PLAIN), (ORACLE, PLAIN), *MESH_PAIRS)
"""(method, the method it is compared with) for the report's same-run ratios: speculation's gain over
batched plain decoding (the issue's targets), its ceiling with the same sources, and each mesh
method over its in-process twin."""


def same_run_ratios(rows: Sequence[Mapping[str, Any]], pairs: Sequence[tuple[str, str]] = SAME_RUN_PAIRS,
                    key: str = "tokens_per_s") -> dict[tuple[str, str], dict[int, dict[str, Any]]]:
    """Per pair whose two methods ran in the report, per C: ``{"ratio", "runs"}``, the first method's
    tokens/s over the second's (``key``: over the whole pass, or ``steady_tokens_per_s``).

    A repeat runs every method of a C back to back, so each repeat gives one paired ratio of two
    passes run one after the other, and the figure is the median of those: a box that drifts
    between repeats (a shared 2-core box drifts by 10% and more) moves both passes of a pair, where
    a ratio of the medians would set passes of different repeats against each other. Rows without
    per-repeat figures give the ratio of their medians."""
    by_key = {(r["method"], r["concurrency"]): r for r in rows}
    out: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}
    for a, b in pairs:
        for (m, c), row in sorted(by_key.items(), key=lambda kv: kv[0][1]):
            ref = by_key.get((b, c))
            if m != a or ref is None or not ref.get(key) or row.get(key) is None:
                continue
            runs_a, runs_b = row.get(f"{key}_runs"), ref.get(f"{key}_runs")
            if runs_a and runs_b and len(runs_a) == len(runs_b) and all(runs_b):
                runs = [x / y for x, y in zip(runs_a, runs_b)]
            else:
                runs = [row[key] / ref[key]]
            out.setdefault((a, b), {})[c] = {"ratio": statistics.median(runs), "runs": runs}
    return out


def _ratios_json(rows: Sequence[Mapping[str, Any]], key: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``same_run_ratios`` of ``key`` as the report's JSON: "a / b" -> C -> {"ratio", "runs"}, rounded."""
    return {f"{a} / {b}": {str(c): {"ratio": round(v["ratio"], 3), "runs": [round(x, 3) for x in v["runs"]]}
                           for c, v in per_c.items()}
            for (a, b), per_c in same_run_ratios(rows, key=key).items()}


def mesh_ratios(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict[int, float]]:
    """Per mesh method whose in-process twin ran in the same report (``MESH_PAIRS``): its
    tokens/s over the twin's, per C. Only a same-run ratio says what the mesh costs."""
    return {a: {c: v["ratio"] for c, v in per_c.items()}
            for (a, _), per_c in same_run_ratios(rows, MESH_PAIRS).items()}


def same_run_ratio_lines(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per pair and measure (the whole pass; while C were in flight): the ratio at each C,
    and each repeat's where there were several."""
    lines = []
    for key, what in (("tokens_per_s", ""), ("steady_tokens_per_s", ", C in flight")):
        lines += _ratio_lines(same_run_ratios(rows, key=key), what)
    return ["", *lines] if lines else []


def _ratio_lines(ratios, what: str) -> list[str]:
    lines = []
    for (a, b), per_c in ratios.items():
        parts = []
        for c, v in per_c.items():
            each = f" ({', '.join(f'{x:.2f}' for x in v['runs'])})" if len(v["runs"]) > 1 else ""
            parts.append(f"{v['ratio']:.2f}x at C={c}{each}")
        how = "same run, median of the repeats' paired ratios" if any(len(v["runs"]) > 1 for v in per_c.values()) \
            else "same run"
        lines.append(f"{a} / {b} ({how}{what}): " + ", ".join(parts))
    return lines


def fmt_same(identical: int | None, outputs: int) -> str:
    """The report's "same" cell: outputs identical to plain-serial's, or ``-`` when it did not run."""
    return f"{'-' if identical is None else identical:>3}/{outputs:<3}"


def format_concurrency(report: dict[str, Any]) -> str:
    lines = ["", "Concurrency (closed loop; aggregate completion tokens/s, medians over repeats: tok/s over the whole",
             "pass, steady while C requests were in flight, i.e. until a client first found no item left)", ""]
    head = (f"{'C':>3} {'method':<15} {'tok/s':>8} {'steady':>7} {'x serial':>9} {'p50 s':>7} {'p95 s':>7} {'ttft50':>7} "
            f"{'ttft95':>7} {'rows':>5} {'tok/fwd':>7} {'spec':>5} {'step ms':>7} {'fwd ms':>6} {'same':>7}")
    lines.append(head)
    serial = {r["concurrency"]: r["tokens_per_s"] for r in report["rows"] if r["method"] == PLAIN_SERIAL}
    for r in report["rows"]:
        base = serial.get(r["concurrency"])
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        lines.append(
            f"{r['concurrency']:>3} {r['method']:<15} {r['tokens_per_s']:>8.1f} {fmt(r.get('steady_tokens_per_s')):>7} "
            f"{ratio:>9} {r['latency_p50_s']:>7.2f} "
            f"{r['latency_p95_s']:>7.2f} {r['ttft_p50_s']:>7.3f} {r['ttft_p95_s']:>7.3f} {fmt(r['mean_rows'], '.2f'):>5} "
            f"{fmt(r['mean_tokens_per_forward']):>7} {fmt(r['speculating_share'], '.2f'):>5} "
            f"{fmt(r.get('step_ms')):>7} {fmt(r.get('forward_ms')):>6} "
            f"{fmt_same(r['identical_to_plain_serial'], r['outputs'])}")
    probe = report.get("prefill_probe")
    if probe:
        lines += ["", f"Prefill probe: a short request's time to first token {1e3 * probe['ttft_alone_s']:.0f} ms alone, "
                      f"{1e3 * probe['ttft_beside_long_prefill_s']:.0f} ms while a {probe['long_prompt_tokens']}-token prompt "
                      f"prefills in chunks of {probe['prefill_chunk']} ({probe['ratio']:.2f}x)"]
    lines += same_run_ratio_lines(report["rows"])
    if report.get("note"):
        lines += ["", report["note"]]
    lines.append(f"KV per token: {report['kv_bytes_per_token']} bytes")
    return "\n".join(lines)


def plot_concurrency(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for m in report["methods"]:
        rows = [r for r in report["rows"] if r["method"] == m]
        cs = [r["concurrency"] for r in rows]
        line, = ax1.plot(cs, [r["tokens_per_s"] for r in rows], marker="o", label=m)
        steady = [(c, r["steady_tokens_per_s"]) for c, r in zip(cs, rows) if r.get("steady_tokens_per_s")]
        if steady:  # the same method while C requests were in flight
            ax1.plot(*zip(*steady), marker="x", linestyle="--", color=line.get_color(), label=f"{m}, C in flight")
        ax2.plot(cs, [r["latency_p95_s"] for r in rows], marker="o", label=m)
    for ax, title, unit in ((ax1, "aggregate throughput", "completion tokens/s"), (ax2, "p95 request latency", "s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight (C)")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
