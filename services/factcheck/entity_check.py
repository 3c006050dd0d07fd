"""The Wikidata check: does a named entity exist, is it the kind NER says, do its dates agree?

For one entity mention ``EntityChecker.check`` links the name to Wikidata (an exact label or
alias match) and reports, on the mention's span:

- ``exists``: not_found (no entity has that name), ambiguous (several do, and the NER label
  does not single one out) or supported (one entity: ``entity_id`` and "label — description");
- ``type``: for labels with a confident Wikidata type (PERSON -> human), contradicted when the
  linked entity's P31 (instance of) has none of those types, else supported;
- date rules (``birth_date``, ``death_date``, ``founding_date``, ``dissolution_date``,
  ``publication_date``): a DATE mention in the same sentence, next to a trigger word ("born",
  "died", ...), compared with the entity's claim at the coarser of the two precisions;
- quantity rules (``population``, ``employees``): a CARDINAL/QUANTITY figure next to a trigger
  word, compared with the entity's claimed values within a relative tolerance.

A failing lookup gives one ``unverified`` finding: the check never raises for Wikidata's sake.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Sequence

from draftmesh.factcheck.findings import Mention
from draftmesh.io_struct import Finding

from .dates import parse_date as parse_calendar_date
from .numeric import parse_number
from .wikidata import Entity, EntityLookup, SearchHit, WikidataError, WikidataTime, normalize_name

log = logging.getLogger(__name__)

__all__ = ["DATE_RULES", "LINKABLE_LABELS", "QUANTITY_RULES", "TYPE_SETS", "DateRule", "EntityChecker", "QuantityRule", "parse_date"]

LINKABLE_LABELS: frozenset[str] = frozenset(
    {"PERSON", "ORG", "GPE", "LOC", "NORP", "FAC", "WORK_OF_ART", "EVENT", "PRODUCT", "MISC"}
)
"""NER labels that name things Wikidata has items for; DATE, CARDINAL, MONEY, ... do not."""

TYPE_SETS: dict[str, frozenset[str]] = {
    # human, fictional human: a PERSON span names one of these (Q42's P31 is exactly Q5).
    "PERSON": frozenset({"Q5", "Q15632617"}),
}
"""P31 values a linked entity must have one of, per NER label. Only PERSON is safe with a
flat P31 test: places and organisations sit deep in P279 class trees (Karlsruhe is a "big
city", an "urban district of Baden-Württemberg", ... but not directly "city" or "GPE"), so
a missing type there would be a false contradiction, not a finding."""

DISAMBIGUATION = "Q4167410"  # Wikimedia disambiguation page: a name's index, not an entity


@dataclass(frozen=True)
class DateRule:
    rule: str
    prop: str
    trigger: re.Pattern[str]


DATE_RULES: tuple[DateRule, ...] = (
    DateRule("birth_date", "P569", re.compile(r"\bborn\b", re.I)),
    DateRule("death_date", "P570", re.compile(r"\b(?:died|dies|death)\b", re.I)),
    DateRule("founding_date", "P571", re.compile(r"\b(?:founded|established|formed)\b", re.I)),
    DateRule("dissolution_date", "P576", re.compile(r"\b(?:dissolved|disbanded)\b", re.I)),
    DateRule("publication_date", "P577", re.compile(r"\b(?:released|published)\b", re.I)),
)
"""Trigger words and the property they date. A trigger counts for a DATE mention when at
most ``TRIGGER_GAP_WORDS`` words separate them ("born in Cambridge on 11 March 1952")."""


@dataclass(frozen=True)
class QuantityRule:
    rule: str
    prop: str
    trigger: re.Pattern[str]
    tolerance: float
    """Relative difference still taken as agreement: counts like populations change over
    the years and texts round them ("about 3.6 million")."""


QUANTITY_RULES: tuple[QuantityRule, ...] = (
    QuantityRule("population", "P1082", re.compile(r"\b(?:population|inhabitants|residents)\b", re.I), 0.15),
    QuantityRule("employees", "P1128", re.compile(r"\b(?:employees|employs|staff|workforce)\b", re.I), 0.25),
)
"""Counts compared with a claim: a CARDINAL or QUANTITY mention next to the trigger, about the
entity the sentence is about, against any of the entity's values of the property."""

QUANTITY_LABELS = frozenset({"CARDINAL", "QUANTITY"})

TRIGGER_GAP_WORDS = 5

_SENTENCE_END = re.compile(r"[.!?]+(?=\s|$)")
_WORD = re.compile(r"\w+")


def parse_date(text: str) -> tuple[int, int, int, int] | None:
    """(year, month, day, precision) a date text states, or None if it states no year.

    Precision uses Wikidata's scale: 11 day, 10 month, 9 year. The reading is the calendar
    check's (``dates.parse_date``: strict shapes, never fuzzy), so both checks agree on what
    a DATE span says; ambiguous all-numeric dates ("03/11/1952") give None."""
    found = parse_calendar_date(" ".join(text.split()))
    if found is None or found.year is None:
        return None
    if found.month is None:
        return found.year, 0, 0, 9
    if found.day is None:
        return found.year, found.month, 0, 10
    return found.year, found.month, found.day, 11


def _matches(claim: WikidataTime, year: int, month: int, day: int, precision: int) -> bool | None:
    """Whether the claim agrees with the text's date at the coarser precision (None: can't say)."""
    claim_precision = claim.precision
    if claim.is_julian:
        # A Julian-calendar day differs from the Gregorian one the text likely means
        claim_precision = min(claim_precision, 9)
    p = min(precision, claim_precision)
    if p < 9:
        return None
    if claim.year != year:
        return False
    if p >= 10 and claim.month and claim.month != month:
        return False
    if p >= 11 and claim.day and claim.day != day:
        return False
    return True


def _sentence_bounds(text: str, pos: int) -> tuple[int, int]:
    start = 0
    for m in _SENTENCE_END.finditer(text):
        if m.end() > pos:
            return start, m.end()
        start = m.end()
    return start, len(text)


def _query_name(text: str) -> str:
    """The name to look up: "the" and a possessive "'s" are not part of it."""
    name = " ".join(text.split())
    name = re.sub(r"^the\s+", "", name, flags=re.I)
    return re.sub(r"['’]s$", "", name)


class EntityChecker:
    """Checks entity mentions against Wikidata through an ``EntityLookup`` (live or offline)."""

    def __init__(self, lookup: EntityLookup, language: str = "en") -> None:
        if not isinstance(lookup, EntityLookup):
            raise ValueError(f"lookup must have search() and get() (an EntityLookup), got {type(lookup).__name__}")
        languages = getattr(lookup, "languages", None)
        if languages is not None and language not in languages:
            raise ValueError(f"language {language!r} is not in the lookup's languages {tuple(languages)}")
        self.lookup = lookup
        self.language = language

    def check(self, text: str, mention: Mention, mentions: Sequence[Mention] = ()) -> list[Finding]:
        """Findings (check="wikidata") on ``mention``'s span; ``mentions`` are all the
        mentions of ``text`` (the DATE ones feed the date rules). [] for labels not linked."""
        if mention.label not in LINKABLE_LABELS:
            return []
        name = _query_name(mention.text)
        if not name:
            return []
        try:
            return self._check(text, mention, mentions, name)
        except WikidataError as exc:
            return [self._finding(mention, "unverified", "exists", evidence=f"Wikidata lookup failed: {exc}")]

    def _finding(self, mention: Mention, verdict: str, rule: str, entity_id: str = "", evidence: str = "") -> Finding:
        return Finding(
            check="wikidata",
            start=mention.start,
            end=mention.end,
            text=mention.text,
            verdict=verdict,
            label=mention.label,
            rule=rule,
            entity_id=entity_id,
            evidence=evidence,
        )

    def _check(self, text: str, mention: Mention, mentions: Sequence[Mention], name: str) -> list[Finding]:
        wanted = normalize_name(name)
        hits: list[SearchHit] = []
        for hit in self.lookup.search(name, self.language):
            # the API searches by prefix: "Douglas" finds "Douglas Adams"; only exact names count
            if normalize_name(hit.match_text or hit.label) == wanted and all(h.id != hit.id for h in hits):
                hits.append(hit)
        if not hits:
            return [self._finding(mention, "not_found", "exists", evidence=f"no Wikidata entity is named {name!r}")]

        entities = self.lookup.get([h.id for h in hits], self.language)
        types = TYPE_SETS.get(mention.label)
        candidates = [h for h in hits if DISAMBIGUATION not in _types(entities.get(h.id))] or hits
        if len(candidates) > 1 and types:
            typed = [h for h in candidates if _types(entities.get(h.id)) & types]
            if len(typed) == 1:
                candidates = typed
        if len(candidates) > 1:
            ids = ", ".join(h.id for h in candidates[:3]) + (", ..." if len(candidates) > 3 else "")
            return [self._finding(mention, "ambiguous", "exists", evidence=f"{len(candidates)} entities named {name!r}: {ids}")]
        if DISAMBIGUATION in _types(entities.get(candidates[0].id)):
            evidence = f"{name!r} only names a disambiguation page: {candidates[0].id}"
            return [self._finding(mention, "ambiguous", "exists", evidence=evidence)]

        hit = candidates[0]
        entity = entities.get(hit.id)
        entity_id = entity.id if entity is not None else hit.id  # a redirect resolves to its target
        label = (entity.label(self.language) if entity else "") or hit.label or entity_id
        description = (entity.description(self.language) if entity else "") or hit.description
        findings = [
            self._finding(mention, "supported", "exists", entity_id, f"{label} — {description}" if description else label)
        ]
        if entity is None:  # found by search but gone when fetched (deleted meanwhile)
            return findings
        if types:
            p31 = entity.instance_of()
            shown = ", ".join(sorted(p31)) or "none"
            if p31 & types:
                findings.append(self._finding(mention, "supported", "type", entity_id, f"P31 = {shown}"))
            else:
                expected = ", ".join(sorted(types))
                findings.append(
                    self._finding(mention, "contradicted", "type", entity_id, f"P31 = {shown}; a {mention.label} is one of {expected}")
                )
        findings.extend(self._date_findings(text, mention, mentions, entity))
        findings.extend(self._quantity_findings(text, mention, mentions, entity))
        return findings

    def _quantity_findings(self, text: str, mention: Mention, mentions: Sequence[Mention], entity: Entity) -> list[Finding]:
        lo, hi = _sentence_bounds(text, mention.start)
        in_sentence = [m for m in mentions if lo <= m.start and m.end <= hi]
        figures = [m for m in in_sentence if m.label in QUANTITY_LABELS]
        if not figures:
            return []
        entities = [m for m in in_sentence if m.label in LINKABLE_LABELS]
        if all((m.start, m.end) != (mention.start, mention.end) for m in entities):
            entities.append(mention)
        findings = []
        for figure in figures:
            found = self._trigger_near(text[lo:hi], lo, figure, QUANTITY_RULES)
            if found is None:
                continue
            rule, t_start, t_end = found
            subject = _subject(entities, t_start, max(t_end, figure.end), figure)
            if subject is None or (subject.start, subject.end) != (mention.start, mention.end):
                continue
            value = parse_number(figure.text)
            if value is None:
                continue
            findings.append(self._compare_quantity(entity, rule, figure, value))
        return findings

    def _compare_quantity(self, entity: Entity, rule: QuantityRule, figure: Mention, value: Decimal) -> Finding:
        """A finding on the figure: within the rule's tolerance of any claimed value, or not."""
        claims = [amount for amount, _unit in entity.quantities(rule.prop)]
        if not claims:
            return self._finding(figure, "unverified", rule.rule, entity.id, f"{entity.id} has no {rule.prop} claim (text: {value})")
        close = [c for c in claims if abs(value - c) <= Decimal(str(rule.tolerance)) * abs(c)]
        if close:
            return self._finding(figure, "supported", rule.rule, entity.id, f"{rule.prop} = {close[0]:,} (text: {value:,})")
        shown = ", ".join(f"{c:,}" for c in sorted(claims, reverse=True)[:3])
        return self._finding(figure, "contradicted", rule.rule, entity.id,
                             f"{rule.prop} = {shown}; text says {value:,} (more than {rule.tolerance:.0%} off)")

    def _date_findings(self, text: str, mention: Mention, mentions: Sequence[Mention], entity: Entity) -> list[Finding]:
        lo, hi = _sentence_bounds(text, mention.start)
        in_sentence = [m for m in mentions if lo <= m.start and m.end <= hi]
        dates = [m for m in in_sentence if m.label == "DATE"]
        if not dates:
            return []
        entities = [m for m in in_sentence if m.label in LINKABLE_LABELS]
        if all((m.start, m.end) != (mention.start, mention.end) for m in entities):
            entities.append(mention)
        sentence = text[lo:hi]
        findings = []
        for date in dates:
            found = self._trigger_near(sentence, lo, date)
            if found is None:
                continue
            rule, t_start, t_end = found
            subject = _subject(entities, t_start, max(t_end, date.end), date)
            if subject is None or (subject.start, subject.end) != (mention.start, mention.end):
                continue  # the date is about another entity of the sentence
            parsed = parse_date(date.text)
            if parsed is None:
                continue  # impossible or vague dates are the date check's business
            findings.append(self._compare_date(mention, entity, rule, date, parsed))
        return findings

    @staticmethod
    def _trigger_near(sentence: str, offset: int, span: Mention, rules: Sequence = DATE_RULES) -> tuple[Any, int, int] | None:
        """The trigger word nearest to ``span`` within TRIGGER_GAP_WORDS words (absolute offsets)."""
        best: tuple[int, DateRule, int, int] | None = None
        for rule in rules:
            for m in rule.trigger.finditer(sentence):
                start, end = m.start() + offset, m.end() + offset
                if end <= span.start:
                    gap = sentence[end - offset : span.start - offset]
                elif start >= span.end:
                    gap = sentence[span.end - offset : start - offset]
                else:
                    continue  # inside the date span itself
                words = len(_WORD.findall(gap))
                if words <= TRIGGER_GAP_WORDS and (best is None or words < best[0]):
                    best = (words, rule, start, end)
        return None if best is None else best[1:]

    def _compare_date(
        self, mention: Mention, entity: Entity, rule: DateRule, date: Mention, parsed: tuple[int, int, int, int]
    ) -> Finding:
        """A finding on the DATE span (what a wrong claim gets wrong), linked to the entity."""
        year, month, day, precision = parsed
        claims = entity.times(rule.prop)
        stated = WikidataTime(year, month, day, precision)
        if not claims:
            return self._finding(
                date, "unverified", rule.rule, entity.id, f"{entity.id} has no {rule.prop} claim (text: {date.text} = {stated})"
            )
        verdicts = [(_matches(c, year, month, day, precision), c) for c in claims]
        agreeing = [c for v, c in verdicts if v]
        if agreeing:
            return self._finding(date, "supported", rule.rule, entity.id, f"{rule.prop} = {agreeing[0]}")
        comparable = [c for v, c in verdicts if v is False]
        if not comparable:
            shown = ", ".join(str(c) for c in claims[:3])
            return self._finding(date, "unverified", rule.rule, entity.id, f"{rule.prop} = {shown} is too coarse to compare with {stated}")
        shown = ", ".join(str(c) for c in comparable[:3])
        return self._finding(date, "contradicted", rule.rule, entity.id, f"{rule.prop} = {shown}; text says {stated}")


def _types(entity: Entity | None) -> frozenset[str]:
    return entity.instance_of() if entity is not None else frozenset()


def _subject(entities: list[Mention], trigger_start: int, after: int, span: Mention) -> Mention | None:
    """Whom a trigger is about: the nearest entity mention before it, else the first after
    both the trigger and the span ("Born in 1952, Douglas Adams ...")."""
    before = [m for m in entities if m.end <= trigger_start and not (m.start < span.end and span.start < m.end)]
    if before:
        return max(before, key=lambda m: m.end)
    later = [m for m in entities if m.start >= after]
    return min(later, key=lambda m: m.start) if later else None
