"""The ``history`` source: draft from what this request, its session and earlier requests said.

Three kinds of knowledge, merged into one list of proposals:

- prompt lookup: continuations of the current suffix inside the request's own prompt and
  generated tokens (code being edited, quoted documents, repeated structure);
- session: the same over the earlier turns (prompt + output) of ``ctx.session_id``;
- answers: completions of earlier requests whose prompt was identical (exact hash) or a
  near-duplicate (MinHash), so a repeated question drafts its previous answer.

Answers live behind ``AnswerStore`` so replicas can share them (``redis_store``); this
module also has the bounded in-memory store. Answers are kept per tenant (``ctx.tenant``): a
request reads the answers of ``ctx.answer_tenants`` only (its own, plus those sharing with it
when it is lossless) and a lossy request stores no answer (``ctx.store_answer``), so no
tenant drafts another's text unless that one opted in, and nobody drafts lossy output. Near-duplicates use MinHash over token
bigrams of the prompt tail with LSH banding, implemented on numpy rather than with
``datasketch``: on SmolLM2 token ids numpy signs a 2k-token prompt in ~1.9 ms against
~4.2 ms for ``datasketch`` (which hashes every shingle through SHA-1 as bytes), it needs
no extra dependency, and its signature is a plain, seeded function of the token ids that
every replica reproduces bit for bit, which a shared store's band keys require.
Bigrams separate a one-word paraphrase (Jaccard ~0.7) from a different question on the
same subject (~0.15) better than unigrams (~0.86 vs ~0.41) or trigrams (~0.6 vs ~0.05).
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from draftmesh.config import DEFAULT_TENANT
from draftmesh.draft.base import DraftContext, Proposal
from draftmesh.draft.suffix import Branch, SuffixIndex

_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a fast, well-mixed bijection on uint64 (wraps on purpose)."""
    x = x ^ (x >> _U64(30))
    x = x * _U64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> _U64(27))
    x = x * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """Stable content hash of a prompt's token ids: the exact-match key of every store."""
    return hashlib.blake2b(np.asarray(prompt_ids, dtype="<i4").tobytes(), digest_size=16).hexdigest()



def tenant_key(tenant: str, key: str) -> str:
    """An answer's key in its tenant's namespace (tenant names hold no '/')."""
    return f"{tenant}/{key}"


def tenant_band(tenant: str, band: bytes) -> bytes:
    """An LSH band key in its tenant's namespace: near-duplicates never match across tenants."""
    return tenant.encode() + b"/" + band


class MinHasher:
    """MinHash signatures of a prompt's token-shingle set, and their LSH band keys.

    Only the last ``window`` tokens are signed (where a chat prompt's question is; it also
    bounds the cost). Shingles of ``boilerplate`` sequences are ignored: pass the chat
    template's fixed parts (e.g. the template applied to an empty user message), or a
    shared system prompt makes every request look alike: with SmolLM2's default template,
    unrelated questions score ~0.6 and a one-word paraphrase ~0.88; without its shingles,
    ~0.0 and ~0.7. Two prompts become near-duplicate candidates when any of ``bands``
    bands of their signatures agree (at 32 x 4 a pair at Jaccard 0.5 meets with
    probability ~0.87, at 0.6 ~0.99, at 0.15 ~0.02); candidates are then checked on the
    full signature.
    """

    def __init__(
        self,
        *,
        num_perm: int = 128,
        bands: int = 32,
        shingle: int = 2,
        window: int = 256,
        boilerplate: Sequence[Sequence[int]] = (),
        seed: int = 0x5EED,
    ) -> None:
        if num_perm % bands:
            raise ValueError(f"num_perm {num_perm} is not a multiple of bands {bands}")
        self.num_perm, self.bands, self.rows = num_perm, bands, num_perm // bands
        self.shingle, self.window = shingle, window
        self._seeds = _mix64(np.arange(num_perm, dtype=_U64) + _U64(seed))
        ignored = [self._shingles(ids) for ids in boilerplate]
        self._ignored = np.unique(np.concatenate(ignored)) if ignored else np.empty(0, dtype=_U64)

    def _shingles(self, ids: Sequence[int]) -> np.ndarray:
        """Distinct hashes of the ``shingle``-token windows of ``ids`` (one window if shorter)."""
        tokens = np.asarray(ids, dtype=np.int64).astype(_U64) + _U64(1)
        k = min(self.shingle, tokens.size)
        hashes = np.zeros(tokens.size - k + 1 if tokens.size else 0, dtype=_U64)
        for j in range(k):
            hashes = hashes * _U64(0x9E3779B97F4A7C15) + tokens[j : tokens.size - k + 1 + j]
        return np.unique(hashes)

    def signature(self, prompt_ids: Sequence[int]) -> np.ndarray:
        """uint32[num_perm]; all 0xFFFFFFFF when nothing but boilerplate is left."""
        shingles = self._shingles(prompt_ids[-self.window :])
        shingles = shingles[~np.isin(shingles, self._ignored)]
        if shingles.size == 0:
            return np.full(self.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        hashed = _mix64(shingles[None, :] ^ self._seeds[:, None]) >> _U64(32)
        return hashed.min(axis=1).astype(np.uint32)

    def band_keys(self, signature: np.ndarray) -> list[bytes]:
        r = self.rows
        return [b.to_bytes(2, "little") + signature[b * r : (b + 1) * r].tobytes() for b in range(self.bands)]

    @staticmethod
    def similarity(a: np.ndarray, b: np.ndarray) -> float:
        """Estimated Jaccard similarity of the two shingle sets."""
        return float(np.mean(a == b))


@dataclass(frozen=True)
class Turn:
    """One finished request of a session."""

    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]


