"""draftmesh.router: the front door only: auth, validation, admission, response mapping, the Serve
app wiring (``app``) and its launcher, the TLS gateway. It makes one call per request to the
verifier pool (``draftmesh.verify``), which runs the engine."""
