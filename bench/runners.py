"""The in-process method runners: our decoder (``EngineRunner``) and transformers ``generate``
(``HFRunner``: greedy, prompt lookup, an assistant model). The mesh's runner is in ``mesh``."""

from __future__ import annotations

import contextlib
import time
from typing import Any, Mapping, Sequence

import torch
from transformers import GenerationConfig

from draftmesh import compute
from draftmesh.backend import TorchTarget
from draftmesh.bench.items import ItemRun, MethodRunner, PreparedItem, SourceStats, cut_at_eos
from draftmesh.bench.methods import Method
from draftmesh.bench.tracing import tracing_switch
from draftmesh.config import DEFAULT_SOURCE_DEADLINE_S, BuilderConfig, EngineConfig
from draftmesh.io_struct import GenerationRequest, SpeculationParams
from draftmesh.verify.engine import build_decoder

PLD_NUM_TOKENS = 10


class _CountingBuilder:
    """Wraps a tree builder to count the drafted tokens each source proposed.

    Only ``build`` is intercepted; everything else (observe, finish, max_nodes, ...) is the
    wrapped builder's own, whatever its interface grows into.
    """

    def __init__(self, inner) -> None:
        self.inner = inner
        self.clear()

    def clear(self) -> None:
        self.proposals: dict[str, int] = {}
        self.tokens: dict[str, int] = {}
        self.texts: dict[str, list[str]] = {}

    def build(self, proposals, ctx, max_depth=None):
        self._count(proposals)
        return self.inner.build(proposals, ctx, max_depth) if max_depth is not None else self.inner.build(proposals, ctx)

    def _count(self, proposals) -> None:
        for p in proposals:
            self.proposals[p.source] = self.proposals.get(p.source, 0) + 1
            if p.token_ids is not None:
                self.tokens[p.source] = self.tokens.get(p.source, 0) + len(p.token_ids)
            else:  # tokenized after the run, outside the timed region
                self.texts.setdefault(p.source, []).append(p.text)

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        attr = getattr(self.inner, name)
        if name == "candidates":  # the batch scheduler's entry (a cost-aware builder's nodes), counted alike
            def candidates(proposals, ctx, max_depth=None):
                self._count(proposals)
                return attr(proposals, ctx, max_depth)
            return candidates
        return attr


class EngineRunner:
    """Our SpeculativeDecoder with named sources (() = plain decoding, None = defaults)."""

    lossless = True

    def __init__(
        self,
        name: str,
        target,
        sources: Sequence[str] | None,
        *,
        source_options: Mapping[str, Mapping] | None = None,
        source_deadline_s: float | None = DEFAULT_SOURCE_DEADLINE_S,
        builder_config: BuilderConfig | None = None,
        policy: str = "exact",
        traced: bool = False,
    ) -> None:
        self.name = name
        self.policy = policy
        self.tracing = None
        if traced:
            self.tracing = tracing_switch()
        self.lossless = policy == "exact"
        self.target = target
        self.sources = None if sources is None else tuple(sources)
        self.source_options = source_options
        self.source_deadline_s = source_deadline_s
        self.builder_config = builder_config
        self.decoder = None
        self.counter: _CountingBuilder | None = None

    def reset(self) -> None:
        self.decoder = build_decoder(self.target, self.sources, source_options=self.source_options,
                                     builder_config=self.builder_config, source_deadline_s=self.source_deadline_s)
        self.counter = None
        if self.decoder.sources:
            self.counter = _CountingBuilder(self.decoder.builder)
            self.decoder.builder = self.counter

    def run(self, item: PreparedItem) -> ItemRun:
        if self.decoder is None:
            self.reset()
        if self.counter is not None:
            self.counter.clear()
        req = GenerationRequest(
            prompt_ids=item.prompt_ids,
            max_new_tokens=item.max_new_tokens,
            request_id=item.id,
            session_id=item.item.session,
            documents=item.item.corpus,
            speculation=SpeculationParams(policy=self.policy),
        )
        with self.tracing.enabled() if self.tracing is not None else contextlib.nullcontext():
            t0 = time.perf_counter()
            res = self.decoder.generate(req)
            seconds = time.perf_counter() - t0
        stats: dict[str, SourceStats] = {}
        names = [s.name for s in self.decoder.sources]
        if self.counter is not None:
            names += [n for n in self.counter.proposals if n not in names]
        for n in names:
            stats[n] = SourceStats()
        for step in res.steps:
            for n, k in step.accepted_by_source.items():
                stats.setdefault(n, SourceStats()).accepted_tokens += k
        if self.counter is not None:
            tok = self.target.tokenizer
            for n, k in self.counter.proposals.items():
                stats[n].proposals += k
            for n, k in self.counter.tokens.items():
                stats[n].proposed_tokens += k
            for n, texts in self.counter.texts.items():
                stats[n].proposed_tokens += sum(len(tok.encode(t, add_special_tokens=False)) for t in texts)
        return ItemRun(
            item_id=item.id,
            kind=item.kind,
            method=self.name,
            token_ids=list(res.token_ids),
            seconds=seconds,
            steps=len(res.steps),
            draft_s=sum(s.draft_s for s in res.steps),
            verify_s=sum(s.verify_s for s in res.steps),
            sources=stats,
            text=res.text,
            prompt_tokens=len(item.prompt_ids),
            lenient_tokens=res.lenient_tokens,
            first_token_s=res.first_token_s,
        )


