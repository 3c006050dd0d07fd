"""Wire a target, named draft sources and the cost-aware tree builder into a decoder."""

from __future__ import annotations

from typing import Mapping, Sequence

from draftmesh.draft import registry
from draftmesh.router.tree_builder import BuilderConfig, CostAwareTreeBuilder
from draftmesh.verify.backend import TorchTarget
from draftmesh.verify.decoder import SpeculativeDecoder


def build_decoder(
    target: TorchTarget,
    sources: Sequence[str] | None = None,
    *,
    source_options: Mapping[str, Mapping] | None = None,
    max_nodes: int = 64,
    builder_config: BuilderConfig | None = None,
) -> SpeculativeDecoder:
    """``sources=None`` means the default set; an empty list means plain decoding.

    The tree budget comes from the target's verify cost curve, measured here once if the
    target has none yet.
    """
    names = registry.DEFAULT_SOURCES if sources is None else tuple(sources)
    options = source_options or {}
    built = [registry.create(name, **dict(options.get(name, {}))) for name in names]
    if built and not target.cost_curve:
        target.measure_cost_curve()
    config = builder_config or BuilderConfig(max_nodes=max_nodes)
    builder = CostAwareTreeBuilder(target.cost_curve or {1: 1.0}, config)
    return SpeculativeDecoder(target, built, builder)
