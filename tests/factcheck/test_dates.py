"""The date check: what parse_date reads (and refuses), impossible dates flagged on DATE spans."""

from __future__ import annotations

from datetime import date

import pytest

from draftmesh.factcheck.dates import PartialDate, calendar_error, check_dates, parse_date
from draftmesh.factcheck.findings import Mention


def date_mention(text: str, span: str, label: str = "DATE") -> Mention:
    start = text.index(span)
    return Mention(start, start + len(span), span, label)


# --- parse_date ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("March 3, 2024", (2024, 3, 3)),
        ("March 3rd, 2024", (2024, 3, 3)),
        ("the 3rd of March 2024", (2024, 3, 3)),
        ("3rd of March, 2024", (2024, 3, 3)),
        ("3 March 2024", (2024, 3, 3)),
        ("Sept. 5, 2020", (2020, 9, 5)),
        ("5 Sep 2020", (2020, 9, 5)),
        ("Tuesday, March 5, 2024", (2024, 3, 5)),
        ("Thursday, the 5th of September 2024", (2024, 9, 5)),
        ("March 2024", (2024, 3, None)),
        ("Mar. 2024", (2024, 3, None)),
        ("March 3", (None, 3, 3)),
        ("June 5th", (None, 6, 5)),
        ("the 1st of May", (None, 5, 1)),
        ("February 29", (None, 2, 29)),
        ("May", (None, 5, None)),
        ("2024", (2024, None, None)),
        ("2024-03-05", (2024, 3, 5)),
        ("2024-3-5", (2024, 3, 5)),
        ("2024/03/05", (2024, 3, 5)),
        ("13/01/2024", (2024, 1, 13)),  # only day/month is possible
        ("01/13/2024", (2024, 1, 13)),  # only month/day is possible
        ("07/07/2024", (2024, 7, 7)),  # both readings agree
        ("(March 3, 2024)", (2024, 3, 3)),
        ("March 3, 2024.", (2024, 3, 3)),
    ],
)
def test_parse_date_reads_the_components_the_text_gives(text, expected):
    parsed = parse_date(text)
    assert parsed is not None
    assert (parsed.year, parsed.month, parsed.day) == expected


@pytest.mark.parametrize(
    "text",
    [
        "last year", "the 1990s", "1990s", "today", "yesterday", "three days", "10 days",
        "Monday", "three years ago", "the summer of 2020", "mid-2020", "early 2000s",
        "1999 to 2001", "2020-2021", "March 3-5, 2024", "5th", "Q3 2024", "the 20th century",
        "noon", "2 p.m.", "5 March 2024 at 3pm", "May 45",
        "2011-12",  # a season far more often than December 2011
        "05/03/2024",  # March 5 or May 3: ambiguous
        "", "   ",
    ],
)  # fmt: skip
def test_parse_date_refuses_what_is_not_a_calendar_date(text):
    assert parse_date(text) is None
    assert calendar_error(text) is None


def test_parse_date_keeps_the_named_weekday_and_knows_completeness():
    parsed = parse_date("Tue, Mar. 5, 2024")
    assert parsed == PartialDate(2024, 3, 5, weekday=1)
    assert parsed.complete and parsed.to_date() == date(2024, 3, 5)
    partial = parse_date("March 2024")
    assert not partial.complete and partial.to_date() is None


@pytest.mark.parametrize(
    "text, iso",
    [("March 3, 2024", "2024-03-03"), ("March 2024", "2024-03"), ("2024", "2024"), ("March 3", "--03-03"), ("May", "--05")],
)
def test_partial_date_isoformat_shows_only_known_components(text, iso):
    assert parse_date(text).isoformat() == iso


# --- impossible dates ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, reason",
    [
        ("February 30, 2023", "February 2023 has 28 days (2023 is not a leap year)"),
        ("31 April 2020", "April has 30 days"),
        ("the 31st of April 2020", "April has 30 days"),
        ("June 31", "June has 30 days"),
        ("February 30", "February has at most 29 days"),
        ("March 32, 2020", "March has 31 days"),
        ("March 0, 2020", "there is no day 0"),
        ("2023-02-29", "February 2023 has 28 days (2023 is not a leap year)"),
        ("February 30, 2000", "February 2000 has 29 days"),
        ("February 30, 2024", "February 2024 has 29 days"),
        ("2024-13-01", "there is no month 13"),
        ("2024-00-10", "there is no month 0"),
        ("2020-04-31", "April has 30 days"),
        ("31/04/2020", "as day/month (April has 30 days) or as month/day (there is no month 31)"),
        ("13/13/2024", "there is no month 13"),
    ],
)
def test_impossible_dates_are_not_dates_and_say_why(text, reason):
    assert parse_date(text) is None
    error = calendar_error(text)
    assert error is not None and reason in error


@pytest.mark.parametrize("text", ["2024-02-29", "February 29, 2024", "2000-02-29", "29 February 2000"])
def test_leap_days_of_leap_years_are_valid(text):
    parsed = parse_date(text)
    assert parsed is not None and parsed.month == 2 and parsed.day == 29
    assert calendar_error(text) is None


