"""Assemble the engine: a target, named draft sources (in-process and remote) and the cost-aware
tree builder, into a decoder."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from draftmesh.backend import TorchTarget
from draftmesh.config import DEFAULT_SOURCE_DEADLINE_S, BuilderConfig, DraftmeshConfig, EngineConfig, ServeConfig
from draftmesh.draft import registry
from draftmesh.draft.base import DraftSource
from draftmesh.draft.grpc_source import GrpcDraftSource
from draftmesh.draft.remote import ServeHandleSource
from draftmesh.verify.decoder import FlagProvider, SpeculativeDecoder
from draftmesh.verify.scheduler import BatchLimits
from draftmesh.verify.prefix_kv import PrefixKVPool
from draftmesh.verify.tree_builder import CostAwareTreeBuilder, default_aligner


def build_decoder(
    target: TorchTarget,
    sources: Sequence[str] | None = None,
    *,
    source_options: Mapping[str, Mapping] | None = None,
    max_nodes: int | None = None,
    builder_config: BuilderConfig | None = None,
    redis_url: str | None = None,
    source_deadline_s: float | None = DEFAULT_SOURCE_DEADLINE_S,
    extra_sources: Sequence[DraftSource] = (),
    kv_pool: PrefixKVPool | None = None,
    flag_provider: FlagProvider | None = None,
    trace_steps: int = 256,
    batch_limits: BatchLimits | None = None,
    batch_observer=None,
    max_document_tokens: int | None = None,
    rag_budget_bytes: int | None = None,
    answer_store_max_bytes: int = 0,
) -> SpeculativeDecoder:
    """``sources=None`` means the default set; an empty list means plain decoding.

    The tree budget comes from the target's verify cost curve, measured here once if the
    target has none yet. Each step waits at most ``source_deadline_s`` for the sources
    (None: call them inline, without a deadline). ``extra_sources`` are already built (remote
    sources: a Serve draft deployment, an external gRPC DraftSource). ``max_nodes`` overrides
    the builder config's node cap.
    """
    names = registry.DEFAULT_SOURCES if sources is None else tuple(sources)
    options = source_options or {}
    unknown = sorted(set(options) - set(registry.available()))
    if unknown:
        raise ValueError(f"options given for unknown draft sources: {', '.join(unknown)}")
    env = registry.SourceEnv(tokenizer=target.tokenizer, vocab_size=target.vocab_size, redis_url=redis_url,
                             answer_store_max_bytes=answer_store_max_bytes, step_deadline_s=source_deadline_s)
    options = dict(options)
    if rag_budget_bytes is not None and "rag" in names:
        options["rag"] = {"budget_bytes": rag_budget_bytes, **options.get("rag", {})}
    built = [registry.create(name, env, **dict(options.get(name, {}))) for name in names] + list(extra_sources)
    if built:
        target.ensure_costs()
    config = builder_config or BuilderConfig()
    if max_nodes is not None:
        config = dataclasses.replace(config, max_nodes=max_nodes)
    builder = CostAwareTreeBuilder(target.cost_curve or {1: 1.0}, config, aligner=default_aligner(target.tokenizer))
    return SpeculativeDecoder(target, built, builder, flag_provider=flag_provider,
                              source_deadline_s=source_deadline_s, kv_pool=kv_pool, trace_steps=trace_steps,
                              batch_limits=batch_limits, batch_observer=batch_observer,
                              max_document_tokens=max_document_tokens, rest_after=config.rest_after,
                              max_rest=config.max_rest, rest_min_rows=config.rest_min_rows,
                              asking_probe_every=config.asking_probe_every)


def load_target(cfg: EngineConfig) -> TorchTarget:
    """The config's target model, on its device and dtype, with its thread count applied."""
    cfg.apply_threads()
    return TorchTarget.load(cfg.model, device=cfg.device, dtype=cfg.torch_dtype(), cost_cache=cfg.cost_cache)


def decoder_from_config(
    target: TorchTarget,
    cfg: DraftmeshConfig,
    *,
    extra_sources: Sequence[DraftSource] = (),
    kv_pool: PrefixKVPool | None = None,
    flag_provider: FlagProvider | None = None,
    batch_observer=None,
) -> SpeculativeDecoder:
    """``build_decoder`` with the config's sources, their options and deadline, its builder, Redis, batch
    limits and prefix pool (``kv_pool``: one of the caller's instead)."""
    return build_decoder(
        target,
        cfg.sources.names,
        source_options=cfg.sources.options,
        builder_config=cfg.builder,
        source_deadline_s=cfg.sources.deadline_s,
        redis_url=cfg.serve.redis_url,
        extra_sources=extra_sources,
        kv_pool=kv_pool if kv_pool is not None else prefix_pool(cfg.engine, cfg.serve.session_cache_size),
        flag_provider=flag_provider,
        trace_steps=cfg.engine.trace_steps,
        batch_limits=batch_limits(cfg.engine),
        batch_observer=batch_observer,
        max_document_tokens=cfg.limits.max_document_tokens,
        rag_budget_bytes=cfg.sources.rag_budget_bytes,
        answer_store_max_bytes=cfg.serve.answer_store_max_bytes,
    )


def prefix_pool(cfg: EngineConfig, session_cache_size: int = ServeConfig.session_cache_size) -> PrefixKVPool | None:
    """The replica's pool of finished requests' KV (sessions' and prefixes'), None when both are off."""
    if not (cfg.prefix_cache_size or session_cache_size):
        return None
    return PrefixKVPool(max_sessions=session_cache_size, max_prefixes=cfg.prefix_cache_size)


def batch_limits(cfg: EngineConfig) -> BatchLimits:
    """The replica's batch: KV budget, tokens per forward, prefill chunk, rows, queue."""
    return BatchLimits(kv_budget_bytes=cfg.kv_budget_bytes, max_batch_tokens=cfg.max_batch_tokens,
                       prefill_chunk=cfg.prefill_chunk,
                       prefill_while_decoding=cfg.prefill_while_decoding, max_rows=cfg.max_batch_rows, max_waiting=cfg.max_waiting)


def remote_sources(cfg: DraftmeshConfig, handles: Mapping[str, Any], tokenizer_name: str) -> list[DraftSource]:
    """Sources outside the verifier replica: Serve draft deployments by handle, external gRPC by address."""
    deadline = cfg.sources.deadline_s or 1.0
    out: list[DraftSource] = []
    for name, spec in cfg.sources.remote.items():
        if spec.external:  # from_spec reads the entry's own timeout_ms
            out.append(GrpcDraftSource.from_spec(name, spec, tokenizer_name=tokenizer_name, default_timeout_s=deadline))
        else:
            timeout = (spec.timeout_ms if spec.timeout_ms is not None else 1000 * deadline) / 1000
            out.append(ServeHandleSource(name, handles[name], tokenizer_name=tokenizer_name, timeout_s=max(timeout, 1.0)))
    return out
