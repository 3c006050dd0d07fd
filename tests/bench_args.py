"""What the bench tests share: a small workload file and `draftmesh bench`'s parser."""

from __future__ import annotations

import argparse
import json

from draftmesh.bench.cli import add_arguments


def workload_file(tmp_path, n: int = 4, max_new_tokens: int = 10):
    rows = []
    for i in range(n):
        words = " ".join(f"w{2 + (i + j) % 8}" for j in range(6))
        rows.append(
            {
                "id": f"item-{i}",
                "kind": "grounded" if i % 2 == 0 else "open",
                "prompt": f"{words} {words}",
                "max_new_tokens": max_new_tokens,
                **({"session": "s"} if i < 2 else {}),
                **({"corpus": [words]} if i == 3 else {}),
            }
        )
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def parse(argv):
    parser = argparse.ArgumentParser(prog="draftmesh bench")
    add_arguments(parser)
    return parser.parse_args(argv)
