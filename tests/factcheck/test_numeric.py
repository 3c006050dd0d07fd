"""The numeric check: value parsing, each default rule's in and out cases, offsets, rule files."""

from __future__ import annotations

import re
import textwrap
from decimal import Decimal

import pytest

from draftmesh.factcheck.numeric import NumericRule, check_numbers, load_rules, parse_number
from draftmesh.io_struct import Finding


@pytest.fixture(scope="module")
def rules() -> list[NumericRule]:
    return load_rules()


def by_rule(text: str, rules: list[NumericRule]) -> list[tuple[str, str, str]]:
    """(rule, figure, verdict) per finding, after checking offsets point at the figure."""
    findings = check_numbers(text, rules)
    for f in findings:
        assert text[f.start : f.end] == f.text
        assert f.check == "numeric"
    return [(f.rule, f.text, f.verdict) for f in findings]


# --- parse_number ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("25", "25"), ("1,250", "1250"), ("1,000,000", "1000000"), ("0.25", "0.25"), ("-5", "-5"),
        ("−5", "-5"), ("+3", "3"), ("minus 40", "-40"), ("fifty", "50"), ("twenty-five", "25"),
        ("twenty five", "25"), ("a hundred", "100"), ("one hundred and ten", "110"),
        ("two hundred twenty-five", "225"), ("1.5 million", "1500000"), ("three billion", "3000000000"),
        ("Fifty", "50"),
    ],
)  # fmt: skip
def test_parse_number(text, value):
    assert parse_number(text) == Decimal(value)


@pytest.mark.parametrize("text", ["", "x", "fifty-ish", "and", "1,2,3", "1.2.3"])
def test_parse_number_refuses_non_numbers(text):
    assert parse_number(text) is None


# --- default rules ---------------------------------------------------------------------


def test_default_rules_load_with_descriptions(rules):
    names = [r.name for r in rules]
    assert len(names) == len(set(names)) >= 8
    assert all(r.description.strip() for r in rules)
    assert all(r.pattern.flags & re.IGNORECASE for r in rules)


@pytest.mark.parametrize(
    "text, figure, verdict",
    [
        ("The Fed raised rates by 30 basis points.", "30", "contradicted"),
        ("The Fed raised rates by 50 basis points.", "50", "unverified"),
        ("The central bank cut rates by 25 bp on Tuesday.", "25", "unverified"),
        ("It is expected to lower rates by 50 bps.", "50", "unverified"),
        ("The ECB hiked its key interest rates by 35 bps.", "35", "unverified"),  # an allowed exception
        ("The Bank of England cut interest rates by 15 basis points.", "15", "unverified"),
        ("The Fed raised the target range for the federal funds rate by 75 basis points.", "75", "unverified"),
        ("It raised its benchmark interest rate by fifty basis points.", "fifty", "unverified"),
        ("It raised its benchmark interest rate by twenty basis points.", "twenty", "contradicted"),
        ("The bank raised rates by 1,250 basis points.", "1,250", "contradicted"),
        ("Policymakers delivered a 50 bps rate hike.", "50", "unverified"),
        ("Markets priced in a 30bp rate cut.", "30", "contradicted"),
        ("It approved a 75-basis-point increase in interest rates.", "75", "unverified"),
        ("It approved a 60 basis point hike in its policy rates.", "60", "contradicted"),
        ("The ECB raised rates by 0.3 percentage points.", "0.3", "contradicted"),
        ("The Fed cut rates by 0.5 percentage points.", "0.5", "unverified"),
        ("The Fed cut rates by 0.25 percentage point.", "0.25", "unverified"),
    ],
)
def test_policy_rate_moves(rules, text, figure, verdict):
    [(rule, got, got_verdict)] = by_rule(text, rules)
    assert rule.startswith("policy_rate_") and (got, got_verdict) == (figure, verdict)


@pytest.mark.parametrize(
    "text",
    [
        "Lenders raised mortgage rates by 30 basis points.",
        "Banks raised their savings rates by 20 bp.",
        "Ten-year bond yields rose 37 basis points.",
        "Spreads widened by 12 bps over the week.",
        "A 9600 bps modem.",
        "A 30 basis point rise in yields.",
        "The Fed raised rates by 25 to 50 basis points over the year.",
        "The company raised prices by 30 percent.",
    ],
)
def test_rate_figures_of_other_kinds_are_not_checked(rules, text):
    assert check_numbers(text, rules) == []


