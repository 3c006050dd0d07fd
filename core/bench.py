"""`draftmesh bench`: our engine side by side with transformers baselines on one workload.

Every method runs the same model, dtype and thread count in one process. After one short
warm-up generation per method, items are run in file order and, for each item, every
method in turn (the order rotates from item to item); the whole pass is repeated N times
and each (item, method) keeps its median time, so background noise hits all methods
alike. Each repeat starts every method from fresh state (new draft sources), so a source
that learns from finished requests only ever sees earlier items of the same pass.

Greedy output of every lossless method must equal ``plain`` token for token; a mismatch
is printed loudly as it happens, recorded as ``identical_to_plain: false`` with the first
differing position (and the top-2 logit gap of the model there), and makes the command
exit with status 1.

With ``--target mesh`` the same workload also runs through the served mesh (gRPC, Ray
Serve): ``mesh:plain`` and ``mesh:draftmesh`` are runners like the others (``MeshRunner``),
interleaved item by item with the in-process methods and checked against in-process
``plain`` token for token; a "mesh vs in-process" table compares each pair. Without
``--addr`` the bench starts a private local mesh (and stops it at the end) and resets its
learned state before every pass, as the in-process engine is rebuilt.

Layout: method runners (one small class per family, one ``run(item) -> ItemRun``) do the
work; ``execute`` runs the interleaved loop; everything after that (summary, table, JSON,
plot) is a pure function of the collected ``ItemResult`` list.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from draftmesh.net import free_port
from draftmesh.workload import WorkItem, WorkloadError, load_workload, render_prompt_ids

PLAIN = "plain"
HF = "hf"
HF_PLD = "hf-pld"
HF_ASSIST = "hf-assist"
DRAFTMESH = "draftmesh"
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
TARGETS = ("local", "mesh")
MESH_TIMEOUT_S = 600.0
"""Deadline of one mesh request (a hung mesh must not hang the bench)."""
PLD_NUM_TOKENS = 10
ALL_KINDS = "all"
WARMUP_TOKENS = 8

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130


# ====================================================================== methods
@dataclass(frozen=True)
class Method:
    name: str
    family: str
    """"engine" (our decoder), "hf" (transformers generate) or "mesh" (the served mesh over gRPC)."""
    sources: tuple[str, ...] | None = None
    """Engine: the draft sources; None = the registry's default set, () = plain decoding.
    Mesh: () = speculation disabled, None = the mesh's default speculation."""
    hf_mode: str | None = None
    """HF only: "greedy", "pld" or "assist"."""
    lossless: bool = True
    policy: str = "exact"
    """Engine only: the acceptance policy (``draftmesh+typical``); only "exact" is lossless."""
    traced: bool = False
    """Engine only: tracing on during its runs (``draftmesh-traced``)."""


def _registry():
    from draftmesh.draft import registry

    return registry


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
    reg = None
    if available is None or defaults is None:
        reg = _registry()
    available = list(reg.available() if available is None else available)
    defaults = list(reg.DEFAULT_SOURCES if defaults is None else defaults)
    from draftmesh.verify.policy import available_policies

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
        else:
            valid = ", ".join(
                [*BASE_METHODS, DRAFTMESH_TRACED, ALL_DEFAULT_ABLATIONS, *MESH_METHODS] + [ENGINE_PREFIX + s for s in available]
            )
            raise ValueError(f"unknown method {name!r}; valid methods: {valid}")
    return methods


# ====================================================================== runs
@dataclass(frozen=True)
class PreparedItem:
    """A workload item with its prompt rendered to token ids for the target."""

    item: WorkItem
    prompt_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def id(self) -> str:
        return self.item.id

    @property
    def kind(self) -> str:
        return self.item.kind


@dataclass
class SourceStats:
    proposals: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, other: "SourceStats") -> None:
        self.proposals += other.proposals
        self.proposed_tokens += other.proposed_tokens
        self.accepted_tokens += other.accepted_tokens

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None


@dataclass
class ItemRun:
    """One generation of one item by one method."""

    item_id: str
    kind: str
    method: str
    token_ids: list[int]
    seconds: float
    steps: int | None = None
    """Target forwards (engine methods); None where the method has no such notion (hf)."""
    draft_s: float | None = None
    verify_s: float | None = None
    sources: dict[str, SourceStats] = field(default_factory=dict)
    text: str = ""
    prompt_tokens: int = 0
    lenient_tokens: int | None = None
    """Tokens a lossy policy accepted that exact verification would not."""
    first_token_s: float | None = None
    """Seconds from the call to the first generated token (None where not visible: hf)."""
    cached_prompt_tokens: int | None = None
    """Mesh only: prompt tokens whose KV came from the mesh's session cache (not prefilled)."""

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Tokens committed per target forward (1.0 for plain decoding), as GenerationResult."""
        return self.new_tokens / max(1, self.steps) if self.steps is not None else None


@dataclass
class ItemResult:
    """All repeats of one (item, method), and how its output compares with plain."""

    item_id: str
    kind: str
    method: str
    lossless: bool = True
    runs: list[ItemRun] = field(default_factory=list)
    identical_to_plain: bool | None = None
    first_difference: int | None = None
    mismatch_repeat: int | None = None
    mismatch_top2_gap: float | None = None
    stable: bool = True
    """All repeats produced the same tokens."""
    same_as_plain: bool | None = None
    """Fidelity for every non-plain method, lossy ones included (first repeat's output)."""
    edit_distance: float | None = None
    """Token-level Levenshtein distance to plain's output / the longer length."""

    @property
    def seconds(self) -> float:
        return statistics.median(r.seconds for r in self.runs)

    @property
    def representative(self) -> ItemRun:
        """The run with the (lower) median time: its step statistics are reported."""
        ordered = sorted(self.runs, key=lambda r: r.seconds)
        return ordered[(len(ordered) - 1) // 2]

    @property
    def new_tokens(self) -> int:
        return self.runs[0].new_tokens

    @property
    def tokens_per_s(self) -> float:
        s = self.seconds
        return self.new_tokens / s if s > 0 else 0.0

    @property
    def mean_accepted_per_step(self) -> float | None:
        return self.representative.mean_accepted_per_step


class MethodRunner(Protocol):
    """Runs one method. ``reset`` starts from fresh state (called before each repeat)."""

    name: str
    lossless: bool

    def reset(self) -> None: ...

    def run(self, item: PreparedItem) -> ItemRun: ...


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

    def build(self, proposals, ctx):
        for p in proposals:
            self.proposals[p.source] = self.proposals.get(p.source, 0) + 1
            if p.token_ids is not None:
                self.tokens[p.source] = self.tokens.get(p.source, 0) + len(p.token_ids)
            else:  # tokenized after the run, outside the timed region
                self.texts.setdefault(p.source, []).append(p.text)
        return self.inner.build(proposals, ctx)

    def __getattr__(self, name: str):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


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
        max_nodes: int | None = None,
        policy: str = "exact",
        traced: bool = False,
    ) -> None:
        self.name = name
        self.policy = policy
        self.tracing = None
        if traced:
            from draftmesh.bench_tracing import tracing_switch

            self.tracing = tracing_switch()
        self.lossless = policy == "exact"
        self.target = target
        self.sources = None if sources is None else tuple(sources)
        self.source_options = source_options
        self.max_nodes = max_nodes
        self.decoder = None
        self.counter: _CountingBuilder | None = None

    def reset(self) -> None:
        from draftmesh.verify.engine import build_decoder

        kwargs: dict[str, Any] = {"source_options": self.source_options}
        if self.max_nodes is not None:  # else build_decoder's own default
            kwargs["max_nodes"] = self.max_nodes
        self.decoder = build_decoder(self.target, self.sources, **kwargs)
        self.counter = None
        if self.decoder.sources:
            self.counter = _CountingBuilder(self.decoder.builder)
            self.decoder.builder = self.counter

    def run(self, item: PreparedItem) -> ItemRun:
        from draftmesh.verify.decoder import GenerationRequest

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
            policy=self.policy,
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
    from transformers import GenerationConfig

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
        from transformers import GenerationConfig

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
        import torch

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
        with _clean_generation_config(model), torch.inference_mode():
            t0 = time.perf_counter()
            out = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg, **kwargs
            )
            seconds = time.perf_counter() - t0
        new = out[0, ids.shape[1] :].tolist()
        for i, tok in enumerate(new):  # stop at EOS like the engine (EOS kept, nothing after)
            if tok in self.eos_ids:
                new = new[: i + 1]
                break
        return ItemRun(
            item_id=item.id,
            kind=item.kind,
            method=self.name,
            token_ids=new,
            seconds=seconds,
            text=self.target.tokenizer.decode(new, skip_special_tokens=True),
            prompt_tokens=len(item.prompt_ids),
        )


