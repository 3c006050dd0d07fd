"""Workload files: parsing, every validation error with its line number, prompt rendering."""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from draftmesh.bench.workload import (
    WorkItem,
    WorkloadError,
    items_of_kinds,
    load_workload,
    parse_workload,
    render_prompt_ids,
)

PUBLIC = Path(__file__).resolve().parents[2] / "bench" / "public.jsonl"
LONG = PUBLIC.with_name("long-context.jsonl")


def line(**obj) -> str:
    return json.dumps(obj)


def good(i: int = 0, **extra) -> str:
    obj = {"id": f"item-{i}", "kind": "open", "prompt": "w3 w4 w5", "max_new_tokens": 16}
    obj.update(extra)
    return json.dumps(obj)


def problems_of(lines: list[str]) -> list[tuple[int, str]]:
    with pytest.raises(WorkloadError) as info:
        parse_workload(lines, source="test.jsonl")
    return info.value.problems


def test_parses_all_fields_and_keeps_line_numbers():
    lines = [
        good(0),
        "",
        line(
            id="rag-1",
            kind="rag",
            messages=[{"role": "system", "content": "Use the document."}, {"role": "user", "content": "Q?"}],
            max_new_tokens=64,
            corpus=["doc one", "doc two"],
            session="s1",
            note="kept aside",
        ),
        "   ",
    ]
    items = parse_workload(lines)
    assert [i.id for i in items] == ["item-0", "rag-1"]
    first, second = items
    assert first == WorkItem("item-0", "open", 16, prompt="w3 w4 w5", line=1)
    assert first.messages is None and first.corpus == () and first.session is None
    assert second.line == 3
    assert second.prompt is None
    assert second.messages[1] == {"role": "user", "content": "Q?"}
    assert second.corpus == ("doc one", "doc two")
    assert second.session == "s1"
    assert second.extra == {"note": "kept aside"}


def test_invalid_json_is_reported_with_its_line():
    probs = problems_of([good(0), '{"id": "x", "kind": ', good(2)])
    assert len(probs) == 1
    assert probs[0][0] == 2 and "invalid JSON" in probs[0][1]


def test_every_problem_is_collected_with_line_numbers():
    lines = [
        good(0),  # 1 ok
        line(kind="open", prompt="p", max_new_tokens=8),  # 2 missing id
        line(id="a", prompt="p", max_new_tokens=8),  # 3 missing kind
        line(id="b", kind="open", prompt="p", messages=[{"role": "user", "content": "c"}], max_new_tokens=8),  # 4 both
        line(id="c", kind="open", max_new_tokens=8),  # 5 neither
        line(id="d", kind="open", prompt="p", max_new_tokens=0),  # 6 bad max_new_tokens
        line(id="e", kind="open", prompt="p"),  # 7 missing max_new_tokens
        good(0),  # 8 duplicate of line 1
        "[1, 2]",  # 9 not an object
        "not json at all",  # 10
    ]
    probs = problems_of(lines)
    by_line = {}
    for n, msg in probs:
        by_line.setdefault(n, []).append(msg)
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert "missing 'id'" in by_line[2][0]
    assert "missing 'kind'" in by_line[3][0]
    assert "not both" in by_line[4][0]
    assert "missing 'prompt' or 'messages'" in by_line[5][0]
    assert "'max_new_tokens' must be an integer >= 1" in by_line[6][0]
    assert "missing 'max_new_tokens'" in by_line[7][0]
    assert "duplicate id 'item-0' (first on line 1)" in by_line[8][0]
    assert "expected a JSON object" in by_line[9][0]
    assert "invalid JSON" in by_line[10][0]


def test_error_message_lists_every_line():
    with pytest.raises(WorkloadError) as info:
        parse_workload([good(0), line(id="x"), good(0)], source="w.jsonl")
    text = str(info.value)
    assert text.startswith("workload w.jsonl: ")
    assert "line 2: missing 'kind'" in text
    assert "line 3: duplicate id" in text


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"id": 7}, "'id' must be a non-empty string"),
        ({"id": ""}, "'id' must be a non-empty string"),
        ({"kind": ["open"]}, "'kind' must be a non-empty string"),
        ({"max_new_tokens": "16"}, "'max_new_tokens' must be an integer"),
        ({"max_new_tokens": 1.5}, "'max_new_tokens' must be an integer"),
        ({"max_new_tokens": True}, "'max_new_tokens' must be an integer"),
        ({"max_new_tokens": -3}, "'max_new_tokens' must be an integer >= 1"),
        ({"prompt": ""}, "'prompt' must be a non-empty string"),
        ({"prompt": ["w1"]}, "'prompt' must be a non-empty string"),
        ({"corpus": "one document"}, "'corpus' must be a list of strings"),
        ({"corpus": ["ok", 3]}, "'corpus' must be a list of strings"),
        ({"session": 12}, "'session' must be a non-empty string"),
    ],
)
def test_wrong_types(override, needle):
    probs = problems_of([good(0), good(1, **override)])
    assert [n for n, _ in probs] == [2]
    assert needle in probs[0][1]


