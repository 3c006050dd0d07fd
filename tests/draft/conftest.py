"""Fixtures for the draft sources: the real SmolLM2 tokenizer and both answer stores."""

from __future__ import annotations

import os
import uuid
from typing import Callable

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from draftmesh.draft.history import AnswerStore, InMemoryAnswerStore  # noqa: E402


@pytest.fixture(scope="session")
def smol_tokenizer():
    from draftmesh.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def encode(smol_tokenizer) -> Callable[[str], list[int]]:
    """Text -> SmolLM2 token ids, no special tokens."""
    return lambda text: list(smol_tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(params=["memory", "redis"])
def make_store(request) -> Callable[..., AnswerStore]:
    """make_store(**bounds) -> a fresh store of the parametrized kind.

    Redis stores made by one test share a random key prefix (like replicas sharing a
    deployment) and never see another test's keys.
    """
    if request.param == "memory":
        return lambda **kwargs: InMemoryAnswerStore(**kwargs)
    from draftmesh.draft.redis_store import RedisAnswerStore

    client = request.getfixturevalue("redis_client")
    prefix = f"test:{uuid.uuid4().hex}:"
    return lambda **kwargs: RedisAnswerStore(client, prefix=prefix, **kwargs)
