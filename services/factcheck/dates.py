"""The date check: flags impossible calendar dates inside NER DATE spans.

Only spans NER labelled DATE are read, never a whole sentence: fuzzy parsing of prose turns
any number into a date. Within a span, a date is recognised only in a few strict shapes
(month name with day and/or year, day-of-month ordinal forms, ISO and numeric dates), and
only then parsed with python-dateutil. dateutil alone cannot tell an impossible date
("February 30, 2023": "day is out of range") from text that is not a date at all ("the
1990s"), and it guesses freely ("March 3-5, 2024" parses as 2005-03-03 20:24), so the shape
decides what the text claims and ``calendar.monthrange`` decides whether that exists.

A possible date yields no finding: being on the calendar is no evidence that it is right, and
the Wikidata check compares dates with claims separately.
"""

from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from datetime import date, datetime
from typing import Sequence

from dateutil import parser as _dateutil

from draftmesh.factcheck.findings import Mention
from draftmesh.io_struct import Finding

__all__ = ["GREGORIAN_SINCE", "PartialDate", "parse_date", "calendar_error", "check_dates"]

GREGORIAN_SINCE = 1753
"""First year whose dates English text gives in the Gregorian calendar (Britain and its
colonies switched in 1752). Earlier dates may be Julian (Old Style), where February 29, 1700
exists and weekdays differ, so leap-century days and weekdays are only checked from here on.
Days no calendar has (April 31, February 30) are flagged in any year."""

_INFO = _dateutil.parserinfo()
_MONTH_NAMES = sorted({name for names in _INFO.MONTHS for name in names}, key=len, reverse=True)
_WEEKDAYS = {
    "monday": 0, "mon": 0,
    "tuesday": 1, "tues": 1, "tue": 1,
    "wednesday": 2, "wed": 2,
    "thursday": 3, "thurs": 3, "thur": 3, "thu": 3,
    "friday": 4, "fri": 4,
    "saturday": 5, "sat": 5,
    "sunday": 6, "sun": 6,
}  # fmt: skip
_WEEKDAY_NAMES = sorted(_WEEKDAYS, key=len, reverse=True)
_DAY_NAMES = [names[-1] for names in _INFO.WEEKDAYS]  # Monday first, as date.weekday()

_MON = r"(?P<mon>(?:%s)\b\.?)" % "|".join(_MONTH_NAMES)
_WD = r"(?:(?P<wd>%s)\b\.?,?\s+)" % "|".join(_WEEKDAY_NAMES)
_DAY = r"(?P<day>\d{1,2})(?:st|nd|rd|th)?"
_YEAR = r"(?P<year>\d{4})"

# Each shape names the components the text states. Named shapes accept a leading weekday.
_SHAPES: dict[str, str] = {
    "mdy": rf"{_WD}?{_MON}\s+{_DAY},?(?:\s+{_YEAR})?",  # March 3rd, 2024; Tue, Mar. 5
    "dmy": rf"{_WD}?(?:the\s+)?{_DAY}(?:\s+of)?\s+{_MON},?(?:\s+{_YEAR})?",  # the 3rd of March 2024
    "my": rf"{_MON},?\s+{_YEAR}",  # March 2024
    "m": _MON,  # March
    "y": _YEAR,  # 2024
    "ymd": r"(?P<year>\d{4})(?P<sep>[-/.])(?P<mon>\d{1,2})(?P=sep)(?P<day>\d{1,2})",  # 2024-03-05
    "num": r"(?P<a>\d{1,2})(?P<sep>[/.])(?P<b>\d{1,2})(?P=sep)(?P<year>\d{4})",  # 05/03/2024
}
_FULL = {kind: re.compile(shape, re.IGNORECASE) for kind, shape in _SHAPES.items()}
# Inside a longer DATE span ("from February 30, 2023 until ..."): only shapes that can be
# impossible, never glued to other digits, words, or range dashes ("March 3-5, 2024").
_SCAN = {
    kind: re.compile(rf"(?<![\w/.\-–]){_SHAPES[kind]}(?![\w/\-–]|\.\d)", re.IGNORECASE)
    for kind in ("mdy", "dmy", "ymd", "num")
}
_STRIP = " \t\n\"'“”‘’()[],;:."


