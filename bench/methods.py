"""The methods `draftmesh bench` compares, by name: our engine, transformers' `generate`, vLLM, the mesh.

``parse_methods`` turns ``plain,hf,...,draftmesh:<source>,draftmesh+<policy>,mesh:...`` into
``Method`` values, plain first (the reference for speed and for the identical-output check).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

MethodFamily = Literal["engine", "hf", "vllm", "mesh"]
"""engine: our decoder in this process; hf: transformers ``generate``; vllm: vLLM's offline engine in a
child process of its own environment; mesh: the served mesh over gRPC."""
HFMode = Literal["greedy", "pld", "assist"]


PLAIN = "plain"

HF = "hf"

HF_PLD = "hf-pld"

HF_ASSIST = "hf-assist"

DRAFTMESH = "draftmesh"

VLLM = "vllm"
"""vLLM, plain greedy; needs ``make vllm-env``."""

VLLM_NGRAM = "vllm-ngram"
"""vLLM with its n-gram (prompt lookup) speculative decoding, greedy."""

VLLM_METHODS = (VLLM, VLLM_NGRAM)

DRAFTMESH_TRACED = "draftmesh-traced"
"""draftmesh with OpenTelemetry tracing on (spans exported over OTLP to an in-process receiver)."""

ENGINE_PREFIX = "draftmesh:"

POLICY_SEPARATOR = "+"

ALL_DEFAULT_ABLATIONS = "draftmesh:*"

MESH_PLAIN = "mesh:plain"

MESH_DRAFTMESH = "mesh:draftmesh"

MESH_METHODS = (MESH_PLAIN, MESH_DRAFTMESH)

BASE_METHODS = (PLAIN, HF, HF_PLD, HF_ASSIST, DRAFTMESH)

DEFAULT_METHODS = "plain,hf,hf-pld,hf-assist,draftmesh"

DEFAULT_MESH_METHODS = "plain,draftmesh,mesh:plain,mesh:draftmesh"

MESH_PAIRS = ((MESH_DRAFTMESH, DRAFTMESH), (MESH_PLAIN, PLAIN))
"""(mesh method, the in-process method it is compared with)."""


@dataclass(frozen=True)
class Method:
    name: str
    family: MethodFamily
    sources: tuple[str, ...] | None = None
    """Engine: the draft sources; None = the registry's default set, () = plain decoding.
    Mesh: () = speculation disabled, None = the mesh's default speculation."""
    hf_mode: HFMode | None = None
    """HF only: plain greedy, prompt lookup, or an assistant model."""
    lossless: bool = True
    policy: str = "exact"
    """Engine only: the acceptance policy (``draftmesh+typical``); only "exact" is lossless."""
    traced: bool = False
    """Engine only: tracing on during its runs (``draftmesh-traced``)."""


def parse_methods(
    text: str | Sequence[str],
    *,
    available: Sequence[str] | None = None,
    defaults: Sequence[str] | None = None,
) -> list[Method]:
    """Parse ``plain,hf,...,draftmesh:<source>`` into methods, plain first, duplicates dropped.

    Source names are checked against ``available`` (default: the draft registry);
    ``draftmesh:*`` stands for one ablation per default source. ``plain`` is always added:
    it is the reference for speed and for the identical-output check.
    """
    # lazy: the registries load torch, and every `draftmesh` command builds its parser from this module
    from draftmesh.draft import registry
    from draftmesh.verify.policy import available_policies

    available = list(registry.available() if available is None else available)
    defaults = list(registry.DEFAULT_SOURCES if defaults is None else defaults)
    policies = available_policies()
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text)]
    names = [n for n in names if n]
    if not names:
        raise ValueError("no methods given")
    expanded: list[str] = []
    for name in names:
        if name == ALL_DEFAULT_ABLATIONS:
            expanded.extend(ENGINE_PREFIX + s for s in defaults)
        else:
            expanded.append(name)
    methods: list[Method] = []
    seen: set[str] = set()
    for name in [PLAIN, *expanded]:
        if name in seen:
            continue
        seen.add(name)
        base, _, policy = name.partition(POLICY_SEPARATOR)
        if policy:
            if policy not in policies:
                raise ValueError(f"unknown acceptance policy {policy!r} in method {name!r}; available: {', '.join(policies)}")
            if not (base == DRAFTMESH or base.startswith(ENGINE_PREFIX)):
                raise ValueError(f"method {name!r}: a policy applies to draftmesh methods only")
            sources = None if base == DRAFTMESH else (base[len(ENGINE_PREFIX) :],)
            if sources and sources[0] not in available:
                raise ValueError(f"unknown draft source {sources[0]!r} in method {name!r}")
            methods.append(Method(name, "engine", sources=sources, lossless=policy == "exact", policy=policy))
        elif name == PLAIN:
            methods.append(Method(PLAIN, "engine", sources=()))
        elif name == DRAFTMESH:
            methods.append(Method(DRAFTMESH, "engine", sources=None))
        elif name == DRAFTMESH_TRACED:
            methods.append(Method(DRAFTMESH_TRACED, "engine", sources=None, traced=True))
        elif name.startswith(ENGINE_PREFIX):
            source = name[len(ENGINE_PREFIX) :]
            if source not in available:
                raise ValueError(
                    f"unknown draft source {source!r} in method {name!r}; available sources: "
                    f"{', '.join(available) or '(none)'}"
                )
            methods.append(Method(name, "engine", sources=(source,)))
        elif name == MESH_PLAIN:
            methods.append(Method(MESH_PLAIN, "mesh", sources=()))
        elif name == MESH_DRAFTMESH:
            methods.append(Method(MESH_DRAFTMESH, "mesh", sources=None))
        elif name == HF:
            methods.append(Method(HF, "hf", hf_mode="greedy"))
        elif name == HF_PLD:
            methods.append(Method(HF_PLD, "hf", hf_mode="pld"))
        elif name == HF_ASSIST:
            methods.append(Method(HF_ASSIST, "hf", hf_mode="assist"))
        elif name in VLLM_METHODS:
            methods.append(Method(name, "vllm"))
        else:
            valid = ", ".join(
                [*BASE_METHODS, *VLLM_METHODS, DRAFTMESH_TRACED, ALL_DEFAULT_ABLATIONS, *MESH_METHODS] + [ENGINE_PREFIX + s for s in available]
            )
            raise ValueError(f"unknown method {name!r}; valid methods: {valid}")
    return methods


def default_methods(target_kind: str, methods: str | None) -> str:
    """The --methods text: the given one, else the default of the target."""
    if methods:
        return methods
    return DEFAULT_MESH_METHODS if target_kind == "mesh" else DEFAULT_METHODS
