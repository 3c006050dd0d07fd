"""Benchmark workload files: one JSON object per line, validated with line numbers.

A line looks like::

    {"id": "fix-01", "kind": "grounded", "max_new_tokens": 64,
     "messages": [{"role": "user", "content": "Fix the typo ..."}],
     "corpus": ["optional document", "..."], "session": "optional-session-id"}

``id`` and ``kind`` are non-empty strings (``kind`` is free text: grounded, rag, open,
repeat, ...); exactly one of ``messages`` (chat messages with roles system/user/assistant,
rendered with the model's chat template) or ``prompt`` (raw text) is given; ``max_new_tokens`` is an integer >= 1;
``corpus`` is an optional list of document strings (for the rag source) and ``session``
an optional string (items sharing it run in file order within one session). Other keys
are kept in ``WorkItem.extra`` and otherwise ignored. Blank lines are skipped.

Every problem in a file is collected and raised together as one ``WorkloadError``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from draftmesh.prompts import ROLES, encode_messages, encode_prompt

KNOWN_KEYS = frozenset({"id", "kind", "messages", "prompt", "max_new_tokens", "corpus", "session"})


class WorkloadError(ValueError):
    """A workload file with one or more bad lines; ``problems`` holds (line number, message)."""

    def __init__(self, source: str, problems: Sequence[tuple[int, str]]) -> None:
        self.source = source
        self.problems = list(problems)
        lines = "\n".join(f"  line {n}: {msg}" if n else f"  {msg}" for n, msg in self.problems)
        count = len(self.problems)
        super().__init__(f"workload {source}: {count} problem{'s' if count != 1 else ''}\n{lines}")


@dataclass(frozen=True)
class WorkItem:
    id: str
    kind: str
    max_new_tokens: int
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = None
    corpus: tuple[str, ...] = ()
    session: str | None = None
    line: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def with_max_new_tokens(self, n: int) -> "WorkItem":
        from dataclasses import replace

        return replace(self, max_new_tokens=n)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _check_messages(value: Any) -> str | None:
    if not isinstance(value, list) or not value:
        return f"'messages' must be a non-empty list of {{role, content}} objects, got {_type_name(value)}"
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            return f"'messages'[{i}] must be an object, got {_type_name(msg)}"
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            return f"'messages'[{i}] needs a 'role' among {', '.join(ROLES)}, got {role!r}"
        if not isinstance(content, str):
            return f"'messages'[{i}] needs a string 'content', got {_type_name(content)}"
    return None


def _parse_line(obj: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """Check one decoded line; return (fields for WorkItem, problems)."""
    if not isinstance(obj, dict):
        return None, [f"expected a JSON object, got {_type_name(obj)}"]
    problems: list[str] = []
    for key in ("id", "kind"):
        if key not in obj:
            problems.append(f"missing '{key}'")
        elif not isinstance(obj[key], str) or not obj[key].strip():
            problems.append(f"'{key}' must be a non-empty string, got {_type_name(obj[key])} {obj[key]!r}")
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt and has_messages:
        problems.append("give exactly one of 'prompt' or 'messages', not both")
    elif not has_prompt and not has_messages:
        problems.append("missing 'prompt' or 'messages' (give exactly one)")
    elif has_prompt and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        problems.append(f"'prompt' must be a non-empty string, got {_type_name(obj['prompt'])}")
    elif has_messages and (msg := _check_messages(obj["messages"])):
        problems.append(msg)
    if "max_new_tokens" not in obj:
        problems.append("missing 'max_new_tokens'")
    elif not _is_int(obj["max_new_tokens"]) or obj["max_new_tokens"] < 1:
        problems.append(f"'max_new_tokens' must be an integer >= 1, got {obj['max_new_tokens']!r}")
    corpus = obj.get("corpus", [])
    if not isinstance(corpus, list) or not all(isinstance(d, str) for d in corpus):
        problems.append(f"'corpus' must be a list of strings, got {_type_name(corpus)}")
    session = obj.get("session")
    if session is not None and (not isinstance(session, str) or not session):
        problems.append(f"'session' must be a non-empty string, got {_type_name(session)} {session!r}")
    if problems:
        return None, problems
    fields = dict(
        id=obj["id"],
        kind=obj["kind"],
        max_new_tokens=obj["max_new_tokens"],
        prompt=obj.get("prompt"),
        messages=tuple(dict(m) for m in obj["messages"]) if has_messages else None,
        corpus=tuple(corpus),
        session=session,
        extra={k: v for k, v in obj.items() if k not in KNOWN_KEYS},
    )
    return fields, []


def parse_workload(lines: Iterable[str], source: str = "<workload>") -> list[WorkItem]:
    """Parse JSONL text lines into items; raise WorkloadError listing every problem."""
    items: list[WorkItem] = []
    problems: list[tuple[int, str]] = []
    first_line: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            problems.append((number, f"invalid JSON: {exc.msg} (column {exc.colno})"))
            continue
        fields, bad = _parse_line(obj)
        problems.extend((number, msg) for msg in bad)
        if isinstance(obj, dict) and isinstance(obj.get("id"), str) and obj["id"].strip():
            if obj["id"] in first_line:
                problems.append((number, f"duplicate id {obj['id']!r} (first on line {first_line[obj['id']]})"))
                continue
            first_line[obj["id"]] = number
        if fields is not None:
            items.append(WorkItem(line=number, **fields))
    if not items and not problems:
        problems.append((0, "no items (the file is empty)"))
    if problems:
        raise WorkloadError(source, problems)
    return items


def load_workload(path: str | Path) -> list[WorkItem]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(str(path), [(0, f"cannot read: {exc.strerror or exc}")]) from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError(str(path), [(0, f"not UTF-8 text: {exc}")]) from exc
    return parse_workload(text.splitlines(), source=str(path))


def items_of_kinds(items: Sequence[WorkItem], kinds: str) -> list[WorkItem]:
    """The items whose ``kind`` is in the comma-separated ``kinds``, in workload order (``--kinds``):
    a kind no item has is a ValueError naming it and the kinds there are, not an empty run."""
    wanted = list(dict.fromkeys(k.strip() for k in kinds.split(",") if k.strip()))
    present = sorted({it.kind for it in items})
    missing = [k for k in wanted if k not in present]
    if not wanted or missing:
        raise ValueError(f"--kinds: no item of kind {', '.join(missing) or '(none given)'} in the workload; "
                         f"its kinds: {', '.join(present)}")
    return [it for it in items if it.kind in wanted]


def render_prompt_ids(item: WorkItem, tokenizer) -> list[int]:
    """The prompt token ids, rendered exactly as ``draftmesh run`` does (``draftmesh.prompts``):
    ``messages`` through the model's chat template (a plain transcript for models without
    one), ``prompt`` by plain encoding."""
    if item.messages is not None:
        ids = encode_messages(tokenizer, list(item.messages))
    else:
        ids = encode_prompt(tokenizer, item.prompt)
    return [int(t) for t in ids]
