"""What NER found in a text: ``Mention``s, the input of every check.

A check's verdict on a span is a ``Finding`` (``draftmesh.io_struct``): it crosses every
boundary (worker, Redis, verifier, router, client), so it is defined with the other messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