class MeshError(RuntimeError):
    """The mesh could not be started or reached, refused a request, or answered inconsistently."""


class MeshRunner:
    """One method through the served mesh: a streaming ``Generate`` per item (``draftmesh.client``).

    The request carries the item as the workload gives it (``messages`` or the raw
    ``prompt``; the mesh renders it with the same ``draftmesh.prompts`` functions the bench
    uses, which is checked on every answer through ``usage.prompt_tokens``), its corpus as
    documents, its session and ``max_new_tokens``. ``speculate=False`` disables speculation
    (``mesh:plain``); ``True`` leaves the mesh's default speculation.

    Timing is client-side wall time around the whole streaming call; ``first_token_s`` is the
    time to the first delta that carries tokens; ``steps`` the number of deltas (one per
    target forward); draft/verify time the sum of the deltas' ``StepStats``. Per-source
    accepted tokens come from the result; the API does not expose proposals, so a mesh
    run's proposal counts stay 0.

    ``reset`` calls ``resetter`` (given when the bench owns the mesh: see ``OwnMeshState``).
    ``session_suffix`` keeps this method's sessions apart from another mesh method's on the
    same mesh (the in-process methods each have their own decoder, so their sessions never
    mix either). ``run_after`` names a method that must run before this one on each item:
    every request leaves its answer in the mesh's shared answer store, so a speculating
    method must not run an item after another method already answered it.
    """

    lossless = True

    def __init__(
        self,
        name: str,
        client,
        *,
        speculate: bool = True,
        max_nodes: int | None = None,
        resetter: Callable[[], None] | None = None,
        session_suffix: str = "",
        run_after: str | None = None,
        timeout_s: float | None = MESH_TIMEOUT_S,
    ) -> None:
        self.name = name
        self.client = client
        self.speculate = speculate
        self.max_nodes = max_nodes
        self.resetter = resetter
        self.session_suffix = session_suffix
        self.run_after = run_after
        self.timeout_s = timeout_s

    def reset(self) -> None:
        if self.resetter is not None:
            self.resetter()

    def request(self, item: PreparedItem):
        """The ``GenerateRequest`` for an item."""
        from draftmesh.client import build_request

        work = item.item
        session = f"{work.session}{self.session_suffix}" if work.session else ""
        return build_request(
            work.prompt if work.messages is None else None,
            messages=[dict(m) for m in work.messages] if work.messages is not None else None,
            max_new_tokens=item.max_new_tokens,
            session_id=session,
            documents=list(work.corpus),
            speculate=None if self.speculate else False,
            max_nodes=self.max_nodes if self.speculate else None,
        )

    def run(self, item: PreparedItem) -> ItemRun:
        import grpc

        req = self.request(item)
        steps, draft_ms, verify_ms = 0, 0.0, 0.0
        first_token_s = None
        result = None
        call = None
        t0 = time.perf_counter()
        try:
            call = self.client.generate(req, timeout_s=self.timeout_s)
            for response in call:
                kind = response.WhichOneof("event")
                if kind == "delta":
                    steps += 1
                    if first_token_s is None and len(response.delta.token_ids):
                        first_token_s = time.perf_counter() - t0
                    draft_ms += response.delta.stats.draft_ms
                    verify_ms += response.delta.stats.verify_ms
                elif kind == "result":
                    result = response.result
            seconds = time.perf_counter() - t0
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            details = exc.details() if hasattr(exc, "details") else str(exc)
            raise MeshError(
                f"{self.name}: item {item.id!r}: the mesh at {getattr(self.client, 'addr', '?')} answered "
                f"{code.name if code is not None else 'UNKNOWN'}: {details}"
            ) from None
        except KeyboardInterrupt:
            if call is not None:
                call.cancel()
            raise
        if result is None:
            raise MeshError(f"{self.name}: item {item.id!r}: the stream ended without a result")
        if result.usage.prompt_tokens != len(item.prompt_ids):
            what = "chat messages (chat template)" if item.item.messages is not None else "raw prompt text"
            raise MeshError(
                f"{self.name}: item {item.id!r}: the mesh rendered the {what} to {result.usage.prompt_tokens} "
                f"prompt tokens, the bench to {len(item.prompt_ids)}: the mesh must serve the same model "
                f"(and tokenizer) as --model"
            )
        sources = {s.source: SourceStats(accepted_tokens=int(s.accepted_tokens)) for s in result.sources}
        return ItemRun(
            item_id=item.id,
            kind=item.kind,
            method=self.name,
            token_ids=[int(t) for t in result.token_ids],
            seconds=seconds,
            steps=steps,
            draft_s=draft_ms / 1000.0,
            verify_s=verify_ms / 1000.0,
            sources=sources,
            text=result.text,
            prompt_tokens=int(result.usage.prompt_tokens),
            lenient_tokens=int(result.lenient_tokens),
            first_token_s=first_token_s,
            cached_prompt_tokens=int(result.usage.cached_prompt_tokens),
        )


class OwnMeshState:
    """Resets the learned state of a mesh this process started (``reset`` before every pass).

    ``reset_state`` on the verifier deployment rebuilds the decoder of the replica it
    reaches (builder statistics, in-memory stores, session KV; the model and its cost curve
    stay), and the answer store's Redis is emptied (``FLUSHDB`` on the mesh's embedded
    redis-server; on a Redis given through ``REDIS_URL`` only the answer store's keys are
    deleted). A deployment handle call reaches ONE replica: with more than one verifier
    replica the others keep their state (the bench starts exactly one).
    """

    ANSWER_PREFIX = "draftmesh:answers:"

    def __init__(self, redis_url: str | None, *, embedded_redis: bool, app_name: str | None = None,
                 idle_timeout_s: float = 30.0) -> None:
        self.redis_url = redis_url
        self.embedded_redis = embedded_redis
        self.app_name = app_name
        self.idle_timeout_s = idle_timeout_s
        self.resets = 0

    def reset(self) -> None:
        from ray import serve

        app = self.app_name
        if app is None:
            from draftmesh.router.app import APP_NAME as app
        handle = serve.get_deployment_handle("verifier", app_name=app)
        deadline = time.monotonic() + self.idle_timeout_s
        while True:
            try:
                handle.reset_state.remote().result()
                break
            except Exception as exc:  # noqa: BLE001 - the replica may still be finishing the last stream
                if "idle replica" in str(exc) and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                raise MeshError(f"cannot reset the mesh's verifier: {type(exc).__name__}: {exc}") from None
        if self.redis_url:
            import redis

            client = redis.Redis.from_url(self.redis_url)
            try:
                if self.embedded_redis:
                    client.flushdb()
                else:
                    keys = list(client.scan_iter(match=self.ANSWER_PREFIX + "*", count=1000))
                    for start in range(0, len(keys), 1000):
                        client.delete(*keys[start : start + 1000])
            finally:
                client.close()
        self.resets += 1


