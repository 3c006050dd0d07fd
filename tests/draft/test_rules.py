"""RulesSource: each rule kind on crafted tails, YAML loading and its errors, the defaults."""

from __future__ import annotations

import textwrap

import pytest

from draftmesh.draft.base import DraftContext, DraftSource
from draftmesh.draft.rules import Entry, GazetteerRule, RegexRule, RulesSource, StructureRule


def completions(source: RulesSource, tail: str) -> list[str]:
    return [p.text for p in source.propose(DraftContext(token_ids=[], prompt_len=0, text_tail=tail))]


def one_rule(yaml_rule: str) -> RulesSource:
    return RulesSource.from_yaml("rules:\n" + textwrap.indent(textwrap.dedent(yaml_rule), "  "))


@pytest.fixture(scope="module")
def default() -> RulesSource:
    return RulesSource.default()


# --- regex ---------------------------------------------------------------------------


def test_regex_matches_only_at_the_end_of_the_tail():
    src = one_rule("- {name: in-order, kind: regex, pattern: '\\bin order', completion: ' to'}")
    assert completions(src, "We did it in order") == [" to"]
    assert completions(src, "in order to win") == []
    assert completions(src, "We did it within order") == []


def test_regex_template_substitutes_numbered_and_named_groups():
    src = one_rule(
        """
        - name: close-tag
          kind: regex
          pattern: '<(\\w+)>[^<]*</'
          completion: '{1}>'
        - name: init-assign
          kind: regex
          pattern: '^(?P<indent>[ ]+)self\\.(?P<attr>\\w+) = '
          completion: "{attr}\\n{indent}"
        - name: braces
          kind: regex
          pattern: '\\\\begin\\{(\\w+)\\}[^\\\\]*\\\\end\\{'
          completion: '{1}}}'
        """
    )
    assert completions(src, "<em>hi</") == ["em>"]
    assert completions(src, "    def f(self, size):\n        self.size = ") == ["size\n        "]
    assert completions(src, "\\begin{quote}text\\end{") == ["quote}"]


def test_regex_proposes_only_what_the_tail_lacks():
    src = one_rule("- {name: url, kind: regex, pattern: '\\bhttps?:', completion: '//'}")
    assert completions(src, "see https:") == ["//"]
    assert completions(src, "see https:/") == ["/"]
    assert completions(src, "see https://") == []


def test_regex_ignore_case_and_line_anchors():
    src = one_rule(
        """
        - {name: doctype, kind: regex, pattern: '<!doctype', completion: ' html>', ignore_case: true}
        - {name: numpy, kind: regex, pattern: '^import numpy', completion: ' as np'}
        """
    )
    assert completions(src, "<!DOCTYPE") == [" html>"]
    assert completions(src, "x = 1\nimport numpy") == [" as np"]
    assert completions(src, "x = 1; import numpy") == []


# --- gazetteer -----------------------------------------------------------------------

NAMES = """
- name: names
  kind: gazetteer
  names:
    - Federal Reserve
    - {name: New York, confidence: 0.6}
    - {name: New York City, confidence: 0.5}
    - {name: New York University, confidence: 0.2}
    - New Zealand
"""


def with_options(*options: str) -> RulesSource:
    return one_rule(NAMES.replace("kind: gazetteer", "kind: gazetteer" + "".join(f"\n  {o}" for o in options)))


def test_gazetteer_completes_a_name_from_its_prefix():
    src = one_rule(NAMES)
    assert completions(src, "said the Federal Re") == ["serve"]
    assert completions(src, "said the Federal Reserve") == []
    assert completions(src, "said the Federal Rx") == []


def test_gazetteer_needs_a_word_boundary_and_min_prefix():
    src = one_rule(NAMES)
    assert completions(src, "xFederal Re") == []
    assert completions(src, "Fe") == []
    assert completions(with_options("min_prefix: 9"), "Federal R") == ["eserve"]
    assert completions(with_options("min_prefix: 10"), "Federal R") == []


def test_gazetteer_multi_match_is_capped_and_weighted():
    src = with_options("max_matches: 2", "confidence: 0.3")
    proposals = src.propose(DraftContext(token_ids=[], prompt_len=0, text_tail="moved to New Y"))
    assert [(p.text, p.confidence) for p in proposals] == [("ork", 0.6), ("ork City", 0.5)]
    texts = completions(one_rule(NAMES), "moved to New ")
    assert len(texts) == 3 and "York University" not in texts
    # a fully typed name still proposes the longer names it starts
    assert completions(one_rule(NAMES), "moved to New York") == [" City", " University"]


def test_gazetteer_case_handling():
    sensitive = one_rule(NAMES)
    insensitive = with_options("case_sensitive: false")
    assert completions(sensitive, "the federal re") == []
    assert completions(insensitive, "the federal re") == ["serve"]
    assert completions(insensitive, "the FEDERAL RE") == ["serve"]


