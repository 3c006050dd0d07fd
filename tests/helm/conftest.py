"""tests/helm: the Helm chart (helm/draftmesh), rendered offline by the real Helm library.

No cluster, no helm binary and no Ray: every values set in chart.VALUE_SETS is rendered once per
session (Helm's coalescing, schema validation and templates), then checked against the
Kubernetes schemas (kubernetes-validate), the KubeRay RayService CRD, Ray Serve's own config
models and draftmesh's own config classes and CLI."""

from __future__ import annotations


import pytest

from helm.chart import VALUE_SETS, Rendered, render


@pytest.fixture(params=list(VALUE_SETS))
def rendered(request) -> Rendered:
    """Each values set, rendered (cached per session)."""
    return render(request.param)


@pytest.fixture
def no_ray_autostart(monkeypatch):
    """Building the app binds deployments without Ray; make sure nothing auto-starts it."""
    import ray
    import ray._private.auto_init_hook as hook

    monkeypatch.setattr(hook, "enable_auto_connect", False)
    before = ray.is_initialized()  # another package's fixture may hold a Ray session; leave it be
    yield
    assert ray.is_initialized() == before, "a helm test started Ray"
