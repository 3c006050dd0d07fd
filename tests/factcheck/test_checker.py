"""The combined checker with the real spaCy NER, the calendar and numeric rules and an offline
Wikidata store built from the recorded Douglas Adams entity."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.checker import FactChecker, build_annotator, build_checker
from draftmesh.factcheck.findings import Mention
from draftmesh.factcheck.numeric import load_rules
from draftmesh.factcheck.protocol import SpanEntry

Q42 = Path(__file__).resolve().parents[1] / "fixtures" / "wikidata" / "entity-Q42.json"
TEXT = ("Douglas Adams was born on 11 March 1952. Zorblax Quintavian was born on February 30, 2023. "
        "The Fed raised rates by 30 basis points.")


@pytest.fixture(scope="module")
def config() -> FactCheckConfig:
    return FactCheckConfig(wikidata="offline", wikidata_dump=[str(Q42)])


@pytest.fixture(scope="module")
def checker(config) -> FactChecker:
    return build_checker(config)


def test_all_checks_on_one_text(checker):
    findings = checker.check(TEXT)
    assert all(TEXT[f.start:f.end] == f.text for f in findings)
    assert [f.start for f in findings] == sorted(f.start for f in findings)
    got = {(f.check, f.rule, f.text, f.verdict) for f in findings}
    assert {
        ("wikidata", "exists", "Douglas Adams", "supported"),
        ("wikidata", "birth_date", "11 March 1952", "supported"),
        ("wikidata", "exists", "Zorblax Quintavian", "not_found"),
        ("date", "calendar", "February 30, 2023", "contradicted"),
        ("numeric", "policy_rate_bp_verb", "30", "contradicted"),
    } <= got
    # "Fed" is not in this one-entity store either: an offline store flags what it lacks.
    assert {f.text for f in findings if f.flagged} == {"Zorblax Quintavian", "February 30, 2023", "30", "Fed"}


def test_batched_equals_one_by_one(checker):
    texts = [TEXT, "Nothing to see here.", ""]
    assert checker.check_many(texts) == [checker.check(t) for t in texts]


def test_wikidata_off_skips_entity_checks():
    findings = build_checker(FactCheckConfig()).check(TEXT)
    assert {f.check for f in findings} == {"date", "numeric"}


def test_the_annotator_keeps_findings_overlapping_the_span(config):
    annotate = build_annotator(config)
    start = TEXT.index("Zorblax")
    end = TEXT.index(" The Fed")
    entry = SpanEntry(annotation_id="d-x", kind="draft", text=TEXT, start=start, end=end)
    assert {f.text for f in annotate(entry)} == {"Zorblax Quintavian", "February 30, 2023"}
    whole = SpanEntry(annotation_id="d-y", kind="draft", text=TEXT)
    assert len(annotate(whole)) > 2


class NoDatesNer:
    """A stand-in with a CoNLL tag set (PER/ORG/LOC/MISC): it never tags DATE spans."""

    name = "conll"
    emits_dates = False

    def __call__(self, texts):
        return [[Mention(0, 13, "Angela Merkel", "PERSON")] if t.startswith("Angela Merkel") else [] for t in texts]


def test_a_backend_without_dates_still_gets_the_calendar_check():
    checker = FactChecker(NoDatesNer(), load_rules())
    findings = checker.check("Angela Merkel spoke on April 31, 2021.")
    assert [(f.check, f.text) for f in findings] == [("date", "April 31, 2021")]
