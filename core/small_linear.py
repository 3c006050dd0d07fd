"""Linear layers that stay cheap for a handful of rows.

On CPU, ``F.linear`` (x @ W.T) over 2-6 rows picks a GEMM kernel that reads the weights
less efficiently than one row does: measured on a 2-core box over SmolLM2-sized weights,
2 rows cost 1.8-2.7x one row and 3-4 rows 2-5x, while the same product computed as
``(W @ x.T).T`` costs 0.7-2.0x (the probe: ``python -m draftmesh.small_linear``).
A verify step is exactly that case (a root plus a few tree nodes, or a few rows of one token
each), so every ``nn.Linear`` of a target takes the transposed product for 2..``MAX_ROWS``
rows and ``F.linear`` otherwise. The result is the same product in another summation order:
equal in float64 to rounding, and in fp32 within the noise that already separates a tree
forward from a one-token step. Only float32 takes it (where it was measured): float64, the
dtype of the exactness proofs, keeps ``F.linear``, whose rows are bitwise independent of how
many rows share the call, so those proofs stay about the algorithm (masks, positions, KV), not
about summation order (Gemma 3's norms compute in float32 and would turn a 1e-17 difference
into 2e-7).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

MAX_ROWS = 6
"""Above this many rows ``F.linear``'s own kernel is as fast or faster (measured at 8)."""


def small_rows_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.numel() // x.shape[-1] if x.numel() else 0
    if not 2 <= rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu":
        return F.linear(x, module.weight, module.bias)
    flat = x.reshape(rows, x.shape[-1])
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