def mesh_process_memory(root_pid: int | None = None) -> dict[str, Any] | None:
    """Memory of a local mesh this process started: every descendant process of ``root_pid``.

    ``start_mesh`` starts the embedded redis-server, Ray's gcs_server, raylet, dashboard,
    monitor and log monitor as children of this process and the raylet starts every Ray
    worker (the Serve controller, the proxy, the router and verifier replicas, Ray's agents),
    so the descendants are exactly the mesh; the bench process itself (the in-process
    methods' model) is not counted. Matching process names instead would also count other
    Ray instances of the same user. ``rss_mb`` sums resident set sizes (shared pages counted
    once per process), ``pss_mb`` proportional set sizes (shared pages split), where readable.
    None without psutil.
    """
    try:
        import psutil
    except ImportError:
        return None
    try:
        root = psutil.Process(root_pid or os.getpid())
        procs = root.children(recursive=True)
    except psutil.Error:
        return None
    rss = pss = 0
    count, pss_ok = 0, True
    names: dict[str, int] = {}
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            name = proc.name()
        except psutil.Error:
            continue
        count += 1
        names[name] = names.get(name, 0) + 1
        try:
            pss += proc.memory_full_info().pss
        except (psutil.Error, AttributeError):
            pss_ok = False
    own = None
    with contextlib.suppress(psutil.Error):
        own = root.memory_info().rss
    return {
        "rss_mb": round(rss / 2**20, 1),
        "pss_mb": round(pss / 2**20, 1) if pss_ok and count else None,
        "processes": count,
        "process_names": dict(sorted(names.items())),
        "counted": "every descendant process of the bench process (the mesh it started: redis-server, "
                   "Ray's gcs_server, raylet, agents and workers incl. Serve replicas), measured right after the run",
        "bench_process_rss_mb": round(own / 2**20, 1) if own is not None else None,
    }


def make_runner(
    method: Method, target, *, assistant=None, max_nodes: int | None = None, source_options=None
) -> MethodRunner:
    """The runner for a method on a local target (mesh methods: ``make_mesh_runners``)."""
    if method.family == "mesh":
        raise ValueError(f"{method.name} runs through the mesh: use make_mesh_runners")
    if method.family == "engine":
        return EngineRunner(
            method.name, target, method.sources, source_options=source_options, max_nodes=max_nodes, policy=method.policy,
            traced=method.traced,
        )
    return HFRunner(method.name, target, method.hf_mode or "greedy", assistant=assistant)


def make_mesh_runners(
    methods: Sequence[Method], client, *, resetter: Callable[[], None] | None = None, max_nodes: int | None = None
) -> list[MeshRunner]:
    """The runners of the mesh methods, on one client (and one mesh).

    ``mesh:plain`` runs after ``mesh:draftmesh`` on every item and uses its own session ids
    (see ``MeshRunner``); ``max_nodes`` is sent per request (for a mesh the bench did not
    start; a mesh it starts gets it in its config instead).
    """
    names = {m.name for m in methods}
    runners = []
    for m in methods:
        if m.family != "mesh":
            continue
        plain = m.sources == ()
        runners.append(MeshRunner(
            m.name, client, speculate=not plain, max_nodes=max_nodes, resetter=resetter,
            session_suffix="#mesh-plain" if plain else "",
            run_after=MESH_DRAFTMESH if plain and MESH_DRAFTMESH in names else None,
        ))
    return runners


# ====================================================================== checks
def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_identical(results: Iterable[ItemResult]) -> list[ItemResult]:
    """Compare every lossless method's output with plain's, repeat by repeat.

    Sets ``identical_to_plain`` / ``first_difference`` / ``mismatch_repeat`` (None for plain
    itself and for lossy methods) and ``stable``; returns the mismatching results.
    """
    results = list(results)
    plain = {r.item_id: r for r in results if r.method == PLAIN}
    mismatches = []
    for r in results:
        r.stable = all(run.token_ids == r.runs[0].token_ids for run in r.runs)
        if r.method == PLAIN or not r.lossless:
            r.identical_to_plain = None
            continue
        ref = plain.get(r.item_id)
        if ref is None or not ref.runs or not r.runs:
            r.identical_to_plain = None
            continue
        r.identical_to_plain, r.first_difference, r.mismatch_repeat = True, None, None
        for rep, run in enumerate(r.runs):
            want = ref.runs[min(rep, len(ref.runs) - 1)].token_ids
            diff = first_difference(want, run.token_ids)
            if diff is not None:
                r.identical_to_plain, r.first_difference, r.mismatch_repeat = False, diff, rep
                mismatches.append(r)
                break
    return mismatches


def mismatch_message(r: ItemResult, plain_ids: Sequence[int] | None = None, tokenizer=None) -> str:
    where = f"token {r.first_difference}"
    detail = ""
    if plain_ids is not None and r.mismatch_repeat is not None and r.first_difference is not None:
        got = r.runs[r.mismatch_repeat].token_ids
        i = r.first_difference

        def show(ids):
            if i >= len(ids):
                return "(end)"
            tok = ids[i]
            return f"{tok} {tokenizer.decode([tok])!r}" if tokenizer is not None else str(tok)

        detail = f": plain has {show(plain_ids)}, {r.method} has {show(got)}"
    gap = f"; plain top-2 logit gap there {r.mismatch_top2_gap:.3g}" if r.mismatch_top2_gap is not None else ""
    rep = f" (repeat {r.mismatch_repeat + 1})" if r.mismatch_repeat is not None else ""
    return (
        f"!!! OUTPUT MISMATCH: item {r.item_id!r} method {r.method!r} differs from plain at {where}"
        f"{rep}{detail}{gap} !!!"
    )


def edit_distance(a: Sequence[int], b: Sequence[int]) -> int:
    """Levenshtein distance between two token sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, start=1):
        cur = [i]
        for j, y in enumerate(b, start=1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def measure_fidelity(results: Iterable[ItemResult]) -> None:
    """Set ``same_as_plain`` and the normalized ``edit_distance`` of every non-plain result."""
    results = list(results)
    plain = {r.item_id: r for r in results if r.method == PLAIN}
    for r in results:
        ref = plain.get(r.item_id)
        if r.method == PLAIN or ref is None or not ref.runs or not r.runs:
            continue
        want, got = ref.runs[0].token_ids, r.runs[0].token_ids
        r.same_as_plain = want == got
        r.edit_distance = edit_distance(want, got) / max(1, len(want), len(got))


def top2_gap(target, prompt_ids: Sequence[int], prefix: Sequence[int]) -> float:
    """Plain decoding's top-1 minus top-2 logit after ``prompt + prefix``."""
    return target.top2_gap([*prompt_ids, *prefix])


