"""start_mesh's ray.init retry: only a local node's startup timeout is retried, once."""

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
