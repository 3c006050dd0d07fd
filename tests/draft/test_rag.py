"""RagSource: corpus chunking, BM25 retrieval once per request, REST-style continuation drafts."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest

from draftmesh.draft.base import DraftContext, DraftSource
from draftmesh.draft.rag import RagSource, corpus_files

DOCS = {
    "redis.md": (
        "# Persistence\n\nRedis offers two persistence options. RDB snapshots write a compact point-in-time "
        "copy of the dataset to disk at configured intervals, while the append-only file logs every write "
        "operation and replays it at startup. AOF gives better durability; RDB restarts faster.\n"
    ),
    "db/postgres.txt": (
        "PostgreSQL uses multi-version concurrency control, so updated and deleted rows leave dead tuples "
        "behind. VACUUM reclaims that space and updates the visibility map, and autovacuum runs it in the "
        "background based on thresholds such as autovacuum_vacuum_scale_factor.\n"
    ),
    "db/notes/gil.md": (
        "The global interpreter lock in CPython allows only one thread to execute Python bytecode at a time. "
        "CPU-bound programs gain little from threads and usually use multiprocessing instead.\n"
    ),
    "garden.txt": (
        "To grow tomatoes, plant seedlings after the last frost in a sunny spot, water deeply twice a week, "
        "and stake the stems once the first flowers appear.\n"
    ),
    "ignored.json": '{"not": "a corpus file"}',
}


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    for name, text in DOCS.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def ctx(prompt, generated=(), **kwargs) -> DraftContext:
    return DraftContext(token_ids=tuple(prompt) + tuple(generated), prompt_len=len(prompt), **kwargs)


def contains(haystack: list[int], needle: list[int]) -> bool:
    return any(haystack[i : i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def find(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i : i + len(needle)] == needle:
            return i
    raise AssertionError("tokens not found: the fragment tokenizes differently in context")


def test_corpus_files_walks_folders_and_keeps_text_and_markdown(corpus):
    assert corpus_files([corpus]) == sorted(corpus / n for n in DOCS if not n.endswith(".json"))
    assert corpus_files([corpus / "garden.txt"]) == [corpus / "garden.txt"]
    with pytest.raises(FileNotFoundError):
        corpus_files([corpus / "missing"])


def test_documents_are_chunked_into_overlapping_windows(smol_tokenizer, encode, corpus):
    source = RagSource(smol_tokenizer, [corpus / "redis.md"], chunk_tokens=24, overlap=8)
    doc = encode(DOCS["redis.md"])
    chunks = [source.passage_ids(i) for i in range(len(source))]
    assert len(chunks) == len(range(0, len(doc) - 8, 16)) > 2
    assert all(len(c) == 24 for c in chunks[:-1])
    assert all(a[-8:] == b[:8] for a, b in pairwise(chunks))
    assert [t for c in chunks[:-1] for t in c[:16]] + chunks[-1] == doc


def test_retrieves_the_relevant_passage(smol_tokenizer, corpus):
    source = RagSource(smol_tokenizer, [corpus], chunk_tokens=48, overlap=8, top_k=2)
    best = source.retrieve("How does Redis save data to disk so it survives a restart?")[0]
    assert "snapshots" in smol_tokenizer.decode(source.passage_ids(best))
    best = source.retrieve("Why are dead rows piling up in my Postgres tables?")[0]
    assert "VACUUM" in smol_tokenizer.decode(source.passage_ids(best))
    assert source.retrieve("quantum chromodynamics") == []


def test_proposes_the_continuation_from_the_retrieved_passage(smol_tokenizer, encode, corpus):
    source = RagSource(smol_tokenizer, [corpus], chunk_tokens=48, overlap=8, top_k=1, max_tokens=6)
    assert isinstance(source, DraftSource) and source.name == "rag"
    doc = encode(DOCS["redis.md"])
    generated = encode(" RDB snapshots write a")
    at = find(doc, generated) + len(generated)
    prompt = encode(
        "<|im_start|>user\nHow does Redis persist data to disk?<|im_end|>\n<|im_start|>assistant\n"
    )
    proposals = source.propose(ctx(prompt, generated, request_id="r"))
    assert proposals[0].source == "rag"
    assert proposals[0].token_ids == tuple(doc[at : at + 6])


def test_retrieval_happens_once_per_request(smol_tokenizer, encode, corpus):
    source = RagSource(smol_tokenizer, [corpus])
    calls = []
    retrieve = source.retrieve
    source.retrieve = lambda query: calls.append(query) or retrieve(query)
    prompt = encode("How do I stop dead tuples from bloating PostgreSQL?")
    generated = encode(" VACUUM reclaims that space and")
    for step in range(1, len(generated)):
        source.propose(ctx(prompt, generated[:step], request_id="one"))
    source.propose(ctx(prompt, generated, request_id="two"))
    assert len(calls) == 2


def test_request_documents_are_searched_and_branches_weighted_by_count(smol_tokenizer, encode):
    source = RagSource(smol_tokenizer, max_tokens=3)  # no corpus at all
    document = (
        "Deploy checklist. Set the timeout to 30 seconds for the API. Set the timeout to 30 seconds for "
        "the worker. Set the timeout to 90 seconds for the batch job."
    )
    generated = encode(" Set the timeout to")
    proposals = source.propose(ctx(encode("Summarise it for me."), generated, documents=[document]))
    thirty, ninety = encode(" 30 seconds for")[:3], encode(" 90 seconds for")[:3]
    assert thirty != ninety
    assert [p.token_ids for p in proposals] == [tuple(thirty), tuple(ninety)]
    assert proposals[0].confidence == pytest.approx(2 * proposals[1].confidence)


def test_overlapping_retrieved_passages_are_not_counted_twice(smol_tokenizer, encode, tmp_path):
    (tmp_path / "a.txt").write_text(
        "Alpha beta gamma delta. The secret word is kiwi, said the parrot to everyone."
    )
    (tmp_path / "b.txt").write_text("Another note. The secret word is lemon.")
    source = RagSource(smol_tokenizer, [tmp_path], chunk_tokens=12, overlap=8, top_k=10, max_tokens=2)
    doc = encode((tmp_path / "a.txt").read_text())
    phrase = encode(" The secret word is")
    start = find(doc, phrase)
    assert sum(contains(source.passage_ids(i), phrase) for i in range(len(source))) > 1  # in the overlap
    proposals = source.propose(ctx(encode("What is the secret word?"), phrase))
    assert sorted(p.token_ids[0] for p in proposals) == sorted(
        [doc[start + len(phrase)], encode(" lemon")[0]]
    )
    assert proposals[0].confidence == pytest.approx(proposals[1].confidence)
