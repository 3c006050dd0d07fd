"""EntityChecker on the offline store built from the recorded entities (hand-built mentions,
no NER model): existence, type and date rules, and what a failing lookup gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from draftmesh.factcheck.entity_check import EntityChecker, parse_date
from draftmesh.factcheck.findings import Mention
from draftmesh.factcheck.wikidata import (
    OfflineEntityStore,
    SearchHit,
    WikidataClient,
    WikidataError,
    WikidataUnavailable,
)
from draftmesh.io_struct import Finding
from draftmesh.net import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wikidata"


@pytest.fixture(scope="module")
def store() -> OfflineEntityStore:
    # Douglas Adams (a dump entity) and Karlsruhe (a saved wbgetentities answer, a redirect)
    return OfflineEntityStore.from_dump([FIXTURES / "entity-Q42.json", FIXTURES / "wbgetentities-Q32063953.json"])


@pytest.fixture(scope="module")
def checker(store) -> EntityChecker:
    return EntityChecker(store)


def mention(text: str, span: str, label: str, nth: int = 0) -> Mention:
    start = -1
    for _ in range(nth + 1):
        start = text.index(span, start + 1)
    return Mention(start, start + len(span), span, label)


def by_rule(findings: list[Finding]) -> dict[str, Finding]:
    rules = [f.rule for f in findings]
    assert len(rules) == len(set(rules)), rules
    return {f.rule: f for f in findings}


def check(checker: EntityChecker, text: str, entity: str, label: str = "PERSON", dates: tuple[str, ...] = (), others=()):
    subject = mention(text, entity, label)
    mentions = [subject, *(mention(text, d, "DATE") for d in dates), *(mention(text, s, lab) for s, lab in others)]
    findings = checker.check(text, subject, mentions)
    for f in findings:
        # Entity rules sit on the entity's span; date rules on the date they compare.
        dates_at = [m for m in mentions if m.label == "DATE" and (m.start, m.end) == (f.start, f.end)]
        span = subject if f.rule in ("exists", "type") else dates_at[0]
        assert (f.check, f.start, f.end, f.text, f.label) == ("wikidata", span.start, span.end, span.text, span.label)
    return by_rule(findings)


def test_birth_date_supported(checker):
    found = check(checker, "Douglas Adams was born on 11 March 1952.", "Douglas Adams", dates=("11 March 1952",))
    assert set(found) == {"exists", "type", "birth_date"}
    assert found["exists"].verdict == "supported" and found["exists"].entity_id == "Q42"
    assert found["exists"].evidence == "Douglas Adams — author and humorist"
    assert found["type"].verdict == "supported" and found["type"].evidence == "P31 = Q5"
    assert found["birth_date"].verdict == "supported" and found["birth_date"].evidence == "P569 = 1952-03-11"
    assert not any(f.flagged for f in found.values())


def test_birth_date_contradicted(checker):
    found = check(checker, "Douglas Adams was born on 11 March 1953.", "Douglas Adams", dates=("11 March 1953",))
    assert found["exists"].verdict == "supported" and found["type"].verdict == "supported"
    birth = found["birth_date"]
    assert birth.verdict == "contradicted" and birth.flagged and birth.entity_id == "Q42"
    assert birth.evidence == "P569 = 1952-03-11; text says 1953-03-11"


@pytest.mark.parametrize(
    "text, date, rule, verdict",
    [
        ("Douglas Adams was born in 1952 in Cambridge.", "1952", "birth_date", "supported"),
        ("Douglas Adams was born in March 1953.", "March 1953", "birth_date", "contradicted"),
        ("Douglas Adams was born in April 1952.", "April 1952", "birth_date", "contradicted"),
        ("Born on March 11, 1952, Douglas Adams became a writer.", "March 11, 1952", "birth_date", "supported"),
        ("Douglas Adams died on 11 May 2001 in Santa Barbara.", "11 May 2001", "death_date", "supported"),
        ("Douglas Adams, who was born in Cambridge in 1952, died in 2002.", "2002", "death_date", "contradicted"),
    ],
)
def test_date_rules_at_the_text_precision(checker, text, date, rule, verdict):
    found = check(checker, text, "Douglas Adams", dates=(date,))
    assert found[rule].verdict == verdict


def test_dates_without_trigger_or_elsewhere_are_not_compared(checker):
    # another sentence
    found = check(checker, "Douglas Adams wrote books. He was born on 11 March 1953.", "Douglas Adams", dates=("11 March 1953",))
    assert set(found) == {"exists", "type"}
    # no trigger word near the date
    found = check(checker, "Douglas Adams wrote a radio series in 1978.", "Douglas Adams", dates=("1978",))
    assert set(found) == {"exists", "type"}
    # the date is about another entity of the sentence
    text = "Douglas Adams met Oliver Kahn, who was born on 15 June 1969."
    found = check(checker, text, "Douglas Adams", dates=("15 June 1969",), others=(("Oliver Kahn", "PERSON"),))
    assert set(found) == {"exists", "type"}
    # a date the parser cannot place (the date check reports those)
    found = check(checker, "Douglas Adams was born in the early fifties.", "Douglas Adams", dates=("the early fifties",))
    assert set(found) == {"exists", "type"}


def test_no_claim_for_a_triggered_rule_is_unverified(checker):
    found = check(checker, "Karlsruhe was founded in 1715.", "Karlsruhe", label="GPE", dates=("1715",))
    # the recorded Karlsruhe has no P571 (inception) claim
    assert found["founding_date"].verdict == "unverified"
    assert found["founding_date"].evidence.startswith("Q1040 has no P571 claim")


def test_unknown_name_is_not_found(checker):
    found = check(checker, "Zaphod Beeblebrox was born in 1952.", "Zaphod Beeblebrox", dates=("1952",))
    assert list(found) == ["exists"]
    assert found["exists"].verdict == "not_found" and found["exists"].flagged


def test_type_rule(checker):
    # Karlsruhe exists, but no PERSON: its P31 (city, municipality, ...) has no human
    found = check(checker, "Karlsruhe wrote a novel.", "Karlsruhe", label="PERSON")
    assert found["exists"].verdict == "supported" and found["exists"].entity_id == "Q1040"
    assert found["type"].verdict == "contradicted" and "Q5" in found["type"].evidence
    # GPE has no confident type set: no type finding
    assert set(check(checker, "Karlsruhe is in Germany.", "Karlsruhe", label="GPE")) == {"exists"}


def test_labels_not_linked_are_skipped(checker):
    text = "Douglas Adams was born on 11 March 1952."
    assert checker.check(text, mention(text, "11 March 1952", "DATE")) == []
    assert checker.check(text, Mention(0, 13, "Douglas Adams", "CARDINAL")) == []


class RecordedAbcSearch:
    """The recorded wbsearchentities answer for "ABC" (seven entities named ABC); get finds none."""

    def search(self, name, language="en", limit=7):
        hits = json.loads((FIXTURES / "wbsearchentities-abc.json").read_text(encoding="utf-8"))["search"]
        return [SearchHit(h["id"], h["label"], h["description"], h["match"]["text"]) for h in hits][:limit]

    def get(self, ids, language="en"):
        return {i: None for i in ids}


def test_ambiguous_name():
    text = "ABC reported it first."
    found = check(EntityChecker(RecordedAbcSearch()), text, "ABC", label="ORG")
    assert list(found) == ["exists"]
    assert found["exists"].verdict == "ambiguous" and not found["exists"].flagged
    assert found["exists"].evidence == "7 entities named 'ABC': Q169889, Q286874, Q781365, ..."


def test_the_ner_type_picks_one_of_several_entities(tmp_path):
    # hand-made entities: the recorded data has no name shared by a human and a non-human
    def entity(eid, description, p31):
        return {
            "type": "item",
            "id": eid,
            "labels": {"en": {"language": "en", "value": "John Smith"}},
            "descriptions": {"en": {"language": "en", "value": description}},
            "claims": {
                "P31": [
                    {
                        "mainsnak": {
                            "snaktype": "value",
                            "property": "P31",
                            "datavalue": {"type": "wikibase-entityid", "value": {"entity-type": "item", "id": p31}},
                        },
                        "rank": "normal",
                    }
                ]
            },
        }

    dump = tmp_path / "smiths.jsonl"
    rows = [entity("Q900001", "a ship", "Q11446"), entity("Q900002", "an explorer", "Q5"), entity("Q900003", "", "Q4167410")]
    dump.write_text("\n".join(json.dumps(e) for e in rows))
    checker = EntityChecker(OfflineEntityStore.from_dump([dump]))
    text = "John Smith sailed to Virginia."
    person = check(checker, text, "John Smith", label="PERSON")
    assert person["exists"].verdict == "supported" and person["exists"].entity_id == "Q900002"
    assert person["type"].verdict == "supported"
    # no type set for ORG: two candidates (the disambiguation page does not count)
    org = check(checker, text, "John Smith", label="ORG")
    assert org["exists"].verdict == "ambiguous" and org["exists"].evidence.endswith("Q900001, Q900002")


class FailingLookup:
    def __init__(self, error: Exception, where: str) -> None:
        self.error, self.where = error, where

    def search(self, name, language="en", limit=7):
        if self.where == "search":
            raise self.error
        return [SearchHit("Q42", "Douglas Adams", "", "Douglas Adams")]

    def get(self, ids, language="en"):
        raise self.error


@pytest.mark.parametrize(
    "error, where",
    [(WikidataUnavailable("unavailable", "HTTP 503 (after 4 tries)"), "search"), (WikidataError("badtoken", "bla bla"), "get")],
)
def test_lookup_failure_is_one_unverified_finding(error, where):
    text = "Douglas Adams was born on 11 March 1952."
    found = check(EntityChecker(FailingLookup(error, where)), text, "Douglas Adams", dates=("11 March 1952",))
    assert list(found) == ["exists"]
    assert found["exists"].verdict == "unverified" and str(error) in found["exists"].evidence


def test_unreachable_api_is_unverified():
    client = WikidataClient(f"http://127.0.0.1:{free_port()}/w/api.php", user_agent="draftmesh-tests/1.0", retries=1, backoff_s=0.01)
    text = "Douglas Adams was born on 11 March 1952."
    found = check(EntityChecker(client), text, "Douglas Adams")
    assert found["exists"].verdict == "unverified" and "after 2 tries" in found["exists"].evidence


def test_checker_refuses_a_language_the_store_lacks(store):
    with pytest.raises(ValueError, match="language 'de'"):
        EntityChecker(store, language="de")
    with pytest.raises(ValueError, match="EntityLookup"):
        EntityChecker(object())


@pytest.mark.parametrize(
    "text, parsed",
    [
        ("11 March 1952", (1952, 3, 11, 11)),
        ("March 11, 1952", (1952, 3, 11, 11)),
        ("1952-03-11", (1952, 3, 11, 11)),
        ("March 1952", (1952, 3, 0, 10)),
        ("1952", (1952, 0, 0, 9)),
        ("03/11/1952", None),  # day and month could be either way round: the calendar check claims nothing
        ("11 March", None),  # no year
        ("the 1950s", None),
        ("yesterday", None),
    ],
)
def test_parse_date_detects_the_precision(text, parsed):
    assert parse_date(text) == parsed


def quantity_check(checker, text: str, figure: str):
    subject = mention(text, "Karlsruhe", "GPE")
    fig = mention(text, figure, "CARDINAL")
    findings = checker.check(text, subject, [subject, fig])
    return {f.rule: f for f in findings}, fig


@pytest.mark.parametrize(
    "text, figure, verdict",
    [
        ("Karlsruhe has a population of 300,000.", "300,000", "supported"),  # claimed: 291,959 to 300,711 and more
        ("Karlsruhe has a population of about 0.3 million.", "0.3 million", "supported"),
        ("Karlsruhe has a population of 3 million.", "3 million", "contradicted"),
        ("Karlsruhe, with 45,000 inhabitants, lies on the Rhine.", "45,000", "contradicted"),
    ],
)
def test_population_is_compared_with_the_claims_on_the_figure(checker, text, figure, verdict):
    found, fig = quantity_check(checker, text, figure)
    population = found["population"]
    assert population.verdict == verdict, population
    assert (population.start, population.end, population.text) == (fig.start, fig.end, fig.text)
    assert population.entity_id == found["exists"].entity_id and "P1082" in population.evidence


def test_a_figure_without_a_trigger_or_a_claim_is_not_compared(checker):
    found, _ = quantity_check(checker, "Karlsruhe has 300,000 trees.", "300,000")
    assert "population" not in found
    found, _ = quantity_check(checker, "Karlsruhe has 2,000 employees.", "2,000")
    assert found["employees"].verdict == "unverified"  # the recorded Karlsruhe has no P1128
