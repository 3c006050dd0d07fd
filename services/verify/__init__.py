"""draftmesh.verify: the whole engine: tree builders and the cost model, acceptance (exact,
rejection sampling, lossy policies), session KV reuse, the decode loop, its assembly from config
(``engine``), the fact-check link, the verifier replica and its Serve deployment."""