@dataclass(frozen=True)
class NearAnswer:
    """A stored answer whose prompt resembles the query's, with the estimated Jaccard."""

    similarity: float
    output_ids: tuple[int, ...]


class AnswerStore(Protocol):
    """Where finished requests are remembered.

    Bounded: at most ``max_entries`` answers, evicting the least recently put or
    exactly-hit one; per session the last ``max_turns`` turns, of at most ``max_sessions``
    sessions (least recently put evicted).
    """

    def put(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], session_id: str | None = None,
        *, tenant: str = DEFAULT_TENANT, answer: bool = True,
    ) -> None:
        """Remember an answer under ``tenant`` (unless ``answer`` is False) and the session's turn."""
        ...

    def get_exact(self, prompt_ids: Sequence[int], *, tenant: str = DEFAULT_TENANT) -> tuple[int, ...] | None: ...

    def near(self, prompt_ids: Sequence[int], limit: int = 4, *, tenant: str = DEFAULT_TENANT) -> list[NearAnswer]:
        """``tenant``'s answers to prompts with similarity >= the store's ``min_similarity``, best first."""
        ...

    def session_turns(self, session_id: str) -> list[Turn]:
        """The session's remembered turns, oldest first."""
        ...


@dataclass
class _Entry:
    output_ids: tuple[int, ...]
    signature: np.ndarray
    bands: list[bytes]


class InMemoryAnswerStore:
    """A process-local ``AnswerStore`` with LRU bounds; thread-safe."""

    def __init__(
        self,
        *,
        max_entries: int = 10_000,
        max_sessions: int = 1_000,
        max_turns: int = 16,
        min_similarity: float = 0.5,
        max_candidates: int = 32,
        hasher: MinHasher | None = None,
    ) -> None:
        self.max_entries, self.max_sessions, self.max_turns = max_entries, max_sessions, max_turns
        self.min_similarity, self.max_candidates = min_similarity, max_candidates
        self.hasher = hasher or MinHasher()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._buckets: dict[bytes, set[str]] = {}
        self._sessions: OrderedDict[str, deque[Turn]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self, prompt_ids: Sequence[int], output_ids: Sequence[int], session_id: str | None = None,
        *, tenant: str = DEFAULT_TENANT, answer: bool = True,
    ) -> None:
        key = tenant_key(tenant, prompt_key(prompt_ids))
        signature = self.hasher.signature(prompt_ids)
        bands = [tenant_band(tenant, b) for b in self.hasher.band_keys(signature)]
        entry = _Entry(tuple(output_ids), signature, bands)
        with self._lock:
            if answer:
                self._drop(key)
                self._entries[key] = entry
                for band in entry.bands:
                    self._buckets.setdefault(band, set()).add(key)
                while len(self._entries) > self.max_entries:
                    self._drop(next(iter(self._entries)))
            if session_id is not None:
                turns = self._sessions.pop(session_id, None) or deque(maxlen=self.max_turns)
                turns.append(Turn(tuple(prompt_ids), tuple(output_ids)))
                self._sessions[session_id] = turns
                while len(self._sessions) > self.max_sessions:
                    self._sessions.popitem(last=False)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        for band in entry.bands:
            bucket = self._buckets[band]
            bucket.discard(key)
            if not bucket:
                del self._buckets[band]

    def get_exact(self, prompt_ids: Sequence[int], *, tenant: str = DEFAULT_TENANT) -> tuple[int, ...] | None:
        key = tenant_key(tenant, prompt_key(prompt_ids))
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry.output_ids

    def near(self, prompt_ids: Sequence[int], limit: int = 4, *, tenant: str = DEFAULT_TENANT) -> list[NearAnswer]:
        signature = self.hasher.signature(prompt_ids)
        with self._lock:
            bands = [tenant_band(tenant, b) for b in self.hasher.band_keys(signature)]
            hits = Counter(key for band in bands for key in self._buckets.get(band, ()))
            candidates = [self._entries[key] for key, _ in hits.most_common(self.max_candidates)]
        found = [NearAnswer(self.hasher.similarity(signature, e.signature), e.output_ids) for e in candidates]
        found = [a for a in found if a.similarity >= self.min_similarity]
        return sorted(found, key=lambda a: -a.similarity)[:limit]

    def session_turns(self, session_id: str) -> list[Turn]:
        with self._lock:
            return list(self._sessions.get(session_id, ()))


