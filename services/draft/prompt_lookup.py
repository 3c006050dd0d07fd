"""Prompt lookup: the history source without memory of other requests.

Every distinct continuation of the longest matching suffix inside the request's own
prompt and output is drafted (a tree), unlike transformers' prompt lookup, which drafts
the first match only. It is ``HistorySource`` over a store that remembers nothing.
"""

from __future__ import annotations

from typing import Any, Sequence

from draftmesh.draft.history import HistorySource, NearAnswer, Turn


class NullAnswerStore:
    """An AnswerStore that forgets everything: no session or answer recall."""

    def put(self, prompt_ids: Sequence[int], output_ids: Sequence[int], session_id: str | None = None,
            **_: Any) -> None:
        return None

    def get_exact(self, prompt_ids: Sequence[int], **_: Any) -> tuple[int, ...] | None:
        return None

    def near(self, prompt_ids: Sequence[int], limit: int = 4, **_: Any) -> list[NearAnswer]:
        return []

    def session_turns(self, session_id: str) -> list[Turn]:
        return []


class PromptLookupSource(HistorySource):
    name = "prompt_lookup"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(store=NullAnswerStore(), **kwargs)
