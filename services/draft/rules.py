"""A draft source driven by hand-written rules: phrases, names, structure, formats.

Some continuations are near certain from the last characters alone ("https:" -> "//",
"Federal Re" -> "serve", the "]" closing a multi-line list). Rules find them at no model
cost, and since the verifier keeps the output lossless when a rule is wrong, a rule only
has to be right often enough to pay for the tree nodes it adds. Rules are data (YAML, see
docs/rules.md) so a deployment can tune them without code. Proposals are text; the tree
builder aligns them to target tokens (draftmesh.draft.align).
"""

from __future__ import annotations

import os
import re
import re._parser as re_parser  # the stdlib's own pattern parser, for a pattern's width
import string
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import yaml

from draftmesh.draft.base import DraftContext, Proposal

DEFAULT_RULES = "default_rules.yaml"
DEFAULT_CONFIDENCE = {"regex": 0.6, "gazetteer": 0.4, "structure": 0.5, "format": 0.7}

Completion = tuple[str, float]
"""Text to append to the tail, and the confidence the rule has in it."""


class Rule(Protocol):
    """One rule: looks at the end of the tail and returns completions (often none)."""

    name: str

    def complete(self, tail: str) -> list[Completion]: ...


def _check_confidence(rule: str, confidence: float) -> None:
    if not 0.0 <= confidence <= 1.0:
        raise ValueError(f"rule {rule!r}: confidence must be within [0, 1], got {confidence!r}")


def _rest_of(expected: str, typed: str) -> str | None:
    """What remains of ``expected`` after the ``typed`` start of it, if anything."""
    return expected[len(typed) :] if len(expected) > len(typed) and expected.startswith(typed) else None


# --- regex -------------------------------------------------------------------------


class _Template:
    """A completion with ``{1}`` / ``{name}`` group references, checked and parsed once."""

    def __init__(self, template: str, regex: re.Pattern[str], rule: str) -> None:
        try:
            parsed = list(string.Formatter().parse(template))
        except ValueError as exc:
            raise ValueError(f"rule {rule!r}: bad completion template {template!r}: {exc}") from None
        pieces: list[tuple[str, int | str | None]] = []
        for literal, field, spec, conversion in parsed:
            ref: int | str | None = None
            if field is not None:
                if spec or conversion:
                    raise ValueError(f"rule {rule!r}: completion field {{{field}}} takes no format or conversion")
                ref = int(field) if field.isdigit() else field
                if ref not in regex.groupindex and not (isinstance(ref, int) and ref <= regex.groups):
                    raise ValueError(f"rule {rule!r}: completion refers to group {{{field}}} that the pattern lacks")
            pieces.append((literal, ref))
        self._pieces = tuple(pieces)
        self.lead = pieces[0][0] if pieces else ""
        """The literal text before the first group reference."""

    def render(self, match: re.Match[str]) -> str:
        return "".join(lit + ((match.group(ref) or "") if ref is not None else "") for lit, ref in self._pieces)


