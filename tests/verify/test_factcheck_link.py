"""The verifier's fact-check link against a real Redis and a real worker running the real
checks (spaCy NER, calendar and numeric rules): which tree nodes get flagged, what the
output report says, and what happens when Redis is gone."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import pytest

from draftmesh.config import FactCheckConfig
from draftmesh.draft.base import DraftContext
from draftmesh.factcheck.client import FactCheckClient
from draftmesh.factcheck.protocol import annotation_id_for_text
from draftmesh.net import free_port
from draftmesh.tree import TokenTree
from draftmesh.verify.factcheck_link import FactCheckLink

WRONG = " Ada Lovelace was born on February 30, 2023 in London."
RIGHT = " Ada Lovelace was born on March 3, 2023 in London."


@pytest.fixture(scope="module")
def tokenizer():
    from draftmesh.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def annotate():
    from draftmesh.factcheck.checker import build_annotator

    return build_annotator(FactCheckConfig())


@pytest.fixture
def service(redis_server, annotate):
    """A real worker thread on a fresh stream prefix; yields (config, client)."""
    import redis

    from draftmesh.factcheck.worker import Worker

    config = FactCheckConfig(redis_url=redis_server.url, stream_prefix=f"test:{uuid.uuid4().hex}", block_ms=50)
    worker = Worker(redis.Redis.from_url(redis_server.url), config, annotate, name="w1")
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), daemon=True)
    thread.start()
    client = FactCheckClient(redis_server.url, config)
    yield config, client
    stop.set()
    thread.join(10)
    client.close()


def chain(tokenizer, text: str) -> TokenTree:
    tree = TokenTree()
    parent = -1
    for tok in tokenizer.encode(text, add_special_tokens=False):
        parent = tree.add(parent, tok, "test")
    return tree


def ctx(request_id="r1", tail="") -> DraftContext:
    return DraftContext(token_ids=(1, 2, 3), prompt_len=3, text_tail=tail, request_id=request_id)


def nodes_over(tokenizer, tree: TokenTree, needle: str, prefix: str = "") -> set[int]:
    """The chain's nodes whose decoded characters overlap ``needle`` in ``prefix + text``."""
    pieces = [tokenizer.decode([t]) for t in tree.tokens]
    text = prefix + "".join(pieces)
    start = text.index(needle)
    end, out, pos = start + len(needle), set(), len(prefix)
    for node, piece in enumerate(pieces):
        if pos < end and start < pos + len(piece):
            out.add(node)
        pos += len(piece)
    return out


def wait_for(client, annotation_id, timeout=20.0):
    annotation = client.wait(annotation_id, timeout)
    assert annotation is not None, "the worker did not annotate in time"
    return annotation


def test_a_wrong_date_is_flagged_once_annotated_and_then_wherever_it_recurs(tokenizer, service):
    _, client = service
    link = FactCheckLink(client, tokenizer)
    tree = chain(tokenizer, WRONG)
    assert link(ctx(), tree) == frozenset()  # first sight: sent, nothing known yet
    text = "".join(tokenizer.decode([t]) for t in tree.tokens)
    annotation = wait_for(client, annotation_id_for_text("draft", text))
    assert [f.text for f in annotation.findings if f.flagged] == ["February 30, 2023"]

    expected = nodes_over(tokenizer, tree, "February 30, 2023")
    assert link(ctx(), tree) == frozenset(expected)

    # A later step's draft starts further on: it was never annotated itself, but the
    # learned flagged string still marks the same characters.
    shifted = chain(tokenizer, " born on February 30, 2023 in London, England.")
    assert link(ctx(request_id="r2", tail="Ada Lovelace was"), shifted) == frozenset(
        nodes_over(tokenizer, shifted, "February 30, 2023")
    )
    # And across the boundary: the date starts in the emitted text, ends in the draft.
    tail_tree = chain(tokenizer, " 30, 2023 in London.")
    flagged = link(ctx(request_id="r3", tail="Ada Lovelace was born on February"), tail_tree)
    assert flagged == frozenset(nodes_over(tokenizer, tail_tree, "February 30, 2023", prefix="February"))


def test_a_correct_date_is_never_flagged(tokenizer, service):
    _, client = service
    link = FactCheckLink(client, tokenizer)
    tree = chain(tokenizer, RIGHT)
    link(ctx(), tree)
    text = "".join(tokenizer.decode([t]) for t in tree.tokens)
    annotation = wait_for(client, annotation_id_for_text("draft", text))
    assert not annotation.flagged
    assert link(ctx(), tree) == frozenset()


def test_trivial_spans_are_not_sent(tokenizer, service):
    _, client = service
    link = FactCheckLink(client, tokenizer)
    assert link(ctx(), chain(tokenizer, " the")) == frozenset()
    assert link(ctx(), chain(tokenizer, " ... !!")) == frozenset()
    assert client.stats()["sent"] == 0


def test_output_report_carries_the_findings_with_offsets(tokenizer, service):
    _, client = service
    link = FactCheckLink(client, tokenizer)
    link(ctx(request_id="req-9"), chain(tokenizer, WRONG))
    output = "Sure. The Fed raised rates by 30 basis points on February 30, 2023."
    report = link.annotate_output("req-9", output, wait_s=20)
    assert report.status == "done" and report.drafts_submitted == 1
    flagged = {(f.check, output[f.start:f.end]) for f in report.findings if f.flagged}
    assert flagged == {("numeric", "30"), ("date", "February 30, 2023")}
    assert all(output[f.start:f.end] == f.text for f in report.findings)
    # Outputs are per request: the same text of another request is its own annotation.
    other = link.annotate_output("req-10", output, wait_s=20)
    assert other.annotation_id != report.annotation_id and other.status == "done"


