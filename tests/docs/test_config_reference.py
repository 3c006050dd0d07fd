"""docs/config.md lists every config field as the dataclasses define it (key, flag, env, default,
help): the reference cannot drift from the code. On a mismatch the message holds the table to paste."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from draftmesh.config import DraftmeshConfig, leaves

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"
BEGIN, END = "<!-- fields: generated from draftmesh.config; tests/docs/test_config_reference.py -->", "<!-- end fields -->"


def _default(leaf) -> str:
    f = leaf.field
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if value in (None, {}, [], ()):
        return "-"
    if isinstance(value, tuple):
        value = list(value)
    return f"`{value}`"


def reference() -> str:
    lines = []
    for section in dataclasses.fields(DraftmeshConfig):
        lines += ["", f"### `{section.name}`: {section.metadata['help']}", "",
                  "| key | flag | env | default | meaning |", "| --- | --- | --- | --- | --- |"]
        for leaf in leaves(sections=(section.name,)):
            flag = "(file only)" if leaf.file_only else f"`--{leaf.flag}`"
            env = "" if leaf.file_only else f"`{leaf.env}`"
            meaning = leaf.field.metadata["help"].replace("|", "\\|")
            lines.append(f"| `{leaf.name}` | {flag} | {env} | {_default(leaf)} | {meaning} |")
    return "\n".join(lines).strip()


def test_the_reference_lists_every_field_as_the_code_does():
    text = DOC.read_text(encoding="utf-8")
    assert BEGIN in text and END in text, f"{DOC} lacks the generated section markers"
    documented = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    want = reference()
    assert documented == want, f"docs/config.md is out of date; the section should read:\n\n{want}\n"


def test_every_config_example_in_the_docs_loads():
    """The YAML config examples of the docs are real configs (sections, keys, typed specs)."""
    import re

    import yaml

    docs = Path(__file__).resolve().parents[2] / "docs"
    found = 0
    for path in sorted(docs.glob("*.md")):
        for block in re.findall(r"```yaml\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            if not block.lstrip().startswith("# mesh.yaml"):
                continue  # only the blocks that say they are a `draftmesh serve --config` file
            DraftmeshConfig.from_dict(yaml.safe_load(block))
            found += 1
    assert found >= 2
