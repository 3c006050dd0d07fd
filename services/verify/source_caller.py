"""Ask a step's draft sources with a deadline: a slow or broken source is skipped, never awaited.

Sources run on worker threads; the step waits at most ``deadline_s`` for all of them.
A source that misses the deadline is counted as timed out and its late answer dropped
(the context it answered for has moved on); while its call is still running it is
skipped as busy, so a hung source occupies one worker and never stalls a step. Without a
deadline the sources are called inline, which is cheapest for sources measured in
microseconds.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from dataclasses import dataclass, field
from typing import Sequence

from draftmesh.draft.base import DraftContext, DraftSource, Proposal

log = logging.getLogger(__name__)


@dataclass
class SourceAnswers:
    proposals: dict[str, list[Proposal]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    """Source name -> "error", "timeout" or "busy"."""


class SourceCaller:
    def __init__(self, deadline_s: float | None = None, max_workers: int = 8) -> None:
        if deadline_s is not None and deadline_s <= 0:
            raise ValueError(f"source deadline must be > 0 seconds, got {deadline_s}")
        self.deadline_s = deadline_s
        self._pool = cf.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="draft-source") if deadline_s else None
        self._running: dict[str, cf.Future] = {}
        self._lock = threading.Lock()

    def call(self, sources: Sequence[DraftSource], ctx: DraftContext) -> SourceAnswers:
        answers = SourceAnswers()
        if self._pool is None:
            for source in sources:
                try:
                    answers.proposals[source.name] = list(source.propose(ctx))
                except Exception:  # a broken source costs speed, never the request
                    log.exception("draft source %s failed; skipped for this step", source.name)
                    answers.failed[source.name] = "error"
            return answers
        futures: dict[cf.Future, str] = {}
        with self._lock:
            for source in sources:
                previous = self._running.get(source.name)
                if previous is not None and not previous.done():
                    answers.failed[source.name] = "busy"
                    continue
                future = self._pool.submit(source.propose, ctx)
                self._running[source.name] = future
                futures[future] = source.name
        done, late = cf.wait(futures, timeout=self.deadline_s)
        for future in done:
            name = futures[future]
            try:
                answers.proposals[name] = list(future.result())
            except Exception as exc:
                log.error("draft source %s failed; skipped for this step: %r", name, exc)
                answers.failed[name] = "error"
        for future in late:
            name = futures[future]
            log.warning("draft source %s missed the %.0f ms deadline; skipped", name, 1e3 * self.deadline_s)
            answers.failed[name] = "timeout"
        return answers

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
