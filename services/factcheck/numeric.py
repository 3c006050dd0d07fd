"""The numeric check: figures whose wording fixes their kind, checked against plausible values.

A rule is a regex that finds one kind of figure by its context ("raised rates by N basis
points", "N% of respondents", "aged N") and what values that kind can take: a range, a set
of values, multiples of a step. A figure outside is "contradicted"; one inside is only
"unverified" (plausible is not proven), but the finding still tells a reader that the figure
was recognised and what it was held to. Rules are narrow on purpose: a pattern that fires on
unrelated numbers (an oven's 200 °C, a 300-year-old tree) mislabels correct answers.

Values are read as digits with thousands separators and decimals ("1,250", "0.25", "-5",
"minus 40"), or as English number words up to 999 ("fifty", "twenty-five", "a hundred and
ten"), either optionally followed by a scale word ("1.5 million"). Arithmetic is Decimal, so a
step of 0.25 is exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import yaml

from draftmesh.io_struct import Finding

__all__ = ["DEFAULT_RULES", "MACROS", "NumericRule", "parse_number", "load_rules", "check_numbers"]

DEFAULT_RULES = "numeric_rules.yaml"

_UNITS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
}  # fmt: skip
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_SCALES = {"thousand": 10**3, "million": 10**6, "billion": 10**9, "trillion": 10**12}


def _alt(words: Iterable[str]) -> str:
    return "|".join(sorted(words, key=len, reverse=True))


_BELOW_100 = rf"(?:(?:{_alt(_TENS)})(?:[\s-](?:{_alt(w for w in _UNITS if 0 < _UNITS[w] < 10)}))?|(?:{_alt(_UNITS)}))"
_WORDS = rf"\b(?:(?:a|an|{_alt(w for w in _UNITS if 0 < _UNITS[w] < 10)})\s+hundred(?:\s+(?:and\s+)?{_BELOW_100})?|{_BELOW_100})\b"
_NO_GLUE = r"(?<![\w.,\-−–/])"  # not the tail of 1.5, 1,000, 20-25, 3/4 or a word
_INT = rf"{_NO_GLUE}(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?!\d|[.,]\d)"
_DECIMAL = rf"{_NO_GLUE}(?:minus\s+|[-+−–])?(?:\d{{1,3}}(?:,\d{{3}})+|\d+)(?:\.\d+)?(?!\d|[.,]\d)"

MACROS: dict[str, str] = {
    "int": _INT,
    "decimal": _DECIMAL,
    "words": rf"(?:\bminus\s+)?{_WORDS}",
    "number": rf"(?:{_DECIMAL}|(?:\bminus\s+)?{_WORDS})(?:\s+(?:{_alt(_SCALES)})\b)?",
}
"""Placeholders a rule's pattern may use: {int} (unsigned digits, "1,250"), {decimal}
(signed, "-0.25", "minus 40"), {words} ("twenty-five"), {number} (either, with an optional
scale word: "1.5 million", "fifty"). Each refuses to start inside a longer number or word."""


def _expand(pattern: str) -> str:
    for name, regex in MACROS.items():
        pattern = pattern.replace("{" + name + "}", regex)
    return pattern


def parse_number(text: str) -> Decimal | None:
    """The value of a figure as the macros match it ("1,250", "-0.25", "minus 40", "fifty",
    "a hundred and ten", "1.5 million"); None when it is not one."""
    words = text.strip().lower().replace("−", "-").replace("–", "-")
    sign = 1
    if words.startswith("minus "):
        sign, words = -1, words[6:].lstrip()
    elif words[:1] and words[:1] in "+-":
        sign, words = (-1 if words[0] == "-" else 1), words[1:]
    scale = 1
    head, _, last = words.rpartition(" ")
    if last in _SCALES and head:
        scale, words = _SCALES[last], head.rstrip()
    if re.fullmatch(r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", words):
        try:
            return sign * Decimal(words.replace(",", "")) * scale
        except InvalidOperation:  # pragma: no cover - the regex admits only numbers
            return None
    value = _words_value(words)
    return None if value is None else sign * Decimal(value) * scale


def _words_value(words: str) -> int | None:
    total, seen = 0, False
    for token in re.split(r"[\s-]+", words):
        if token in _UNITS or token in _TENS:
            total += _UNITS.get(token, 0) + _TENS.get(token, 0)
        elif token in ("a", "an"):
            total += 1
        elif token == "hundred":
            total = max(total, 1) * 100
        elif token == "and" and seen:
            continue
        else:
            return None
        seen = True
    return total if seen else None


def _fmt(value: Decimal | float | int) -> str:
    d = value if isinstance(value, Decimal) else Decimal(str(value))
    text = format(d.normalize(), "f")
    return text if text != "-0" else "0"


def _dec(value: float | int) -> Decimal:
    return Decimal(str(value))


@dataclass(frozen=True)
class NumericRule:
    """One kind of figure: where it is (``pattern``, with a ``value`` group) and what it may be.

    A figure passes when it lies within [min, max] (either bound optional) and, when ``step``
    or ``allowed`` is given, is ``offset`` plus a multiple of ``step`` or one of ``allowed``
    (``allowed`` lists the exceptions a step would reject). ``pattern`` may be a string (with
    MACROS; compiled case-insensitive) or a compiled regex (recompiled case-insensitive)."""

    name: str
    pattern: re.Pattern[str]
    description: str = ""
    min: float | None = None
    max: float | None = None
    allowed: frozenset[float] = field(default_factory=frozenset)
    step: float | None = None
    offset: float = 0
    label: str = ""
    """The kind of figure reported as a finding's label; the name when empty."""

    def __post_init__(self) -> None:
        where = f"rule {self.name!r}"
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError(f"rule {self.name!r}: field 'name' must be a non-empty string")
        source = self.pattern.pattern if isinstance(self.pattern, re.Pattern) else self.pattern
        if not isinstance(source, str) or not source.strip():
            raise ValueError(f"{where}: field 'pattern' must be a non-empty regex")
        flags = (self.pattern.flags if isinstance(self.pattern, re.Pattern) else 0) | re.IGNORECASE
        try:
            compiled = re.compile(_expand(source), flags)
        except re.error as exc:
            raise ValueError(f"{where}: field 'pattern' is not a valid regex ({exc}): {source!r}") from None
        if "value" not in compiled.groupindex:
            raise ValueError(f"{where}: field 'pattern' has no named group 'value' (write (?P<value>...))")
        object.__setattr__(self, "pattern", compiled)
        object.__setattr__(self, "allowed", frozenset(self.allowed))
        for key in ("min", "max", "step", "offset"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise ValueError(f"{where}: field {key!r} must be a number, got {value!r}")
        for value in self.allowed:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{where}: field 'allowed' must list numbers, got {value!r}")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"{where}: field 'min' ({self.min}) is greater than field 'max' ({self.max})")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"{where}: field 'step' must be > 0, got {self.step!r}")
        if self.offset and self.step is None:
            raise ValueError(f"{where}: field 'offset' needs a 'step'")
        if self.min is None and self.max is None and self.step is None and not self.allowed:
            raise ValueError(f"{where}: no constraint: give at least one of 'min', 'max', 'allowed', 'step'")

    @property
    def kind(self) -> str:
        return self.label or self.name

    def describe(self) -> str:
        """What the rule holds a figure to: "multiples of 25 (or 10, 15) within 0..1000"."""
        parts = []
        if self.step is not None:
            base = f"multiples of {_fmt(self.step)}"
            if self.offset:
                base = f"{_fmt(self.offset)} plus {base}"
            parts.append(base)
        if self.allowed:
            values = ", ".join(_fmt(v) for v in sorted(self.allowed))
            parts.append(f"(or {values})" if self.step is not None else f"one of {values}")
        if self.min is not None and self.max is not None:
            parts.append(f"within {_fmt(self.min)}..{_fmt(self.max)}")
        elif self.min is not None:
            parts.append(f"at least {_fmt(self.min)}")
        elif self.max is not None:
            parts.append(f"at most {_fmt(self.max)}")
        return " ".join(parts)

    def problem(self, value: Decimal) -> str | None:
        """Why ``value`` breaks the rule, or None when it is plausible."""
        if self.min is not None and value < _dec(self.min) or self.max is not None and value > _dec(self.max):
            return "outside " + (
                f"{_fmt(self.min)}..{_fmt(self.max)}"
                if self.min is not None and self.max is not None
                else f"the minimum {_fmt(self.min)}" if self.min is not None else f"the maximum {_fmt(self.max)}"
            )
        if self.step is None and not self.allowed:
            return None
        if any(value == _dec(v) for v in self.allowed):
            return None
        if self.step is not None:
            if (value - _dec(self.offset)) % _dec(self.step) == 0:
                return None
            what = f"not {_fmt(self.offset)} plus a multiple" if self.offset else "not a multiple"
            return f"{what} of {_fmt(self.step)}" + (" nor an allowed value" if self.allowed else "")
        return "not an allowed value"


def check_numbers(text: str, rules: Sequence[NumericRule]) -> list[Finding]:
    """One finding per figure a rule's pattern finds: "contradicted" when the value breaks the
    rule, "unverified" when it is plausible. Offsets (and ``text``) are the ``value`` group's,
    the figure itself, not its context; sorted by position, then by rule order."""
    findings: list[tuple[int, int, Finding]] = []
    for order, rule in enumerate(rules):
        for m in rule.pattern.finditer(text):
            raw = m.group("value")
            value = parse_number(raw) if raw else None
            if value is None:
                continue
            problem = rule.problem(value)
            status = problem or "plausible"
            findings.append(
                (
                    m.start("value"),
                    order,
                    Finding(
                        check="numeric",
                        start=m.start("value"),
                        end=m.end("value"),
                        text=raw,
                        verdict="contradicted" if problem else "unverified",
                        label=rule.kind,
                        rule=rule.name,
                        evidence=f"{rule.name}: {rule.describe()}; got {_fmt(value)} → {status}",
                    ),
                )
            )
    findings.sort(key=lambda item: item[:2])
    return [finding for _, _, finding in findings]


_FIELDS = {"name", "label", "description", "pattern", "min", "max", "allowed", "step", "offset"}


def _rule(spec: Any, index: int) -> NumericRule:
    if not isinstance(spec, Mapping):
        raise ValueError(f"rule #{index + 1}: expected a mapping, got {spec!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"rule #{index + 1}: field 'name' must be a non-empty string, got {name!r}")
    where = f"rule {name!r}"
    unknown = set(spec) - _FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, sorted(unknown)))}")
    if "pattern" not in spec:
        raise ValueError(f"{where}: missing field 'pattern'")
    for key in ("label", "description", "pattern"):
        if key in spec and not isinstance(spec[key], str):
            raise ValueError(f"{where}: field {key!r} must be a string, got {spec[key]!r}")
    allowed = spec.get("allowed", [])
    if not isinstance(allowed, list) or ("allowed" in spec and not allowed):
        raise ValueError(f"{where}: field 'allowed' must be a non-empty list of numbers, got {allowed!r}")
    return NumericRule(
        name=name,
        pattern=spec["pattern"],
        description=spec.get("description", ""),
        min=spec.get("min"),
        max=spec.get("max"),
        allowed=frozenset(allowed),
        step=spec.get("step"),
        offset=spec.get("offset", 0),
        label=spec.get("label", ""),
    )


def load_rules(path: str | Path | None = None) -> list[NumericRule]:
    """Rules from a YAML file with a top-level ``rules`` list; None loads the packaged
    numeric_rules.yaml. Any problem is a ValueError naming the file, the rule and the field."""
    if path is None:
        source = resources.files(__package__).joinpath(DEFAULT_RULES)
        text, origin = source.read_text(encoding="utf-8"), DEFAULT_RULES
    else:
        origin = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"{origin}: cannot read rules: {exc.strerror or exc}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{origin}: invalid YAML: {exc}") from None
    if not isinstance(doc, Mapping) or not isinstance(doc.get("rules"), list):
        raise ValueError(f"{origin}: expected a mapping with a 'rules' list")
    unknown = set(doc) - {"rules"}
    if unknown:
        raise ValueError(f"{origin}: unknown top-level field(s) {', '.join(map(repr, sorted(unknown)))}")
    rules: list[NumericRule] = []
    try:
        for index, spec in enumerate(doc["rules"]):
            rule = _rule(spec, index)
            if any(r.name == rule.name for r in rules):
                raise ValueError(f"rule {rule.name!r}: duplicate name")
            rules.append(rule)
    except ValueError as exc:
        raise ValueError(f"{origin}: {exc}") from None
    return rules
