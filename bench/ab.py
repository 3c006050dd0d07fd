"""A/B engine variants on a workload, interleaved in one process (a developer tool).

`draftmesh bench` compares methods; this compares *configurations* of the draftmesh method
(source options), each beside plain, with the bench's own runners, warm-up, interleaving
and medians. Used for the history-source experiments noted on issue 2:

    .venv/bin/python bench/ab.py --repeats 3 --variant 'resume={"history": {"resume_window": 8}}'
"""

from __future__ import annotations

import argparse
import collections
import json
import math


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="bench/public.jsonl")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                        help="source options of one variant, e.g. 'ng1={\"history\": {\"min_ngram\": 1}}' (repeatable)")
    args = parser.parse_args()

    import torch

    from draftmesh.bench import EngineRunner, execute, prepare_items
    from draftmesh.backend import TorchTarget
    from draftmesh.workload import load_workload

    torch.set_num_threads(args.threads)
    variants = {"default": None}
    for spec in args.variant:
        name, _, options = spec.partition("=")
        variants[name] = json.loads(options)
    target = TorchTarget.load(args.model)
    target.measure_cost_curve()
    items = prepare_items(load_workload(args.workload)[: args.limit], target)
    runners = [EngineRunner("plain", target, ())]
    runners += [EngineRunner(name, target, None, source_options=opts) for name, opts in variants.items()]
    results = execute(runners, items, repeats=args.repeats, progress=False)
    by = collections.defaultdict(dict)
    for r in results:
        by[r.item_id][r.method] = r

    def speedup(v, name):
        return v[name].tokens_per_s / v["plain"].tokens_per_s

    print("kind      " + "".join(f"{name:>12s}" for name in variants))
    for kind in ["all", *dict.fromkeys(v["plain"].kind for v in by.values())]:
        rows = [v for v in by.values() if kind == "all" or v["plain"].kind == kind]
        cells = [math.exp(sum(math.log(speedup(v, n)) for v in rows) / len(rows)) for n in variants]
        print(f"{kind:9s} " + "".join(f"{c:11.3f}x" for c in cells))
    for item_id, v in by.items():
        print(f"  {item_id:28s}" + "".join(f"{speedup(v, n):11.2f}x" for n in variants)
              + ("" if all(v[n].identical_to_plain for n in variants) else "  NOT IDENTICAL"))
    return 0 if all(r.identical_to_plain is not False for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
