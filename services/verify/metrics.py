"""What a verifier replica reports per step: the speculation's own numbers, per source.

Acceptance per source is ``accepted_tokens / tree_nodes`` of the two per-source counters
(a PromQL ratio of rates), so it can be read over any window.
"""

from __future__ import annotations

from draftmesh.io_struct import StepRecord
from draftmesh.metrics import (
    BATCH_ROWS_BUCKETS,
    LATENCY_BUCKETS_S,
    TOKENS_PER_STEP_BUCKETS,
    TREE_SIZE_BUCKETS,
    MetricsBackend,
)


class VerifierMetrics:
    def __init__(self, backend: MetricsBackend, replica: str) -> None:
        self.tags = {"replica": replica}
        self.steps = backend.counter("draftmesh_steps", "speculation steps (one target forward each)", ("replica",))
        self.tokens_per_step = backend.histogram(
            "draftmesh_tokens_per_step", "tokens committed per target forward (1 = no draft accepted)",
            TOKENS_PER_STEP_BUCKETS, ("replica",))
        self.tree_size = backend.histogram("draftmesh_tree_nodes", "drafted tree nodes verified per step",
                                           TREE_SIZE_BUCKETS, ("replica",))
        self.draft_seconds = backend.histogram("draftmesh_draft_seconds", "time to ask the sources and build the tree, per step",
                                               LATENCY_BUCKETS_S, ("replica",))
        self.verify_seconds = backend.histogram("draftmesh_verify_seconds", "time of the tree forward, acceptance and KV commit, per step",
                                                LATENCY_BUCKETS_S, ("replica",))
        self.source_nodes = backend.counter("draftmesh_source_tree_nodes", "verified tree nodes a source proposed",
                                            ("replica", "source"))
        self.source_accepted = backend.counter("draftmesh_source_accepted_tokens", "drafted tokens of a source the target accepted",
                                               ("replica", "source"))
        self.source_failures = backend.counter("draftmesh_source_failed_steps", "steps a source failed, timed out or was busy",
                                               ("replica", "source"))
        self.prompt_tokens = backend.counter("draftmesh_prompt_tokens", "prompt tokens of served requests", ("replica",))
        self.prefix_cached_tokens = backend.counter(
            "draftmesh_prefix_cached_tokens", "prompt tokens of served requests whose KV came from the prefix pool, not a "
            "prefill (over draftmesh_prompt_tokens: the pool's hit rate)", ("replica",))
        self.active = backend.gauge("draftmesh_verifier_active_requests",
                                    "requests on the replica (in the batch or waiting for room in it)", ("replica",))

        self.batch_rows = backend.histogram("draftmesh_batch_rows", "requests in one batched target forward",
                                            BATCH_ROWS_BUCKETS, ("replica",))
        self.batch_tokens = backend.histogram("draftmesh_batch_tokens", "tokens in one batched target forward "
                                              "(roots, trees and prefill chunks)", TREE_SIZE_BUCKETS, ("replica",))
        self.batch_speculating = backend.counter("draftmesh_batch_speculating_rows",
                                                 "rows of batched forwards that verified a draft tree", ("replica",))
        self.batch_forward_rows = backend.counter("draftmesh_batch_forward_rows", "rows of batched forwards", ("replica",))
        self.queued = backend.gauge("draftmesh_verifier_queued_requests",
                                    "requests waiting for room in the batch (KV budget, rows)", ("replica",))
        self.kv_bytes = backend.gauge("draftmesh_verifier_kv_bytes", "bytes of the batch's KV slab", ("replica",))
        self.size_gauges = {
            "prefix_kv_bytes": backend.gauge("draftmesh_prefix_kv_bytes", "bytes of pooled KV caches: sessions' and finished requests' prefixes", ("replica",)),
            "rag_index_bytes": backend.gauge("draftmesh_rag_index_bytes", "bytes of the live rag indexes", ("replica",)),
            "answer_store_bytes": backend.gauge("draftmesh_answer_store_bytes",
                                                "bytes of answers and session turns in the answer store", ("replica",)),
            "redis_used_bytes": backend.gauge("draftmesh_redis_used_bytes", "used_memory of the answer store's Redis",
                                              ("replica",)),
        }

    def batch(self, *, rows: int, tokens: int, queued: int, kv_bytes: int, speculating: int) -> None:
        tags = self.tags
        self.batch_rows.observe(rows, tags)
        self.batch_tokens.observe(tokens, tags)
        self.batch_forward_rows.inc(rows, tags)
        if speculating:
            self.batch_speculating.inc(speculating, tags)
        self.queued.set(queued, tags)
        self.kv_bytes.set(kv_bytes, tags)

    def step(self, record: StepRecord) -> None:
        tags = self.tags
        self.steps.inc(1, tags)
        self.tokens_per_step.observe(record.emitted, tags)
        self.tree_size.observe(record.tree_size, tags)
        self.draft_seconds.observe(record.draft_s, tags)
        self.verify_seconds.observe(record.verify_s, tags)
        for source, nodes in record.nodes_by_source.items():
            self.source_nodes.inc(nodes, {**tags, "source": source})
        for source, accepted in record.accepted_by_source.items():
            self.source_accepted.inc(accepted, {**tags, "source": source})
        for source in record.failed_sources:
            self.source_failures.inc(1, {**tags, "source": source})

    def prompt(self, tokens: int, cached: int) -> None:
        """A served request's prompt, and how much of it the prefix pool held."""
        self.prompt_tokens.inc(tokens, self.tags)
        if cached:
            self.prefix_cached_tokens.inc(cached, self.tags)

    def sizes(self, sizes: dict[str, int]) -> None:
        """The bounded caches' sizes (``SpeculativeDecoder.sizes``)."""
        for name, value in sizes.items():
            if name in self.size_gauges:
                self.size_gauges[name].set(value, self.tags)

    def set_active(self, active: int) -> None:
        self.active.set(active, self.tags)
