"""The verifier's side of the fact-check service: flags for lossy steps, a report per output.

Annotation is asynchronous: the loop never waits for a worker. At each step of a lossy
request the link, in one Redis round trip, reads the annotations that are already there
for the tree's draft spans and for the spans this request sent earlier, and sends the new
spans (a content hash is the annotation id, so a span proposed again by any request or
replica is annotated once). A node is flagged when a flagged finding of its own span
covers it, or when a flagged surface string learned from earlier annotations ("February
30, 2023", an unknown name) occurs over it — drafts shift by a few tokens from step to
step, and the learned strings still catch them. Flags only ever restrict lenient
acceptance, so a wrong flag costs speed, never correctness.

If Redis is unreachable the link flags every node: lossy requests fall back to exact
acceptance until it is back, and their reports say "unavailable".
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from draftmesh import tracing
from draftmesh.draft.base import DraftContext
from draftmesh.factcheck.client import FactCheckClient
from draftmesh.factcheck.protocol import SpanEntry, annotation_id_for_text
from draftmesh.io_struct import FactCheckReport
from draftmesh.tree import TokenTree

log = logging.getLogger(__name__)
_tracer = tracing.tracer("draftmesh.verify")

CONTEXT_CHARS = 64
"""Emitted text put before a draft when looking for learned flagged strings, so that a
string starting in the output and ending in the draft is still found."""


@dataclass
class _RequestState:
    pending: "OrderedDict[str, None]" = field(default_factory=OrderedDict)
    """Ids this request sent whose annotations have not been read yet (oldest first)."""
    submitted: int = 0
    skipped: int = 0
    flagged_steps: int = 0


class FactCheckLink:
    """A ``FlagProvider`` for the decoder plus the output annotation the replica adds."""

    def __init__(
        self,
        client: FactCheckClient,
        tokenizer: Any,
        *,
        max_spans_per_step: int = 8,
        min_span_chars: int = 6,
        max_pending: int = 32,
        max_learned: int = 2048,
        max_requests: int = 1024,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.max_spans_per_step = max_spans_per_step
        self.min_span_chars = min_span_chars
        self.max_pending = max_pending
        self.max_learned = max_learned
        self.max_requests = max_requests
        self._pieces: dict[int, str] = {}
        self._learned: "OrderedDict[str, None]" = OrderedDict()
        self._requests: "OrderedDict[str, _RequestState]" = OrderedDict()
        self._lock = threading.Lock()
        self._warned_unavailable = False

    # ------------------------------------------------------------------ per step
    def __call__(self, ctx: DraftContext, tree: TokenTree) -> frozenset[int]:
        paths = _leaf_paths(tree)
        pieces = [self._piece(tok) for tok in tree.tokens]
        spans: dict[str, tuple[str, list[int]]] = {}
        for path in sorted(paths, key=len, reverse=True):
            text = "".join(pieces[n] for n in path)
            if len(text.strip()) >= self.min_span_chars and _checkable(text):
                spans.setdefault(annotation_id_for_text("draft", text), (text, path))
            if len(spans) >= self.max_spans_per_step:
                break
        state = self._state(ctx.request_id)
        with self._lock:
            pending = list(state.pending)
        ready = self.client.ready(list(spans) + [i for i in pending if i not in spans])
        if not self.client.available:
            self._warn_unavailable()
            return frozenset(range(len(tree)))
        self._learn(ready.values())
        with self._lock:
            for annotation_id in ready:
                state.pending.pop(annotation_id, None)
        new = [SpanEntry(annotation_id=i, kind="draft", text=text, request_id=ctx.request_id, start=0, end=len(text))
               for i, (text, _) in spans.items() if i not in ready]
        if new:
            report = self.client.submit(new)
            with self._lock:
                state.submitted += report.sent
                state.skipped += report.skipped_backpressure
                for entry in new:
                    state.pending[entry.annotation_id] = None
                while len(state.pending) > self.max_pending:
                    state.pending.popitem(last=False)
        flagged = self._flag_nodes(ctx, spans, ready, pieces)
        if flagged:
            with self._lock:
                state.flagged_steps += 1
        return frozenset(flagged)

    def _flag_nodes(self, ctx: DraftContext, spans, ready, pieces: Sequence[str]) -> set[int]:
        flagged: set[int] = set()
        tail = ctx.text_tail[-CONTEXT_CHARS:] if ctx.text_tail else ""
        # One containment test per learned string over all spans at once, then the search
        # per span only for the few that occur: up to 2048 strings x 8 spans per step.
        everything = "\x00".join(tail + text for text, _ in spans.values())
        with self._lock:
            learned = [needle for needle in self._learned if needle in everything]
        for annotation_id, (text, path) in spans.items():
            bounds = _node_bounds(path, pieces, offset=0)
            annotation = ready.get(annotation_id)
            if annotation is not None:
                for finding in annotation.findings:
                    if finding.flagged:
                        flagged.update(_covering(bounds, finding.start, finding.end))
            if learned:
                shifted = _node_bounds(path, pieces, offset=len(tail))
                haystack = tail + text
                for needle in learned:
                    start = haystack.find(needle)
                    while start != -1:
                        flagged.update(_covering(shifted, start, start + len(needle)))
                        start = haystack.find(needle, start + 1)
        return flagged

    def _learn(self, annotations) -> None:
        with self._lock:
            for annotation in annotations:
                for finding in annotation.findings:
                    needle = finding.text.strip()
                    if finding.flagged and len(needle) >= 3:
                        self._learned[needle] = None
                        self._learned.move_to_end(needle)
            while len(self._learned) > self.max_learned:
                self._learned.popitem(last=False)

    # ------------------------------------------------------------------ per request
    def annotate_output(self, request_id: str, text: str, wait_s: float, enabled: bool = True) -> FactCheckReport:
        """Send the finished output and wait up to ``wait_s`` for its annotations."""
        with _tracer.start_as_current_span("factcheck.output") as span:
            report = self._annotate_output(request_id, text, wait_s, enabled)
            if span.is_recording():
                span.set_attributes({"draftmesh.factcheck.status": report.status,
                                     "draftmesh.factcheck.findings": len(report.findings),
                                     "draftmesh.factcheck.flagged": sum(f.flagged for f in report.findings),
                                     "draftmesh.factcheck.annotation_id": report.annotation_id})
            return report

    def _annotate_output(self, request_id: str, text: str, wait_s: float, enabled: bool) -> FactCheckReport:
        with self._lock:
            state = self._requests.pop(request_id, None) or _RequestState()
        counts = {"drafts_submitted": state.submitted, "drafts_skipped": state.skipped,
                  "flagged_steps": state.flagged_steps}
        if not enabled:
            return FactCheckReport("skipped", **counts)
        annotation_id = annotation_id_for_text("output", text, request_id=request_id)
        if not text.strip():
            return FactCheckReport("done", annotation_id, **counts)
        sent = self.client.submit([SpanEntry(annotation_id=annotation_id, kind="output", text=text,
                                             request_id=request_id, start=0, end=len(text))])
        if not self.client.available or sent.unavailable:
            return FactCheckReport("unavailable", annotation_id, **counts)
        if sent.skipped_backpressure:
            return FactCheckReport("skipped", annotation_id, error="the fact-check service is behind; this output was "
                                   "not sent", **counts)
        annotation = self.client.wait(annotation_id, wait_s) if wait_s > 0 else None
        if annotation is None:
            return FactCheckReport("unavailable" if not self.client.available else "pending", annotation_id, **counts)
        self._learn([annotation])
        return annotation.report(**counts)

    def forget(self, request_id: str) -> None:
        """Drop a request's state (it ended without a result: cancelled or failed)."""
        with self._lock:
            self._requests.pop(request_id, None)

    # ------------------------------------------------------------------ helpers
    def _state(self, request_id: str) -> _RequestState:
        with self._lock:
            state = self._requests.get(request_id)
            if state is None:
                state = self._requests[request_id] = _RequestState()
                while len(self._requests) > self.max_requests:
                    self._requests.popitem(last=False)
            return state

    def _piece(self, token: int) -> str:
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.tokenizer.decode([token], skip_special_tokens=False)
        return piece

    def _warn_unavailable(self) -> None:
        if not self._warned_unavailable:
            self._warned_unavailable = True
            log.warning("fact-check service unreachable: lossy requests fall back to exact acceptance until it is back")

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"learned_flagged_strings": len(self._learned), "requests": len(self._requests),
                    **self.client.stats()}


