"""Helpers for tests on the real packaged models (fp32).

A many-token tree forward and a one-token step differ by ~1e-5 in fp32, which can flip
an argmax only where the top two logits nearly tie. Outputs must be identical, except
at a step whose top-2 gap under plain decoding is below TIE_TOLERANCE; such a
divergence is reported as a warning, never hidden.
"""

from __future__ import annotations

import warnings

from draftmesh.prompts import encode_messages
from draftmesh.backend import TorchTarget

TIE_TOLERANCE = 1e-3

CODE = '''def load_config(path):
    with open(path) as handle:
        data = json.load(handle)
    if "name" not in data:
        raise KeyError("name")
    return data
'''

PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.",
    "Add a docstring to this Python function and return the whole function:\n\n" + CODE,
    "Rename the function load_config to read_config in this code:\n\n" + CODE,
    "List the three colours mentioned in this text: The flag is red, white and blue.",
    "What is the capital of France?",
]


def assert_identical_or_near_tie(target: TorchTarget, prompt: list[int], want: list[int], got: list[int]) -> None:
    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
    gap = target.top2_gap(prompt + want[:k])
    warnings.warn(f"greedy divergence at token {k}: top-2 logit gap {gap:.2e} (tolerance {TIE_TOLERANCE})")
    assert gap < TIE_TOLERANCE, f"divergence at token {k} with a clear top-2 gap {gap}: a losslessness bug"


def chat_ids(target: TorchTarget, text: str) -> list[int]:
    return encode_messages(target.tokenizer, [{"role": "user", "content": text}])
