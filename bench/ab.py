"""A/B engine variants on a workload, interleaved in one process (a developer tool).

`draftmesh bench` compares methods; this compares *configurations* of the draftmesh method
(source options), each beside plain, with the bench's own runners, warm-up, interleaving,
medians, statistics and tables. Used for the history-source experiments noted on issue 2:

    .venv/bin/python -m draftmesh.bench.ab --repeats 3 --variant 'resume={"history": {"resume_window": 8}}'
"""

from __future__ import annotations

import argparse
import collections
import json

from draftmesh import compute
from draftmesh.backend import TorchTarget
from draftmesh.bench.items import prepare_items
from draftmesh.bench.loop import execute
from draftmesh.bench.report import table
from draftmesh.bench.runners import EngineRunner
from draftmesh.bench.stats import geometric_mean
from draftmesh.bench.workload import load_workload


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

    compute.set_threads(args.threads)
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

    rows = []
    for kind in ["all", *dict.fromkeys(v["plain"].kind for v in by.values())]:
        group = [v for v in by.values() if kind == "all" or v["plain"].kind == kind]
        rows.append([kind, *(f"{geometric_mean(speedup(v, n) for v in group):.3f}x" for n in variants)])
    for item_id, v in by.items():
        same = all(v[n].identical_to_plain for n in variants)
        rows.append([f"  {item_id}", *(f"{speedup(v, n):.2f}x" for n in variants), "" if same else "NOT IDENTICAL"])
    print("\n".join(table(["kind / item", *variants, ""], rows, [False, *[True] * len(variants), False])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
