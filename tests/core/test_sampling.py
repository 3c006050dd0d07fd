"""greedy_tokens: the token greedy decoding takes at every position of a step's logits."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from draftmesh.sampling import greedy_tokens


def _torch_rule(logits: torch.Tensor) -> list[int]:
    return torch.argmax(logits, dim=-1).tolist()


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6), vocab=st.integers(1, 40), levels=st.integers(1, 4), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([torch.float32, torch.float64]))
def test_greedy_tokens_takes_the_first_maximum_like_torch(rows, vocab, levels, seed, dtype):
    # few distinct values, so most rows hold ties: the rule must pick the first maximum, as torch does
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (rows, vocab), generator=gen).to(dtype)
    assert greedy_tokens(logits) == _torch_rule(logits)


def test_greedy_tokens_on_views_vectors_nan_and_other_dtypes():
    base = torch.randn(9, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    base[2, 17] = base[2, 250] = base[2].max() + 1  # a tie
    view = base[1:8:2, ::3]  # strided, not contiguous
    assert greedy_tokens(view) == _torch_rule(view)
    assert greedy_tokens(base[4]) == [int(torch.argmax(base[4]))]  # one row given as a vector
    with_nan = base.clone().float()
    with_nan[5, 40] = float("nan")
    assert greedy_tokens(with_nan)[5] == 40 == _torch_rule(with_nan)[5]
    half = base.to(torch.bfloat16)  # no NumPy dtype: torch's own argmax, same rule
    assert greedy_tokens(half) == _torch_rule(half)
    grads = base.clone().float().requires_grad_()
    assert greedy_tokens(grads) == _torch_rule(grads.detach())
