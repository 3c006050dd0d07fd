"""``python -m draftmesh.bench.forward_cost [--model M] [--rounds N]``: the batched forward's cost
three ways, side by side in one run (interleaved rounds, medians): ``F.linear`` (the model's own
modules over torch ops: a second copy of the model loaded with the packed kernel off, SDPA
attention), ``packed`` (the same modules with the packed GEMM kernel of
``draftmesh.packed_linear``) and ``direct`` (today's forward: the packed kernel, the direct
decoder of ``draftmesh.direct_decoder`` and the tree attention of ``draftmesh.tree_attention``).
Each row of the table is a forward's time in ms and relative to the batch-1 one-token step of
each, so the figures show both the shape of each cost curve and what each step does to the
one-token step itself. Then the same one-token forward on the compute thread and on a second
thread (``--thread-probe-only``: just that), and the same tokens in one forward shaped four ways
(``--shape-probe-only``: just that): the batch's budget prices a forward by its rows and tokens
alone, whatever trees they form. The figures are in docs/batching.md and BENCHMARKS.md."""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from draftmesh import compute, packed_linear
from draftmesh.backend import TorchTarget
from draftmesh.batch_kv import RowInput, SlotKVCache

ROUTINGS = ("F.linear", "packed", "direct")


def load_unpacked(model: str) -> TorchTarget:
    """The target with every linear on ``F.linear`` (the kernel switched off while it loads)."""
    saved = packed_linear._kernel, packed_linear._looked
    packed_linear._kernel, packed_linear._looked = None, True
    try:
        return TorchTarget.load(model)
    finally:
        packed_linear._kernel, packed_linear._looked = saved


@compute.on_compute_thread
def primed_cache(target: TorchTarget, forward, rows: int, context: int, room: int) -> SlotKVCache:
    """A slab of ``rows`` rows, each holding ``context`` cached tokens (prefilled through ``forward``),
    with room for ``room`` more a row.

    On the compute thread, whoever calls it: a prefill on the caller's thread gave that thread an
    OpenMP team of its own for the rest of the process, and with more team threads than CPUs libgomp
    stops every team's spinning (``draftmesh.compute``), so each forward the probe timed after it paid
    a kernel wake-up per parallel region."""
    kv = target.new_batch_cache(max_bytes=1 << 40)
    kv.ensure(rows, context + room)
    for _ in range(rows):
        kv.add_row()
    v = target.vocab_size
    forward(target, kv, [RowInput.chain(r, [(100 + 7 * r + i) % v for i in range(context)]) for r in range(rows)])
    return kv


def one_token_ms(target: TorchTarget, forward, repeats: int = 12, context: int = 128) -> float:
    """Median ms of a batch-1 one-token forward (logits included) through ``forward``."""
    kv = primed_cache(target, forward, 1, context, room=2)
    v = target.vocab_size
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        forward(target, kv, [RowInput.chain(0, [(300 + i) % v], logits_from=0)])
        times.append(time.perf_counter() - t0)
        kv.commit(0, context, [])
    return 1e3 * statistics.median(times[2:])


def thread_probe(target: TorchTarget, rounds: int) -> tuple[float, float]:
    """The one-token forward on the compute thread, and on a second thread while the compute
    thread's OpenMP team exists (what every step on a request's thread did before
    ``draftmesh.compute``); interleaved rounds, medians. The second thread ends each round, so
    the compute thread's rounds run with one team."""
    direct = TorchTarget.forward_batch.__wrapped__  # the forward itself, on whichever thread calls it
    on_compute, elsewhere = [], []
    for _ in range(rounds):
        on_compute.append(compute.run(one_token_ms, target, direct))
        out: list[float] = []
        worker = threading.Thread(target=lambda: out.append(one_token_ms(target, direct)))
        worker.start()
        worker.join()
        elsewhere.append(out[0])
    return statistics.median(on_compute), statistics.median(elsewhere)


TREE_PARENTS = (-1, 0, 0, 1, 1, 2, 3, 3, 5, 6, 8, 9)
"""A 12-node draft tree (each node's parent among the row's new tokens): a root and branches."""

SHAPES: dict[str, tuple[int, ...]] = {
    "8 rows x 1 token": (1,) * 8,
    "8 rows, chains of 3,3,3,2,2,2,2,2": (3, 3, 3, 2, 2, 2, 2, 2),
    "7 rows x 1 + one chain of 12": (1,) * 7 + (12,),
    "7 rows x 1 + one tree of 12": (1,) * 7 + (-12,),
}
"""Rows' new tokens per shape (negative: a tree of that many nodes); all but the first hold 19 tokens."""


def shape_inputs(shape: tuple[int, ...], vocab: int, salt: int = 0) -> list[RowInput]:
    """The rows' inputs of one forward shaped as ``shape`` (logits for every new token)."""
    rows = []
    for row, n in enumerate(shape):
        tokens = [(500 + salt + 13 * row + i) % vocab for i in range(abs(n))]
        if n < 0:
            rows.append(RowInput(row, tokens, list(TREE_PARENTS[: abs(n)]), 0))
        else:
            rows.append(RowInput.chain(row, tokens, logits_from=0))
    return rows