def test_policy_rate_evidence_names_rule_step_and_range(rules):
    [finding] = check_numbers("The Fed raised rates by 30 basis points.", rules)
    assert finding.label == "policy_rate_move" and finding.rule == "policy_rate_bp_verb"
    assert finding.evidence == (
        "policy_rate_bp_verb: multiples of 25 (or 10, 15, 35, 40) within 0..1000; "
        "got 30 → not a multiple of 25 nor an allowed value"
    )
    [ok] = check_numbers("The Fed raised rates by 50 basis points.", rules)
    assert ok.evidence.endswith("got 50 → plausible") and not ok.flagged


@pytest.mark.parametrize(
    "text, figure, verdict",
    [
        ("52% of voters backed the plan.", "52", "unverified"),
        ("She won 120% of the vote.", "120", "contradicted"),
        ("About 30 percent of the population lives in cities.", "30", "unverified"),
        ("Some 110% of the country's adults own a phone.", "110", "contradicted"),
        ("33.3% of respondents agreed.", "33.3", "unverified"),
        ("100.5% of registered voters turned out.", "100.5", "contradicted"),
        ("Fifty percent of those surveyed agreed.", "Fifty", "unverified"),
        ("0% of patients relapsed.", "0", "unverified"),
        ("There is a 70% chance of rain.", "70", "unverified"),
        ("There is a 120% chance of rain.", "120", "contradicted"),
        ("A 95 per cent probability.", "95", "unverified"),
    ],
)
def test_percent_shares_and_probabilities(rules, text, figure, verdict):
    [(rule, got, got_verdict)] = by_rule(text, rules)
    assert rule in ("share_percent", "chance_percent") and (got, got_verdict) == (figure, verdict)


@pytest.mark.parametrize(
    "text",
    [
        "Public debt reached 120% of GDP.",
        "The drink has 200% of the recommended daily intake.",
        "Sales grew to 300% of their 2010 level.",
        "The insurer covers 150% of the cost for patients.",
        "Prices rose 150% in a year.",
        "He gave 110% effort.",
        "It is 150% of people's income.",
    ],
)
def test_percentages_that_are_not_shares_are_not_checked(rules, text):
    assert check_numbers(text, rules) == []


@pytest.mark.parametrize(
    "text, figure, verdict",
    [
        ("Adults aged 65 and over are eligible.", "65", "unverified"),
        ("A man aged 150 was interviewed.", "150", "contradicted"),
        ("She died at the age of 130.", "130", "contradicted"),
        ("He retired at the age of 65.", "65", "unverified"),
        ("Children under age 5 travel free.", "5", "unverified"),
        ("A 35-year-old woman was hired.", "35", "unverified"),
        ("A 150-year-old man claimed the record.", "150", "contradicted"),
        ("A five-year-old boy found it.", "five", "unverified"),
        ("She was 35 years old.", "35", "unverified"),
        ("He was 200 years old when he died.", "200", "contradicted"),
        ("Jeanne Calment was 122 years old when she died; she is 122 years old in records.", "122", "unverified"),
    ],
)
def test_human_age(rules, text, figure, verdict):
    results = by_rule(text, rules)
    assert results and all(rule.startswith("age_") for rule, _, _ in results)
    assert (results[0][1], results[0][2]) == (figure, verdict)


@pytest.mark.parametrize(
    "text",
    [
        "A 300-year-old tree fell.",
        "The 4,000-year-old mummy.",
        "The whisky was aged 150 years in oak.",
        "Stars form at the age of 10 billion years.",
        "The universe is 13.8 billion years old.",
        "The building is 200 years old.",
        "The 190-year-old tortoise.",
    ],
)
def test_ages_of_things_are_not_checked(rules, text):
    assert check_numbers(text, rules) == []


@pytest.mark.parametrize(
    "text, figure, verdict",
    [
        ("During the heatwave temperatures reached 48.8°C in Lytton.", "48.8", "unverified"),
        ("The weather forecast says 75 °C for tomorrow.", "75", "contradicted"),
        ("A cold snap brought -45 °C to the city.", "-45", "unverified"),
        ("A cold snap brought minus 95 degrees Celsius to the city.", "minus 95", "contradicted"),
        ("Outside temperatures hit 38 degrees C.", "38", "unverified"),
        ("The heat wave pushed thermometers to 134°F in the valley.", "134", "unverified"),
        ("The weather forecast calls for 150 degrees Fahrenheit.", "150", "contradicted"),
    ],
)
def test_weather_temperatures(rules, text, figure, verdict):
    [(rule, got, got_verdict)] = by_rule(text, rules)
    assert rule.startswith("weather_temperature_") and (got, got_verdict) == (figure, verdict)