@dataclass(frozen=True)
class PartialDate:
    """The calendar components a text states; the others are None (not 1, not today)."""

    year: int | None = None
    month: int | None = None
    day: int | None = None
    weekday: int | None = None
    """The weekday the text names (Monday = 0), unchecked; None when it names none."""

    @property
    def complete(self) -> bool:
        return self.year is not None and self.month is not None and self.day is not None

    def to_date(self) -> date | None:
        return date(self.year, self.month, self.day) if self.complete else None  # type: ignore[arg-type]

    def isoformat(self) -> str:
        """ISO 8601 with what is known: "2024-03-05", "2024-03", "2024", "--03-05", "--03"."""
        if self.year is None:
            return "--" + "-".join(f"{v:02d}" for v in (self.month, self.day) if v is not None)
        return "-".join([f"{self.year:04d}"] + [f"{v:02d}" for v in (self.month, self.day) if v is not None])


@dataclass(frozen=True)
class _Impossible:
    reason: str


def _month_days(month: int, year: int | None) -> int:
    if year is None:
        return 29 if month == 2 else calendar.monthrange(2001, month)[1]
    if month == 2 and year < GREGORIAN_SINCE and year % 4 == 0:
        return 29  # a Julian leap year at least; not flagged (see GREGORIAN_SINCE)
    return calendar.monthrange(year, month)[1]


def _day_problem(year: int | None, month: int, day: int) -> str | None:
    """Why (year, month, day) is not on the calendar, or None when it is."""
    if not 1 <= month <= 12:
        return f"there is no month {month}"
    if day == 0:
        return "there is no day 0"
    days = _month_days(month, year)
    if day <= days:
        return None
    name = _INFO.MONTHS[month - 1][-1]
    if year is None:
        return f"{name} has at most {days} days" if month == 2 else f"{name} has {days} days"
    if month != 2 or days == 29:
        return f"{name} {year} has {days} days" if month == 2 else f"{name} has {days} days"
    if year % 100 == 0 and year % 4 == 0:
        return f"February {year} has 28 days ({year} is not a leap year: a century year is one only when divisible by 400)"
    return f"February {year} has 28 days ({year} is not a leap year)"


def _analyse(kind: str, m: re.Match[str]) -> PartialDate | _Impossible | None:
    """What a shape's match states: a possible date, an impossible one, or no date."""
    g = m.groupdict()
    year = int(g["year"]) if g.get("year") else None
    if year == 0:
        return None  # no year 0 in the Gregorian calendar as written; nothing to check
    weekday = _WEEKDAYS[g["wd"].lower()] if g.get("wd") else None
    if kind == "num":
        a, b = int(g["a"]), int(g["b"])
        readings = {"day/month": (b, a), "month/day": (a, b)}
        problems = {how: _day_problem(year, mon, day) for how, (mon, day) in readings.items()}
        valid = {readings[how] for how, problem in problems.items() if problem is None}
        if not valid:
            why = " or ".join(f"as {how} ({problem})" for how, problem in problems.items())
            return _Impossible(f"impossible read {why}")
        if len(valid) > 1:
            return None  # 05/03/2024: March 5 or May 3; the text does not say which
        [(month, day)] = valid
        return PartialDate(year, month, day)
    month = None
    if g.get("mon"):
        month = int(g["mon"]) if g["mon"].isdigit() else _INFO.month(g["mon"].rstrip("."))
    day = int(g["day"]) if g.get("day") else None
    if day is not None and month is not None:
        if year is None and not 1 <= day <= 31:
            return None  # "May 45" may mean May 1945; a day past 31 is no day
        problem = _day_problem(year, month, day)
        if problem:
            return _Impossible(problem)
    elif month is not None and not 1 <= month <= 12:
        return _Impossible(f"there is no month {month}")
    return PartialDate(year, month, day, weekday)


def _match_full(text: str) -> tuple[str, re.Match[str]] | None:
    clean = text.strip(_STRIP)  # quotes, brackets, a final full stop ("Sept" reads as "Sept.")
    for kind, shape in _FULL.items():
        m = shape.fullmatch(clean)
        if m:
            return kind, m
    return None


def _dateutil_components(m: re.Match[str], kind: str, found: PartialDate) -> PartialDate | None:
    """Parse the shape's text with dateutil twice, with two different defaults: a component
    the text gives is the same in both results. Leap-year defaults keep "February 29" valid."""
    g = m.groupdict()
    text = m.group(0)
    if g.get("wd"):  # dateutil moves a date to the named weekday when the day is missing
        text = text[m.end("wd") - m.start() :].lstrip(" .,\t")
    text = re.sub(r"\b(?:the|of)\b", " ", text, flags=re.IGNORECASE)  # "the 3rd of March"
    dayfirst = kind == "num" and (found.month, found.day) == (int(g["b"]), int(g["a"]))
    try:
        a = _dateutil.parse(text, default=datetime(2000, 1, 1), dayfirst=dayfirst)
        b = _dateutil.parse(text, default=datetime(2004, 2, 2), dayfirst=dayfirst)
    except (ValueError, OverflowError):
        return None
    year = a.year if a.year == b.year else None
    month = a.month if a.month == b.month else None
    day = a.day if a.day == b.day else None
    return PartialDate(year, month, day, found.weekday)


