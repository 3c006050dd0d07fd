"""Train a small flair NER tagger offline, on spaCy's silver labels over our own sentences.

Why: the flair backend must be testable (and usable) without a model hub. This script needs
nothing from the network: the labels come from the packaged spaCy pipeline, the embeddings
are trained from scratch (one-hot words + a character LSTM whose dictionary is built from
the corpus; flair's default ``CharacterEmbeddings()`` would download one), and the tagger is
reloaded from disk and scored on a held-out split, so what is reported is what a worker loads.

    python -m draftmesh.factcheck.flair_train --out DIR [--epochs N] [--seed S] [--corpus PATH]

Writes DIR/corpus/{train,dev,test}.txt (BIO columns), DIR/final-model.pt and DIR/metrics.json,
and prints the metrics as one JSON line on stdout (flair's own log goes to stderr).
Runs in the fact-check environment only (``make factcheck-env``).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

from draftmesh.factcheck.findings import Mention
from draftmesh.factcheck.ner import DEFAULT_SPACY_MODEL, FACTCHECK_ENV_HINT, SpacyNer

DEFAULT_CORPUS = Path(__file__).parent / "data" / "ner_corpus.txt"

SILVER_LABELS: dict[str, str] = {
    "PERSON": "PER",
    "ORG": "ORG",
    "GPE": "LOC",
    "LOC": "LOC",
    "FAC": "LOC",
    "NORP": "MISC",
    "EVENT": "MISC",
    "WORK_OF_ART": "MISC",
    "PRODUCT": "MISC",
    "LANGUAGE": "MISC",
    "LAW": "MISC",
}
"""spaCy's OntoNotes labels onto the CoNLL-03 set of flair's English "ner" taggers, so a hub
model and ours are interchangeable (ner.py maps PER back to PERSON). Dates, times, money,
percents, quantities and numbers are left out, as CoNLL-03 leaves them out: they are not
names. Consequence: a CoNLL tagger yields no DATE mentions, so with ``ner: flair`` the date
check sees none (flair's OntoNotes taggers, e.g. "ner-ontonotes-fast", do tag DATE)."""

SPLITS = (("train", 0.8), ("dev", 0.1), ("test", 0.1))


def bio_tags(tokens: Sequence[tuple[int, int]], mentions: Sequence[Mention]) -> tuple[list[str], int]:
    """BIO tags for tokens given as (start, end) char offsets; a token belongs to the first
    mention it overlaps. Also returns how many mentions did not fall on token boundaries
    (spaCy and segtok tokenize differently); those are snapped to the tokens they cover."""
    tags = ["O"] * len(tokens)
    snapped = 0
    for m in mentions:
        label = SILVER_LABELS.get(m.label)
        if label is None:
            continue
        covered = [i for i, (s, e) in enumerate(tokens) if s < m.end and e > m.start]
        if not covered or any(tags[i] != "O" for i in covered):
            continue
        if tokens[covered[0]][0] != m.start or tokens[covered[-1]][1] != m.end:
            snapped += 1
        tags[covered[0]] = f"B-{label}"
        for i in covered[1:]:
            tags[i] = f"I-{label}"
    return tags, snapped


def read_corpus(path: Path) -> list[str]:
    lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def write_column_corpus(
    texts: Sequence[str], spacy_model: str, folder: Path, seed: int
) -> dict[str, Any]:
    """Silver-label the texts with spaCy, tokenize them with segtok (as FlairNer does at run
    time) and write a shuffled train/dev/test split in two-column BIO format."""
    from flair.data import Sentence
    from flair.tokenization import SegtokTokenizer

    mentions = SpacyNer(spacy_model)(texts)
    tokenizer = SegtokTokenizer()
    rows: list[list[tuple[str, str]]] = []
    snapped = 0
    labels: Counter[str] = Counter()
    for text, found in zip(texts, mentions):
        sentence = Sentence(text, use_tokenizer=tokenizer)
        spans = [(t.start_position, t.end_position) for t in sentence.tokens]
        tags, n = bio_tags(spans, found)
        snapped += n
        labels.update(t[2:] for t in tags if t.startswith("B-"))
        rows.append([(t.text, tag) for t, tag in zip(sentence.tokens, tags)])
    random.Random(seed).shuffle(rows)
    folder.mkdir(parents=True, exist_ok=True)
    sizes: dict[str, int] = {}
    start = 0
    for i, (split, frac) in enumerate(SPLITS):
        end = len(rows) if i == len(SPLITS) - 1 else start + round(frac * len(rows))
        part = rows[start:end]
        sizes[split] = len(part)
        with (folder / f"{split}.txt").open("w", encoding="utf-8") as f:
            for row in part:
                f.writelines(f"{tok} {tag}\n" for tok, tag in row)
                f.write("\n")
        start = end
    return {"sentences": sizes, "entities": dict(sorted(labels.items())), "snapped_to_tokens": snapped}


def char_dictionary(corpus: Any) -> Any:
    """The characters of the training split (unseen ones map to <unk>): replaces flair's
    downloaded "common-chars" dictionary."""
    from flair.data import Dictionary

    chars = Dictionary(add_unk=True)
    for sentence in corpus.train:
        for token in sentence.tokens:
            for ch in token.text:
                chars.add_item(ch)
    return chars


def train(
    out: Path,
    *,
    corpus_path: Path = DEFAULT_CORPUS,
    epochs: int = 30,
    seed: int = 13,
    hidden_size: int = 64,
    learning_rate: float = 0.1,
    batch_size: int = 8,
    threads: int = 1,
    spacy_model: str = DEFAULT_SPACY_MODEL,
) -> dict[str, Any]:
    """Build the silver corpus, train, save, reload from disk and score on the test split."""
    try:
        import flair
    except ImportError as exc:
        raise SystemExit(f"flair is not installed here; {FACTCHECK_ENV_HINT}") from exc
    import torch
    from flair.datasets import ColumnCorpus
    from flair.embeddings import CharacterEmbeddings, OneHotEmbeddings, StackedEmbeddings
    from flair.models import SequenceTagger
    from flair.trainers import ModelTrainer

    # flair logs to stdout; keep stdout for the JSON result.
    for handler in logging.getLogger("flair").handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)

    # A tagger this small trains faster on one thread than on two (measured: 5.4 s vs 7.2 s for
    # 5 epochs on the 2-core CI machine), and leaves the other core to whatever else runs.
    torch.set_num_threads(threads)
    flair.set_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    stats = write_column_corpus(read_corpus(corpus_path), spacy_model, out / "corpus", seed)
    corpus = ColumnCorpus(
        out / "corpus", {0: "text", 1: "ner"}, train_file="train.txt", dev_file="dev.txt",
        test_file="test.txt", comment_symbol=None, in_memory=True,
    )
    label_dictionary = corpus.make_label_dictionary("ner", add_unk=False)
    embeddings = StackedEmbeddings([
        # Characters first: flair concatenates a token's embeddings sorted by name, and a
        # reloaded OneHotEmbeddings loses its stack prefix ("0-one-hot-text" comes back as
        # "one-hot-text"); only this order sorts the same before saving and after loading.
        CharacterEmbeddings(char_dictionary(corpus), char_embedding_dim=25, hidden_size_char=25),
        # Words seen twice in training; rarer ones (most names) are left to the characters.
        OneHotEmbeddings.from_corpus(corpus, min_freq=2, embedding_length=64),
    ])
    tagger = SequenceTagger(
        hidden_size=hidden_size, embeddings=embeddings, tag_dictionary=label_dictionary,
        tag_type="ner", use_crf=True,
    )
    started = time.perf_counter()
    trained = ModelTrainer(tagger, corpus).train(
        out, learning_rate=learning_rate, mini_batch_size=batch_size, max_epochs=epochs,
        embeddings_storage_mode="none", save_final_model=True, create_file_logs=False,
        use_final_model_for_eval=True,
    )
    train_s = time.perf_counter() - started

    model_file = out / "final-model.pt"
    reloaded = SequenceTagger.load(str(model_file))
    result = reloaded.evaluate(corpus.test, gold_label_type="ner", mini_batch_size=32)
    # The same weights on the same sentences: a different score means the saved model does
    # not rebuild what was trained (as with the embedding order above).
    if abs(float(result.main_score) - float(trained["test_score"])) > 1e-6:
        raise RuntimeError(
            f"the reloaded tagger scores {result.main_score:.4f} on the test split, the trained one "
            f"{trained['test_score']:.4f}: {model_file} does not rebuild the trained model"
        )
    report = result.classification_report
    per_label = {
        label: {k: round(float(v), 4) for k, v in scores.items()}
        for label, scores in report.items()
        if label in label_dictionary.get_items()
    }
    metrics = {
        "micro_f1": round(float(result.main_score), 4),
        "per_label": per_label,
        "corpus": stats,
        "epochs": epochs,
        "seed": seed,
        "hidden_size": hidden_size,
        "learning_rate": learning_rate,
        "batch_size": batch_size,
        "threads": threads,
        "train_seconds": round(train_s, 1),
        "model": str(model_file),
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n", encoding="utf-8")
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m draftmesh.factcheck.flair_train", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (model, corpus splits, metrics.json)")
    parser.add_argument("--epochs", type=int, default=30, help="training epochs (default 30: about 35 s on one core)")
    parser.add_argument("--seed", type=int, default=13, help="seed of the split and the training (default 13)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="one sentence a line (default: the packaged corpus)")
    parser.add_argument("--hidden-size", type=int, default=64, help="tagger LSTM hidden size (default 64)")
    parser.add_argument("--lr", type=float, default=0.1, help="initial SGD learning rate, annealed on dev plateaus (default 0.1)")
    parser.add_argument("--batch-size", type=int, default=8, help="mini-batch size (default 8)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    parser.add_argument("--spacy-model", default=DEFAULT_SPACY_MODEL, help="spaCy pipeline giving the silver labels")
    args = parser.parse_args(argv)
    if min(args.epochs, args.hidden_size, args.batch_size, args.threads) < 1 or args.lr <= 0:
        parser.error("--epochs, --hidden-size, --batch-size and --threads must be >= 1, --lr > 0")
    metrics = train(args.out, corpus_path=args.corpus, epochs=args.epochs, seed=args.seed,
                    hidden_size=args.hidden_size, learning_rate=args.lr, batch_size=args.batch_size, threads=args.threads,
                    spacy_model=args.spacy_model)
    print(json.dumps(metrics), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
