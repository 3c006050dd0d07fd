"""Draft sources by name, so configs, requests and the CLI can say which ones to use.

Factories receive a ``SourceEnv`` (what every source may need from the deployment: the
target tokenizer, the Redis URL) plus that source's own options from config. Each factory
imports its source's module when called: a deployment pays (bm25s, the answer store's Redis,
a draft model) only for the sources it uses.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from draftmesh.backend import TorchTarget
from draftmesh.draft.base import DraftSource
from draftmesh.models import load_tokenizer
from draftmesh.prompts import encode_messages


@dataclass(frozen=True)
class SourceEnv:
    tokenizer: Any = None
    vocab_size: int | None = None
    """The target's output vocabulary (can exceed the tokenizer's: padded embeddings)."""
    redis_url: str | None = None
    answer_store_max_bytes: int = 0
    """Byte bound of the Redis answer store (``serve.answer_store_max_bytes``; 0: none)."""
    step_deadline_s: float | None = None
    """The verifier's per-step source deadline (``sources.deadline_ms``; None: none). A compute-bound
    source runs on the step's own thread, where that deadline cannot cut it short, so it takes it
    as its own time limit (the llm source's ``max_seconds``) unless given one."""


SourceFactory = Callable[..., DraftSource]


def _prompt_lookup(env: SourceEnv, **options: Any) -> DraftSource:
    from draftmesh.draft.prompt_lookup import PromptLookupSource  # lazy: a source's module loads when it is used

    return PromptLookupSource(**options)


def _history(env: SourceEnv, **options: Any) -> DraftSource:
    from draftmesh.draft.history import (  # lazy: a source's module loads when it is used
        HistorySource,
        InMemoryAnswerStore,
        MinHasher,
    )

    hasher = MinHasher(boilerplate=_template_boilerplate(env.tokenizer))
    if env.redis_url:
        from draftmesh.draft.redis_store import RedisAnswerStore  # lazy: a source's module loads when it is used

        store = RedisAnswerStore.from_url(env.redis_url, hasher=hasher, max_bytes=env.answer_store_max_bytes)
    else:
        store = InMemoryAnswerStore(hasher=hasher)
    options.setdefault("tokenizer", env.tokenizer)
    return HistorySource(store, **options)


def _template_boilerplate(tokenizer: Any) -> list[list[int]]:
    """The chat template's fixed tokens, so near-duplicate search looks at the question."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return []
    return [encode_messages(tokenizer, [{"role": "user", "content": ""}])]


def _rules(env: SourceEnv, path: str | None = None, **options: Any) -> DraftSource:
    from draftmesh.draft.rules import RulesSource  # lazy: a source's module loads when it is used

    source = RulesSource.from_yaml(path) if path else RulesSource.default()
    for key, value in options.items():
        if not hasattr(source, key):
            raise ValueError(f"rules source: unknown option {key!r}")
        setattr(source, key, value)
    return source


def _rag(env: SourceEnv, paths: list[str] | tuple[str, ...] = (), **options: Any) -> DraftSource:
    from draftmesh.draft.rag import RagSource  # lazy: a source's module loads when it is used

    if env.tokenizer is None:
        raise ValueError("the rag source needs the target tokenizer")
    return RagSource(env.tokenizer, list(paths), **options)


def _llm(env: SourceEnv, draft: str = "smollm2-135m", device: str = "cpu", **options: Any) -> DraftSource:
    """A small draft LLM. Off by default: on CPU it costs more than it saves (docs/llm_source.md)."""
    from draftmesh.draft.llm import LLMSource  # lazy: a source's module loads when it is used

    options.setdefault("target_vocab_size", env.vocab_size)
    options.setdefault("max_seconds", env.step_deadline_s)
    return LLMSource(TorchTarget.load(draft, device=device), target_tokenizer=env.tokenizer, **options)


def _recycle(env: SourceEnv, **options: Any) -> DraftSource:
    """The target's own recent predictions; fed by the verifier, so in-process only."""
    from draftmesh.draft.recycle import RecycleSource  # lazy: a source's module loads when it is used

    if env.vocab_size is None:
        raise ValueError("the recycle source needs the target's vocabulary size")
    return RecycleSource(env.vocab_size, **options)


FACTORIES: dict[str, SourceFactory] = {
    "llm": _llm,
    "prompt_lookup": _prompt_lookup,
    "history": _history,
    "rules": _rules,
    "rag": _rag,
    "recycle": _recycle,
}
DEFAULT_SOURCES: tuple[str, ...] = ("history", "rules", "rag")


def available() -> list[str]:
    return sorted(FACTORIES)


def create(name: str, env: SourceEnv | None = None, **options: Any) -> DraftSource:
    try:
        factory = FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown draft source {name!r}; available: {', '.join(available())}") from None
    try:
        return factory(env or SourceEnv(), **options)
    except TypeError as exc:
        raise ValueError(f"bad options for draft source {name!r}: {exc}") from None


def build_source(name: str, model: str, *, options: Mapping[str, Any] | None = None, factory: str | None = None,
                 redis_url: str | None = None, answer_store_max_bytes: int = 0) -> DraftSource:
    """A source outside any verifier (a Serve draft deployment, `draftmesh draft-serve`),
    with the tokenizer of the target ``model``: the built-in ``name``, or ``factory``
    ("package.module:callable") called as factory(env, **options)."""
    tokenizer = load_tokenizer(model)
    env = SourceEnv(tokenizer=tokenizer, vocab_size=len(tokenizer), redis_url=redis_url,
                    answer_store_max_bytes=answer_store_max_bytes)
    options = dict(options or {})
    if factory:
        module, _, attr = str(factory).partition(":")
        if not module or not attr:
            raise ValueError(f"sources.remote.{name}.factory must look like package.module:callable, got {factory!r}")
        source = getattr(importlib.import_module(module), attr)(env, **options)
    else:
        source = create(name, env, **options)
    source.name = name
    return source