def shape_probe(target: TorchTarget, rounds: int, context: int = 150) -> dict[str, float]:
    """Median ms of one forward per shape of ``SHAPES`` over rows of ``context`` cached tokens;
    the shapes interleaved, their order reversed every other round."""
    forward = TorchTarget.forward_batch.__wrapped__  # the forward itself (called on the compute thread)
    rows = max(len(s) for s in SHAPES.values())
    kv = primed_cache(target, forward, rows, context, room=max(abs(n) for s in SHAPES.values() for n in s))
    v = target.vocab_size
    names = list(SHAPES)
    times: dict[str, list[float]] = {n: [] for n in names}

    def one(name: str, salt: int) -> None:
        inputs = shape_inputs(SHAPES[name], v, salt)
        t0 = time.perf_counter()
        forward(target, kv, inputs)
        times[name].append(1e3 * (time.perf_counter() - t0))
        for row in range(rows):
            kv.commit(row, context, [])

    for i in range(rounds + 2):  # two warm-up rounds
        for name in names if i % 2 == 0 else names[::-1]:
            compute.run(one, name, i)
    return {n: statistics.median(ts[2:]) for n, ts in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--thread-probe-only", action="store_true",
                        help="only the one-token forward on the compute thread vs on a second thread")
    parser.add_argument("--shape-probe-only", action="store_true",
                        help="only the same tokens in one forward as chains over 8 rows, one row's chain, one row's tree")
    parser.add_argument("--shape-contexts", default="150",
                        help="comma-separated cached tokens per row for the shape probe (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        contexts = [int(c) for c in args.shape_contexts.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--shape-contexts: comma-separated integers, got {args.shape_contexts!r}")
    if not contexts or min(contexts) < 1:
        parser.error(f"--shape-contexts: positive integers, got {args.shape_contexts!r}")
    compute.set_threads(args.threads)
    target = TorchTarget.load(args.model)
    if args.thread_probe_only:
        _print_thread_probe(target, args.rounds)
        return 0
    if args.shape_probe_only:
        _print_shape_probe(target, max(args.rounds, 8), contexts)
        return 0
    if not target.packed_linears:
        parser.error("the packed GEMM kernel does not run here (see draftmesh.packed_linear): nothing to compare")
    unpacked = load_unpacked(args.model)
    direct, attention = target.direct, target.tree_attention
    unpacked.direct = unpacked.tree_attention = None
    names = list(ROUTINGS)
    tables: dict[str, list] = {n: [] for n in names}
    units: dict[str, list[float]] = {n: [] for n in names}
    for i in range(args.rounds):
        for how in names[i % len(names):] + names[: i % len(names)]:
            t = unpacked if how == "F.linear" else target
            target.direct, target.tree_attention = (direct, attention) if how == "direct" else (None, None)
            tables[how].append(t.measure_batch_cost(rows=(1, 2, 4, 8), per_row=(1, 2, 3, 4, 8, 16, 32), repeats=3))
            units[how].append(t.batch_step_seconds)
    target.direct, target.tree_attention = direct, attention
    base = statistics.median(units[names[0]])
    own = {n: statistics.median(units[n]) for n in names}
    print(f"forward time in ms, relative to the one-token step with F.linear, and (in brackets) to its own "
          f"one-token step ({args.model}, {args.threads} threads, medians of {args.rounds} interleaved rounds)")
    print("  forward                 " + "".join(f"{n:>26}" for n in names))
    print("  1 row x 1 token         " + "".join(f"{1e3 * own[n]:>10.1f} ms {own[n] / base:>5.2f}x (1.00x)" for n in names))
    for r in tables[names[-1]][0]:
        for k in tables[names[-1]][0][r]:
            if r == k == 1:
                continue
            cells = []
            for n in names:
                secs = statistics.median(t[r][k] * u for t, u in zip(tables[n], units[n]))
                cells.append(f"{1e3 * secs:>10.1f} ms {secs / base:>5.2f}x ({secs / own[n]:>4.2f}x)")
            print(f"  {r} rows x {k // r:>2} tokens     " + "".join(cells))
    _print_thread_probe(target, args.rounds)
    _print_shape_probe(target, max(args.rounds, 8), contexts)
    return 0


def _print_shape_probe(target: TorchTarget, rounds: int, contexts: list[int]) -> None:
    for context in contexts:
        found = shape_probe(target, rounds, context)
        base = found[next(iter(SHAPES))]
        print(f"one forward, rows of {context} cached tokens, shaped four ways (medians of {rounds} interleaved rounds):")
        for name, ms in found.items():
            tokens = sum(abs(n) for n in SHAPES[name])
            extra = (ms - base) / (tokens - len(SHAPES[name])) if tokens > len(SHAPES[name]) else 0.0
            print(f"  {name:<36} {tokens:>3} tokens {ms:>8.2f} ms {ms / base:>5.2f}x"
                  + (f"  {extra:.2f} ms per token past one a row" if extra else ""))


def _print_thread_probe(target: TorchTarget, rounds: int) -> None:
    here, elsewhere = thread_probe(target, rounds)
    print(f"one-token forward on the compute thread {here:.1f} ms; on a second thread beside it "
          f"{elsewhere:.1f} ms ({elsewhere / here:.2f}x: what a step on a request's thread cost before draftmesh.compute)")


if __name__ == "__main__":
    raise SystemExit(main())