# ====================================================================== the loop
def item_order(runners: Sequence[MethodRunner], shift: int) -> list[MethodRunner]:
    """The runners rotated left by ``shift``; then a runner with ``run_after = NAME`` is moved
    right behind runner NAME when the rotation put it first (runners sharing learned state,
    see ``MeshRunner``)."""
    n = len(runners)
    order = list(runners[shift % n :]) + list(runners[: shift % n]) if n else []
    for r in list(order):
        after = getattr(r, "run_after", None)
        names = [x.name for x in order]
        if after in names and names.index(r.name) < names.index(after):
            order.remove(r)
            order.insert([x.name for x in order].index(after) + 1, r)
    return order


def execute(
    runners: Sequence[MethodRunner],
    items: Sequence[PreparedItem],
    repeats: int = 1,
    *,
    warmup: bool = True,
    progress: bool = True,
    warn: Callable[[str], None] | None = None,
    tokenizer=None,
) -> list[ItemResult]:
    """Warm up, then run repeats x items x methods interleaved; return one result per (item, method).

    Mismatches with plain are reported through ``warn`` as soon as an item is done.
    """
    from tqdm.auto import tqdm

    if not runners or runners[0].name != PLAIN:
        raise ValueError("the first runner must be plain (the reference)")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    results = {
        (it.id, r.name): ItemResult(it.id, it.kind, r.name, lossless=r.lossless) for it in items for r in runners
    }
    bar = tqdm(
        total=repeats * len(items) * len(runners), file=sys.stderr, desc="bench", unit="gen",
        disable=not progress, dynamic_ncols=True,
    )
    say = warn or (lambda msg: tqdm.write(msg, file=sys.stderr))
    warned: set[tuple[str, str]] = set()
    try:
        if warmup and items:
            first = items[0]
            short = PreparedItem(first.item, first.prompt_ids, min(WARMUP_TOKENS, first.max_new_tokens))
            for r in runners:
                bar.set_postfix_str(f"warm-up {r.name}", refresh=True)
                r.reset()
                r.run(short)
        for rep in range(repeats):
            for r in runners:
                r.reset()
            for index, it in enumerate(items):
                for r in item_order(runners, index + rep):
                    bar.set_postfix_str(f"{it.id} {r.name}", refresh=False)
                    results[(it.id, r.name)].runs.append(r.run(it))
                    bar.update(1)
                row = [results[(it.id, r.name)] for r in runners]
                for bad in check_identical(row):
                    if (bad.item_id, bad.method) not in warned:
                        warned.add((bad.item_id, bad.method))
                        plain_ids = results[(it.id, PLAIN)].runs[bad.mismatch_repeat].token_ids
                        say(mismatch_message(bad, plain_ids, tokenizer))
    finally:
        bar.close()
    out = list(results.values())
    check_identical(out)
    return out


# ====================================================================== summary (pure)
def geometric_mean(values: Iterable[float]) -> float | None:
    """Geometric mean of positive values; None when there are none."""
    vals = [float(v) for v in values]
    if not vals:
        return None
    if any(v <= 0 or not math.isfinite(v) for v in vals):
        raise ValueError(f"geometric mean needs positive finite values, got {vals}")
    return math.exp(sum(math.log(v) for v in vals) / len(vals))


def speedup_ratios(
    results: Sequence[ItemResult], method: str, kind: str | None = None, reference: str = PLAIN
) -> list[float]:
    """Per-item tokens/s of ``method`` over ``reference``'s (default plain; items with no tokens
    or time are skipped)."""
    plain = {r.item_id: r for r in results if r.method == reference}
    ratios = []
    for r in results:
        if r.method != method or (kind not in (None, ALL_KINDS) and r.kind != kind):
            continue
        ref = plain.get(r.item_id)
        if ref is None:
            continue
        a, b = r.tokens_per_s, ref.tokens_per_s
        if a > 0 and b > 0:
            ratios.append(a / b)
    return ratios


def kinds_in_order(results: Iterable[ItemResult]) -> list[str]:
    kinds: list[str] = []
    for r in results:
        if r.kind not in kinds:
            kinds.append(r.kind)
    return kinds


def methods_in_order(results: Iterable[ItemResult]) -> list[str]:
    methods: list[str] = []
    for r in results:
        if r.method not in methods:
            methods.append(r.method)
    return methods


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(float(x), digits)


def summarize_group(results: Sequence[ItemResult], method: str, kind: str) -> dict[str, Any]:
    group = [r for r in results if r.method == method and (kind == ALL_KINDS or r.kind == kind)]
    tokens = sum(r.new_tokens for r in group)
    seconds = sum(r.seconds for r in group)
    reps = [r.representative for r in group]
    with_steps = [run for run in reps if run.steps is not None]
    steps = sum(run.steps for run in with_steps)
    sources: dict[str, SourceStats] = {}
    for run in reps:
        for name, st in run.sources.items():
            sources.setdefault(name, SourceStats()).add(st)
    speed = geometric_mean(speedup_ratios(results, method, kind))
    return {
        "items": len(group),
        "new_tokens": tokens,
        "seconds": _round(seconds, 6),
        "tokens_per_s": _round(tokens / seconds if seconds > 0 else 0.0),
        "speedup_vs_plain": _round(speed),
        "mean_accepted_per_step": _round(sum(r.new_tokens for r in with_steps) / steps) if steps else None,
        "steps": steps if with_steps else None,
        "draft_ms_per_step": _round(1e3 * sum(run.draft_s or 0.0 for run in with_steps) / steps) if steps else None,
        "verify_ms_per_step": _round(1e3 * sum(run.verify_s or 0.0 for run in with_steps) / steps) if steps else None,
        "identical": sum(1 for r in group if r.identical_to_plain is True),
        "mismatches": sum(1 for r in group if r.identical_to_plain is False),
        "identical_share": _round(_mean([float(r.same_as_plain) for r in group if r.same_as_plain is not None])),
        "mean_norm_edit_distance": _round(_mean([r.edit_distance for r in group if r.edit_distance is not None])),
        "lenient_tokens": sum(r.representative.lenient_tokens or 0 for r in group) if group else 0,
        "first_token_ms": _round(_median_ms([first_token_s(r) for r in group])),
        "lossless": all(r.lossless for r in group),
        "acceptance_by_source": {
            name: {
                "proposals": st.proposals,
                "proposed_tokens": st.proposed_tokens,
                "accepted_tokens": st.accepted_tokens,
                "acceptance": _round(st.acceptance),
            }
            for name, st in sources.items()
        },
    }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def first_token_s(r: ItemResult) -> float | None:
    """Median over the repeats of the time to the first token (None where no run has one)."""
    vals = [run.first_token_s for run in r.runs if run.first_token_s is not None]
    return statistics.median(vals) if vals else None


def _median_ms(seconds: Iterable[float | None]) -> float | None:
    vals = [1e3 * v for v in seconds if v is not None]
    return statistics.median(vals) if vals else None


def _compute_s_per_step(run: ItemRun) -> float | None:
    if not run.steps or run.draft_s is None or run.verify_s is None:
        return None
    return (run.draft_s + run.verify_s) / run.steps


