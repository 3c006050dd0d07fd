"""start_mesh's ray.init retry: only a local node's startup timeout is retried, once, after the
half-started node's processes are stopped."""

from __future__ import annotations

import pytest

from draftmesh.router import launcher

GCS = RuntimeError("Timed out waiting for file /tmp/ray/session_x/logs/gcs_server_port_0.txt")
RAYLET = Exception("The current node timed out during startup. This could happen because ...")


@pytest.fixture
def fake_ray(monkeypatch):
    import ray

    calls: list = []

    def install(*failures: BaseException):
        pending = list(failures)

        def init(**kwargs):
            calls.append(("init", kwargs))
            if pending:
                raise pending.pop(0)

        monkeypatch.setattr(ray, "init", init)
        monkeypatch.setattr(ray, "shutdown", lambda: calls.append(("shutdown", None)))
        return calls

    return install


@pytest.mark.parametrize("failure", [GCS, RAYLET])
def test_a_local_startup_timeout_is_retried_once_after_a_shutdown(fake_ray, failure):
    calls = fake_ray(failure)
    launcher._init_ray("local", {"num_cpus": 2})
    assert [name for name, _ in calls] == ["init", "shutdown", "init"]
    assert calls[2][1]["num_cpus"] == 2 and calls[2][1]["address"] == "local"


def test_a_second_timeout_is_raised(fake_ray):
    calls = fake_ray(RAYLET, GCS)
    with pytest.raises(RuntimeError, match="gcs_server_port"):
        launcher._init_ray("local", {})
    assert [name for name, _ in calls] == ["init", "shutdown", "init"]


@pytest.mark.parametrize("address, failure", [
    ("local", ValueError("bad option")),   # not a startup timeout
    ("ray://head:10001", RAYLET),          # an existing cluster: not ours to restart
])
def test_other_failures_are_raised_at_once(fake_ray, address, failure):
    calls = fake_ray(failure)
    with pytest.raises(type(failure)):
        launcher._init_ray(address, {})
    assert [name for name, _ in calls] == ["init"]


LEFTOVERS = """
import json, os, psutil
from draftmesh.router import launcher
try:
    launcher._init_ray("local", {"num_cpus": 1})
except RuntimeError as exc:
    assert "gcs_server_port" in str(exc), exc
else:
    raise SystemExit("ray.init was expected to time out")
children = psutil.Process().children(recursive=True)
print(json.dumps([c.name() for c in children]))
for c in children:
    c.kill()
"""


@pytest.mark.timeout(180)
def test_a_half_started_node_is_stopped_before_the_retry_and_the_error():
    """A real ray.init whose GCS port wait is 0 s fails on both attempts: the gcs_server each attempt
    started is gone afterwards (Ray itself leaves it running, and the retry competed with it)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "RAY_gcs_server_port_wait_time_s": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-c", LEFTOVERS], env=env, capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
    assert "stopped" in out.stderr and "retrying once" in out.stderr, out.stderr[-3000:]

def test_serves_proxy_port_is_picked_after_rays_node_is_up(monkeypatch):
    """A port picked before ``ray.init`` can be taken by one of Ray's own processes by the time
    Serve's proxy binds it ("Address already in use" failed a bench's mesh start): it is picked
    after the node is up, and the gateway is pointed at it then."""
    import ray
    from ray import serve

    from draftmesh.config import DraftmeshConfig
    from draftmesh.net import free_port

    events: list = []

    def pick(host: str = "127.0.0.1") -> int:
        port = free_port(host)
        events.append(("port", port))
        return port

    class Stop(Exception):
        pass

    def serve_start(grpc_options, **_):
        events.append(("serve.start", grpc_options.port))
        raise Stop

    monkeypatch.setattr(launcher, "free_port", pick)
    from draftmesh.fatal_signals import FatalSignalHandlers

    def init_ray(address, options):
        events.append(("ray.init", None))
        return FatalSignalHandlers()  # nothing saved: nothing to put back

    monkeypatch.setattr(launcher, "_init_ray", init_ray)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: events.append(("ray.shutdown", None)))
    monkeypatch.setattr(serve, "start", serve_start)
    cfg = DraftmeshConfig().replace(serve={"grpc_port": free_port(), "redis_url": "redis://127.0.0.1:1/0",
                                           "http_port": 0}, factcheck={"enabled": False})
    with pytest.raises(Stop):
        launcher.start_mesh(cfg)
    names = [name for name, _ in events]
    proxy_port = dict(events)["serve.start"]
    assert ("port", proxy_port) in events
    assert names.index("ray.init") < events.index(("port", proxy_port)) < names.index("serve.start")
    assert names[-1] == "ray.shutdown"  # the failed start still stopped what it started


def test_a_crash_after_the_mesh_stopped_ray_still_prints_its_traceback():
    """A real local Ray: ``ray.shutdown`` resets SIGSEGV to the default action; the launcher's stop
    puts back the handler from before ``ray.init`` (faulthandler's), so a later crash is not silent.
    Three clean-clone CI runs died after every test had passed with no traceback at all."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import ctypes, faulthandler, sys
        import ray
        from draftmesh.router import launcher

        faulthandler.enable()
        handlers = launcher._init_ray("local", {"num_cpus": 1})
        if sys.argv[1] == "launcher":
            launcher._shutdown_ray(handlers)
        else:
            ray.shutdown()
        print("stopped", flush=True)
        ctypes.string_at(0)
    """)
    env = {**__import__("os").environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    runs = {mode: subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                                 timeout=180, env=env) for mode in ("launcher", "bare")}
    for mode, done in runs.items():
        assert "stopped" in done.stdout and done.returncode < 0, (mode, done.stdout, done.stderr[-2000:])
    assert "Fatal Python error: Segmentation fault" in runs["launcher"].stderr, runs["launcher"].stderr[-2000:]
    assert "Fatal Python error" not in runs["bare"].stderr  # Ray's own shutdown: silent


@pytest.mark.parametrize("address, handlers_off, warned", [
    ("local", False, 1),
    ("local", True, 0),
    ("ray://head:10001", False, 0),  # an existing cluster: Ray's processes are not forked here
])
def test_a_local_start_with_grpcs_fork_handlers_on_is_warned_about(fake_ray, monkeypatch, caplog, address,
                                                                    handlers_off, warned):
    """A program that imported grpc before draftmesh keeps gRPC's fork handlers, which killed the
    local node's raylet as Ray forked it (``draftmesh.grpc_fork``): the start says so."""
    fake_ray()
    monkeypatch.setattr(launcher.grpc_fork, "handlers_off", lambda: handlers_off)
    with caplog.at_level("WARNING", logger=launcher.log.name):
        launcher._init_ray(address, {})
    messages = [r.getMessage() for r in caplog.records if "fork handlers" in r.getMessage()]
    assert len(messages) == warned
    if messages:
        assert "GRPC_ENABLE_FORK_SUPPORT=0" in messages[0]
