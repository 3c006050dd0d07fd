"""Linear layers over packed weights: one read of the weights for a handful of rows.

A decode or verify step multiplies a few rows (one request's root and tree, or one token of each
of a few requests) by every weight of the model, so it is bound by reading the weights. On these
CPUs torch's kernels read them at a fraction of the memory bandwidth for small row counts:
measured over SmolLM2-135M's linears and tied head (2 threads, cold weights as in a forward),
``F.linear`` took 50 ms for one row and 63-80 ms for 2-8 rows, the transposed product that
replaced it for 1-32 rows (``(W @ x.T).T``) 24 ms for one row and 47 ms for 8, and this kernel
18-19 ms for any of 1 to 8 rows (31 ms for 16, 186 ms against 236 for 128: it is also the faster
one for prefill chunks). So every fp32 ``nn.Linear`` of a CPU target runs
``csrc/packed_gemm.cpp`` over its weights packed once at load: blocks of output columns laid out
k-major, streamed once per step while all the step's rows are multiplied from registers.

Each output is one sequential FMA chain over the input features, whatever the row count, the
row's place in the batch or the thread count: a row's result is **bitwise** the same alone or in
any batch (``tests/core/test_packed_linear.py``), so the linears add no batch-dependent rounding.

Where the kernel does not apply (float64, the dtype of the exactness proofs; bf16; a GPU; a CPU
without AVX2; a build without a compiler) the layer keeps ``F.linear``. A packed layer keeps no
unpacked copy of its weight unless another module shares it (a head tied to the embeddings).
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import logging
import math
import mmap
import os
import weakref
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

LIBRARIES = {"avx512": "_packed_gemm_avx512", "avx2": "_packed_gemm_avx2"}
"""ISA -> the ctypes library setup.py builds from ``csrc/packed_gemm.cpp`` for it."""
ENV_ISA = "DRAFTMESH_PACKED_GEMM"
"""Set to ``avx512``, ``avx2`` or ``off`` to override the ISA picked from the CPU."""
HUGE_PAGE = 2 << 20
"""The transparent huge page size packed weights are advised onto (x86-64)."""


class PackedGemm:
    """One build of the kernel: packs weights, multiplies rows by them."""

    def __init__(self, path: str | Path, isa: str) -> None:
        self.isa = isa
        self.path = str(path)
        lib = native_library(self.path)
        lib.dm_block_width.restype = ctypes.c_long
        lib.dm_packed_mm.restype = None
        lib.dm_packed_mm.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_long,
                                     ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
        self._mm = lib.dm_packed_mm
        self.block = int(lib.dm_block_width())

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [N, K] as [ceil(N / block), K, block]: block columns k-major, zero-padded."""
        n, k = weight.shape
        blocks = -(-n // self.block)
        padded = torch.zeros((blocks * self.block, k), dtype=torch.float32)
        padded[:n] = weight.detach()
        return weight_buffer((blocks, k, self.block)).copy_(padded.view(blocks, self.block, k).transpose(1, 2))

    def mm(self, x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T (+ bias)`` for ``x`` [..., K] in fp32 on the CPU."""
        k = x.shape[-1]
        flat = x.reshape(math.prod(x.shape[:-1]), k).contiguous()  # (-1 is ambiguous when k is 0)
        rows = flat.shape[0]
        y = torch.empty((rows, out_features), dtype=torch.float32)
        if rows:
            self._mm(flat.data_ptr(), rows, k, packed.data_ptr(), out_features,
                     None if bias is None else bias.data_ptr(), y.data_ptr(), torch.get_num_threads())
        return y.view(*x.shape[:-1], out_features)


def weight_buffer(shape: tuple[int, ...]) -> torch.Tensor:
    """An empty fp32 tensor for packed weights, in fresh memory advised onto transparent huge pages.

    A step streams every weight once: on 4 KiB pages SmolLM2's 540 MB are ~135k TLB misses a
    forward, and the hardware prefetchers stop at every page. Measured over 1 GB of 576x1536
    products (2 threads, µs per product, 4 KiB -> 2 MiB pages): 1 row 143 -> 125, 8 rows 194 -> 187,
    16 rows 239 -> 221. The memory is its own mapping, starting on a 2 MiB boundary and ending at
    the tensor's last 4 KiB page (torch's allocator may hand back memory already faulted in on
    small pages, and the kernel aligns only mappings of whole 2 MiB multiples), so every whole
    extent gets a huge page and nothing is added. Below 2 MiB, or without THP or libc's mmap, an
    ordinary tensor."""
    numel = math.prod(shape)
    nbytes = numel * 4
    libc = _libc()
    if nbytes < HUGE_PAGE or libc is None:
        return torch.empty(shape, dtype=torch.float32)
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    base = libc.mmap(None, length + HUGE_PAGE, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        return torch.empty(shape, dtype=torch.float32)
    start = -(-base // HUGE_PAGE) * HUGE_PAGE
    if start > base:
        libc.munmap(base, start - base)
    libc.munmap(start + length, base + HUGE_PAGE - start)  # the rest of the slack after the tensor
    libc.madvise(start, length, mmap.MADV_HUGEPAGE)  # refused without THP: small pages
    buffer = (ctypes.c_char * nbytes).from_address(start)
    # Unmapped when the last tensor on it goes, never at exit: a daemon thread may still be reading it.
    weakref.finalize(buffer, libc.munmap, start, length).atexit = False
    return torch.frombuffer(buffer, dtype=torch.float32, count=numel).view(shape)  # the tensor keeps buffer


_libc_handle: ctypes.CDLL | None | bool = False


def _libc() -> ctypes.CDLL | None:
    """libc's mmap, munmap and madvise (None off Linux or without MADV_HUGEPAGE)."""
    global _libc_handle
    if _libc_handle is False:
        _libc_handle = None
        if hasattr(mmap, "MADV_HUGEPAGE"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.mmap.restype = ctypes.c_void_p
                libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                      ctypes.c_long]
                libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
                libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
                _libc_handle = libc
            except (OSError, AttributeError):
                pass
    return _libc_handle


_kernel: PackedGemm | None = None
_looked = False
_libraries: dict[str, ctypes.CDLL] = {}


def native_library(path: str | Path) -> ctypes.CDLL:
    """The native library at ``path``, loaded once (it also holds ``draftmesh.tree_attention``'s kernel)."""
    path = str(path)
    if path not in _libraries:
        _libraries[path] = ctypes.CDLL(path)  # CDLL releases the GIL during each call
    return _libraries[path]


def cpu_isa() -> str | None:
    """The widest build this CPU runs (``DRAFTMESH_PACKED_GEMM`` overrides; ``off``: None)."""
    wanted = os.environ.get(ENV_ISA, "").strip().lower()
    if wanted:
        return None if wanted == "off" else wanted
    capability = torch.backends.cpu.get_cpu_capability()
    if capability.startswith("AVX512"):
        return "avx512"
    if capability == "AVX2":
        return "avx2"
    return None


def library_path(isa: str) -> Path | None:
    """The built library for ``isa`` beside this module, if setup.py could build it."""
    here = Path(__file__).resolve().parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{LIBRARIES[isa]}{suffix}"
        if path.exists():
            return path
    return None


def native_build() -> tuple[Path, str] | None:
    """The native library built for this CPU and its ISA, or None (no AVX2, switched off, not built)."""
    isa = cpu_isa()
    if isa not in LIBRARIES:
        return None
    path = library_path(isa)
    return None if path is None else (path, isa)


def kernel() -> PackedGemm | None:
    """The kernel for this CPU, loaded once; None where it does not apply (then ``F.linear``)."""
    global _kernel, _looked
    if not _looked:
        _looked = True
        isa = cpu_isa()
        if isa is not None:
            if isa not in LIBRARIES:
                raise ValueError(f"{ENV_ISA}={isa!r}: expected one of {sorted(LIBRARIES)} or 'off'")
            path = library_path(isa)
            if path is None:
                log.warning("the packed GEMM kernel for %s is not built (no C++ compiler at install?): "
                            "linears use F.linear, and small-batch steps are slower", isa)
            else:
                _kernel = PackedGemm(path, isa)
    return _kernel


def packed_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"{module.__class__.__name__} holds packed fp32 CPU weights; got {x.dtype} on {x.device}")
    return module._draftmesh_gemm.mm(x, module.packed_weight, module.out_features, module.bias)


def use_packed_linears(model: nn.Module, gemm: PackedGemm | None = None) -> int:
    """Pack every fp32 CPU ``nn.Linear`` of ``model`` and route it through the kernel; returns how
    many. A weight no other module shares is dropped after packing (the packed copy replaces it)."""
    gemm = gemm or kernel()
    if gemm is None:
        return 0
    shared = {id(p) for m in model.modules() if not isinstance(m, nn.Linear) for p in m.parameters(recurse=False)}
    n = 0
    for module in model.modules():
        if type(module) is not nn.Linear or getattr(module, "_draftmesh_gemm", None) is not None:
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            continue
        module.register_buffer("packed_weight", gemm.pack(weight), persistent=False)
        if module.bias is not None:
            module.bias.data = module.bias.data.contiguous()
        module._draftmesh_gemm = gemm
        module.forward = packed_linear.__get__(module)  # bound: forward(x)
        if id(weight) not in shared:
            module.weight = None  # the packed copy is the weight now
        n += 1
    return n

