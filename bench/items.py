"""What one bench run is made of: prepared items, one generation (``ItemRun``), all repeats of an
(item, method) (``ItemResult``), and the runner protocol every method implements."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from draftmesh.bench.workload import WorkItem, render_prompt_ids


@dataclass(frozen=True)
class PreparedItem:
    """A workload item with its prompt rendered to token ids for the target."""

    item: WorkItem
    prompt_ids: tuple[int, ...]
    max_new_tokens: int

    @property
    def id(self) -> str:
        return self.item.id

    @property
    def kind(self) -> str:
        return self.item.kind


@dataclass
class SourceStats:
    proposals: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0

    def add(self, other: "SourceStats") -> None:
        self.proposals += other.proposals
        self.proposed_tokens += other.proposed_tokens
        self.accepted_tokens += other.accepted_tokens

    @property
    def acceptance(self) -> float | None:
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else None


@dataclass
class ItemRun:
    """One generation of one item by one method."""

    item_id: str
    kind: str
    method: str
    token_ids: list[int]
    seconds: float
    steps: int | None = None
    """Target forwards (engine methods); None where the method has no such notion (hf)."""
    draft_s: float | None = None
    verify_s: float | None = None
    sources: dict[str, SourceStats] = field(default_factory=dict)
    text: str = ""
    prompt_tokens: int = 0
    lenient_tokens: int | None = None
    """Tokens a lossy policy accepted that exact verification would not."""
    first_token_s: float | None = None
    """Seconds from the call to the first generated token (None where not visible: hf)."""
    cached_prompt_tokens: int | None = None
    """Mesh only: prompt tokens whose KV came from the mesh's session cache (not prefilled)."""
    completion_tokens: int | None = None
    """The HTTP face only: ``usage.completion_tokens`` (it returns text, so ``token_ids`` stays empty)."""

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mean_accepted_per_step(self) -> float | None:
        """Tokens committed per target forward (1.0 for plain decoding), as GenerationResult."""
        return self.new_tokens / max(1, self.steps) if self.steps is not None else None


@dataclass
class ItemResult:
    """All repeats of one (item, method), and how its output compares with plain."""

    item_id: str
    kind: str
    method: str
    lossless: bool = True
    other_engine: bool = False
    """Another implementation of the model (vLLM): its agreement with plain is reported
    (``identical_to_plain``, first difference, top-2 gap) but a difference is not a lossless
    violation: other kernels may break a near-tie the other way."""
    runs: list[ItemRun] = field(default_factory=list)
    identical_to_plain: bool | None = None
    first_difference: int | None = None
    mismatch_repeat: int | None = None
    mismatch_top2_gap: float | None = None
    stable: bool = True
    """All repeats produced the same tokens."""
    same_as_plain: bool | None = None
    """Fidelity for every non-plain method, lossy ones included (first repeat's output)."""
    edit_distance: float | None = None
    """Token-level Levenshtein distance to plain's output / the longer length."""

    @property
    def seconds(self) -> float:
        return statistics.median(r.seconds for r in self.runs)

    @property
    def representative(self) -> ItemRun:
        """The run with the (lower) median time: its step statistics are reported."""
        ordered = sorted(self.runs, key=lambda r: r.seconds)
        return ordered[(len(ordered) - 1) // 2]

    @property
    def new_tokens(self) -> int:
        return self.runs[0].new_tokens

    @property
    def tokens_per_s(self) -> float:
        s = self.seconds
        return self.new_tokens / s if s > 0 else 0.0

    @property
    def mean_accepted_per_step(self) -> float | None:
        return self.representative.mean_accepted_per_step


class MethodRunner(Protocol):
    """Runs one method. ``reset`` starts from fresh state (called before each repeat). A runner
    may set ``other_engine = True`` (see ``ItemResult.other_engine``)."""

    name: str
    lossless: bool

    def reset(self) -> None: ...

    def run(self, item: PreparedItem) -> ItemRun: ...


def cut_at_eos(token_ids: Sequence[int], eos_ids) -> list[int]:
    """The tokens up to and including the first EOS, as our decoder stops (for engines that may
    hand back more: transformers ``generate``, vLLM)."""
    out = list(token_ids)
    for i, tok in enumerate(out):
        if tok in eos_ids:
            return out[: i + 1]
    return out


def prepare_items(items: Sequence[WorkItem], target, max_new_tokens: int | None = None) -> list[PreparedItem]:
    """Render prompts with the target's tokenizer and check each fits the model's context."""
    prepared, problems = [], []
    for it in items:
        n = max_new_tokens or it.max_new_tokens
        try:
            ids = render_prompt_ids(it, target.tokenizer)
        except Exception as exc:  # noqa: BLE001 - reported with the item id
            problems.append(f"item {it.id!r} (line {it.line}): cannot render the prompt: {exc}")
            continue
        if not ids:
            problems.append(f"item {it.id!r} (line {it.line}): the prompt renders to no tokens")
        elif len(ids) + n > target.max_context:
            problems.append(
                f"item {it.id!r} (line {it.line}): prompt {len(ids)} + max_new_tokens {n} tokens exceeds "
                f"the model context of {target.max_context}"
            )
        else:
            prepared.append(PreparedItem(it, tuple(ids), n))
    if problems:
        raise ValueError("\n  ".join(["some items cannot run on this model:", *problems]))
    return prepared