class _AnswerTrack:
    """Follows one remembered answer while the request generates.

    While the generated tokens are a prefix of the answer (from its start, or from a point
    found by re-synchronising), the answer's next tokens are proposed. After a divergence
    the current suffix is matched into the answer; a unique match re-aligns, several
    matches each propose their continuation.
    """

    def __init__(self, answer: tuple[int, ...], weight: float, min_ngram: int, max_ngram: int) -> None:
        self.answer, self.weight = answer, weight
        self._ngrams = (min_ngram, max_ngram)
        self._index: SuffixIndex | None = None
        self._aligned: int | None = 0  # answer position matching the end of the generated tokens
        self._seen = 0  # generated tokens already compared

    def _answer_index(self) -> SuffixIndex:
        if self._index is None:
            self._index = SuffixIndex(self.answer, min_ngram=self._ngrams[0], max_ngram=self._ngrams[1])
        return self._index

    def propose(self, ctx: DraftContext, max_len: int) -> list[tuple[tuple[int, ...], float]]:
        generated = ctx.generated_ids
        new = list(generated[self._seen :])
        self._seen = len(generated)
        if self._aligned is not None and new:
            if list(self.answer[self._aligned : self._aligned + len(new)]) == new:
                self._aligned += len(new)
            else:
                self._aligned = None
        if self._aligned is None:
            _, ends = self._answer_index().occurrences(ctx.token_ids)
            if len(ends) == 1:
                self._aligned = ends[0]
            elif ends:
                found = self._answer_index().lookup(ctx.token_ids, max_len)
                return _weighted(found.branches, found.length, self._ngrams[1], self.weight)
        if self._aligned is None or self._aligned >= len(self.answer):
            return []
        return [(self.answer[self._aligned : self._aligned + max_len], self.weight)]


def _weighted(
    branches: Sequence[Branch], length: int, max_ngram: int, weight: float
) -> list[tuple[tuple[int, ...], float]]:
    """Confidence of suffix-match branches: share of occurrences x match strength x weight."""
    total = sum(b.count for b in branches) or 1
    return [(b.tokens, weight * (b.count / total) * (length / max_ngram)) for b in branches]


@dataclass
class _RequestState:
    prompt_len: int
    context: SuffixIndex  # the request's own prompt + generated tokens
    session: SuffixIndex | None
    answers: list[_AnswerTrack]
    copy: tuple[int, int] | None = None
    """(haystack position the last copied match continued at, committed length then)."""
    nbytes: int = 0
    """What the indexes took when last measured (``HistorySource.state_bytes`` counts it)."""


def _state_bytes(state: _RequestState) -> int:
    size = state.context.nbytes() + (state.session.nbytes() if state.session is not None else 0)
    for track in state.answers:
        size += 8 * len(track.answer) + (track._index.nbytes() if track._index is not None else 0)
    return size


