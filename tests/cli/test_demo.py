"""`draftmesh demo` end to end on a tiny random model saved as a local HF folder."""

from __future__ import annotations

import io

from draftmesh.config import DraftmeshConfig
from draftmesh.cli.demo import run_demo
from tiny_models import tiny_target


def test_demo_runs_and_reports_identical_outputs(tmp_path):
    tiny = tiny_target("llama", vocab_size=64, dtype=__import__("torch").float32)
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    out = io.StringIO()
    cfg = DraftmeshConfig().replace(engine={"model": str(tmp_path), "threads": 1})
    summary = run_demo(cfg, repeats=1, max_new_tokens=12, out=out)
    text = out.getvalue()
    assert "plain greedy:" in text and "speculative greedy:" in text and "verify cost curve" in text
    assert summary["identical"] and summary["repeat_identical"]
    assert summary["plain_tokens_per_s"] > 0 and summary["speculative_tokens_per_s"] > 0