def mesh_summary(
    results: Sequence[ItemResult], pairs: Sequence[tuple[str, str]] = MESH_PAIRS
) -> dict[str, dict[str, Any]]:
    """Each mesh method against its in-process counterpart, over the items both ran.

    - ``tokens_per_s_ratio``: geometric mean over items of (mesh tokens/s / in-process
      tokens/s), each from the median time, as ``speedup_vs_plain``;
    - ``first_token_ms``: median over items of each side's median time to the first token;
    - ``overhead_ms_per_step``: median over items of (mesh seconds - in-process seconds) /
      mesh steps: what serving adds per target forward (gRPC, the proxy, the router,
      streaming each step; Redis for the answer store);
    - ``compute_ms_per_step``: median over items of (draft + verify time) / steps of each
      side's representative run, as measured where the decoder runs; the difference to
      ``overhead_ms_per_step`` is outside the decode loop.
    Pairs whose mesh method did not run are left out.
    """
    by_key = {(r.item_id, r.method): r for r in results}
    out: dict[str, dict[str, Any]] = {}
    for mesh, local in pairs:
        if not any(r.method == mesh for r in results):
            continue
        items = [r.item_id for r in results if r.method == mesh and (r.item_id, local) in by_key]
        m_res = [by_key[(i, mesh)] for i in items]
        l_res = [by_key[(i, local)] for i in items]
        ratios = speedup_ratios(results, mesh, reference=local)
        overhead = []
        for m, lo in zip(m_res, l_res):
            steps = m.representative.steps
            if steps:
                overhead.append(1e3 * (m.seconds - lo.seconds) / steps)
        out[mesh] = {
            "reference": local,
            "items": len(items),
            "tokens_per_s": {"mesh": _round(_group_tps(m_res)), "local": _round(_group_tps(l_res))},
            "tokens_per_s_ratio": _round(geometric_mean(ratios)),
            "first_token_ms": {
                "mesh": _round(_median_ms(first_token_s(r) for r in m_res)),
                "local": _round(_median_ms(first_token_s(r) for r in l_res)),
            },
            "overhead_ms_per_step": _round(statistics.median(overhead) if overhead else None),
            "compute_ms_per_step": {
                "mesh": _round(_median_ms(_compute_s_per_step(r.representative) for r in m_res)),
                "local": _round(_median_ms(_compute_s_per_step(r.representative) for r in l_res)),
            },
            "mean_accepted_per_step": {
                "mesh": _round(_tokens_per_step(m_res)), "local": _round(_tokens_per_step(l_res)),
            },
            "identical": sum(1 for r in m_res if r.identical_to_plain is True),
            "mismatches": sum(1 for r in m_res if r.identical_to_plain is False),
        }
    return out


def _group_tps(group: Sequence[ItemResult]) -> float | None:
    seconds = sum(r.seconds for r in group)
    return sum(r.new_tokens for r in group) / seconds if group and seconds > 0 else None


def _tokens_per_step(group: Sequence[ItemResult]) -> float | None:
    reps = [r.representative for r in group if r.representative.steps]
    steps = sum(run.steps for run in reps)
    return sum(run.new_tokens for run in reps) / steps if steps else None


def summarize(results: Sequence[ItemResult]) -> dict[str, dict[str, dict[str, Any]]]:
    """{method: {"all" | kind: {tokens_per_s, speedup_vs_plain, mean_accepted_per_step, ...}}}."""
    kinds = [ALL_KINDS, *kinds_in_order(results)]
    return {m: {k: summarize_group(results, m, k) for k in kinds} for m in methods_in_order(results)}


@dataclass
class BenchReport:
    model: str
    threads: int
    repeats: int
    results: list[ItemResult]
    skipped: dict[str, str] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    mesh: dict[str, Any] | None = None
    """With mesh methods: how the mesh ran (address, started_by_bench, started_s, memory,
    mesh_state_reset, ...); ``report_to_json`` adds the pairs of ``mesh_summary``."""


def _per_step_ms(seconds: float | None, steps: int | None) -> float | None:
    return _round(1e3 * seconds / steps) if steps and seconds is not None else None


def item_record(r: ItemResult) -> dict[str, Any]:
    rep = r.representative
    return {
        "id": r.item_id,
        "kind": r.kind,
        "method": r.method,
        "new_tokens": r.new_tokens,
        "seconds": round(r.seconds, 6),
        "tokens_per_s": round(r.tokens_per_s, 4),
        "mean_accepted_per_step": _round(r.mean_accepted_per_step),
        "identical_to_plain": r.identical_to_plain,
        "first_difference": r.first_difference,
        "mismatch_top2_gap": _round(r.mismatch_top2_gap, 6),
        "lossless": r.lossless,
        "same_as_plain": r.same_as_plain,
        "norm_edit_distance": _round(r.edit_distance),
        "lenient_tokens": rep.lenient_tokens,
        "first_token_ms": _round(None if first_token_s(r) is None else 1e3 * first_token_s(r)),
        "stable_across_repeats": r.stable,
        "seconds_by_repeat": [round(run.seconds, 6) for run in r.runs],
        "prompt_tokens": rep.prompt_tokens,
        **({"cached_prompt_tokens": rep.cached_prompt_tokens} if rep.cached_prompt_tokens is not None else {}),
        "steps": rep.steps,
        "draft_ms_per_step": _per_step_ms(rep.draft_s, rep.steps),
        "verify_ms_per_step": _per_step_ms(rep.verify_s, rep.steps),
        "sources": {
            n: {"proposals": s.proposals, "proposed_tokens": s.proposed_tokens, "accepted_tokens": s.accepted_tokens}
            for n, s in rep.sources.items()
        },
        "text": rep.text,
    }


def report_to_json(report: BenchReport) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": report.model,
        "threads": report.threads,
        "repeats": report.repeats,
    }
    out.update(report.meta)
    out["methods"] = methods_in_order(report.results)
    out["skipped"] = dict(report.skipped)
    out["summary"] = summarize(report.results)
    out["items"] = [item_record(r) for r in report.results]
    out["mismatches"] = [
        {
            "id": r.item_id,
            "method": r.method,
            "first_difference": r.first_difference,
            "repeat": r.mismatch_repeat,
            "mismatch_top2_gap": _round(r.mismatch_top2_gap, 6),
        }
        for r in report.results
        if r.identical_to_plain is False
    ]
    if any(m in MESH_METHODS for m in out["methods"]):
        out["mesh"] = {**(report.mesh or {}), "pairs": mesh_summary(report.results)}
    return out


