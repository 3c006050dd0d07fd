"""draftmesh: the base layer, what every other layer may use.

The typed config (``config``), the messages between the parts (``io_struct``), model loading
(``models``), prompt rendering (``prompts``), the target backend (``backend``: prefill, the
tree forward, KV compaction, the cost curve) and the token tree (``tree``) that both a draft LLM
and the verifier use, the sampling law (``sampling``), tracing, metrics, the embedded Redis, the
gRPC client library (``client``) and small helpers. It imports nothing above it: the draft
sources (``draftmesh.draft``), the engine (``draftmesh.verify``), the front door
(``draftmesh.router``) and the entry points (``draftmesh.cli``, ``draftmesh.bench``) build on it.
"""

# First, before anything loads grpcio: its fork handlers off (see ``grpc_fork``).
from draftmesh import grpc_fork as _grpc_fork  # noqa: E402,F401