@pytest.mark.parametrize(
    "text",
    [
        "Bake at 200°C for an hour.",
        "Water boils at 100 °C.",
        "During the heatwave ground temperatures of 70°C were measured.",
        "In the heatwave the heat index hit 70°C.",
        "The weather on Venus is hot, with 464 °C at noon.",
        "The weather was cold so we baked bread at 220 °C.",
        "Steel melts at 1,370 °C.",
    ],
)
def test_temperatures_that_are_not_weather_are_not_checked(rules, text):
    assert check_numbers(text, rules) == []


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The shop opens at 9 am.", [("clock_hour_12h", "9", "unverified")]),
        ("Meet me at 13 pm.", [("clock_hour_12h", "13", "contradicted")]),
        ("It ends at 10:30 p.m.", [("clock_hour_12h", "10", "unverified"), ("clock_minute", "30", "unverified")]),
        ("The call is at 10:75 pm.", [("clock_minute", "75", "contradicted")]),
        ("Launch is set for 14:30 UTC.", [("clock_minute", "30", "unverified")]),
    ],
)
def test_clock_times(rules, text, expected):
    assert by_rule(text, rules) == expected


@pytest.mark.parametrize(
    "text",
    ["John 3:16 says so.", "The goal came at 25:17 of the second period.", "It runs 20 AM and FM stations.", "I am 5."],
)
def test_colons_and_am_that_are_not_clock_times_are_not_checked(rules, text):
    assert check_numbers(text, rules) == []


def test_findings_are_sorted_by_position_and_offsets_are_the_figures(rules):
    text = "At 13 pm the Fed raised rates by 30 basis points; 52% of voters and a 150-year-old man noticed."
    findings = check_numbers(text, rules)
    assert [f.text for f in findings] == ["13", "30", "52", "150"]
    assert [f.start for f in findings] == sorted(f.start for f in findings)
    assert [text[f.start : f.end] for f in findings] == ["13", "30", "52", "150"]
    assert [f.verdict for f in findings] == ["contradicted", "contradicted", "unverified", "contradicted"]
    assert all(Finding.from_dict(f.to_dict()) == f for f in findings)


# --- custom rules and loading errors ---------------------------------------------------


def write(tmp_path, body: str):
    path = tmp_path / "rules.yaml"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


def test_a_custom_rule_file(tmp_path):
    path = write(
        tmp_path,
        r"""
        rules:
          - name: dice
            label: die_roll
            description: a six-sided die shows 1..6
            pattern: 'rolled an? (?P<value>{int}|{words})\b'
            min: 1
            max: 6
          - name: quarter_hours
            pattern: '(?P<value>{int}) minutes past'
            step: 15
            offset: 0
            max: 45
          - name: odd_shoe_sizes
            pattern: 'size (?P<value>{decimal}) shoes'
            step: 2
            offset: 1
          - name: colours
            pattern: 'colour number (?P<value>{int})'
            allowed: [1, 2, 3]
        """,
    )
    rules = load_rules(path)
    assert [r.name for r in rules] == ["dice", "quarter_hours", "odd_shoe_sizes", "colours"]
    text = "She rolled a 7, then rolled an eight, then rolled a 3 at 20 minutes past; size 9 shoes, size 10 shoes, colour number 4."
    assert by_rule(text, rules) == [
        ("dice", "7", "contradicted"),
        ("dice", "eight", "contradicted"),
        ("dice", "3", "unverified"),
        ("quarter_hours", "20", "contradicted"),
        ("odd_shoe_sizes", "9", "unverified"),
        ("odd_shoe_sizes", "10", "contradicted"),
        ("colours", "4", "contradicted"),
    ]
    findings = check_numbers(text, rules)
    assert findings[0].label == "die_roll" and findings[3].label == "quarter_hours"
    assert findings[0].evidence == "dice: within 1..6; got 7 → outside 1..6"
    assert findings[3].evidence == "quarter_hours: multiples of 15 at most 45; got 20 → not a multiple of 15"
    assert findings[5].evidence == "odd_shoe_sizes: 1 plus multiples of 2; got 10 → not 1 plus a multiple of 2"
    assert findings[6].evidence == "colours: one of 1, 2, 3; got 4 → not an allowed value"