@contextlib.contextmanager
def _clean_generation_config(model):
    """Hide the checkpoint's generation defaults (repetition penalty, min length, ...) during
    ``generate``: transformers fills every unset field from ``model.generation_config``."""
    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class HFRunner:
    """transformers ``generate``: greedy, prompt lookup (``pld``) or an assistant model."""

    lossless = True

    def __init__(self, name: str, target, mode: str = "greedy", assistant=None) -> None:
        if mode not in ("greedy", "pld", "assist"):
            raise ValueError(f"unknown hf mode {mode!r}")
        if mode == "assist" and assistant is None:
            raise ValueError("hf-assist needs an assistant model")
        self.name = name
        self.target = target
        self.mode = mode
        self.assistant = assistant
        eos = sorted(target.eos_token_ids)
        self.eos_ids = eos
        pad = getattr(target.tokenizer, "pad_token_id", None)
        self.pad_id = pad if isinstance(pad, int) else (eos[0] if eos else 0)

    def reset(self) -> None:
        return None

    def generation_config(self, max_new_tokens: int):
        cfg = GenerationConfig(
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            min_new_tokens=None,
            min_length=0,
            eos_token_id=list(self.eos_ids) or None,
            pad_token_id=self.pad_id,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            use_cache=True,
            return_dict_in_generate=False,
        )
        if self.mode == "pld":
            cfg.prompt_lookup_num_tokens = PLD_NUM_TOKENS
        return cfg

    def run(self, item: PreparedItem) -> ItemRun:
        model = self.target.model
        device = self.target.device
        ids = torch.tensor([list(item.prompt_ids)], dtype=torch.long, device=device)
        kwargs: dict[str, Any] = {}
        if self.mode == "assist":
            kwargs["assistant_model"] = self.assistant.model
            t_vocab = model.config.get_text_config().vocab_size
            a_vocab = self.assistant.model.config.get_text_config().vocab_size
            if t_vocab != a_vocab:  # universal assisted decoding (the rule transformers applies)
                kwargs["tokenizer"] = self.target.tokenizer
                kwargs["assistant_tokenizer"] = self.assistant.tokenizer
        cfg = self.generation_config(item.max_new_tokens)

        def generate():  # on the compute thread, as our engine's forwards (draftmesh.compute)
            with _clean_generation_config(model), torch.inference_mode():
                t0 = time.perf_counter()
                out = model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kwargs
                )
                return out, time.perf_counter() - t0

        out, seconds = compute.run(generate)
        new = cut_at_eos(out[0, ids.shape[1] :].tolist(), self.eos_ids)
        return ItemRun(
            item_id=item.id,
            kind=item.kind,
            method=self.name,
            token_ids=new,
            seconds=seconds,
            text=self.target.tokenizer.decode(new, skip_special_tokens=True),
            prompt_tokens=len(item.prompt_ids),
        )


def make_runner(
    method: Method, target, *, assistant=None, builder_config: BuilderConfig | None = None, source_options=None,
    source_deadline_s: float | None = DEFAULT_SOURCE_DEADLINE_S,
) -> MethodRunner:
    """The runner for a method on a local target (mesh methods: ``make_mesh_runners``)."""
    if method.family == "mesh":
        raise ValueError(f"{method.name} runs through the mesh: use make_mesh_runners")
    if method.family == "vllm":
        raise ValueError(f"{method.name} runs in vLLM's own environment: use vllm_runner.start_vllm")
    if method.family == "engine":
        return EngineRunner(
            method.name, target, method.sources, source_options=source_options, source_deadline_s=source_deadline_s,
            builder_config=builder_config, policy=method.policy,
            traced=method.traced,
        )
    return HFRunner(method.name, target, method.hf_mode or "greedy", assistant=assistant)


def load_target_spec(spec_or_target, engine: EngineConfig | None = None) -> TorchTarget:
    """A loaded target for a model spec (on the engine config's device and dtype), or the target
    itself (tests inject loaded models)."""
    if isinstance(spec_or_target, TorchTarget):
        return spec_or_target
    engine = engine or EngineConfig()
    return TorchTarget.load(str(spec_or_target), device=engine.device, dtype=engine.torch_dtype(),
                            cost_cache=engine.cost_cache)
