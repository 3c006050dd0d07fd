"""``python -m draftmesh.bench.forward_cost [--model M] [--rounds N]``: the batched forward's cost
table with ``small_rows_linear`` off and on, side by side in one run (interleaved rounds, medians),
each relative to a batch-1 one-token step of its own round. The figures in docs/batching.md."""

from __future__ import annotations

import argparse
import statistics

import torch
from torch import nn

from draftmesh.backend import TorchTarget
from draftmesh.small_linear import use_small_rows_linear


def _set_small_rows(target: TorchTarget, on: bool) -> None:
    if on:
        use_small_rows_linear(target.model)
        return
    for m in target.model.modules():
        if type(m) is nn.Linear:
            m.__dict__.pop("forward", None)  # back to nn.Linear.forward (F.linear)
            m._draftmesh_small_rows = False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = TorchTarget.load(args.model)
    tables: dict[str, list] = {"off": [], "on": []}
    for i in range(args.rounds):
        for how in ("off", "on") if i % 2 == 0 else ("on", "off"):
            _set_small_rows(target, how == "on")
            tables[how].append(target.measure_batch_cost(rows=(1, 2, 4, 8), per_row=(1, 2, 3, 4, 8), repeats=3))
    _set_small_rows(target, True)
    print(f"forward cost relative to a batch-1 one-token step ({args.model}, {args.threads} threads, "
          f"medians of {args.rounds} interleaved rounds)")
    for r in tables["on"][0]:
        for k in tables["on"][0][r]:
            off = statistics.median(t[r][k] for t in tables["off"])
            on = statistics.median(t[r][k] for t in tables["on"])
            print(f"  {r} rows x {k // r} tokens: off {off:.2f}x  on {on:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
