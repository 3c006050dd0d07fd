"""Linear layers that stay cheap for a handful of rows.

On CPU, ``F.linear`` (x @ W.T) over one row runs a GEMV kernel, and over 2-32 rows a GEMM
kernel, that both read the weights far slower than the same product computed as
``(W @ x.T).T``: a decode step is bound by reading the weights, and on a 2-core box, over
SmolLM2-135M's weights (cold in cache, as in a real forward), every linear of one token took
48 ms with ``F.linear``, 22 ms as the transposed product of the row stacked twice, and two rows
21 ms transposed against 86 ms with ``F.linear``. A verify step is exactly that case (a root
plus a few tree nodes, or a few rows of one token each), and so is plain decoding, so every
``nn.Linear`` of a target takes the transposed product for 1..``MAX_ROWS`` rows (one row
stacked twice: the one-column product takes the slow GEMV path again) and ``F.linear`` above.
The result is the same product in another summation order: equal in float64 to rounding, and
in fp32 within the noise that already separates a tree forward from a one-token step. Only
float32 takes it (where it was measured): float64, the dtype of the exactness proofs, keeps
``F.linear``, whose rows are bitwise independent of how many rows share the call, so those
proofs stay about the algorithm (masks, positions, KV), not about summation order (Gemma 3's
norms compute in float32 and would turn a 1e-17 difference into 2e-7).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 32
"""Up to this many rows the transposed product is as fast or faster; from 64 rows on ``F.linear``'s
kernel wins (``python -m draftmesh.bench.forward_cost``)."""
ONE_ROW = True
"""One row goes through the two-row product too (the row twice): the one-row GEMV kernel reads
the weights at about half the speed of the two-row GEMM on these CPUs."""


def small_rows_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    low = 1 if ONE_ROW else 2
    if not low <= rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
    if rows == 1:
        out = torch.mm(module.weight, torch.cat([flat, flat]).t()).t()[:1].contiguous()
    else:
        out = torch.mm(module.weight, flat.t()).t()
    if module.bias is not None:
        out = out + module.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


def use_small_rows_linear(model: nn.Module) -> int:
    """Route every ``nn.Linear`` of ``model`` through ``small_rows_linear``; returns how many."""
    n = 0
    for module in model.modules():
        if type(module) is nn.Linear and not getattr(module, "_draftmesh_small_rows", False):
            module.forward = small_rows_linear.__get__(module)  # bound: forward(x)
            module._draftmesh_small_rows = True
            n += 1
    return n


def _probe(repeats: int = 7) -> None:  # pragma: no cover - a measuring aid, not a code path
    """Print F.linear vs the transposed product over SmolLM2-135M-sized weights, interleaved."""
    layers = [[torch.randn(o, i) for o, i in ((576, 576), (192, 576), (1536, 576), (576, 1536))] for _ in range(30)]
    res: dict = {}
    for _ in range(repeats):
        for m in (1, 2, 3, 4, 6, 8):
            for how in ("F.linear", "W@x.T"):
                xs = {i: torch.randn(m, i) for i in (576, 1536)}
                t0 = time.perf_counter()
                for layer in layers:
                    for w in layer:
                        x = xs[w.shape[1]]
                        F.linear(x, w) if how == "F.linear" else torch.mm(w, x.t()).t()
                res.setdefault((how, m), []).append(time.perf_counter() - t0)
    unit = statistics.median(res[("F.linear", 1)][1:])
    for key in sorted(res, key=lambda k: (k[1], k[0])):
        print(f"{key[0]:9s} rows={key[1]}  {statistics.median(res[key][1:]) / unit:.2f}x F.linear of one row")


if __name__ == "__main__":  # pragma: no cover
    torch.set_num_threads(2)
    _probe()