def parse_date(text: str) -> PartialDate | None:
    """The calendar date ``text`` states, with only the components it gives; None when the
    text is not a calendar date ("last year", "the 1990s", "Monday", "three days"), is ambiguous
    ("05/03/2024"), or is impossible ("February 30, 2023": see ``calendar_error``).

    Accepted shapes: "March 3rd, 2024", "Tue, Mar. 5", "the 3rd of March 2024", "3 March",
    "March 2024", "March", "2024", "2024-03-05" (also with / or .), "13/01/2024". Not "2024-03":
    in prose "2011-12" is a season far more often than December 2011."""
    hit = _match_full(text)
    if hit is None:
        return None
    kind, m = hit
    found = _analyse(kind, m)
    if not isinstance(found, PartialDate):
        return None
    if found.year is None and found.month is None:
        return None
    parsed = _dateutil_components(m, kind, found)
    # dateutil must read what the shape says; if not, one of them is confused: claim nothing.
    return found if parsed == found else None


def calendar_error(text: str) -> str | None:
    """Why ``text`` is an impossible date ("31 April 2020: April has 30 days"), or None when it
    is a possible date or no date at all. The whole text is tried first, then dates inside it."""
    problems = [f"{m.group(0)}: {found.reason}" for m, found in _dates_in(text) if isinstance(found, _Impossible)]
    return "; ".join(problems) or None


def _dates_in(text: str) -> list[tuple[re.Match[str], PartialDate | _Impossible | None]]:
    hit = _match_full(text)
    if hit is not None:
        return [(hit[1], _analyse(*hit))]
    return [(m, found) for _, m, found in _scan(text)]


def _scan(text: str) -> list[tuple[str, re.Match[str], PartialDate | _Impossible | None]]:
    """Date shapes inside a longer span, first match wins where they overlap."""
    hits: list[tuple[str, re.Match[str]]] = []
    for kind, shape in _SCAN.items():
        for m in shape.finditer(text):
            if all(m.end() <= h.start() or m.start() >= h.end() for _, h in hits):
                hits.append((kind, m))
    hits.sort(key=lambda hit: hit[1].start())
    return [(kind, m, _analyse(kind, m)) for kind, m in hits]


def find_date_spans(text: str) -> list[Mention]:
    """DATE mentions found by the strict date shapes alone, for NER backends that tag no
    dates (CoNLL taggers such as flair's "ner" know PER/ORG/LOC/MISC only). Strict shapes,
    never a fuzzy parse of the sentence."""
    return [Mention(m.start(), m.end(), m.group(0), "DATE") for _, m, _ in _scan(text)]


def _weekday_error(found: PartialDate, shown: str) -> str | None:
    """Why the weekday the text names is wrong for its date, or None (right, or uncheckable)."""
    day = found.to_date()
    if found.weekday is None or day is None or day.year < GREGORIAN_SINCE or day.weekday() == found.weekday:
        return None
    return f"{shown} falls on a {_DAY_NAMES[day.weekday()]}, not a {_DAY_NAMES[found.weekday]}"


def check_dates(text: str, mentions: Sequence[Mention]) -> list[Finding]:
    """Findings for the DATE mentions that are impossible dates: "contradicted", rule
    "calendar" (no such day) or "weekday" (the named weekday is wrong). Possible dates, vague
    or relative ones and non-dates give no finding. Offsets and text are the mention's (its
    offsets index ``text``, the checked text; the span is read from the mention)."""
    findings: list[Finding] = []
    for mention in mentions:
        if mention.label != "DATE":
            continue
        rule, evidence = "", ""
        results = _dates_in(mention.text)
        calendar_problems = [f"{m.group(0)}: {r.reason}" for m, r in results if isinstance(r, _Impossible)]
        weekday_problems = [
            problem for m, r in results if isinstance(r, PartialDate) and (problem := _weekday_error(r, m.group(0)))
        ]
        if calendar_problems:
            rule, evidence = "calendar", "; ".join(calendar_problems)
        elif weekday_problems:
            rule, evidence = "weekday", "; ".join(weekday_problems)
        if rule:
            findings.append(
                Finding(
                    check="date",
                    start=mention.start,
                    end=mention.end,
                    text=mention.text,
                    verdict="contradicted",
                    label=mention.label,
                    rule=rule,
                    evidence=evidence,
                )
            )
    return findings
