"""The stream contract: entries and annotations survive Redis round trips; bad entries say why."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from draftmesh.factcheck.protocol import (
    MAX_TEXT_CHARS,
    Annotation,
    MalformedEntry,
    SpanEntry,
    StreamNames,
    annotation_id_for_text,
)
from draftmesh.io_struct import Finding

FEB30 = Finding("date", 4, 15, "February 30", "contradicted", label="DATE", rule="impossible_date")


def test_stream_names_share_one_prefix():
    names = StreamNames.from_prefix("dm:fc")
    assert (names.stream, names.group) == ("dm:fc:spans", "dm:fc:workers")
    assert (names.dead_letter, names.errors) == ("dm:fc:dead", "dm:fc:errors")
    assert names.annotation_key("d-1") == "dm:fc:ann:d-1"
    assert names.done_key("d-1") == "dm:fc:done:d-1"
    with pytest.raises(ValueError):
        StreamNames.from_prefix("")


def test_annotation_ids_are_content_hashes_per_kind():
    a = annotation_id_for_text("draft", "Paris is in France.")
    assert a == annotation_id_for_text("draft", "Paris is in France.")  # a draft proposed again reuses it
    assert a.startswith("d-") and len(a) == 34
    assert a != annotation_id_for_text("draft", "Paris is in France!")
    others = {annotation_id_for_text(k, "Paris is in France.") for k in ("output", "query")}
    assert len(others | {a}) == 3 and {i[:2] for i in others} == {"o-", "q-"}
    with pytest.raises(ValueError, match="kind"):
        annotation_id_for_text("essay", "x")


def test_output_ids_are_per_request():
    text = "The output of a request."
    one, two = (annotation_id_for_text("output", text, request_id=r) for r in ("req-1", "req-2"))
    assert one != two and one.startswith("o-")
    assert SpanEntry.for_text("output", text, request_id="req-1").annotation_id == one
    # Drafts stay shared across requests: the request id is metadata only.
    assert SpanEntry.for_text("draft", text, request_id="req-1").annotation_id == annotation_id_for_text("draft", text)


def test_entry_round_trip_through_redis(redis_client):
    stream = f"test:{uuid.uuid4().hex}"
    full = SpanEntry.for_text("draft", "He was born on February 30.", request_id="req-7", start=3, end=11,
                              traceparent="00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")  # fmt: skip
    minimal = SpanEntry.for_text("query", "Ünïcødé – text ✓")
    assert (full.start, full.end) == (3, 11) and (minimal.start, minimal.end) == (0, len(minimal.text))
    assert "traceparent" not in SpanEntry("q-1", "query", "x").to_fields()  # optional fields stay off the wire
    for entry in (full, minimal, SpanEntry("q-1", "query", "x")):
        redis_client.xadd(stream, entry.to_fields())
    decoded = [SpanEntry.from_fields(fields) for _, fields in redis_client.xrange(stream)]
    assert decoded == [full, minimal, SpanEntry("q-1", "query", "x")]
    assert SpanEntry.from_fields(full.to_fields()) == full  # str keys work too
    redis_client.delete(stream)


def test_unknown_fields_are_ignored():
    fields = {**SpanEntry("d-1", "draft", "text").to_fields(), "future_field": "whatever"}
    assert SpanEntry.from_fields(fields) == SpanEntry("d-1", "draft", "text")


GOOD = {b"v": b"1", b"id": b"d-abc", b"kind": b"draft", b"text": b"some text"}


@pytest.mark.parametrize(
    "change, reason, keeps_id",
    [
        ({b"id": None}, "missing field 'id'", False),
        ({b"text": None}, "missing field 'text'", True),
        ({b"v": b"2"}, "unsupported protocol version '2'", True),
        ({b"kind": b"essay"}, "kind must be one of draft, output, query", True),
        ({b"text": b"\xff\xfe"}, "field 'text' is not valid UTF-8", True),
        ({b"text": b"   "}, "text must be a non-blank string", True),
        ({b"text": b"x" * (MAX_TEXT_CHARS + 1)}, "more than", True),
        ({b"id": b"bad id with spaces"}, "invalid annotation id", False),
        ({b"start": b"-3", b"end": b"4"}, "field 'start' is not a non-negative integer", True),
        ({b"start": b"5", b"end": b"4"}, "end (4) is before start (5)", True),
        ({b"start": b"0", b"end": b"10"}, "end (10) is past the text's 9 characters", True),
        ({b"traceparent": b"x" * 600}, "traceparent must be a string of at most", True),
    ],
)
def test_malformed_entries_say_why(change, reason, keeps_id):
    fields = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(MalformedEntry) as info:
        SpanEntry.from_fields(fields)
    assert reason in info.value.reason
    # With a usable id, the worker can still write a "failed" annotation for the waiters.
    assert info.value.annotation_id == ("d-abc" if keeps_id else "")


def test_empty_entry_is_malformed():
    for fields in (None, {}):
        with pytest.raises(MalformedEntry, match="empty entry"):
            SpanEntry.from_fields(fields)


def test_annotation_json_round_trip():
    done = Annotation("d-1", "done", [FEB30, Finding("date", 0, 3, "May", "supported")], "w1", 12.5, traceparent="tp")
    assert isinstance(done.findings, tuple) and done.flagged
    assert Annotation.from_json(done.to_json()) == done
    assert Annotation.from_json(done.to_json().encode()) == done
    failed = Annotation("d-2", "failed", worker="w1", error="max_deliveries: RuntimeError: boom")
    back = Annotation.from_json(failed.to_json())
    assert back == failed and not back.flagged and back.findings == ()
    assert not Annotation("d-3", "done", [Finding("date", 0, 3, "May", "supported")]).flagged


@pytest.mark.parametrize(
    "raw, message",
    [
        ("not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"status": "done"}', "lacks 'annotation_id'"),
        ('{"annotation_id": "d-1", "status": "pending"}', "status must be one of"),
        ('{"annotation_id": "d-1", "status": "done", "findings": [{"check": "date"}]}', "bad annotation"),
        ('{"annotation_id": "d-1", "status": "done", "findings": [{"bogus": 1}]}', "unknown finding fields"),
        ('{"annotation_id": "d-1", "status": "done", "findings": {}}', "findings must be a list"),
    ],
)
def test_bad_annotations_raise_value_error(raw, message):
    with pytest.raises(ValueError, match=message):
        Annotation.from_json(raw)


def test_protocol_and_client_import_nothing_heavy():
    """The verifier imports them on its hot path: redis is the heaviest dependency allowed."""
    code = ("import sys, draftmesh.factcheck.protocol, draftmesh.factcheck.client; "
            "heavy = [m for m in ('torch', 'numpy', 'transformers', 'spacy', 'flair', 'grpc', 'ray') "
            "if m in sys.modules]; "
            "print(','.join(heavy))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == ""