def test_gazetteer_file_is_relative_to_the_yaml_file(tmp_path):
    (tmp_path / "lists").mkdir()
    (tmp_path / "lists" / "orgs.txt").write_text(
        "# organisations\nMassachusetts Institute of Technology\t0.9\n\nMassachusetts General Hospital\n"
    )
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {name: orgs, kind: gazetteer, file: lists/orgs.txt, confidence: 0.4}\n")
    src = RulesSource.from_yaml(rules)
    proposals = src.propose(DraftContext(token_ids=[], prompt_len=0, text_tail="at Massachusetts "))
    expected = [("Institute of Technology", 0.9), ("General Hospital", 0.4)]
    assert [(p.text, p.confidence) for p in proposals] == expected
    assert completions(RulesSource.from_yaml(str(rules)), "at Massachusetts Inst") == ["itute of Technology"]


def test_gazetteer_rule_in_python():
    rule = GazetteerRule("g", [Entry("Stack Overflow", 0.5)], min_prefix=5)
    assert rule.complete("ask on Stack O") == [("verflow", 0.5)]


# --- structure -----------------------------------------------------------------------


def structure(mode: str) -> RulesSource:
    return RulesSource([StructureRule(mode, mode)])


def test_close_bracket_after_the_last_item_of_a_multiline_structure():
    src = structure("close_bracket")
    assert completions(src, '{\n  "a": 1,\n  "b": [1, 2]\n') == ["}"]
    assert completions(src, 'data = {\n    "items": [\n        "x",\n        "y"\n') == ["    ]"]
    assert completions(src, 'data = {\n    "items": [\n        "x",\n        "y"\n    ') == ["]"]
    assert completions(src, "result = compute(\n    first,\n    second\n") == [")"]
    # only a guess where an operator may lead the next line
    assert completions(src, "total = (\n    a\n    + b\n") == [")"]


def test_close_bracket_abstains_when_more_items_may_follow():
    src = structure("close_bracket")
    assert completions(src, '{\n  "a": 1,\n') == []  # trailing comma
    assert completions(src, '{\n  "a": {\n') == []  # just opened
    assert completions(src, "x = [1, 2]\n") == []  # nothing open
    assert completions(src, '{\n  "a": 1\n  ') == []  # typed indentation is not the closer's


def test_json_colon_follows_the_spacing_in_use():
    src = structure("json_colon")
    assert completions(src, '{"name": "Ada", "born"') == [": "]
    assert completions(src, '{"name":"Ada","born"') == [":"]
    assert completions(src, '{"name": "Ada"') == []  # a value, not a key
    assert completions(src, 'He said "hi"') == []


def test_close_string_inside_a_json_value():
    src = structure("close_string")
    assert completions(src, '{"key": "value') == ['"']
    assert completions(src, '{"tags": ["a", "b') == ['"']
    assert completions(src, '{"key": "two words ') == []
    assert completions(src, 'She said "hello') == []


def test_numbered_and_bullet_lists():
    numbered, bullets = structure("numbered_list"), structure("bullet_list")
    assert completions(numbered, "Steps:\n3. Mix the flour\n") == ["4. "]
    assert completions(numbered, "Steps:\n  9) Mix the flour\n  10") == [") "]
    assert completions(numbered, "In 2024. Then\n") == []
    assert completions(bullets, "Notes:\n- apples\n") == ["- "]
    assert completions(bullets, "  * nested item\n  ") == ["* "]
    assert completions(bullets, "---\n") == []


# --- format --------------------------------------------------------------------------


def formats(name: str) -> RulesSource:
    return one_rule(f"- {{name: f, kind: format, format: {name}}}")


def test_clock_format():
    src = formats("clock")
    assert completions(src, "at 5:30 p.") == ["m."]
    assert completions(src, "at 5 a.m") == ["."]
    assert completions(src, "at 10:15 P") == ["M"]
    assert completions(src, "at 5:30 p") == []  # "pm" or "p.m.": not determinable


def test_iso_date_format():
    src = formats("iso_date")
    assert completions(src, "released 2024-01") == ["-"]
    assert completions(src, "at 2024-01-15T10") == [":"]
    assert completions(src, "released 2024-13") == []
    assert completions(src, "released 2024-01-") == []


def test_ordinal_format():
    src = formats("ordinal")
    assert completions(src, "the 21s") == ["t"]
    assert completions(src, "the 22n") == ["d"]
    assert completions(src, "the 12t") == ["h"]
    assert completions(src, "the 11s") == []


# --- the source ----------------------------------------------------------------------


def test_proposals_are_deduplicated_ranked_and_capped():
    src = RulesSource(
        [
            RegexRule("low", "abc", "d", confidence=0.2),
            RegexRule("high", "bc", "d", confidence=0.9),
            RegexRule("other", "c", "e", confidence=0.5),
            RegexRule("third", "c", "f", confidence=0.1),
        ],
        max_proposals=2,
    )
    proposals = src.propose(DraftContext(token_ids=[], prompt_len=0, text_tail="xabc"))
    assert [(p.source, p.text, p.token_ids, p.confidence) for p in proposals] == [
        ("rules", "d", None, 0.9),
        ("rules", "e", None, 0.5),
    ]


