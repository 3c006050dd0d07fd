"""draftmesh.cli: the ``draftmesh`` command and its subcommands (the entry points).

``main`` parses the command line and dispatches; ``generate`` is the client's command,
``health`` the container health check, ``demo`` and ``mesh_demo`` the two demos. Nothing
below the entry points imports this package.
"""