def test_output_not_ready_in_time_is_pending_and_disabled_is_skipped(tokenizer, redis_server):
    # No worker on this prefix: nothing ever answers.
    config = FactCheckConfig(redis_url=redis_server.url, stream_prefix=f"test:{uuid.uuid4().hex}")
    client = FactCheckClient(redis_server.url, config)
    link = FactCheckLink(client, tokenizer)
    t0 = time.perf_counter()
    report = link.annotate_output("r", "Ada Lovelace was born in 1815.", wait_s=0.2)
    assert report.status == "pending" and report.annotation_id and time.perf_counter() - t0 < 2
    assert link.annotate_output("r", "text", wait_s=1, enabled=False).status == "skipped"


def test_redis_down_flags_every_node_and_reports_unavailable_quickly(tokenizer):
    config = FactCheckConfig(redis_url=f"redis://127.0.0.1:{free_port()}/0")
    link = FactCheckLink(FactCheckClient(config.redis_url, config), tokenizer)
    tree = chain(tokenizer, WRONG)
    assert link(ctx(), tree) == frozenset(range(len(tree)))  # lossy falls back to exact
    t0 = time.perf_counter()
    for _ in range(20):
        assert link(ctx(), tree) == frozenset(range(len(tree)))
    assert time.perf_counter() - t0 < 1.0  # the breaker: no per-step connection attempts
    assert link.annotate_output("r1", "Ada Lovelace was born in 1815.", wait_s=1).status == "unavailable"


class ScriptSource:
    """Drafts the rest of a fixed text while the output still follows it (test double)."""

    name = "script"

    def __init__(self, ids):
        self.ids = list(ids)

    def propose(self, ctx):
        from draftmesh.draft.base import Proposal

        done = list(ctx.generated_ids)
        if done != self.ids[: len(done)] or len(done) >= len(self.ids):
            return []
        return [Proposal(self.name, token_ids=tuple(self.ids[len(done):]))]


@pytest.mark.slow
def test_a_lossy_policy_never_accepts_a_flagged_draft_leniently(smollm2, service, monkeypatch):
    from draftmesh.io_struct import GenerationRequest, SpeculationParams
    from draftmesh.prompts import encode_messages
    from draftmesh.verify import policy
    from draftmesh.verify.decoder import SpeculativeDecoder
    from draftmesh.verify.lossy import TypicalPolicy
    from draftmesh.verify.tree_builder import TrieBuilder

    class AcceptAnything(TypicalPolicy):
        """typical with epsilon 0: takes any token the target gives p > 0. Requests may not ask
        for it (epsilon >= 0.01); the worst case shows the guard best, so the test registers it."""

        def __init__(self) -> None:
            self.epsilon, self.delta = 0.0, 0.3

    monkeypatch.setitem(policy.POLICIES, "accept-anything", AcceptAnything)

    _, client = service
    tokenizer = smollm2.tokenizer
    text = "The Fed raised rates by 30 basis points in March."  # policy moves come in steps of 25
    script = tokenizer.encode(text, add_special_tokens=False)
    prompt = tuple(encode_messages(tokenizer, [{"role": "user", "content": "Tell me one fact."}]))
    # The accept-anything policy takes the whole draft. A trie
    # builder with room for all of it, so the script is one step's tree: the cost-aware one
    # sizes trees from measured timings and could end a step before the final "." (the
    # target's own next token there is " 2022").
    req = GenerationRequest(prompt, max_new_tokens=len(script) + 4, speculation=SpeculationParams(policy="accept-anything"))
    unguarded = SpeculativeDecoder(smollm2, [ScriptSource(script)], builder=TrieBuilder(max_nodes=64)).generate(req)
    assert unguarded.text.startswith(text) and unguarded.lenient_tokens > 0

    link = FactCheckLink(client, tokenizer)
    tree = chain(tokenizer, text)
    link(ctx(request_id="earlier"), tree)  # an earlier request drafted the same span
    wait_for(client, annotation_id_for_text("draft", "".join(tokenizer.decode([t]) for t in tree.tokens)))
    guarded = SpeculativeDecoder(smollm2, [ScriptSource(script)], builder=TrieBuilder(max_nodes=64), flag_provider=link).generate(
        dataclasses.replace(req, request_id="guarded")
    )

    # Up to the flagged figure the draft is still taken (leniently); from the flagged node
    # on, every token is the target's own greedy choice.
    k = min(nodes_over(tokenizer, tree, "30"))
    assert list(guarded.token_ids[:k]) == script[:k] and guarded.lenient_tokens > 0
    greedy = SpeculativeDecoder(smollm2).generate(
        GenerationRequest(prompt + tuple(script[:k]), max_new_tokens=len(guarded.token_ids) - k)
    )
    assert guarded.token_ids[k:] == greedy.token_ids
    assert "by 30 basis points" not in guarded.text
    report = link.annotate_output("guarded", guarded.text, wait_s=20)
    assert report.status == "done" and report.flagged_steps >= 1 and report.drafts_submitted == 0


def test_only_spans_a_check_could_flag_are_sent(tokenizer, service):
    _, client = service
    link = FactCheckLink(client, tokenizer)
    link(ctx(), chain(tokenizer, " and then we went home for the night"))  # no name, date or figure
    assert client.stats()["sent"] == 0
    for text in (" and then we met Alice at home", " and then it was 2023 again", " rates rose by fifty basis points"):
        link(ctx(), chain(tokenizer, text))
    assert client.stats()["sent"] == 3
