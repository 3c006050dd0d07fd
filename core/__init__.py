"""draftmesh core: typed config, shared types, model resolution and the CLI."""
