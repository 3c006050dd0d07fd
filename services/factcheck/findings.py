"""What a fact check says about a span of text: the shared vocabulary of every check.

A ``Mention`` is what NER found (a span and its label); a ``Finding`` is one check's verdict
on one span. Findings travel as JSON through Redis (``to_dict``/``from_dict``) and reach the
client in the ``Generate`` final message, so their fields are plain strings and ints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping

Verdict = Literal["supported", "contradicted", "not_found", "ambiguous", "unverified"]
"""supported: a source agrees; contradicted: a source or rule disagrees (wrong date, type,
figure, impossible date); not_found: no such entity; ambiguous: several entities match;
unverified: nothing applicable to check against (or the lookup failed)."""

FLAGGING: frozenset[str] = frozenset({"contradicted", "not_found"})
"""Verdicts that flag a span: lossy acceptance policies never accept it leniently."""

Check = Literal["wikidata", "date", "numeric"]


@dataclass(frozen=True)
class Mention:
    """A named-entity span found by NER; offsets are character offsets into the checked text.

    Labels use spaCy's OntoNotes names (PERSON, ORG, GPE, LOC, DATE, CARDINAL, ...); backends
    with other tag sets map onto them (flair's PER -> PERSON, MISC -> MISC)."""

    start: int
    end: int
    text: str
    label: str


@dataclass(frozen=True)
class Finding:
    check: str
    """Which check: "wikidata", "date" or "numeric"."""
    start: int
    end: int
    """Character offsets of the span in the checked text."""
    text: str
    verdict: str
    label: str = ""
    """The NER label of the span (PERSON, DATE, ...) or the kind of figure."""
    rule: str = ""
    """What was checked: "exists", "type", "birth_date", a numeric rule's name, ..."""
    entity_id: str = ""
    """The Wikidata id the span was linked to, if any."""
    evidence: str = ""
    """Why, for a human: the claim it was compared with, the rule's range, the parse error."""

    @property
    def flagged(self) -> bool:
        return self.verdict in FLAGGING

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Finding":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"unknown finding fields: {', '.join(sorted(unknown))}")
        return cls(**data)