def _fmt(x: float | None, spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(cells, widths, right)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return [line(header), sep, *(line(r) for r in rows)]


def format_report(report: BenchReport) -> str:
    """The terminal tables: speed per kind and method, then acceptance per source."""
    summary = summarize(report.results)
    methods = list(summary)
    kinds = [ALL_KINDS, *kinds_in_order(report.results)]
    lines = [
        f"model {report.model}  threads {report.threads}  repeats {report.repeats}  "
        f"(median time per item; speedup = geometric mean of per-item tokens/s ratios vs plain)",
        "",
    ]
    header = ["kind", "method", "items", "tok/s", "speedup", "tok/step", "draft ms/step", "verify ms/step", "identical"]
    rows = []
    for kind in kinds:
        for m in methods:
            s = summary[m][kind]
            if m == PLAIN:
                ident = "ref"
            elif s["identical"] + s["mismatches"] == 0:
                ident = "-"
            else:
                ident = f"{s['identical']}/{s['identical'] + s['mismatches']}"
                if s["mismatches"]:
                    ident += " !!"
            rows.append([
                kind if m == methods[0] else "",
                m,
                str(s["items"]),
                _fmt(s["tokens_per_s"], ".1f"),
                _fmt(s["speedup_vs_plain"], ".2f") + ("x" if s["speedup_vs_plain"] is not None else ""),
                _fmt(s["mean_accepted_per_step"], ".2f"),
                _fmt(s["draft_ms_per_step"], ".2f"),
                _fmt(s["verify_ms_per_step"], ".2f"),
                ident,
            ])
    lines += _table(header, rows, [False, False, True, True, True, True, True, True, True])
    for name, why in report.skipped.items():
        lines.append(f"{name}: skipped ({why})")

    src_rows = []
    for m in methods:
        names = list(summary[m][ALL_KINDS]["acceptance_by_source"])
        for n in names:
            cells = [m, n]
            for kind in kinds:
                st = summary[m][kind]["acceptance_by_source"].get(n)
                if st and not st["proposed_tokens"] and not st["proposals"] and st["accepted_tokens"]:
                    cells.append(f"{st['accepted_tokens']}/?")  # the mesh reports no proposals
                elif not st or not st["proposed_tokens"]:
                    cells.append("-")
                else:
                    cells.append(f"{st['accepted_tokens']}/{st['proposed_tokens']} {100 * st['acceptance']:.0f}%")
            src_rows.append(cells)
    if src_rows:
        lines += ["", "acceptance per source: accepted / proposed drafted tokens"]
        lines += _table(["method", "source", *kinds], src_rows, [False, False, *[True] * len(kinds)])

    lossy = [m for m in methods if not summary[m][ALL_KINDS]["lossless"]]
    if lossy:
        lines += ["", "lossy policies: speed gained vs fidelity lost (against plain greedy)"]
        fid_rows = []
        for m in lossy:
            s = summary[m][ALL_KINDS]
            fid_rows.append([
                m,
                _fmt(s["speedup_vs_plain"], ".2f") + "x",
                _fmt(s["mean_accepted_per_step"], ".2f"),
                _fmt(None if s["identical_share"] is None else 100 * s["identical_share"], ".0f") + "%",
                _fmt(s["mean_norm_edit_distance"], ".3f"),
                str(s["lenient_tokens"]),
            ])
        lines += _table(
            ["method", "speedup", "tok/step", "identical outputs", "mean norm. edit distance", "lenient tokens"],
            fid_rows,
            [False, True, True, True, True, True],
        )

    if any(m in MESH_METHODS for m in methods):
        lines += ["", *format_mesh(report)]
    if DRAFTMESH_TRACED in methods:
        spans, noop = report.meta.get("traced_spans_exported"), report.meta.get("untraced_step_span_cost_us")
        lines += ["", f"{DRAFTMESH_TRACED}: draftmesh with tracing on, {spans} spans exported over OTLP/gRPC to an "
                      "in-process receiver; draftmesh: tracing off (no collector configured), where the spans of "
                      f"one step (3 sources) cost {noop} us with the no-op tracer"]

    bad = [r for r in report.results if r.identical_to_plain is False]
    if bad:
        lines += ["", f"!!! {len(bad)} OUTPUT MISMATCH(ES) WITH PLAIN (lossless methods must match token for token):"]
        for r in bad:
            gap = f", plain top-2 logit gap {r.mismatch_top2_gap:.3g}" if r.mismatch_top2_gap is not None else ""
            lines.append(
                f"!!!   item {r.item_id!r} method {r.method!r}: first difference at token {r.first_difference}{gap}"
            )
    unstable = [r for r in report.results if not r.stable]
    if unstable:
        which = ", ".join(f"{r.item_id}/{r.method}" for r in unstable)
        lines += ["", f"note: output changed between repeats for: {which}"]
    return "\n".join(lines)


def format_mesh(report: BenchReport) -> list[str]:
    """The "mesh vs in-process" table (one row per mesh method and its in-process counterpart)."""
    info = report.mesh or {}
    pairs = mesh_summary(report.results)
    head = "mesh vs in-process"
    facts = []
    if info.get("started_by_bench"):
        if info.get("started_s") is not None:
            facts.append(f"mesh started in {info['started_s']:.1f}s")
        mem = info.get("memory") or {}
        if mem.get("rss_mb") is not None:
            pss = f", PSS {mem['pss_mb'] / 1024:.2f} GiB" if mem.get("pss_mb") is not None else ""
            facts.append(f"mesh memory RSS {mem['rss_mb'] / 1024:.2f} GiB{pss} in {mem['processes']} processes")
    elif info.get("address"):
        facts.append(f"mesh at {info['address']}")
    if info.get("mesh_state_reset") is False:
        facts.append("mesh state NOT reset between passes")
    lines = [head + (f" ({'; '.join(facts)})" if facts else "")]
    header = ["mesh method", "vs", "items", "tok/s ratio", "first token ms mesh/local",
              "overhead ms/step", "compute ms/step mesh/local", "tok/step mesh/local"]
    rows = []
    for mesh, p in pairs.items():
        ratio = p["tokens_per_s_ratio"]
        rows.append([
            mesh,
            p["reference"],
            str(p["items"]),
            _fmt(ratio, ".2f") + ("x" if ratio is not None else ""),
            f"{_fmt(p['first_token_ms']['mesh'], '.1f')} / {_fmt(p['first_token_ms']['local'], '.1f')}",
            _fmt(p["overhead_ms_per_step"], ".2f"),
            f"{_fmt(p['compute_ms_per_step']['mesh'], '.2f')} / {_fmt(p['compute_ms_per_step']['local'], '.2f')}",
            f"{_fmt(p['mean_accepted_per_step']['mesh'], '.2f')} / {_fmt(p['mean_accepted_per_step']['local'], '.2f')}",
        ])
    lines += _table(header, rows, [False, False, True, True, True, True, True, True])
    return lines


def write_plot(report: BenchReport, path: str | Path) -> None:
    """A PNG: speedup vs plain per kind and method; acceptance rate per source and method."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = summarize(report.results)
    methods = [m for m in summary if m != PLAIN]
    kinds = [ALL_KINDS, *kinds_in_order(report.results)]
    fig = Figure(figsize=(max(8.0, 1.4 * len(kinds) + 4), 8.5))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1)
    width = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        vals = [summary[m][k]["speedup_vs_plain"] or 0.0 for k in kinds]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(kinds))]
        ax1.bar(xs, vals, width, label=m)
    ax1.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax1.set_xticks(range(len(kinds)), kinds)
    ax1.set_ylabel("speedup vs plain (geo. mean)")
    top = max([summary[m][k]["speedup_vs_plain"] or 0.0 for m in methods for k in kinds] + [1.0])
    ax1.set_ylim(0, top * 1.3)  # room for the legend above the bars
    threads = f"{report.threads} thread{'s' if report.threads != 1 else ''}"
    ax1.set_title(f"speedup vs plain: {report.model}, {threads}, median of {report.repeats}")
    if methods:
        ax1.legend(fontsize="small", ncols=min(4, len(methods)), loc="upper left")

    pairs = [
        (m, n, st["acceptance"])
        for m in summary
        for n, st in summary[m][ALL_KINDS]["acceptance_by_source"].items()
        if st["acceptance"] is not None
    ]
    if pairs:
        sources = list(dict.fromkeys(n for _, n, _ in pairs))
        engine = list(dict.fromkeys(m for m, _, _ in pairs))
        width = min(0.35, 0.8 / len(engine))
        for j, m in enumerate(engine):
            got = {n: a for mm, n, a in pairs if mm == m}
            xs = [i + (j - (len(engine) - 1) / 2) * width for i in range(len(sources))]
            ax2.bar(xs, [100 * got.get(n, 0.0) for n in sources], width, label=m)
        ax2.set_xticks(range(len(sources)), sources)
        ax2.set_xlim(-0.6, len(sources) - 0.4)
        ax2.set_ylabel("accepted / proposed tokens (%)")
        ax2.set_ylim(0, min(100.0, max(100 * a for _, _, a in pairs) * 1.3 + 1))
        ax2.set_title("acceptance per source (all items)")
        ax2.legend(fontsize="small", loc="upper left")
    else:
        ax2.set_axis_off()
        ax2.text(0.5, 0.5, "no draft source proposed anything", ha="center", va="center")
    fig.tight_layout()
    fig.savefig(str(path), format="png", dpi=100)


# ====================================================================== environment
def machine_info() -> dict[str, Any]:
    cpu, physical = platform.processor() or platform.machine(), None
    try:
        text = Path("/proc/cpuinfo").read_text()
        names = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")]
        if names:
            cpu = names[0]
        cores = set()
        phys = core = None
        for ln in text.splitlines() + [""]:
            if ln.startswith("physical id"):
                phys = ln.split(":", 1)[1].strip()
            elif ln.startswith("core id"):
                core = ln.split(":", 1)[1].strip()
            elif not ln.strip():
                if core is not None:
                    cores.add((phys, core))
                phys = core = None
        physical = len(cores) or None
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "physical_cores": physical,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError, AttributeError):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    for mod in ("torch", "transformers"):
        with contextlib.suppress(ImportError):
            info[mod] = __import__(mod).__version__
    return info


# ====================================================================== CLI
def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, metavar="FILE.jsonl", help="workload file (JSON lines)")
    parser.add_argument("--model", default="smollm2-135m", metavar="SPEC", help="target model (default: %(default)s)")
    parser.add_argument(
        "--methods",
        default=None,
        metavar="LIST",
        help="comma-separated: plain, hf, hf-pld, hf-assist, draftmesh, draftmesh:<source> (one source alone), "
        "draftmesh:* (each default source alone), draftmesh+<policy> or draftmesh:<source>+<policy> "
        "(a lossy acceptance policy: typical, nkl, block, semantic), mesh:plain, mesh:draftmesh (through the "
        f"mesh, with --target mesh); plain is always run (default: {DEFAULT_METHODS}; with --target mesh: "
        f"{DEFAULT_MESH_METHODS})",
    )
    parser.add_argument(
        "--target", choices=TARGETS, default="local",
        help="local: in-process methods only; mesh: also run the mesh:* methods through a served mesh "
        "(--addr, or a local mesh the bench starts and stops) (default: %(default)s)",
    )
    parser.add_argument(
        "--addr", metavar="HOST:PORT", default=None,
        help="with --target mesh: an already running mesh (its learned state is not reset between passes); "
        "default: start a local mesh for the run",
    )
    parser.add_argument(
        "--api-key", default=None, help="with --addr: API key sent as a bearer token (default: $DRAFTMESH_API_KEY)"
    )
    parser.add_argument("--tls-ca", metavar="FILE", default=None, help="with --addr: PEM CA/certificate to trust; enables TLS")
    parser.add_argument("--assistant", metavar="SPEC", default=None, help="assistant model for hf-assist")
    parser.add_argument(
        "--repeats", type=_positive_int, default=3, metavar="N",
        help="passes over the workload; the median time per item and method is kept (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=None, metavar="T",
        help="torch threads for every method (default: torch's current setting)",
    )
    parser.add_argument("--json", metavar="OUT.json", default=None, help="write the full results as JSON")
    parser.add_argument("--plot", metavar="OUT.png", default=None, help="write a PNG chart (needs matplotlib)")
    parser.add_argument("--limit", type=_positive_int, default=None, metavar="N", help="only the first N items")
    parser.add_argument(
        "--max-new-tokens", type=_positive_int, default=None, metavar="N",
        help="replace every item's max_new_tokens with N",
    )
    parser.add_argument(
        "--max-nodes", type=_positive_int, default=None, metavar="N",
        help="draft tree size cap for draftmesh methods (default: the engine's)",
    )
    parser.add_argument("--no-cost-curve", action="store_true", help="skip measuring the target's cost curve")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _error(msg: str) -> int:
    print(f"draftmesh bench: error: {msg}", file=sys.stderr)
    return EXIT_USAGE


def _load_target(spec_or_target):
    from draftmesh.backend import TorchTarget

    if isinstance(spec_or_target, TorchTarget):
        return spec_or_target
    return TorchTarget.load(str(spec_or_target))


def prepare_items(items: Sequence[WorkItem], target, max_new_tokens: int | None = None) -> list[PreparedItem]:
    """Render prompts with the target's tokenizer and check each fits the model's context."""
    prepared, problems = [], []
    for it in items:
        n = max_new_tokens or it.max_new_tokens
        try:
            ids = render_prompt_ids(it, target.tokenizer)
        except Exception as exc:  # noqa: BLE001 - reported with the item id
            problems.append(f"item {it.id!r} (line {it.line}): cannot render the prompt: {exc}")
            continue
        if not ids:
            problems.append(f"item {it.id!r} (line {it.line}): the prompt renders to no tokens")
        elif len(ids) + n > target.max_context:
            problems.append(
                f"item {it.id!r} (line {it.line}): prompt {len(ids)} + max_new_tokens {n} tokens exceeds "
                f"the model context of {target.max_context}"
            )
        else:
            prepared.append(PreparedItem(it, tuple(ids), n))
    if problems:
        raise ValueError("\n  ".join(["some items cannot run on this model:", *problems]))
    return prepared


def default_methods(target_kind: str, methods: str | None) -> str:
    """The --methods text: the given one, else the default of the target."""
    if methods:
        return methods
    return DEFAULT_MESH_METHODS if target_kind == "mesh" else DEFAULT_METHODS


def check_target(target_kind: str, methods: Sequence[Method], *, addr: str | None = None,
                 tls_ca: str | None = None) -> None:
    """ValueError for a --target that does not fit the methods or the mesh flags."""
    if target_kind not in TARGETS:
        raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {target_kind!r}")
    mesh = [m.name for m in methods if m.family == "mesh"]
    if target_kind != "mesh":
        if mesh:
            raise ValueError(f"method(s) {', '.join(mesh)} run through the mesh: add --target mesh")
        if addr or tls_ca:
            raise ValueError("--addr and --tls-ca need --target mesh")
    elif not mesh:
        raise ValueError(f"--target mesh needs a mesh method in --methods ({', '.join(MESH_METHODS)})")
    if tls_ca and not addr:
        raise ValueError("--tls-ca applies to a mesh given with --addr")



def open_mesh(
    cleanup: contextlib.ExitStack,
    methods: Sequence[Method],
    *,
    model: str,
    threads: int,
    addr: str | None = None,
    api_key: str | None = None,
    tls_ca: bytes | None = None,
    max_nodes: int | None = None,
) -> tuple[list[MeshRunner], dict[str, Any], Callable[[], dict[str, Any] | None]]:
    """Connect to ``addr``, or start a local mesh for ``model`` (stopped by ``cleanup``, also on
    an error or Ctrl-C); return the mesh runners, the mesh facts for the report and a
    function measuring the mesh's memory (None for a mesh not started here)."""
    from draftmesh.client import MeshClient, api_key_from_env

    api_key = api_key_from_env(api_key)
    if addr:
        client = cleanup.enter_context(MeshClient(addr, api_key=api_key, tls_ca=tls_ca))
        print(
            f"draftmesh bench: warning: the mesh at {addr} was not started by the bench, so its learned state "
            "(answer store, builder statistics, session KV caches) carries over between passes and from "
            "earlier traffic: mesh:draftmesh does not start each pass cold like the in-process methods",
            file=sys.stderr,
        )
        runners = make_mesh_runners(methods, client, max_nodes=max_nodes)
        info = {"address": addr, "started_by_bench": False, "started_s": None, "memory": None,
                "mesh_state_reset": False, "tls": tls_ca is not None}
        return runners, info, lambda: None

    from draftmesh.config import MeshConfig
    from draftmesh.router.launcher import start_mesh

    # Serve's per-request INFO lines would bury the progress bar and the tables
    cfg_args: dict[str, Any] = {"model": model, "threads": threads, "grpc_port": free_port(), "log_level": "WARNING"}
    if max_nodes is not None:
        cfg_args["max_nodes"] = max_nodes
    embedded_redis = not os.environ.get("REDIS_URL")
    print(f"draftmesh bench: starting a local mesh for {model} ({threads} torch threads) ...", file=sys.stderr)
    try:
        running = start_mesh(MeshConfig(**cfg_args))
    except Exception as exc:  # noqa: BLE001 - reported as a bench error; start_mesh cleaned up
        raise MeshError(f"cannot start a local mesh: {type(exc).__name__}: {exc}") from exc
    cleanup.callback(running.stop)
    print(f"draftmesh bench: mesh ready at {running.address} in {running.started_s:.1f}s", file=sys.stderr)
    # api_key: the bench's own mesh has no auth; a key from the environment is simply ignored there
    client = cleanup.enter_context(MeshClient(running.address, api_key=api_key))
    state = OwnMeshState(running.config.redis_url, embedded_redis=embedded_redis)
    runners = make_mesh_runners(methods, client, resetter=state.reset)
    cfg = running.config
    info = {
        "address": running.address,
        "started_by_bench": True,
        "started_s": round(running.started_s, 3),
        "memory": None,
        "mesh_state_reset": True,
        "config": {"model": cfg.model, "threads": cfg.threads, "max_nodes": cfg.max_nodes,
                   "verifier_replicas": cfg.verifier_replicas, "session_cache_size": cfg.session_cache_size},
    }
    return runners, info, mesh_process_memory


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args`` (see ``add_arguments``); return the exit status.

    ``args.model`` (and ``args.assistant``) may be a model spec or an already-loaded
    ``TorchTarget``, so tests and callers can inject a model.
    """
    import torch

    opt = lambda name, default=None: getattr(args, name, default)  # noqa: E731 - Namespaces built by hand
    target_kind = opt("target") or "local"
    try:
        items = load_workload(args.workload)
        methods = parse_methods(default_methods(target_kind, opt("methods")))
        check_target(target_kind, methods, addr=opt("addr"), tls_ca=opt("tls_ca"))
    except (WorkloadError, ValueError) as exc:
        return _error(str(exc))
    mesh_methods = [m for m in methods if m.family == "mesh"]
    tls_ca = None
    if opt("tls_ca"):
        try:
            tls_ca = Path(opt("tls_ca")).expanduser().read_bytes()
        except OSError as exc:
            return _error(f"--tls-ca: cannot read {opt('tls_ca')}: {exc.strerror or exc}")
    if opt("limit"):
        items = items[: opt("limit")]
    repeats = opt("repeats") or 3
    if opt("plot"):
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return _error("--plot needs matplotlib (pip install matplotlib)")

    skipped: dict[str, str] = {}
    if any(m.name == HF_ASSIST for m in methods) and opt("assistant") is None:
        skipped[HF_ASSIST] = "no --assistant given"
        methods = [m for m in methods if m.name != HF_ASSIST]

    old_threads = torch.get_num_threads()
    threads = opt("threads") or old_threads
    torch.set_num_threads(threads)
    try:
        model = opt("model") or "smollm2-135m"
        try:
            target = _load_target(model)
            assistant = _load_target(opt("assistant")) if opt("assistant") is not None else None
            prepared = prepare_items(items, target, opt("max_new_tokens"))
        except (ValueError, FileNotFoundError, OSError) as exc:
            return _error(str(exc))
        if mesh_methods and not opt("addr") and not isinstance(model, str):
            return _error("--target mesh without --addr starts a mesh for --model, which must be a model spec")
        mesh_info: dict[str, Any] | None = None
        try:
            with contextlib.ExitStack() as cleanup:
                runners = [
                    make_runner(m, target, assistant=assistant, max_nodes=opt("max_nodes"))
                    for m in methods
                    if m.family != "mesh"
                ]
                if mesh_methods:
                    try:
                        mesh_runners, mesh_info, measure_memory = open_mesh(
                            cleanup, mesh_methods, model=model, threads=threads, addr=opt("addr"),
                            api_key=opt("api_key"), tls_ca=tls_ca, max_nodes=opt("max_nodes"),
                        )
                    except MeshError as exc:
                        return _error(str(exc))
                    runners += mesh_runners
                try:
                    results = execute(
                        runners, prepared, repeats, progress=not opt("no_progress"), tokenizer=target.tokenizer
                    )
                except MeshError as exc:
                    return _error(str(exc))
                if mesh_info is not None and mesh_info.get("started_by_bench"):
                    mesh_info["memory"] = measure_memory()
        except KeyboardInterrupt:
            stopped = " (the mesh it started is stopped)" if mesh_methods and not opt("addr") else ""
            print(f"draftmesh bench: interrupted{stopped}", file=sys.stderr)
            return EXIT_INTERRUPTED
        measure_fidelity(results)
        by_id = {p.id: p for p in prepared}
        plain = {r.item_id: r for r in results if r.method == PLAIN}
        for r in results:
            if r.identical_to_plain is False and r.first_difference is not None:
                ref = plain[r.item_id].runs[r.mismatch_repeat or 0].token_ids
                try:
                    r.mismatch_top2_gap = top2_gap(target, by_id[r.item_id].prompt_ids, ref[: r.first_difference])
                except Exception:  # noqa: BLE001 - the gap is a diagnostic only
                    r.mismatch_top2_gap = None
        cost_curve = {}
        if not opt("no_cost_curve"):
            cost_curve = target.cost_curve or target.measure_cost_curve()
        meta = {
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": opt("command_line") or shlex.join(sys.argv),
            "machine": machine_info(),
            "dtype": str(target.dtype).replace("torch.", ""),
            "device": str(target.device),
            "assistant": getattr(assistant, "name", None),
            "workload": {"path": str(args.workload), "items": len(prepared)},
            "max_new_tokens_override": opt("max_new_tokens"),
            "max_nodes": opt("max_nodes"),
            "cost_curve": {str(k): round(v, 4) for k, v in cost_curve.items()},
            "step_ms": round(1e3 * target.step_seconds, 4) if cost_curve and target.step_seconds else None,
        }
        name = model if isinstance(model, str) else getattr(target, "name", "model")
        meta["target"] = target_kind
        traced = next((r.tracing for r in runners if getattr(r, "tracing", None) is not None), None)
        if traced is not None:
            from draftmesh.bench_tracing import noop_step_cost_us

            meta["traced_spans_exported"] = traced.exported()
            meta["untraced_step_span_cost_us"] = round(noop_step_cost_us(), 2)
        report = BenchReport(name, threads, repeats, results, skipped, meta, mesh=mesh_info)
        print(format_report(report))
        if opt("json"):
            Path(opt("json")).parent.mkdir(parents=True, exist_ok=True)
            Path(opt("json")).write_text(json.dumps(report_to_json(report), indent=2) + "\n", encoding="utf-8")
            print(f"wrote {opt('json')}")
        if opt("plot"):
            Path(opt("plot")).parent.mkdir(parents=True, exist_ok=True)
            write_plot(report, opt("plot"))
            print(f"wrote {opt('plot')}")
        return EXIT_MISMATCH if any(r.identical_to_plain is False for r in results) else EXIT_OK
    finally:
        torch.set_num_threads(old_threads)