@pytest.mark.parametrize("text", ["2023-02-29", "1900-02-29", "February 29, 1900", "2100-02-29"])
def test_leap_days_of_common_years_are_impossible(text):
    assert parse_date(text) is None
    assert "28 days" in calendar_error(text)


def test_century_years_explain_the_400_rule():
    assert "divisible by 400" in calendar_error("1900-02-29")


def test_julian_era_leap_days_are_not_flagged():
    """Before the Gregorian switch an English date may be Old Style, where 1700-02-29 exists."""
    assert calendar_error("February 29, 1700") is None


def test_days_no_calendar_has_are_flagged_in_any_year():
    assert "April has 30 days" in calendar_error("April 31, 1600")


# --- check_dates -----------------------------------------------------------------------


def test_check_dates_flags_an_impossible_date_with_the_mentions_offsets():
    text = "The treaty was signed on February 30, 2023 in Geneva."
    mention = date_mention(text, "February 30, 2023")
    (finding,) = check_dates(text, [mention])
    assert finding.check == "date" and finding.verdict == "contradicted" and finding.flagged
    assert finding.rule == "calendar" and finding.label == "DATE"
    assert (finding.start, finding.end) == (mention.start, mention.end)
    assert text[finding.start : finding.end] == finding.text == "February 30, 2023"
    assert finding.evidence == "February 30, 2023: February 2023 has 28 days (2023 is not a leap year)"


@pytest.mark.parametrize(
    "span, evidence",
    [
        ("31 April 2020", "31 April 2020: April has 30 days"),
        ("2023-02-29", "2023-02-29: February 2023 has 28 days (2023 is not a leap year)"),
        ("1900-02-29", "1900-02-29: February 1900 has 28 days"),
        ("2024-13-01", "2024-13-01: there is no month 13"),
        ("the 30th of February", "the 30th of February: February has at most 29 days"),
    ],
)
def test_check_dates_evidence(span, evidence):
    text = f"It happened on {span}, they say."
    (finding,) = check_dates(text, [date_mention(text, span)])
    assert finding.evidence.startswith(evidence)


@pytest.mark.parametrize(
    "span",
    [
        "March 3, 2024", "2024-02-29", "2000-02-29", "March 2024", "2024", "last year",
        "the 1990s", "today", "three days", "Monday", "March 3-5, 2024", "05/03/2024",
        "Tuesday, March 5, 2024", "between 2019 and 2021",
    ],
)  # fmt: skip
def test_check_dates_gives_no_finding_for_possible_or_vague_dates(span):
    """A possible date is no evidence the date is right: the Wikidata check compares it."""
    text = f"Noted on {span} by the clerk."
    assert check_dates(text, [date_mention(text, span)]) == []


def test_check_dates_finds_an_impossible_date_inside_a_longer_span():
    text = "The festival ran from March 3 to April 31, 2021 in Lisbon."
    span = "from March 3 to April 31, 2021"
    (finding,) = check_dates(text, [date_mention(text, span)])
    assert (finding.start, finding.end, finding.text) == (text.index(span), text.index(span) + len(span), span)
    assert finding.evidence == "April 31, 2021: April has 30 days"


def test_check_dates_flags_a_wrong_weekday():
    text = "The vote took place on Monday, March 5, 2024."
    (finding,) = check_dates(text, [date_mention(text, "Monday, March 5, 2024")])
    assert finding.verdict == "contradicted" and finding.rule == "weekday"
    assert finding.evidence == "Monday, March 5, 2024 falls on a Tuesday, not a Monday"


def test_check_dates_ignores_weekdays_it_cannot_check():
    text = "Monday, March 5 and Friday, 13 October 1307 and Tue, 5 March 2024."
    mentions = [date_mention(text, s) for s in ("Monday, March 5", "Friday, 13 October 1307", "Tue, 5 March 2024")]
    assert check_dates(text, mentions) == []  # no year; possibly Julian; right


def test_check_dates_reads_only_date_mentions():
    text = "He scored February 30, 2023 points in 31 April 2020."
    mentions = [date_mention(text, "February 30, 2023", "CARDINAL"), date_mention(text, "31 April 2020", "DATE")]
    findings = check_dates(text, mentions)
    assert [f.text for f in findings] == ["31 April 2020"]


def test_check_dates_one_finding_per_flagged_mention_in_order():
    text = "Due 2023-02-29, paid 2024-02-29, filed June 31, 2022."
    mentions = [date_mention(text, s) for s in ("2023-02-29", "2024-02-29", "June 31, 2022")]
    findings = check_dates(text, mentions)
    assert [f.text for f in findings] == ["2023-02-29", "June 31, 2022"]
    assert all(text[f.start : f.end] == f.text for f in findings)
    assert [f.to_dict()["rule"] for f in findings] == ["calendar", "calendar"]


def test_find_date_spans_finds_strict_shapes_only():
    from draftmesh.factcheck.dates import find_date_spans

    text = "Signed on February 30, 2023 and again on 2024-03-05; 30 people came last year."
    spans = find_date_spans(text)
    assert [(m.text, m.label) for m in spans] == [("February 30, 2023", "DATE"), ("2024-03-05", "DATE")]
    assert all(text[m.start:m.end] == m.text for m in spans)
    assert [f.rule for f in check_dates(text, spans)] == ["calendar"]