def test_rules_only_see_the_window():
    rule = RegexRule("r", r"\bsee https?:", "//")
    assert completions(RulesSource([rule], window=20), "x" * 100 + " see https:") == ["//"]
    assert completions(RulesSource([rule], window=8), "x" * 100 + " see https:") == []
    assert completions(RulesSource([rule]), "") == []


def test_disabled_rules_do_not_fire():
    src = one_rule("- {name: unused, kind: regex, pattern: 'a', completion: 'b', enabled: false}")
    assert src.rules == () and completions(src, "a") == []


# --- loading errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ("- {name: broken, kind: regex, pattern: 'a(b', completion: 'x'}", "rule 'broken': bad pattern"),
        ("- {name: escape, kind: regex, pattern: 'a)|(b', completion: 'x'}", "rule 'escape': bad pattern"),
        ("- {name: group, kind: regex, pattern: 'a(b)', completion: '{2}'}", "rule 'group': completion refers to group"),
        ("- {name: brace, kind: regex, pattern: 'a', completion: '}'}", "rule 'brace': bad completion template"),
        ("- {name: nokind, kind: markov}", "rule 'nokind': unknown kind 'markov'"),
        ("- {name: missing, kind: gazetteer, file: nowhere.txt}", "rule 'missing': cannot read gazetteer file"),
        ("- {name: empty, kind: gazetteer, names: []}", "rule 'empty': gazetteer has no names"),
        ("- {name: typo, kind: regex, patern: 'a', completion: 'b'}", "rule 'typo': unknown field(s) 'patern'"),
        ("- {name: nopat, kind: regex, completion: 'b'}", "rule 'nopat': missing field 'pattern'"),
        ("- {name: type, kind: regex, pattern: 'a', completion: {1: null}}", "rule 'type': field 'completion' must be str"),
        ("- {name: conf, kind: regex, pattern: 'a', completion: 'b', confidence: 2}", "rule 'conf': confidence"),
        ("- {name: flag, kind: regex, pattern: 'a', completion: 'b', enabled: 'no'}", "rule 'flag': field 'enabled'"),
        ("- {name: mode, kind: structure, mode: indent}", "rule 'mode': unknown structure mode"),
        ("- {name: fmt, kind: format, format: currency}", "rule 'fmt': unknown format"),
        ("- {name: prefix, kind: gazetteer, names: [Abc], min_prefix: 0}", "rule 'prefix': min_prefix"),
        ("- {name: unused, kind: regex, pattern: '(', completion: 'b', enabled: false}", "rule 'unused': bad pattern"),
        ("- {name: off, kind: format, format: clock}", "rule #1: 'name' must be a non-empty string, got False"),
        ("- {name: twice, kind: format, format: clock}\n" * 2, "rule 'twice': duplicate name"),
        ("- {kind: format, format: clock}", "rule #1: 'name'"),
        ("- just a string", "rule #1: expected a mapping"),
    ],
)
def test_load_errors_name_the_rule(rule, message):
    with pytest.raises(ValueError) as info:
        RulesSource.from_yaml("rules:\n" + textwrap.indent(rule, "  "))
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rules: [", "invalid YAML"),
        ("missing-file.yaml", "expected a mapping with a 'rules' list"),
        ("rules: []\nwindw: 3", "unknown top-level field(s) 'windw'"),
        ("rules: []\nwindow: 0", "window and max_proposals must be >= 1"),
        ("rules: []\nmax_proposals: many", "field 'max_proposals' must be int"),
    ],
)
def test_document_errors(text, message):
    with pytest.raises(ValueError) as info:
        RulesSource.from_yaml(text)
    assert message in str(info.value)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("rules:\n  - {name: broken, kind: regex, pattern: '[', completion: 'x'}\n")
    with pytest.raises(ValueError, match="bad.yaml: rule 'broken'"):
        RulesSource.from_yaml(path)


# --- the shipped defaults --------------------------------------------------------------


def test_default_rules_load(default):
    assert isinstance(default, DraftSource)
    assert default.name == "rules"
    assert len(default.rules) >= 30
    kinds = {type(rule).__name__ for rule in default.rules}
    assert kinds == {"RegexRule", "GazetteerRule", "StructureRule", "FormatRule"}


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        ("The Federal Re", "serve"),
        ("She moved to the United St", "ates"),
        ("He lives in New York Ci", "ty"),
        ("She studied at the Massachusetts Institute of Tech", "nology"),
        ("Check https:", "//"),
        ("if __name__ == ", '"__main__":\n    '),
        ("import numpy", " as np\n"),
        ('{\n  "model": "smollm2",\n  "stream": true\n', "}"),
        ("Steps:\n1. Install it\n", "2. "),
        ("The meeting is at 5:30 p.", "m."),
        ("<p>Hello</", "p>"),
    ],
)
def test_default_rules_complete_common_cases(default, tail, expected):
    assert expected in completions(default, tail)


def test_default_rules_stay_quiet_on_plain_prose(default):
    prose = "The committee met on a quiet morning and agreed, after a long discussion, to wait"
    assert completions(default, prose) == []
