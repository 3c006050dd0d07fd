"""The exact law of a tiny target's first two sampled tokens, the yardstick of the sampling
distribution tests (tests/verify/test_sampling_lossless.py, test_seeded_sampling.py)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_target

from draftmesh.backend import KVState
from draftmesh.sampling import target_probs

VOCAB = 16
PROMPT = [3, 7, 2, 9]


@pytest.fixture(scope="module")
def model():
    """The tiny float64 target both tests sample from (import the fixture with the law)."""
    return tiny_target("llama", vocab_size=VOCAB, seed=5, attn="eager")


@pytest.fixture(scope="module")
def logits_table(model):
    return logits_after(model, PROMPT, VOCAB)


def logits_after(model, prompt: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits after the prompt (the root) and after prompt + t for every t."""
    state = KVState()
    model.prefill(state, prompt[:-1])
    root = model.step(state, prompt[-1])[0]
    after = []
    for t in range(vocab):
        s = KVState()
        model.prefill(s, prompt)
        after.append(model.step(s, t)[0])
    return root, torch.stack(after)


def exact_law(root, after, params) -> torch.Tensor:
    """P(first token t, second u) as a (V, V) tensor."""
    p1 = target_probs(root, params)
    return torch.stack([p1[t] * target_probs(after[t], params) for t in range(len(after))])
