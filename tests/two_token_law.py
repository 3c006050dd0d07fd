"""The exact law of a tiny target's first two sampled tokens, the yardstick of the sampling
distribution tests (tests/verify/test_sampling_lossless.py, test_seeded_sampling.py)."""

from __future__ import annotations

import torch

from draftmesh.backend import KVState
from draftmesh.sampling import target_probs


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