_CHECKABLE = re.compile(
    r"[0-9A-Z]|\b(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|fifty|"
    r"sixty|seventy|eighty|ninety|hundred|thousand|million|billion)\b"
)


def _checkable(text: str) -> bool:
    """Whether any check could find something: every check looks at a name (capitalized), a
    date or a figure (digits, number words). Other spans are not worth a worker's time."""
    return _CHECKABLE.search(text) is not None


def _leaf_paths(tree: TokenTree) -> list[list[int]]:
    """Root-to-leaf node paths (node indices, parents first)."""
    has_child = [False] * len(tree)
    for parent in tree.parents:
        if parent >= 0:
            has_child[parent] = True
    paths = []
    for leaf in range(len(tree)):
        if has_child[leaf]:
            continue
        path, node = [], leaf
        while node >= 0:
            path.append(node)
            node = tree.parents[node]
        paths.append(path[::-1])
    return paths


def _node_bounds(path: Sequence[int], pieces: Sequence[str], offset: int) -> list[tuple[int, int, int]]:
    """(node, start, end) character ranges of a path's nodes in its text (shifted by ``offset``)."""
    out, pos = [], offset
    for node in path:
        out.append((node, pos, pos + len(pieces[node])))
        pos += len(pieces[node])
    return out


def _covering(bounds: Sequence[tuple[int, int, int]], start: int, end: int) -> list[int]:
    return [node for node, a, b in bounds if a < end and start < b]
