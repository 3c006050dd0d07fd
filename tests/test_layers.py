"""The layers contract (pyproject ``[tool.importlinter]``), checked with the real ``lint-imports``.

The package is spread over the repository by setuptools ``package-dir`` (``draftmesh`` is
``core/``, ``draftmesh.verify`` is ``services/verify/``, ...), which grimp cannot follow, so the
tests lay the package out as one tree of symlinks (``package_view``) and point ``lint-imports`` at
it. A wrong-way import, an import cycle between siblings and an import of a fact-check internal
each break a contract; the view lets a test add one without touching the repository.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def package_view(into: Path) -> Path:
    """``into``/draftmesh as the import system sees it: symlinks to the repository's files."""
    top = into / "draftmesh"
    top.mkdir(parents=True)
    for path in sorted((ROOT / PACKAGE_DIRS["draftmesh"]).glob("*.py")):
        (top / path.name).symlink_to(path)
    for name, folder in sorted(PACKAGE_DIRS.items()):
        parts = name.split(".")
        if len(parts) == 2:  # the subpackages; deeper ones (bench.factcheck) lie inside their parent's folder
            (top / parts[1]).symlink_to(ROOT / folder, target_is_directory=True)
    return into


def lint(view: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(view)}
    return subprocess.run([str(LINT_IMPORTS), "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)


def with_import(view: Path, module_file: str, line: str) -> None:
    """Replace the view's symlink of ``module_file`` (relative to the view's draftmesh/) by a copy
    that also has ``line``. A symlinked folder on the way becomes a real folder of symlinks first,
    so the repository's own file is never touched."""
    folder = view / "draftmesh"
    for part in Path(module_file).parts[:-1]:
        folder = folder / part
        if folder.is_symlink():
            target = folder.resolve()
            folder.unlink()
            folder.mkdir()
            for child in target.iterdir():
                (folder / child.name).symlink_to(child, target_is_directory=child.is_dir())
    path = folder / Path(module_file).name
    assert path.is_symlink(), f"{path} is not a link of the view"
    text = path.read_text(encoding="utf-8")
    path.unlink()
    path.write_text(text + "\n" + line + "\n", encoding="utf-8")


def test_the_package_keeps_its_contracts(tmp_path):
    run = lint(package_view(tmp_path))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Contracts: 3 kept, 0 broken." in run.stdout


@pytest.mark.parametrize("module_file, line, broken, shown", [
    # the base reaching up into the engine
    ("config.py", "from draftmesh.verify import engine  # a wrong-way import", "layers", "draftmesh.config -> draftmesh.verify.engine"),
    # a draft source reaching into verify (what draft.llm used to do), even from inside a function
    ("draft/rag.py", "def _wrong():\n    from draftmesh.verify.acceptance import Verdict  # lazy: wrong anyway", "layers",
     "draftmesh.draft.rag -> draftmesh.verify.acceptance"),
    # policy and lossy importing each other (the old cycle)
    ("verify/lossy.py", "from draftmesh.verify import policy", "no import cycles", "No cycles are allowed in draftmesh.verify"),
    # the router using a fact-check internal instead of the client
    ("router/ingress.py", "from draftmesh.factcheck import ner", "factcheck is reached only", "draftmesh.factcheck.ner"),
])
def test_a_wrong_import_breaks_a_contract(tmp_path, module_file, line, broken, shown):
    view = package_view(tmp_path)
    with_import(view, module_file, line)
    run = lint(view)
    assert run.returncode != 0
    out = re.sub(r"\s+", " ", run.stdout)
    assert re.search(re.escape(broken) + r".*? BROKEN", out), run.stdout
    assert shown in out, run.stdout


def test_the_view_is_the_installed_package(tmp_path):
    """The view holds exactly the modules the installed package has (a wrong view would prove nothing)."""
    view = package_view(tmp_path)
    code = ("import pkgutil, draftmesh; print(sorted(m.name for m in pkgutil.walk_packages(draftmesh.__path__, "
            "'draftmesh.', onerror=lambda name: None) if not m.name.startswith('draftmesh.v1')))")
    seen = {}
    for where, extra in (("view", {"PYTHONPATH": str(view)}), ("installed", {})):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                             env={**os.environ, **extra}, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        seen[where] = out.stdout
    assert seen["view"] == seen["installed"]


def test_every_factcheck_module_is_public_or_protected():
    """A new fact-check module must be declared either public (what the rest may import) or
    protected (the contract's list), so the contract cannot miss it."""
    public = {"protocol", "client", "processes"}
    (contract,) = [c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["type"] == "protected"]
    protected = {m.rsplit(".", 1)[1] for m in contract["protected_modules"]}
    modules = {p.stem for p in (ROOT / PACKAGE_DIRS["draftmesh.factcheck"]).glob("*.py") if p.stem != "__init__"}
    assert not public & protected
    assert modules == public | protected


def _package_files() -> list[Path]:
    files = []
    for name, folder in PACKAGE_DIRS.items():
        if name == "draftmesh.v1":
            continue  # generated stubs
        files += sorted((ROOT / folder).glob("*.py"))
    return files


def test_function_level_imports_of_draftmesh_say_why():
    """An import inside a function must not dodge the layers: one of draftmesh's modules there
    is allowed only as a lazy import for start-up time, and its comment says so ("# lazy: ...",
    on the import or on the comment and import lines right above it)."""
    missing = []
    for path in _package_files():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        tree = ast.parse(source)
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if not isinstance(node, (ast.Import, ast.ImportFrom)):
                    continue
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                if not any(n == "draftmesh" or n.startswith("draftmesh.") for n in names):
                    continue
                said = "# lazy" in lines[node.lineno - 1]
                above = node.lineno - 2
                while not said and above >= 0 and (not lines[above].strip()
                                                    or lines[above].strip().startswith(("#", "from ", "import "))):
                    said = "# lazy" in lines[above]
                    above -= 1
                if not said:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    assert not missing, "function-level imports without a '# lazy: why' comment:\n" + "\n".join(missing)


def test_lint_imports_is_installed():
    assert shutil.which(str(LINT_IMPORTS)), "import-linter is a test dependency (pyproject [test])"