class RegexRule:
    """Completes a tail whose end matches ``pattern`` with the ``completion`` template.

    The tail may already hold the start of the completion's leading literal text
    ("5:30 p." with completion ".m."): only the rest is proposed.
    """

    def __init__(
        self,
        name: str,
        pattern: str,
        completion: str,
        *,
        confidence: float = DEFAULT_CONFIDENCE["regex"],
        ignore_case: bool = False,
    ) -> None:
        _check_confidence(name, confidence)
        flags = re.MULTILINE | (re.IGNORECASE if ignore_case else 0)
        try:  # parsed alone first, so that "a)|(b" cannot escape the end anchor
            self._reach = min(re_parser.parse(pattern, flags).getwidth()[1], sys.maxsize)
            """The most characters a match can span: searching further back is wasted work."""
            self._regex = re.compile(f"(?:{pattern})\\Z", flags)
        except re.error as exc:
            raise ValueError(f"rule {name!r}: bad pattern {pattern!r}: {exc}") from None
        self._template = _Template(completion, self._regex, name)
        self.name = name
        self.confidence = confidence

    def complete(self, tail: str) -> list[Completion]:
        lead = self._template.lead
        # Where the tail may already hold the start of the lead (rarely: test cheaply first).
        first = tail.find(lead[0], len(tail) - len(lead)) if lead else -1
        for typed in (self._typed_lengths(tail, first) if first >= 0 else (0,)):
            end = len(tail) - typed
            match = self._regex.search(tail, end - self._reach, end)  # pos < 0 means 0
            if match:
                rest = self._template.render(match)[typed:]
                return [(rest, self.confidence)] if rest else []
        return []

    def _typed_lengths(self, tail: str, first: int) -> list[int]:
        """How much of the lead the tail may end with, longest first, then 0; ``first``
        is the first place the lead's first character occurs near the end."""
        lead, lengths, i = self._template.lead, [], first
        while i >= 0:
            if lead.startswith(tail[i:]):
                lengths.append(len(tail) - i)
            i = tail.find(lead[0], i + 1)
        lengths.append(0)
        return lengths


# --- gazetteer ---------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """A gazetteer name and how likely it is once its prefix has been typed."""

    name: str
    confidence: float


class _Node:
    __slots__ = ("children", "top")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.top: tuple[Entry, ...] = ()
        """The best longer names below this prefix, best first."""


def _fold_char(ch: str) -> str:
    """Case-fold one character, keeping it when folding would change the length ('ß')."""
    folded = ch.casefold()
    return folded if len(folded) == 1 else ch


def _rank(entries: Iterable[Entry], limit: int) -> list[Entry]:
    return sorted(entries, key=lambda e: (-e.confidence, len(e.name), e.name))[:limit]


class GazetteerRule:
    """Completes a known name when the tail ends with its first characters ("Federal Re").

    Names live in a character trie whose nodes keep their best completions, so a step
    costs one short walk per word start near the end of the tail.
    """

    def __init__(
        self,
        name: str,
        entries: Iterable[Entry],
        *,
        min_prefix: int = 3,
        case_sensitive: bool = True,
        max_matches: int = 3,
    ) -> None:
        if min_prefix < 1 or max_matches < 1:
            raise ValueError(f"rule {name!r}: min_prefix and max_matches must be >= 1")
        self.name = name
        self.min_prefix = min_prefix
        self.max_matches = max_matches
        self._fold: Callable[[str], str] = (lambda ch: ch) if case_sensitive else _fold_char
        self._root = _Node()
        self._longest = 0
        terminals: dict[int, list[Entry]] = {}
        for entry in entries:
            _check_confidence(name, entry.confidence)
            node = self._root
            for ch in entry.name:
                node = node.children.setdefault(self._fold(ch), _Node())
            terminals.setdefault(id(node), []).append(entry)
            self._longest = max(self._longest, len(entry.name))
        if not terminals:
            raise ValueError(f"rule {name!r}: gazetteer has no names")
        self._fill(terminals)
        # Candidate starts: a possible first character not preceded by a letter or digit.
        first = "".join(re.escape(ch) for ch in self._root.children)
        self._starts = re.compile(f"(?<![^\\W_])[{first}]", 0 if case_sensitive else re.IGNORECASE)

    def _fill(self, terminals: dict[int, list[Entry]]) -> None:
        """Set each node's ``top``: the best names strictly longer than its prefix."""
        order, stack = [], [self._root]
        while stack:  # preorder, iterative: a long name must not exhaust the recursion limit
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        subtree: dict[int, list[Entry]] = {}  # best names of a node's subtree, itself included
        for node in reversed(order):  # children before their parent
            below = [e for child in node.children.values() for e in subtree[id(child)]]
            node.top = tuple(_rank(below, self.max_matches))
            subtree[id(node)] = _rank(terminals.get(id(node), []) + below, self.max_matches)

    def complete(self, tail: str) -> list[Completion]:
        out: dict[str, float] = {}
        fold, end = self._fold, len(tail)
        # Earlier starts first: a longer typed prefix is better evidence.
        for start in self._starts.finditer(tail, max(0, end - self._longest), end - self.min_prefix + 1):
            node: _Node | None = self._root
            for ch in tail[start.start() :]:
                node = node.children.get(fold(ch))
                if node is None:
                    break
            if node is None:
                continue
            typed = end - start.start()
            for entry in node.top:
                out.setdefault(entry.name[typed:], entry.confidence)
                if len(out) == self.max_matches:
                    return list(out.items())
        return list(out.items())


