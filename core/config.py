"""One typed engine config, filled from defaults < YAML file < DRAFTMESH_* env < CLI flags.

The dataclass is the single source of truth: its fields generate the CLI flags and the
env names, so a new option is added in exactly one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

Dtype = Literal["auto", "float32", "bfloat16", "float16"]


@dataclass
class EngineConfig:
    model: str = field(default="smollm2-135m", metadata={"help": "model spec: smollm2-135m, gemma3-270m, a path or a hub id"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda:0"})
    dtype: Dtype = field(default="auto", metadata={"help": "auto = float32 on CPU, bfloat16 on CUDA"})
    threads: int = field(default=0, metadata={"help": "torch CPU threads (0 = torch default)"})
    sources: list[str] | None = field(default=None, metadata={"help": "draft sources (default: all default sources)"})
    source_deadline_ms: int = field(default=100, metadata={"help": "per-step deadline for draft sources (0 = none)"})
    source_options: dict[str, dict[str, Any]] | None = field(
        default=None, metadata={"help": "per-source options, e.g. {rag: {paths: [docs/]}} (config file only)"}
    )
    max_nodes: int = field(default=64, metadata={"help": "upper bound on token-tree nodes per step (the cost curve decides below it)"})

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0, got {self.threads}")
        if self.source_deadline_ms < 0:
            raise ValueError(f"source_deadline_ms must be >= 0, got {self.source_deadline_ms}")
        if self.max_nodes < 0:
            raise ValueError(f"max_nodes must be >= 0, got {self.max_nodes}")
        if self.dtype not in typing.get_args(Dtype):
            raise ValueError(f"dtype must be one of {', '.join(typing.get_args(Dtype))}, got {self.dtype!r}")

    def torch_dtype(self):
        import torch

        from draftmesh.models import default_dtype

        return default_dtype(self.device) if self.dtype == "auto" else getattr(torch, self.dtype)

    @property
    def source_deadline_s(self) -> float | None:
        return self.source_deadline_ms / 1000 if self.source_deadline_ms else None

    def apply_threads(self) -> None:
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_list(tp: Any) -> bool:
    return any(typing.get_origin(a) is list for a in (tp, *typing.get_args(tp)))


def add_config_arguments(parser: argparse.ArgumentParser, cls: type = EngineConfig) -> None:
    """Add a flag per config field (defaults left as None so unset flags do not override)."""
    parser.add_argument("--config", type=Path, default=None, help="YAML config file")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if any(typing.get_origin(a) is dict for a in (tp, *typing.get_args(tp))):
            continue  # structured options come from the config file
        kwargs: dict[str, Any] = {"default": None, "help": f.metadata.get("help", "")}
        if _is_list(tp):
            kwargs["type"] = lambda s: [x for x in s.split(",") if x]
            kwargs["metavar"] = "A,B,..."
        elif typing.get_origin(tp) is Literal:
            kwargs["choices"] = typing.get_args(tp)
        elif tp in (int, float, str):
            kwargs["type"] = tp
        parser.add_argument(_flag(f.name), dest=f.name, **kwargs)


def load_config(
    cls: type = EngineConfig,
    *,
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
):
    """Build ``cls`` from its defaults, a YAML file, DRAFTMESH_<FIELD> env vars and overrides."""
    values: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(cls)}
    if file is not None:
        data = yaml.safe_load(Path(file).read_text()) or {}
        if not isinstance(data, dict):
            raise ValueError(f"config file {file} must hold a mapping")
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"config file {file}: unknown keys {', '.join(unknown)}")
        values.update(data)
    hints = typing.get_type_hints(cls)
    env = os.environ if env is None else env
    for name in names:
        raw = env.get(f"DRAFTMESH_{name.upper()}")
        if raw is not None and any(typing.get_origin(a) is dict for a in (hints[name], *typing.get_args(hints[name]))):
            raise ValueError(f"DRAFTMESH_{name.upper()}: {name} can only be set in the config file")
        if raw is not None:
            values[name] = _parse_env(raw, hints[name], name)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None and k in names})
    return cls(**values)


def config_from_args(args: argparse.Namespace, cls: type = EngineConfig):
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}
    return load_config(cls, file=getattr(args, "config", None), overrides=overrides)


def _parse_env(raw: str, tp: Any, name: str) -> Any:
    if _is_list(tp):
        return [x for x in raw.split(",") if x]
    if tp is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"DRAFTMESH_{name.upper()} must be an integer, got {raw!r}") from None
    return raw
