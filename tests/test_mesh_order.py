"""The collection order conftest applies (``served_mesh.mesh_users_last``): mesh users last, the tests
that break the mesh after them, the rest in collection order."""

from __future__ import annotations

from served_mesh import mesh_users_last


class Item:
    """What the hook reads of a pytest item: its fixture closure and its markers."""

    def __init__(self, name: str, fixtures: tuple[str, ...] = (), breaks: bool = False) -> None:
        self.name, self.fixturenames, self._breaks = name, list(fixtures), breaks

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
    ]
    assert [i.name for i in mesh_users_last(items)] == [
        "unit_a", "unit_b", "marked_but_no_mesh", "http_chat", "grpc_complete", "lost_replica", "redis_stopped"]

