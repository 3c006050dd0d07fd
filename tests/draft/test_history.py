"""HistorySource (prompt lookup, session, answer store) and the AnswerStore contract.

Store tests run against both the in-memory store and the Redis store (real redis-server).
"""

from __future__ import annotations

from typing import Sequence

import pytest

from draftmesh.draft.base import DraftContext, LearningSource
from draftmesh.draft.history import HistorySource, InMemoryAnswerStore, MinHasher, Turn

CODE = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
QUESTION = "How do I reverse a list in Python without modifying the original?"
PARAPHRASE = "How do I reverse a list in Python without changing the original?"
UNRELATED = "What is the boiling point of water at sea level?"
ANSWER = (
    "Use slicing: `reversed_copy = items[::-1]` creates a new list in reverse order and leaves "
    "`items` untouched. `list(reversed(items))` works too."
)


def ctx(prompt: Sequence[int], generated: Sequence[int] = (), **kwargs) -> DraftContext:
    return DraftContext(token_ids=tuple(prompt) + tuple(generated), prompt_len=len(prompt), **kwargs)


def token_ids(proposals) -> list[tuple[int, ...]]:
    return [p.token_ids for p in proposals]


def test_is_a_learning_source():
    source = HistorySource()
    assert isinstance(source, LearningSource)
    assert source.name == "history"


def test_prompt_lookup_continues_a_code_block(encode):
    code = encode(CODE)
    prompt = (
        encode("Here is my function:\n```python\n") + code + encode("```\nAdd a docstring, keep the code.\n")
    )
    source = HistorySource(max_tokens=8)
    proposals = source.propose(ctx(prompt, code[:6], request_id="r"))
    assert proposals[0].source == "history"
    assert proposals[0].token_ids == tuple(code[6:14])
    # later steps append the new tokens to the request's index and keep following the block
    proposals = source.propose(ctx(prompt, code[:20], request_id="r"))
    assert proposals[0].token_ids == tuple(code[20:28])


def test_resume_window_picks_a_copy_up_after_a_changed_token():
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    source = HistorySource(max_tokens=3, resume_window=4)
    assert token_ids(source.propose(ctx(prompt, [6, 7, 8], request_id="r"))) == [(9, 10, 11)]
    # the model wrote 99 instead of 9, then 10: no 2-gram of the context is in the prompt,
    # but 10 sits where the copy would be, so the copy resumes after it
    got = source.propose(ctx(prompt, [6, 7, 8, 99, 10], request_id="r"))
    assert token_ids(got) == [(11, 12, 13)] and got[0].confidence == pytest.approx(1 / 8)
    off = HistorySource(max_tokens=3, resume_window=0)
    off.propose(ctx(prompt, [6, 7, 8], request_id="r"))
    assert off.propose(ctx(prompt, [6, 7, 8, 99, 10], request_id="r")) == []


def test_the_answer_start_matches_the_spaced_word_in_the_prompt(smol_tokenizer, encode):
    prompt = encode("Fix the typos and repeat it: The quick brown fox jumsp over the dog.\n")
    first = encode("The")  # the answer's first word: no leading space, unlike " The" in the prompt
    assert first != encode(" The")[:1]
    plain = HistorySource(max_tokens=4)
    assert plain.propose(ctx(prompt, first)) == []  # no 2-gram of the answer is in the prompt
    source = HistorySource(max_tokens=4, tokenizer=smol_tokenizer)
    got = source.propose(ctx(prompt, first))
    assert token_ids(got) == [tuple(encode(" quick brown fox jumsp")[:4])]
    # Only at the start of an answer: later the n-grams take over.
    later = first + encode(" quick brown fox jumsp over the")
    assert token_ids(source.propose(ctx(prompt, later)))[0][0] == encode(" dog")[0]


def test_two_continuations_become_two_proposals_weighted_by_count(encode):
    lines = ["status: ok\n", "status: failed\n", "status: ok\n"]
    prompt = encode("Log\n") + [t for line in lines for t in encode(line)] + encode("Report the status.\n")
    head = encode("status:")
    ok, failed = (tuple(encode(line)[len(head) : len(head) + 2]) for line in lines[:2])
    assert ok != failed
    proposals = HistorySource(max_tokens=2).propose(ctx(prompt, head))
    assert token_ids(proposals) == [ok, failed]
    assert proposals[0].confidence == pytest.approx(2 * proposals[1].confidence)


def test_caps_on_proposals_and_tokens(encode):
    prompt = [t for i in range(12) for t in encode(f"key: value{i} and more words\n")] + encode("Again.\n")
    source = HistorySource(max_proposals=3, max_tokens=6)
    proposals = source.propose(ctx(prompt, encode("key:"), size_hint=4))
    assert len(proposals) == 3
    assert all(1 <= len(p.token_ids) <= 4 for p in proposals)  # size_hint 4 < max_tokens 6


def test_session_turns_are_recalled_in_the_same_session_only(encode, make_store):
    store = make_store()
    source = HistorySource(store, max_tokens=6)
    first = encode("Write a limerick about a cat.\n")
    line1, line2 = (
        encode("A cat with a hat made of felt\n"),
        encode("would dance while the butter would melt\n"),
    )
    source.finish(ctx(first, request_id="a", session_id="s1"), line1 + line2, "")
    later = encode("Now repeat the second line for me.\n")
    proposals = source.propose(ctx(later, line2[:3], request_id="b", session_id="s1"))
    assert tuple(line2[3:9]) in token_ids(proposals)
    other = source.propose(ctx(later, line2[:3], request_id="c", session_id="s2"))
    assert tuple(line2[3:9]) not in token_ids(other)


