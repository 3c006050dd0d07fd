"""``python -m draftmesh.cli``: the same as the ``draftmesh`` script."""

import sys

from draftmesh.cli.main import main

sys.exit(main())