# --- structure ---------------------------------------------------------------------

_PAIRS = {"(": ")", "[": "]", "{": "}"}
_OPENER_OF = {close: open_ for open_, close in _PAIRS.items()}
_STRUCTURAL = re.compile(r'[()\[\]{}"\\\n]')
_NUMBERED = re.compile(r"([ \t]*)(\d{1,3})([.)])[ \t]+\S")
_BULLET = re.compile(r"([ \t]*)([-*+•])[ \t]+\S")
_INDENT = re.compile(r"[ \t]*")


def _scan(text: str) -> tuple[list[int], int | None]:
    """Positions of the unclosed brackets (innermost last) and of an unclosed ``"``.

    Only double quotes open strings (apostrophes are too common in prose), and a string
    ends at a newline as in JSON, which resynchronises after a stray quote in prose.
    Closers without a matching opener (opened before the window) are ignored.
    """
    stack: list[int] = []
    in_string: int | None = None
    escaped = -1
    for m in _STRUCTURAL.finditer(text):
        i, ch = m.start(), m.group()
        if i == escaped:
            continue
        if ch == "\n":
            in_string = None
        elif in_string is not None:
            if ch == "\\":
                escaped = i + 1
            elif ch == '"':
                in_string = None
        elif ch == '"':
            in_string = i
        elif ch in _PAIRS:
            stack.append(i)
        elif ch in _OPENER_OF:
            for j in range(len(stack) - 1, -1, -1):
                if text[stack[j]] == _OPENER_OF[ch]:
                    del stack[j:]
                    break
    return stack, in_string


def _lines(tail: str) -> tuple[int, str, str] | None:
    """(start of the previous line, the previous line, what is typed of the current one)."""
    nl = tail.rfind("\n")
    if nl < 0:
        return None
    prev_start = tail.rfind("\n", 0, nl) + 1
    return prev_start, tail[prev_start:nl], tail[nl + 1 :]


def _close_bracket(tail: str) -> str | None:
    """A line just ended on a value inside a multi-line bracket: the closer comes next.

    '[\\n  1,\\n  2\\n' -> ']'. Without a trailing comma the previous line was the last
    item, and the closer sits at the indentation of the line that opened the bracket.
    """
    lines = _lines(tail)
    if lines is None:
        return None
    prev_start, prev, typed = lines
    body = prev.strip()
    if typed.strip() or not body or body.startswith(("#", "//")):
        return None
    if not (body[-1].isalnum() or body[-1] in "\"')]}"):
        return None
    stack, in_string = _scan(tail[: prev_start + len(prev)])
    if in_string is not None or not stack or stack[-1] >= prev_start:
        return None  # the bracket must have opened before the line that just ended
    opener = stack[-1]
    open_line = tail[tail.rfind("\n", 0, opener) + 1 :]
    indent = _INDENT.match(open_line).group()
    if len(_INDENT.match(prev).group()) <= len(indent):
        return None  # items sit deeper than their bracket; anything else is not a list
    return _rest_of(indent + _PAIRS[tail[opener]], typed)


