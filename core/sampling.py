"""The target distribution a request's ``SamplingParams`` define, and a draw from it.

Plain sampling and speculative rejection sampling both draw from ``target_probs``; that
shared definition is what "exactly the target's distribution" means in this project.
The arithmetic is float64 so that residual updates do not drift.
"""

from __future__ import annotations

import torch

from draftmesh.io_struct import SamplingParams


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution to sample from for one row of logits: temperature, top-k, top-p."""
    if params.greedy:
        raise ValueError("target_probs is undefined for greedy decoding")
    scaled = logits.to(torch.float64) / params.temperature
    if params.top_k and params.top_k < scaled.numel():
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = before >= params.top_p  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())