@pytest.mark.parametrize(
    "messages, needle",
    [
        ("hello", "'messages' must be a non-empty list"),
        ([], "'messages' must be a non-empty list"),
        (["hello"], "'messages'[0] must be an object"),
        ([{"content": "x"}], "'messages'[0] needs a 'role' among system, user, assistant"),
        ([{"role": "robot", "content": "x"}], "got 'robot'"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], "'messages'[1] needs a string 'content'"),
    ],
)
def test_bad_messages(messages, needle):
    obj = {"id": "m", "kind": "open", "messages": messages, "max_new_tokens": 8}
    probs = problems_of([json.dumps(obj)])
    assert probs[0][0] == 1 and needle in probs[0][1]


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match="no items"):
        load_workload(empty)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing.jsonl")


def test_load_workload_reads_a_file(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text(good(0) + "\n" + good(1) + "\n")
    assert [i.id for i in load_workload(path)] == ["item-0", "item-1"]


# ---------------------------------------------------------------------- rendering
@pytest.fixture(scope="module")
def word_tok():
    from tiny_models import word_tokenizer

    return word_tokenizer(64)


def test_render_raw_prompt(word_tok):
    item = parse_workload([good(0)])[0]
    assert render_prompt_ids(item, word_tok) == [3, 4, 5]


def test_render_messages_uses_the_chat_template(word_tok):
    import copy

    tok = copy.deepcopy(word_tok)
    # (single-digit words: the tiny tokenizer splits "w10" into two unknown pieces)
    tok.chat_template = (
        "{% for m in messages %}w7 {{ m['content'] }} w8 {% endfor %}{% if add_generation_prompt %}w9{% endif %}"
    )
    obj = {"id": "m", "kind": "open", "messages": [{"role": "user", "content": "w3 w4"}], "max_new_tokens": 8}
    item = parse_workload([json.dumps(obj)])[0]
    assert render_prompt_ids(item, tok) == [7, 3, 4, 8, 9]


def test_render_matches_draftmesh_run_for_models_without_a_chat_template(word_tok):
    from draftmesh.prompts import encode_messages

    messages = [{"role": "user", "content": "w3"}]
    obj = {"id": "m", "kind": "open", "messages": messages, "max_new_tokens": 8}
    item = parse_workload([json.dumps(obj)])[0]
    assert render_prompt_ids(item, word_tok) == encode_messages(word_tok, messages)


# ---------------------------------------------------------------------- the public set
def _question(item: WorkItem) -> str:
    if item.prompt is not None:
        return item.prompt
    return [m["content"] for m in item.messages if m["role"] == "user"][-1]


def test_public_workload_is_valid_and_covers_every_kind():
    items = load_workload(PUBLIC)
    assert len(items) >= 24
    kinds = {i.kind for i in items}
    assert {"grounded", "rag", "repeat", "open"} <= kinds
    for kind in ("grounded", "rag", "repeat", "open"):
        assert sum(i.kind == kind for i in items) >= 4, kind
    assert all(64 <= i.max_new_tokens <= 128 for i in items)
    assert all(i.corpus for i in items if i.kind == "rag")
    sessions = [i.session for i in items if i.session]
    assert any(sessions.count(s) >= 2 for s in sessions), "some session must hold several items"


def test_long_context_workload_holds_long_prompts_of_mixed_lengths():
    """What docs/bench.md says of it: 16 items, passages of ~400 to ~1600 tokens in four sizes."""
    items = load_workload(LONG)
    assert len(items) == 16 and all(i.kind == "long" and i.max_new_tokens == 48 for i in items)
    sizes = sorted(len(_question(i)) for i in items)
    assert sizes[0] > 500 and sizes[-1] > 5 * sizes[0]  # characters: long, and far from uniform


def test_public_repeats_ask_an_earlier_question_again():
    items = load_workload(PUBLIC)
    same_session = other = 0
    for n, item in enumerate(items):
        if item.kind != "repeat":
            continue
        q = _question(item)
        earlier = [
            e for e in items[:n]
            if e.kind != "repeat" and difflib.SequenceMatcher(None, _question(e), q).ratio() > 0.8
        ]
        assert earlier, f"{item.id}: no earlier item asks the same question"
        if item.session and any(e.session == item.session for e in earlier):
            same_session += 1
        else:
            other += 1
    assert same_session and other  # both kinds of repetition are exercised


def test_items_of_kinds_keeps_the_named_kinds_in_order():
    items = load_workload(PUBLIC)
    grounded = items_of_kinds(items, "grounded")
    assert grounded and all(i.kind == "grounded" for i in grounded)
    assert len(grounded) == sum(i.kind == "grounded" for i in items)
    two = items_of_kinds(items, " rag , grounded,rag")
    assert [i.id for i in two] == [i.id for i in items if i.kind in ("rag", "grounded")]


@pytest.mark.parametrize("kinds, needle", [("nope", "no item of kind nope"), ("grounded,nope", "kind nope"),
                                           (" , ", "(none given)")])
def test_items_of_kinds_names_a_kind_no_item_has(kinds, needle):
    with pytest.raises(ValueError) as err:
        items_of_kinds(load_workload(PUBLIC), kinds)
    assert needle in str(err.value) and "its kinds: grounded, open, rag, repeat" in str(err.value)
