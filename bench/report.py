"""What every bench's report shares: text tables, number formatting, the machine it ran on, the
command as typed, and the JSON file. (Each bench lays out its own tables on top of these.)"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from draftmesh import compute

VERSIONED_PACKAGES = ("draftmesh", "torch", "transformers", "ray", "spacy", "redis")


def fmt(x: float | None, spec: str = ".1f", none: str = "-") -> str:
    """``x`` formatted with ``spec``, or ``none`` where there is no value."""
    return none if x is None else format(x, spec)


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool]) -> list[str]:
    """Aligned text columns (``right[i]``: right-align column i), a dashed rule under the header."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells):
        return "  ".join(c.rjust(w) if ra else c.ljust(w) for c, w, ra in zip(cells, widths, right)).rstrip()

    sep = "  ".join("-" * w for w in widths)
    return [line(header), sep, *(line(r) for r in rows)]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_info(packages: Sequence[str] = VERSIONED_PACKAGES) -> dict[str, Any]:
    """CPU model and cores (physical, logical, usable by this process), platform, Python, load and
    the versions of ``packages``: what a reader needs to compare a figure with their own."""
    physical = None
    try:
        text = Path("/proc/cpuinfo").read_text()
        cores = set()
        phys = core = None
        for ln in text.splitlines() + [""]:
            if ln.startswith("physical id"):
                phys = ln.split(":", 1)[1].strip()
            elif ln.startswith("core id"):
                core = ln.split(":", 1)[1].strip()
            elif not ln.strip():
                if core is not None:
                    cores.add((phys, core))
                phys = core = None
        physical = len(cores) or None
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": compute.cpu_model(),
        "physical_cores": physical,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": compute.usable_cpus(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError, AttributeError):
        info["load_avg_1m"] = round(os.getloadavg()[0], 2)
    info["versions"] = {name: _version(name) for name in packages}
    return info


def command_line(prog: str, argv: Sequence[str] | None = None) -> str:
    """The command as typed, for a report's header and JSON (a README figure needs its command).

    The process's own command line when ``argv`` is None or ends it (the program path made
    relative when it lies below the working directory); else ``prog argv`` (a call from code)."""
    typed = list(sys.argv)
    if argv is None or (list(argv) and typed[-len(argv):] == list(argv)) or (not argv and typed[1:] == prog.split()[1:]):
        with contextlib.suppress(ValueError, IndexError):
            rel = os.path.relpath(typed[0])
            if not rel.startswith(".."):
                typed[0] = rel
        return shlex.join(typed)
    return shlex.join([*prog.split(), *argv])


def write_json(path: str | Path, data: Any) -> Path:
    """``data`` as indented JSON at ``path`` (its folder made if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def progress(prog: str, msg: str) -> None:
    """A progress line on stderr (stdout is for the results)."""
    print(f"{prog}: {msg}", file=sys.stderr, flush=True)
