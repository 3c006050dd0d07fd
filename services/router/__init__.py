"""draftmesh.router: the cost-aware tree builder and the wiring of sources, builder and target."""
