"""The recycle source's table: best-first trees from observed successors, the latest observation
wins, tenants apart, a byte bound over all tenants, bad options named."""

from __future__ import annotations

import numpy as np
import pytest

from draftmesh.config import DraftmeshConfig
from draftmesh.draft import registry
from draftmesh.draft.base import DraftContext, SuccessorObserver
from draftmesh.draft.recycle import RecycleSource

VOCAB = 50


def rows(*successors: list[tuple[int, float]], k: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows (ids, probs) from per-input successor lists, padded with id -1."""
    ids = np.full((len(successors), k), -1, dtype=np.int64)
    probs = np.zeros((len(successors), k), dtype=np.float32)
    for i, succ in enumerate(successors):
        for j, (tok, p) in enumerate(succ):
            ids[i, j], probs[i, j] = tok, p
    return ids, probs


def ctx(last: int, tenant: str = "default", size_hint: int = 64) -> DraftContext:
    return DraftContext(token_ids=(1, 2, last), prompt_len=2, tenant=tenant, size_hint=size_hint)


def paths(proposals) -> dict[tuple[int, ...], tuple[float, ...]]:
    return {p.token_ids: tuple(round(x, 4) for x in p.token_probs) for p in proposals}


def test_it_drafts_the_most_probable_successors_of_successors_first():
    src = RecycleSource(VOCAB, max_nodes=4, min_prob=0.0)
    # 7 -> 8 (0.6) | 9 (0.3);  8 -> 10 (0.5) | 11 (0.2);  10 -> 12 (0.9)
    src.observe_successors("default", [7, 8, 10], *rows([(8, 0.6), (9, 0.3)], [(10, 0.5), (11, 0.2)], [(12, 0.9)]))
    got = paths(src.propose(ctx(7)))
    # best-first by path probability: 8 (0.6), 9 (0.3, older), 8-10 (0.3), 8-10-12 (0.27); 8-11 (0.12) is left out
    assert got == {(8, 10, 12): (0.6, 0.5, 0.9), (9,): (0.3,)}
    for p in src.propose(ctx(7)):
        assert p.confidence == pytest.approx(float(np.prod(p.token_probs)))
        assert p.token_dists is None  # deterministic drafts: lossless under every rule


def test_caps_depth_min_probability_and_the_steps_size_hint():
    src = RecycleSource(VOCAB, max_nodes=16, max_depth=2, min_prob=0.25)
    src.observe_successors("default", [7, 8, 10], *rows([(8, 0.6), (9, 0.2)], [(10, 0.5), (11, 0.4)], [(12, 0.9)]))
    # 9 (0.2) and 8-11 (0.24) fall under min_prob; 8-10-12 is deeper than 2
    assert paths(src.propose(ctx(7))) == {(8, 10): (0.6, 0.5)}
    assert paths(src.propose(ctx(7, size_hint=1))) == {(8,): (0.6,)}
    assert src.propose(ctx(7, size_hint=0)) == []
    assert src.propose(ctx(3)) == []  # never an input: nothing to say
    assert src.propose(ctx(VOCAB + 5)) == []  # outside the table


def test_the_latest_row_for_an_input_wins():
    src = RecycleSource(VOCAB, min_prob=0.0)
    src.observe_successors("default", [7, 7], *rows([(20, 0.9)], [(21, 0.4)]))
    assert paths(src.propose(ctx(7))) == {(21,): (0.4,)}
    src.observe_successors("default", [7], *rows([(22, 0.5)]))  # a later step replaces it
    assert paths(src.propose(ctx(7))) == {(22,): (0.5,)}


def test_tenants_never_draft_from_each_others_steps():
    src = RecycleSource(VOCAB, min_prob=0.0)
    src.observe_successors("acme", [7], *rows([(8, 0.9)]))
    assert paths(src.propose(ctx(7, tenant="acme"))) == {(8,): (0.9,)}
    assert src.propose(ctx(7, tenant="globex")) == []
    src.observe_successors("globex", [7], *rows([(9, 0.8)]))
    assert paths(src.propose(ctx(7, tenant="acme"))) == {(8,): (0.9,)}
    assert paths(src.propose(ctx(7, tenant="globex"))) == {(9,): (0.8,)}


def test_all_tenants_tables_stay_within_max_bytes_least_recently_used_first_out():
    one = VOCAB * 4 * 8  # ids int32 + probs float32, top_k 4
    src = RecycleSource(VOCAB, min_prob=0.0, max_bytes=2 * one)
    for tenant in ("a", "b"):
        src.observe_successors(tenant, [7], *rows([(8, 0.9)]))
    assert src.nbytes == 2 * one
    src.propose(ctx(7, tenant="a"))  # "a" used last: "b" is the one to go
    src.observe_successors("c", [7], *rows([(9, 0.9)]))
    assert src.nbytes == 2 * one
    assert src.propose(ctx(7, tenant="b")) == []
    assert src.propose(ctx(7, tenant="a")) and src.propose(ctx(7, tenant="c"))


@pytest.mark.parametrize("options, field", [
    ({"top_k": 0}, "top_k"), ({"top_k": 65}, "top_k"), ({"max_nodes": -1}, "max_nodes"),
    ({"min_prob": 1.0}, "min_prob"), ({"max_bytes": 100}, "max_bytes"),
])
def test_bad_options_name_their_field(options, field):
    with pytest.raises(ValueError, match=field):
        registry.create("recycle", registry.SourceEnv(vocab_size=VOCAB), **options)


def test_the_registry_builds_it_as_a_source_the_verifier_feeds():
    src = registry.create("recycle", registry.SourceEnv(vocab_size=VOCAB), top_k=2)
    assert isinstance(src, SuccessorObserver) and src.top_k == 2
    with pytest.raises(ValueError, match="vocabulary"):
        registry.create("recycle", registry.SourceEnv())


def test_it_cannot_be_a_serve_deployment():
    """Nothing would feed it there: the config refuses it, naming the entry."""
    with pytest.raises(ValueError, match=r"sources\.remote\.recycle.*sources\.names"):
        DraftmeshConfig.from_dict({"sources": {"remote": {"recycle": {"deployment": {"num_replicas": 1}}}}})
