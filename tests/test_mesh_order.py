"""The collection order conftest applies (``served_mesh.mesh_users_last``): mesh users last, the tests
that break the mesh after them, the rest in collection order."""

from __future__ import annotations

from types import SimpleNamespace

from served_mesh import mesh_users_last


def served():
    """The served mesh's fixture function (what pytest's FixtureDef.func is)."""


served.__module__ = "served_mesh"


def own_mesh():
    """Another module's fixture that is also called ``mesh`` (tests/deploy/test_dockerfiles.py has one)."""


class Item:
    """What the hook reads of a pytest item: the definitions of its fixtures and its markers."""

    def __init__(self, name: str, fixtures: tuple[str, ...] = (), breaks: bool = False, mesh=served) -> None:
        defs = {f: [SimpleNamespace(func=mesh if f == "mesh" else own_mesh)] for f in fixtures}
        self.name, self._fixtureinfo, self._breaks = name, SimpleNamespace(name2fixturedefs=defs), breaks

    def get_closest_marker(self, name: str):
        return object() if name == "breaks_mesh" and self._breaks else None


def test_mesh_users_run_last_and_the_ones_that_break_it_after_them():
    items = [
        Item("lost_replica", ("mesh", "stub"), breaks=True),
        Item("http_chat", ("client", "base_url", "mesh")),
        Item("unit_a"),
        Item("redis_stopped", ("mesh",), breaks=True),
        Item("grpc_complete", ("stub", "channel", "mesh")),
        Item("unit_b", ("tiny",)),
        Item("marked_but_no_mesh", breaks=True),
        Item("dockerfile_mesh", ("mesh",), mesh=own_mesh),  # its own fixture named mesh: not a user
    ]
    assert [i.name for i in mesh_users_last(items)] == [
        "unit_a", "unit_b", "marked_but_no_mesh", "dockerfile_mesh", "http_chat", "grpc_complete", "lost_replica",
        "redis_stopped"]

