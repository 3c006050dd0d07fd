"""Draft sources by name, so configs, requests and the CLI can say which ones to use."""

from __future__ import annotations

from typing import Any, Callable

from draftmesh.draft.base import DraftSource

SourceFactory = Callable[..., DraftSource]


def _prompt_lookup(**kwargs: Any) -> DraftSource:
    from draftmesh.draft.prompt_lookup import PromptLookupSource

    return PromptLookupSource(**kwargs)


FACTORIES: dict[str, SourceFactory] = {"prompt_lookup": _prompt_lookup}
DEFAULT_SOURCES: tuple[str, ...] = ("prompt_lookup",)


def available() -> list[str]:
    return sorted(FACTORIES)


def create(name: str, **kwargs: Any) -> DraftSource:
    try:
        factory = FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown draft source {name!r}; available: {', '.join(available())}") from None
    return factory(**kwargs)