def test_load_rules_accepts_str_paths(tmp_path):
    path = write(tmp_path, "rules:\n  - {name: r, pattern: 'x=(?P<value>{int})', max: 3}\n")
    [rule] = load_rules(str(path))
    assert [f.verdict for f in check_numbers("x=4 x=2 x4", [rule])] == ["contradicted", "unverified"]


def test_rules_can_be_built_in_code():
    rule = NumericRule(name="pct", pattern=re.compile(r"(?P<value>{decimal})%"), max=100)
    assert rule.pattern.flags & re.IGNORECASE
    assert [f.verdict for f in check_numbers("101% and 99%", [rule])] == ["contradicted", "unverified"]


@pytest.mark.parametrize(
    "rule_yaml, message",
    [
        ("{name: r, max: 3}", "rule 'r': missing field 'pattern'"),
        ("{name: r, pattern: 'x(\\d+)', max: 3}", "rule 'r': field 'pattern' has no named group 'value'"),
        ("{name: r, pattern: 'x(?P<value>\\d+', max: 3}", "rule 'r': field 'pattern' is not a valid regex"),
        ("{name: r, pattern: '(?P<value>{int})', min: 5, max: 3}", "rule 'r': field 'min' (5) is greater than field 'max' (3)"),
        ("{name: r, pattern: '(?P<value>{int})', step: 0}", "rule 'r': field 'step' must be > 0"),
        ("{name: r, pattern: '(?P<value>{int})', step: -25}", "rule 'r': field 'step' must be > 0"),
        ("{name: r, pattern: '(?P<value>{int})', max: 3, colour: red}", "rule 'r': unknown field(s) 'colour'"),
        ("{name: r, pattern: '(?P<value>{int})'}", "rule 'r': no constraint"),
        ("{name: r, pattern: '(?P<value>{int})', offset: 1, max: 3}", "rule 'r': field 'offset' needs a 'step'"),
        ("{name: r, pattern: '(?P<value>{int})', max: many}", "rule 'r': field 'max' must be a number"),
        ("{name: r, pattern: '(?P<value>{int})', max: true}", "rule 'r': field 'max' must be a number"),
        ("{name: r, pattern: '(?P<value>{int})', allowed: []}", "rule 'r': field 'allowed' must be a non-empty list"),
        ("{name: r, pattern: '(?P<value>{int})', allowed: 5}", "rule 'r': field 'allowed' must be a non-empty list"),
        ("{name: r, pattern: '(?P<value>{int})', allowed: [1, x]}", "rule 'r': field 'allowed' must list numbers"),
        ("{name: r, pattern: 5, max: 3}", "rule 'r': field 'pattern' must be a string"),
        ("{name: r, pattern: '(?P<value>{int})', max: 3, description: [1]}", "rule 'r': field 'description' must be a string"),
        ("{pattern: '(?P<value>{int})', max: 3}", "rule #1: field 'name' must be a non-empty string"),
        ("just a string", "rule #1: expected a mapping"),
    ],
)
def test_rule_errors_name_the_rule_and_the_field(tmp_path, rule_yaml, message):
    path = write(tmp_path, f"rules:\n  - {rule_yaml}\n")
    with pytest.raises(ValueError) as info:
        load_rules(path)
    assert str(info.value).startswith(f"{path}: {message}")


def test_duplicate_rule_names_are_refused(tmp_path):
    path = write(
        tmp_path,
        """
        rules:
          - {name: r, pattern: '(?P<value>{int})', max: 3}
          - {name: r, pattern: 'y(?P<value>{int})', max: 3}
        """,
    )
    with pytest.raises(ValueError, match=r"rule 'r': duplicate name"):
        load_rules(path)


@pytest.mark.parametrize(
    "body, message",
    [
        ("rules: [\n", "invalid YAML"),
        ("- {name: r}\n", "expected a mapping with a 'rules' list"),
        ("rules: []\nwindow: 3\n", "unknown top-level field(s) 'window'"),
    ],
)
def test_file_level_errors(tmp_path, body, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load_rules(write(tmp_path, body))


def test_a_missing_file_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot read rules"):
        load_rules(tmp_path / "nope.yaml")