class HistorySource:
    """Draft source ``history``: prompt lookup, session recall and remembered answers.

    Per-request work (session fetch, answer lookup, indexing the prompt) happens on the
    request's first ``propose``; later steps only append the new tokens and match.
    Requests are keyed by ``ctx.request_id`` (the prompt's hash when empty); at most
    ``max_requests`` are tracked and at most ``max_bytes`` of their indexes (the context, the
    session's turns, the remembered answers), least recently used dropped. A request's state
    is freed when it ends: ``finish`` (it finished) or ``forget`` (the decoder, whenever it
    ends, failed and cancelled included).
    """

    name = "history"

    def __init__(
        self,
        store: AnswerStore | None = None,
        *,
        max_proposals: int = 6,
        max_tokens: int = 16,
        min_ngram: int = 2,
        max_ngram: int = 8,
        max_near: int = 2,
        max_requests: int = 256,
        max_bytes: int = 256 << 20,
        resume_window: int = 8,
        tokenizer: Any = None,
    ) -> None:
        self.store: AnswerStore = store if store is not None else InMemoryAnswerStore()
        self.max_proposals, self.max_tokens = max_proposals, max_tokens
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.max_near, self.max_requests = max_near, max_requests
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.state_bytes = 0
        """Bytes of every tracked request's indexes (as last measured)."""
        # > 0: when no n-gram matches, look for the last token only within this many
        # positions of where the previous copy would have got to (resuming a copy after
        # the model changed a word, e.g. fixing a typo). 0 turns it off.
        self.resume_window = resume_window
        # The answer's first word usually lacks the leading space the same word has inside
        # the prompt ("The" vs " The"), so no n-gram matches for the first steps of a copy.
        # With the tokenizer, those steps also look for the spaced variant of the answer's start.
        self.tokenizer = tokenizer
        self._spaced: dict[int, int | None] = {}
        self._requests: OrderedDict[str, _RequestState] = OrderedDict()
        self._lock = threading.Lock()

    def propose(self, ctx: DraftContext) -> list[Proposal]:
        state = self._state(ctx)
        max_len = min(self.max_tokens, max(1, ctx.size_hint))
        answers = [c for track in state.answers for c in track.propose(ctx, max_len)]
        candidates = []
        for index in (state.context, state.session):
            if index is not None:
                found = index.lookup(ctx.token_ids, max_len)
                candidates += _weighted(found.branches, found.length, self.max_ngram, 1.0)
                if index is state.context and self.resume_window and not answers:
                    candidates += self._resume(state, ctx, found, max_len)
        # The guesses from the prompt only when no earlier answer is being followed: they
        # would take tree nodes from a far better draft.
        if not candidates and not answers:
            candidates += self._answer_start(state, ctx, max_len)
        candidates += answers
        scored: dict[tuple[int, ...], float] = {}
        for tokens, confidence in candidates:
            if tokens and confidence > scored.get(tokens, -1.0):
                scored[tokens] = confidence
        best = sorted(scored.items(), key=lambda item: -item[1])[: self.max_proposals]
        return [Proposal(source=self.name, token_ids=tokens, confidence=conf) for tokens, conf in best]

    def _answer_start(self, state: _RequestState, ctx: DraftContext, max_len: int) -> list[tuple[tuple[int, ...], float]]:
        """Continuations of the answer so far (at most 3 tokens) where it occurs in the prompt
        with a space before its first word."""
        generated = list(ctx.token_ids[ctx.prompt_len :])
        if self.tokenizer is None or not 1 <= len(generated) <= 3:
            return []
        spaced = self._spaced_variant(generated[0])
        if spaced is None:
            return []
        needle = [spaced, *generated[1:]]
        prompt = ctx.token_ids[: ctx.prompt_len]
        found: dict[tuple[int, ...], float] = {}
        for pos in range(len(prompt) - len(needle), -1, -1):  # latest occurrence first
            if list(prompt[pos : pos + len(needle)]) == needle:
                cont = tuple(prompt[pos + len(needle) : pos + len(needle) + max_len])
                if cont and cont not in found:
                    if not found:  # the copy the resume window follows after a miss
                        state.copy = (pos + len(needle), len(ctx.token_ids))
                    found[cont] = 1.0 / self.max_ngram
                    if len(found) >= self.max_proposals:
                        break
        return list(found.items())

    def _spaced_variant(self, token: int) -> int | None:
        if token not in self._spaced:
            text = self.tokenizer.decode([token])
            ids = self.tokenizer.encode(" " + text, add_special_tokens=False) if text and not text[0].isspace() else []
            self._spaced[token] = ids[0] if len(ids) == 1 else None
        return self._spaced[token]

    def _resume(self, state: _RequestState, ctx: DraftContext, found, max_len: int) -> list[tuple[tuple[int, ...], float]]:
        """Track where the request copies from; after a miss, resume near that place."""
        n = len(ctx.token_ids)
        if found:
            _, ends = state.context.occurrences(ctx.token_ids, max_occurrences=1)
            if ends:
                state.copy = (ends[0], n)
            return []
        if state.copy is None:
            return []
        end, then = state.copy
        expected = end + (n - then)
        last = ctx.token_ids[-1]
        seq = state.context.tokens
        for pos in range(max(0, expected - 2), min(n - 1, expected + self.resume_window)):
            if seq[pos] == last:
                cont = tuple(seq[pos + 1 : min(n, pos + 1 + max_len)])
                if cont:
                    state.copy = (pos + 1, n)
                    return [(cont, 1.0 / self.max_ngram)]
        return []

    def finish(self, ctx: DraftContext, output_ids: Sequence[int], output_text: str) -> None:
        """Remember the finished request (``output_text`` is unused: everything is token ids)."""
        self.forget(_request_key(ctx))
        if output_ids:
            self.store.put(ctx.token_ids[: ctx.prompt_len], output_ids, ctx.session_id,
                           tenant=ctx.tenant, answer=ctx.store_answer)

    def forget(self, request_id: str) -> None:
        """The request ended: drop its state (a short lock, never held across a lookup)."""
        with self._lock:
            state = self._requests.pop(request_id, None)
            if state is not None:
                self.state_bytes -= state.nbytes

    @property
    def tracked_requests(self) -> list[str]:
        with self._lock:
            return list(self._requests)

    def _state(self, ctx: DraftContext) -> _RequestState:
        key = _request_key(ctx)
        with self._lock:
            state = self._requests.get(key)
            if state is not None:
                self._requests.move_to_end(key)
        if state is None or not _extend(state, ctx):
            state = self._new_state(ctx)
        size = _state_bytes(state)
        with self._lock:
            old = self._requests.get(key)
            if old is not None:
                self.state_bytes -= old.nbytes
            state.nbytes = size
            self._requests[key] = state
            self._requests.move_to_end(key)
            self.state_bytes += size
            while len(self._requests) > 1 and (len(self._requests) > self.max_requests or self.state_bytes > self.max_bytes):
                _, dropped = self._requests.popitem(last=False)
                self.state_bytes -= dropped.nbytes
        return state

    def _new_state(self, ctx: DraftContext) -> _RequestState:
        ngrams = {"min_ngram": self.min_ngram, "max_ngram": self.max_ngram}
        prompt = ctx.token_ids[: ctx.prompt_len]
        session = None
        if ctx.session_id is not None:
            turns = self.store.session_turns(ctx.session_id)
            if turns:
                session = SuffixIndex(**ngrams)
                for turn in turns:
                    session.extend(turn.prompt_ids + turn.output_ids, new_segment=True)
        answers: dict[tuple[int, ...], float] = {}
        for tenant in ctx.answer_tenants:  # own first; others only for a lossless request
            exact = self.store.get_exact(prompt, tenant=tenant)
            if exact:
                answers[exact] = 1.0
            for near in self.store.near(prompt, limit=self.max_near, tenant=tenant):
                if near.output_ids and near.similarity > answers.get(near.output_ids, 0.0):
                    answers[near.output_ids] = near.similarity
        tracks = [_AnswerTrack(a, w, self.min_ngram, self.max_ngram) for a, w in answers.items()]
        return _RequestState(ctx.prompt_len, SuffixIndex(ctx.token_ids, **ngrams), session, tracks)


def _request_key(ctx: DraftContext) -> str:
    return ctx.request_id or "prompt:" + prompt_key(ctx.token_ids[: ctx.prompt_len])


def _extend(state: _RequestState, ctx: DraftContext, probe: int = 8) -> bool:
    """Append the newly committed tokens; False when the state belongs to another sequence."""
    ids, seen = ctx.token_ids, len(state.context)
    if state.prompt_len != ctx.prompt_len or len(ids) < seen:
        return False
    lo = max(0, seen - probe)
    if list(ids[lo:seen]) != list(state.context.tokens[lo:seen]):
        return False
    state.context.extend(ids[seen:])
    return True