def test_exact_repeat_drafts_the_previous_answer_and_follows_it(encode, make_store):
    question, answer = encode(QUESTION), encode(ANSWER)
    source = HistorySource(make_store(), max_tokens=8)
    source.finish(ctx(question, answer, request_id="first"), answer, ANSWER)
    proposals = source.propose(ctx(question, request_id="again"))
    assert proposals[0].token_ids == tuple(answer[:8])
    assert proposals[0].confidence == 1.0
    proposals = source.propose(ctx(question, answer[:10], request_id="again"))
    assert proposals[0].token_ids == tuple(answer[10:18])


def test_resynchronises_after_the_output_diverges(encode, make_store):
    question, answer = encode(QUESTION), encode(ANSWER)
    source = HistorySource(make_store(), max_tokens=8)
    source.finish(ctx(question, answer), answer, ANSWER)
    source.propose(ctx(question, answer[:5], request_id="r"))
    detour = answer[:5] + encode(" (a shallow copy)")
    assert tuple(answer[5:13]) not in token_ids(source.propose(ctx(question, detour, request_id="r")))
    rejoined = detour + answer[5:14]
    assert source.propose(ctx(question, rejoined, request_id="r"))[0].token_ids == tuple(answer[14:22])


def test_near_duplicate_question_drafts_the_answer_and_an_unrelated_one_does_not(encode, make_store):
    answer = encode(ANSWER)
    store = make_store()
    source = HistorySource(store, max_tokens=8)
    source.finish(ctx(encode(QUESTION), answer), answer, ANSWER)
    proposals = source.propose(ctx(encode(PARAPHRASE), request_id="paraphrase"))
    drafted = [p for p in proposals if p.token_ids == tuple(answer[:8])]
    assert drafted and 0.5 <= drafted[0].confidence < 1.0
    assert tuple(answer[:8]) not in token_ids(source.propose(ctx(encode(UNRELATED), request_id="unrelated")))
    assert store.near(encode(UNRELATED)) == []


def test_chat_template_boilerplate_is_ignored_by_near_duplicate_search(smol_tokenizer, encode, make_store):
    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        return smol_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )

    store = make_store(hasher=MinHasher(boilerplate=[chat("")]))
    store.put(chat(QUESTION), encode(ANSWER))
    assert [a.output_ids for a in store.near(chat(PARAPHRASE))] == [tuple(encode(ANSWER))]
    assert store.near(chat(UNRELATED)) == []


def test_store_contract(encode, make_store):
    store = make_store()
    q1, q2 = encode(QUESTION), encode(UNRELATED)
    store.put(q1, [1, 2, 3], session_id="s")
    store.put(q2, [4, 5], session_id="s")
    store.put(q1, [6, 7])  # the latest answer to a prompt wins
    assert store.get_exact(q1) == (6, 7)
    assert store.get_exact(q2) == (4, 5)
    assert store.get_exact(encode(PARAPHRASE)) is None
    near = store.near(encode(PARAPHRASE))
    assert [a.output_ids for a in near] == [(6, 7)] and 0.5 <= near[0].similarity < 1.0
    assert store.near(q1)[0].similarity == 1.0
    assert store.session_turns("s") == [Turn(tuple(q1), (1, 2, 3)), Turn(tuple(q2), (4, 5))]
    assert store.session_turns("nobody") == []


def test_store_evicts_the_least_recently_used_answer(encode, make_store):
    store = make_store(max_entries=3)
    prompts = [encode(f"Question number {i}: how tall is mountain {i}?") for i in range(5)]
    for i in range(3):
        store.put(prompts[i], [i])
    assert store.get_exact(prompts[0]) == (0,)  # a hit makes it recent
    store.put(prompts[3], [3])
    assert len(store) == 3
    assert store.get_exact(prompts[1]) is None
    assert [store.get_exact(prompts[i]) for i in (0, 2, 3)] == [(0,), (2,), (3,)]
    assert all(a.output_ids != (1,) for a in store.near(prompts[1], limit=10))


def test_store_bounds_sessions_and_turns(encode, make_store):
    store = make_store(max_sessions=2, max_turns=2)
    for turn in range(3):
        store.put(encode(f"turn {turn}"), [turn], session_id="long")
    assert [t.output_ids for t in store.session_turns("long")] == [(1,), (2,)]
    store.put(encode("hello"), [7], session_id="second")
    store.put(encode("hello again"), [8], session_id="third")
    assert store.session_turns("long") == []
    assert [t.output_ids for t in store.session_turns("third")] == [(8,)]


def test_finish_without_output_stores_nothing(encode):
    store = InMemoryAnswerStore()
    HistorySource(store).finish(ctx(encode(QUESTION), session_id="s"), [], "")
    assert len(store) == 0 and store.session_turns("s") == []


def test_a_reused_request_id_with_another_prompt_starts_over(encode):
    source = HistorySource(max_tokens=4)
    code = encode(CODE)
    source.propose(ctx(encode(QUESTION), encode(" Use"), request_id="same"))
    proposals = source.propose(ctx(code + encode("\n"), code[:6], request_id="same"))
    assert proposals[0].token_ids == tuple(code[6:10])