def _json_colon(tail: str) -> str | None:
    """A JSON key just closed ('{"name"'): the colon, spaced as the text already does."""
    if not tail.endswith('"'):
        return None
    stack, key_start = _scan(tail[:-1])
    if key_start is None or not stack or tail[stack[-1]] != "{":
        return None
    before = tail[:key_start].rstrip()
    if not before or before[-1] not in "{,":
        return None
    seen = tail.rfind('":', 0, key_start)
    return ":" if seen >= 0 and tail[seen + 2 : seen + 3] not in (" ", "") else ": "


def _close_string(tail: str) -> str | None:
    """Inside a JSON string value ('"key": "value'): the closing quote.

    Only a guess (the value may go on), so it is the lowest-confidence structure rule.
    """
    if '"' not in tail[tail.rfind("\n") + 1 :]:
        return None  # strings end at a newline, so an open one starts on the last line
    stack, start = _scan(tail)
    if start is None or not stack:
        return None
    content = tail[start + 1 :]
    if not content or content[-1].isspace() or content[-1] == "\\":
        return None
    before = tail[:start].rstrip()
    inner = tail[stack[-1]]
    if before and ((inner == "{" and before[-1] == ":") or (inner == "[" and before[-1] in "[,")):
        return '"'
    return None


def _numbered_list(tail: str) -> str | None:
    """'3. foo\\n' -> '4. ' (same indentation and separator)."""
    lines = _lines(tail)
    m = _NUMBERED.match(lines[1]) if lines else None
    if not (lines and m):
        return None
    return _rest_of(f"{m.group(1)}{int(m.group(2)) + 1}{m.group(3)} ", lines[2])


def _bullet_list(tail: str) -> str | None:
    """'- foo\\n' -> '- ' (same indentation and marker)."""
    lines = _lines(tail)
    m = _BULLET.match(lines[1]) if lines else None
    if not (lines and m):
        return None
    return _rest_of(f"{m.group(1)}{m.group(2)} ", lines[2])


STRUCTURE_MODES: dict[str, Callable[[str], str | None]] = {
    "close_bracket": _close_bracket,
    "json_colon": _json_colon,
    "close_string": _close_string,
    "numbered_list": _numbered_list,
    "bullet_list": _bullet_list,
}


class StructureRule:
    """Completes what the open structure of the tail implies (brackets, JSON, lists)."""

    def __init__(self, name: str, mode: str, *, confidence: float = DEFAULT_CONFIDENCE["structure"]) -> None:
        _check_confidence(name, confidence)
        if mode not in STRUCTURE_MODES:
            raise ValueError(f"rule {name!r}: unknown structure mode {mode!r} (one of {', '.join(STRUCTURE_MODES)})")
        self.name = name
        self.confidence = confidence
        self._complete = STRUCTURE_MODES[mode]

    def complete(self, tail: str) -> list[Completion]:
        text = self._complete(tail)
        return [(text, self.confidence)] if text else []


# --- format ------------------------------------------------------------------------

FORMATS: dict[str, tuple[tuple[str, str], ...]] = {
    # "5:30 p." -> "m.", "5 a.m" -> ".", "5:30 P" -> "M"; a bare "5:30 p" may be "pm".
    "clock": ((r"\b\d{1,2}(?::\d{2})? ?[ap]\.", "m."), (r"\b\d{1,2}:\d{2} ?[AP]", "M")),
    # "2024-01" -> "-", "2024-01-15T10" -> ":", "...T10:30" -> ":" (seconds).
    "iso_date": (
        (r"\b(?:19|20)\d{2}-(?:0[1-9]|1[0-2])", "-"),
        (r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}", ":"),
        (r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}", ":"),
    ),
    # "21s" -> "t", "2n" -> "d", "13t" -> "h" (11th-13th are irregular).
    "ordinal": (
        (r"(?<![\d.])(?:\d{0,5}[02-9])?1s", "t"),
        (r"(?<![\d.])(?:\d{0,5}[02-9])?(?:2n|3r)", "d"),
        (r"(?<![\d.])\d{0,5}(?:1[1-3]|[04-9])t", "h"),
    ),
}


