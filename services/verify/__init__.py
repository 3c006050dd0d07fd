"""draftmesh.verify: target backend, token tree, acceptance, policies and the decode loop."""