class FormatRule:
    """A built-in, conservative family of patterns (``FORMATS``) enabled by name."""

    def __init__(self, name: str, format: str, *, confidence: float = DEFAULT_CONFIDENCE["format"]) -> None:
        if format not in FORMATS:
            raise ValueError(f"rule {name!r}: unknown format {format!r} (one of {', '.join(FORMATS)})")
        self.name = name
        self._parts = [RegexRule(name, p, c, confidence=confidence) for p, c in FORMATS[format]]

    def complete(self, tail: str) -> list[Completion]:
        return [c for part in self._parts for c in part.complete(tail)]


# --- loading -----------------------------------------------------------------------

_COMMON_FIELDS = {"name", "kind", "confidence", "enabled"}
_KIND_FIELDS = {
    "regex": {"pattern", "completion", "ignore_case"},
    "gazetteer": {"names", "file", "min_prefix", "case_sensitive", "max_matches"},
    "structure": {"mode"},
    "format": {"format"},
}
_TOP_FIELDS = {"rules", "window", "max_proposals"}
_REQUIRED = object()


def _field(spec: Mapping[str, Any], key: str, kind: type, default: Any, where: str) -> Any:
    """``spec[key]`` checked against ``kind`` (bools are not numbers; ints are floats)."""
    value = spec.get(key, default)
    if value is _REQUIRED:
        raise ValueError(f"{where}: missing field {key!r}")
    kinds = (int, float) if kind is float else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and kind is not bool):
        raise ValueError(f"{where}: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _entries(spec: Mapping[str, Any], confidence: float, base_dir: Path, where: str) -> list[Entry]:
    """Names given inline (strings or {name, confidence}) and/or one per line in ``file``."""
    entries = []
    for item in _field(spec, "names", list, [], where):
        if isinstance(item, str):
            entries.append(Entry(item, confidence))
        elif isinstance(item, Mapping) and set(item) <= {"name", "confidence"}:
            weight = _field(item, "confidence", float, confidence, where)
            entries.append(Entry(_field(item, "name", str, _REQUIRED, where), weight))
        else:
            raise ValueError(f"{where}: a name must be a string or {{name, confidence}}, got {item!r}")
    file = _field(spec, "file", str, "", where)
    if file:
        path = base_dir / file
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise ValueError(f"{where}: cannot read gazetteer file {str(path)!r}: {exc.strerror or exc}") from None
        for line in lines:
            if line.strip() and not line.lstrip().startswith("#"):
                name, _, weight = line.rstrip().partition("\t")
                try:
                    entries.append(Entry(name, float(weight) if weight else confidence))
                except ValueError:
                    raise ValueError(f"{where}: bad confidence {weight!r} for {name!r} in {str(path)!r}") from None
    return [e for e in entries if e.name.strip()]


def _build(spec: Any, index: int, base_dir: Path) -> tuple[str, Rule | None]:
    """(name, rule) from one YAML rule mapping; the rule is None when disabled.

    Disabled rules are still compiled, so their errors show before anyone enables them.
    """
    if not isinstance(spec, Mapping):
        raise ValueError(f"rule #{index + 1}: expected a mapping, got {spec!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"rule #{index + 1}: 'name' must be a non-empty string, got {name!r}")
    where = f"rule {name!r}"
    kind = spec.get("kind")
    if kind not in _KIND_FIELDS:
        raise ValueError(f"{where}: unknown kind {kind!r} (one of {', '.join(_KIND_FIELDS)})")
    unknown = set(spec) - _COMMON_FIELDS - _KIND_FIELDS[kind]
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(map(repr, sorted(unknown)))} for kind {kind!r}")
    confidence = _field(spec, "confidence", float, DEFAULT_CONFIDENCE[kind], where)
    _check_confidence(name, confidence)
    enabled = _field(spec, "enabled", bool, True, where)
    rule: Rule
    if kind == "regex":
        rule = RegexRule(
            name,
            _field(spec, "pattern", str, _REQUIRED, where),
            _field(spec, "completion", str, _REQUIRED, where),
            confidence=confidence,
            ignore_case=_field(spec, "ignore_case", bool, False, where),
        )
    elif kind == "gazetteer":
        rule = GazetteerRule(
            name,
            _entries(spec, confidence, base_dir, where),
            min_prefix=_field(spec, "min_prefix", int, 3, where),
            case_sensitive=_field(spec, "case_sensitive", bool, True, where),
            max_matches=_field(spec, "max_matches", int, 3, where),
        )
    elif kind == "structure":
        rule = StructureRule(name, _field(spec, "mode", str, _REQUIRED, where), confidence=confidence)
    else:
        rule = FormatRule(name, _field(spec, "format", str, _REQUIRED, where), confidence=confidence)
    return name, rule if enabled else None


class RulesSource:
    """DraftSource proposing, as text, the completions of its rules for the tail's end."""

    name = "rules"

    def __init__(self, rules: Sequence[Rule], *, window: int = 200, max_proposals: int = 8) -> None:
        if window < 1 or max_proposals < 1:
            raise ValueError("window and max_proposals must be >= 1")
        self.rules = tuple(rules)
        self.window = window
        """Rules see only this many trailing characters: propose runs every step."""
        self.max_proposals = max_proposals

    @classmethod
    def from_yaml(cls, source: str | os.PathLike[str]) -> RulesSource:
        """Load rules from a YAML file (a path, or a string naming an existing file) or
        from YAML text. Gazetteer files resolve against the YAML file's folder (the
        working directory for text). Any invalid rule is a ValueError naming it."""
        if isinstance(source, os.PathLike) or ("\n" not in source and os.path.isfile(source)):
            path = Path(source)
            return cls._parse(path.read_text(encoding="utf-8"), path.parent, str(path))
        return cls._parse(source, Path.cwd(), "rules text")

    @classmethod
    def default(cls) -> RulesSource:
        """The rules shipped with draftmesh (default_rules.yaml)."""
        with resources.as_file(resources.files(__package__) / DEFAULT_RULES) as path:
            return cls.from_yaml(path)

    @classmethod
    def _parse(cls, text: str, base_dir: Path, origin: str) -> RulesSource:
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{origin}: invalid YAML: {exc}") from None
        if not isinstance(doc, Mapping) or not isinstance(doc.get("rules"), list):
            raise ValueError(f"{origin}: expected a mapping with a 'rules' list (or a path to an existing file)")
        unknown = set(doc) - _TOP_FIELDS
        if unknown:
            raise ValueError(f"{origin}: unknown top-level field(s) {', '.join(map(repr, sorted(unknown)))}")
        rules: list[Rule] = []
        names: set[str] = set()
        try:
            settings = {
                key: _field(doc, key, int, None, "top level") for key in ("window", "max_proposals") if key in doc
            }
            for index, spec in enumerate(doc["rules"]):
                name, rule = _build(spec, index, base_dir)
                if name in names:
                    raise ValueError(f"rule {name!r}: duplicate name")
                names.add(name)
                if rule is not None:
                    rules.append(rule)
            return cls(rules, **settings)
        except ValueError as exc:
            raise ValueError(f"{origin}: {exc}") from None

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        tail = ctx.text_tail[-self.window :]
        if not tail:
            return []
        best: dict[str, float] = {}
        for rule in self.rules:
            for text, confidence in rule.complete(tail):
                if text and confidence > best.get(text, -1.0):
                    best[text] = confidence
        ranked = sorted(best.items(), key=lambda item: -item[1])[: self.max_proposals]
        # Rules complete whole units (a name, a closer, a phrase), so the last token counts.
        return [
            Proposal(source=self.name, text=text, confidence=confidence, text_complete=True)
            for text, confidence in ranked
        ]
