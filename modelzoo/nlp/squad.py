"""SQuAD v1.1 and v2.0: reading, windowed features, answer post-processing, official metric.

Rajpurkar et al., "SQuAD: 100,000+ Questions for Machine Comprehension of Text" (2016) and
"Know What You Don't Know: Unanswerable Questions for SQuAD" (2018). The feature and
post-processing rules are those of Google's ``run_squad.py`` as GluonNLP's
``finetune_squad.py`` uses them; answer text is cut from the context by the WordPiece
character offsets (as Hugging Face's ``run_qa.py``).

* :data:`SQUAD_DATASETS` / :func:`squad_file`: the official files by name (``"squad1.1"``,
  ``"squad2.0"``; GluonNLP's ``SQuAD(segment, version)``), fetched from the SQuAD site and
  verified against their published sha256 by the store (:mod:`modelzoo.data`).
* :func:`read_squad` reads the official JSON format, checks every question (fields present,
  non-empty context, ``answer_start`` pointing at the answer text) and raises an error naming
  the question id, or with ``skip_bad=True`` skips, counts and reports it.
* :func:`make_features` windows each context: ``[CLS] question [SEP] context window [SEP]``,
  windows starting every ``doc_stride`` context tokens; each context token remembers whether
  this window is its "max context" one (the window where it has the most context on both
  sides), and only there may an answer start.
* :func:`postprocess` turns start/end logits into the n-best spans and the prediction (v2.0:
  the empty answer when null score - best span score > threshold);
  :func:`write_predictions` writes ``predictions.json``, ``nbest_predictions.json`` and
  ``null_odds.json``.
* :func:`squad_v1_metrics` / :func:`squad_v2_metrics` are the official ``evaluate-v1.1.py`` /
  ``evaluate-v2.0.py`` scores (x100).

(Why one module of about 790 lines: reading, windowing, post-processing and the official
metric are one pipeline whose character/token offset conventions must agree end to end.)
"""

from __future__ import annotations

import collections
import json
import math
import os
import re
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data import DataFile, DataSet, register_dataset
from ..fileio import atomic_write_text
from .tokenizer import BertTokenizer

__all__ = [
    "Answer",
    "SquadExample",
    "SquadFeature",
    "SquadFormatError",
    "SquadSet",
    "SpanPrediction",
    "SQUAD_DATASETS",
    "SQUAD_URL",
    "exact_match_score",
    "f1_score",
    "make_features",
    "normalize_answer",
    "pad_features",
    "postprocess",
    "read_squad",
    "score_example",
    "squad_file",
    "squad_v1_metrics",
    "squad_v2_metrics",
    "write_predictions",
]


class SquadFormatError(ValueError):
    """A SQuAD file that breaks the format; the message names the question (or place)."""


@dataclass(frozen=True)
class Answer:
    """A gold answer: its text and the character offset where it starts in the context."""

    text: str
    start: int


@dataclass(frozen=True)
class SquadExample:
    """One question about one context paragraph.

    ``answers`` are all gold answers (training sets have one); v2.0 unanswerable questions
    have ``is_impossible`` and no answers.
    """

    qid: str
    question: str
    context: str
    answers: tuple[Answer, ...]
    is_impossible: bool = False
    title: str = ""


@dataclass
class SquadSet:
    """Examples read from one file, with the version and what was skipped (and why)."""

    examples: list[SquadExample]
    version: str
    source: str
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.examples)

    def report(self) -> str:
        """One line: how many questions were read and skipped, with the first reasons."""
        text = f"{self.source}: {len(self.examples)} questions (SQuAD {self.version})"
        if self.skipped:
            shown = "; ".join(f"{where}: {why}" for where, why in self.skipped[:5])
            more = f"; and {len(self.skipped) - 5} more" if len(self.skipped) > 5 else ""
            text += f", skipped {len(self.skipped)} malformed: {shown}{more}"
        return text


# ---------------------------------------------------------------------------------------------
# The official files, by name
# ---------------------------------------------------------------------------------------------

#: Where the SQuAD authors publish the data set (https://rajpurkar.github.io/SQuAD-explorer/).
SQUAD_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset"

# The sha256 digests and sizes of the four official files at SQUAD_URL, as two independent
# references pin them for these exact URLs (they agree on every digit):
#   Hugging Face datasets: datasets/squad/dataset_infos.json and
#     datasets/squad_v2/dataset_infos.json ("download_checksums");
#   TensorFlow Datasets: tensorflow_datasets/question_answering/squad/checksums.tsv.
# GluonNLP (scripts/datasets/url_checksums/squad.txt) pins the sha1 of the same URLs with the
# same sizes: train-v1.1 1faea125..., dev-v1.1 e1621aae..., train-v2.0 ceb2acde..., dev-v2.0
# 53ebaeb1... (GluonNLP 0.x's SQuAD class pinned 846082d1... for dev-v2.0: the JSON inside
# its own S3 zip, not this URL's bytes).
_SQUAD_SHA256 = {
    ("1.1", "train"): ("3527663986b8295af4f7fcdff1ba1ff3f72d07d61a20f487cb238a6ef92fd955", 30288272),
    ("1.1", "dev"): ("95aa6a52d5d6a735563366753ca50492a658031da74f301ac5238b03966972c9", 4854279),
    ("2.0", "train"): ("68dcfbb971bd3e96d5b46c7177b16c1a4e7d4bdef19fb204502738552dede002", 42123633),
    ("2.0", "dev"): ("80a5225e94905956a6446d296ca1093975c4d3b3260f1d6c8f68bc2ab77182d8", 4370528),
}  # fmt: skip
_SQUAD_HASH_SOURCE = (
    "Hugging Face datasets datasets/{hf}/dataset_infos.json; TensorFlow Datasets "
    "tensorflow_datasets/question_answering/squad/checksums.tsv"
)

#: ``"1.1"`` / ``"2.0"`` -> the registered :class:`~modelzoo.data.DataSet` (``"squad1.1"``,
#: ``"squad2.0"``), parts ``"train"`` and ``"dev"``, in ``$MODELZOO_HOME/datasets/squad``.
SQUAD_DATASETS: dict[str, DataSet] = {
    version: register_dataset(
        DataSet(
            name=f"squad{version}",
            files={
                split: DataFile(
                    url=f"{SQUAD_URL}/{split}-v{version}.json",
                    hash_prefix=_SQUAD_SHA256[version, split][0],
                    num_bytes=_SQUAD_SHA256[version, split][1],
                    hash_source=_SQUAD_HASH_SOURCE.format(
                        hf="squad" if version == "1.1" else "squad_v2"
                    ),
                )
                for split in ("train", "dev")
            },
            folder="squad",
            description=f"SQuAD v{version}, the official train and dev files"
            + (" (with unanswerable questions)" if version == "2.0" else ""),
            homepage="https://rajpurkar.github.io/SQuAD-explorer/",
            license="CC BY-SA 4.0",
        )
    )
    for version in ("1.1", "2.0")
}


def squad_file(
    version: str = "1.1",
    split: str = "train",
    *,
    root: str | os.PathLike[str] | None = None,
    progress: bool = True,
) -> Path:
    """The official SQuAD file (``train-v1.1.json``, ``dev-v2.0.json``, ...), verified.

    GluonNLP's ``SQuAD(segment, version)`` as a path: the file is looked for in ``root``
    (default ``$MODELZOO_HOME/datasets/squad``) and downloaded from :data:`SQUAD_URL` (or
    ``$MODELZOO_DATA_URL``) when missing or not the published bytes. Read it with
    :func:`read_squad`.

    Args:
        version: ``"1.1"`` or ``"2.0"``.
        split: ``"train"`` or ``"dev"``.
        root: The folder of the files.
        progress: Show a download progress bar (on a terminal).

    Raises:
        ValueError: Unknown version or split.
        FileNotFoundError: ``MODELZOO_OFFLINE=1`` and the file is not there.
        modelzoo.store.DownloadError: It could not be downloaded. Both messages name the
            file, its URL and the path to put it at.
        modelzoo.store.ChecksumError: The bytes served are not the published file.
    """
    if version not in SQUAD_DATASETS:
        raise ValueError(f"SQuAD version must be one of {list(SQUAD_DATASETS)}, got {version!r}")
    return SQUAD_DATASETS[version].fetch(split, root, progress=progress)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_squad(
    source: str | os.PathLike[str] | Mapping[str, Any],
    *,
    version: str | None = None,
    skip_bad: bool = False,
    training: bool = False,
) -> SquadSet:
    """Reads a SQuAD JSON file (or its parsed dict).

    Args:
        source: Path to ``train-v1.1.json`` / ``dev-v2.0.json`` / ..., or the parsed JSON.
        version: ``"1.1"`` or ``"2.0"``; default: the file's ``version`` field (``v2.0``
            files mark unanswerable questions with ``is_impossible``).
        skip_bad: Skip malformed questions (counted in :attr:`SquadSet.skipped`) instead of
            raising.
        training: Every answerable question needs an answer (only the first is used).

    Raises:
        SquadFormatError: The file is not SQuAD JSON, or (without ``skip_bad``) a question is
            malformed: a missing field, an empty context or question, an ``answer_start`` that
            does not point at its answer text, a duplicate id. The message names the question
            id (or its place, ``data[i].paragraphs[j].qas[k]``, when the id is missing).
    """
    if isinstance(source, Mapping):
        data, name = source, "<SQuAD dict>"
    else:
        name = os.fspath(source)
        try:
            with open(source, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise SquadFormatError(f"{name}: cannot read the SQuAD file ({exc})") from exc
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise SquadFormatError(f"{name}: not valid JSON ({exc})") from exc
    if not isinstance(data, Mapping) or not isinstance(data.get("data"), list):
        raise SquadFormatError(
            f"{name}: not a SQuAD file: expected a JSON object with a 'data' list of articles"
        )
    if version is None:
        version = "2.0" if str(data.get("version", "1.1")).lstrip("v").startswith("2") else "1.1"
    if version not in ("1.1", "2.0"):
        raise ValueError(f"version must be '1.1' or '2.0', got {version!r}")

    examples: list[SquadExample] = []
    skipped: list[tuple[str, str]] = []
    seen: set[str] = set()

    def bad(where: str, why: str) -> None:
        if not skip_bad:
            raise SquadFormatError(
                f"{name}: {where}: {why} (pass skip_bad=True / --skip_bad_examples to skip "
                "malformed questions and report them)"
            )
        skipped.append((where, why))

    for i, article in enumerate(data["data"]):
        paragraphs = article.get("paragraphs") if isinstance(article, Mapping) else None
        if not isinstance(paragraphs, list):
            bad(f"data[{i}]", "missing 'paragraphs' list")
            continue
        title = str(article.get("title", ""))
        for j, paragraph in enumerate(paragraphs):
            place = f"data[{i}].paragraphs[{j}]"
            if not isinstance(paragraph, Mapping):
                bad(place, "a paragraph must be a JSON object")
                continue
            qas = paragraph.get("qas")
            if not isinstance(qas, list):
                bad(place, "missing 'qas' list")
                continue
            context = paragraph.get("context")
            context_problem = None
            if not isinstance(context, str):
                context_problem = "missing 'context'"
            elif not context.strip():
                context_problem = "empty context"
            for k, qa in enumerate(qas):
                qid = qa.get("id") if isinstance(qa, Mapping) else None
                if not isinstance(qid, str) or not qid:
                    bad(f"{place}.qas[{k}]", "question without an 'id'")
                    continue
                where = f"question {qid!r}"
                if context_problem is not None:
                    bad(where, f"{context_problem} in {place}")
                    continue
                example, problem = _parse_question(qa, qid, context, title, version, training)
                if problem is not None:
                    bad(where, problem)
                    continue
                if qid in seen:
                    bad(where, "duplicate question id")
                    continue
                seen.add(qid)
                examples.append(example)
    return SquadSet(examples, version, name, skipped)


def _parse_question(
    qa: Mapping[str, Any], qid: str, context: str, title: str, version: str, training: bool
) -> tuple[SquadExample | None, str | None]:
    question = qa.get("question")
    if not isinstance(question, str):
        return None, "missing 'question'"
    if not question.strip():
        return None, "empty question"
    impossible = bool(qa.get("is_impossible", False)) if version == "2.0" else False
    raw_answers = qa.get("answers")
    if raw_answers is None and impossible:
        raw_answers = []
    if not isinstance(raw_answers, list):
        return None, "missing 'answers' list"
    answers = []
    for n, raw in enumerate(raw_answers):
        if not isinstance(raw, Mapping) or "text" not in raw or "answer_start" not in raw:
            return None, f"answer #{n} needs 'text' and 'answer_start'"
        text, start = raw["text"], raw["answer_start"]
        if not isinstance(text, str) or not text.strip():
            return None, f"answer #{n} has an empty text"
        if isinstance(start, bool) or not isinstance(start, int):
            return None, f"answer #{n}: answer_start must be an integer, got {start!r}"
        found = context[start : start + len(text)] if 0 <= start <= len(context) else ""
        if found != text:
            return None, (
                f"answer #{n}: answer_start {start} does not match the answer text {text!r}: "
                f"the context there reads {found!r}"
            )
        answers.append(Answer(text, start))
    if impossible:
        answers = []  # v2.0 dev files keep plausible answers elsewhere; gold is ""
    elif not answers and (training or version == "1.1"):
        return None, "an answerable question without answers"
    return SquadExample(qid, question, context, tuple(answers), impossible, title), None


# ---------------------------------------------------------------------------------------------
# Features
# ---------------------------------------------------------------------------------------------


@dataclass
class SquadFeature:
    """One window of one example, ready for the model.

    Attributes:
        example_index: Index of the example in the list given to :func:`make_features`.
        input_ids: ``[CLS] question [SEP] window [SEP]`` token ids.
        token_type_ids: 0 for the question part, 1 for the window and its ``[SEP]``.
        start_position: Training label: token index of the answer start (0, the ``[CLS]``,
            when the answer is not inside this window or there is none).
        end_position: Training label: token index of the answer end (inclusive).
        offsets: Per token, its ``(start, end)`` characters in the context, or None for tokens
            outside the window (question, special tokens).
        max_context: Per token, whether this window is the token's max-context window.
    """

    example_index: int
    input_ids: list[int]
    token_type_ids: list[int]
    start_position: int
    end_position: int
    offsets: list[tuple[int, int] | None]
    max_context: list[bool]


def _windows(num_tokens: int, max_tokens: int, doc_stride: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each window; starts every ``doc_stride`` tokens (Google)."""
    spans: list[tuple[int, int]] = []
    start = 0
    while start < num_tokens:
        length = min(num_tokens - start, max_tokens)
        spans.append((start, length))
        if start + length == num_tokens:
            break
        start += min(length, doc_stride)
    return spans


def _max_context_flags(spans: Sequence[tuple[int, int]], num_tokens: int) -> list[np.ndarray]:
    """For each window, per token in it: is this the window with the best
    ``min(left, right) + 0.01 * length`` context score (first wins ties)?"""
    best_score = np.full(num_tokens, -np.inf)
    best_span = np.full(num_tokens, -1)
    for index, (start, length) in enumerate(spans):
        positions = np.arange(start, start + length)
        score = np.minimum(positions - start, start + length - 1 - positions) + 0.01 * length
        better = score > best_score[positions]
        best_score[positions[better]] = score[better]
        best_span[positions[better]] = index
    return [best_span[start : start + length] == i for i, (start, length) in enumerate(spans)]


def _answer_tokens(offsets: Sequence[tuple[int, int]], start: int, end: int) -> tuple[int, int]:
    """First and last context token overlapping characters ``[start, end)``; (-1, -1) if none."""
    first = last = -1
    for i, (a, b) in enumerate(offsets):
        if b > start and a < end:
            if first < 0:
                first = i
            last = i
    return first, last


def make_features(
    examples: Sequence[SquadExample],
    tokenizer: BertTokenizer,
    *,
    max_seq_length: int = 384,
    doc_stride: int = 128,
    max_query_length: int = 64,
    training: bool = False,
) -> list[SquadFeature]:
    """Windows every example into features (see the module docstring).

    With ``training`` the first gold answer gives the labels; a window that does not contain
    the whole answer (and every unanswerable question) is labelled with the ``[CLS]`` token.

    Raises:
        ValueError: ``max_seq_length`` leaves no room for the context.
    """
    if max_seq_length <= max_query_length + 3:
        raise ValueError(
            f"max_seq_length ({max_seq_length}) must be greater than max_query_length "
            f"({max_query_length}) + 3"
        )
    if doc_stride < 1:
        raise ValueError(f"doc_stride must be >= 1, got {doc_stride}")
    questions = tokenizer.encode_batch([e.question for e in examples])
    contexts = tokenizer.encode_batch([e.context for e in examples])
    features: list[SquadFeature] = []
    for index, (example, query, doc) in enumerate(zip(examples, questions, contexts, strict=True)):
        query_ids = query.ids[:max_query_length]
        max_tokens = max_seq_length - len(query_ids) - 3
        spans = _windows(len(doc.ids), max_tokens, doc_stride)
        flags = _max_context_flags(spans, len(doc.ids))
        answer = (-1, -1)
        if training and example.answers and not example.is_impossible:
            first = example.answers[0]
            answer = _answer_tokens(doc.offsets, first.start, first.start + len(first.text))
        prefix = [tokenizer.cls_id, *query_ids, tokenizer.sep_id]
        for (start, length), is_max in zip(spans, flags, strict=True):
            window = slice(start, start + length)
            input_ids = prefix + doc.ids[window] + [tokenizer.sep_id]
            token_type_ids = [0] * len(prefix) + [1] * (length + 1)
            offsets: list[tuple[int, int] | None] = [None] * len(prefix)
            offsets += doc.offsets[window]
            offsets.append(None)
            max_context = [False] * len(prefix) + is_max.tolist() + [False]
            start_position = end_position = 0
            if answer[0] >= 0 and start <= answer[0] and answer[1] < start + length:
                start_position = answer[0] - start + len(prefix)
                end_position = answer[1] - start + len(prefix)
            features.append(
                SquadFeature(
                    index,
                    input_ids,
                    token_type_ids,
                    start_position,
                    end_position,
                    offsets,
                    max_context,
                )  # fmt: skip
            )
    return features


# ---------------------------------------------------------------------------------------------
# Post-processing
# ---------------------------------------------------------------------------------------------


def pad_features(features: Sequence[SquadFeature], pad_id: int) -> dict[str, Any]:
    """The model inputs of a batch of windows: ``input_ids`` and ``token_type_ids`` padded
    to the longest, and ``attention_mask`` (``None`` when no window is padded: SDPA's fast
    path). What ``finetune_squad.py`` and the question-answering pipeline feed BERT."""
    lengths = [len(f.input_ids) for f in features]
    width = max(lengths, default=1)
    ids = torch.full((len(features), width), pad_id, dtype=torch.long)
    types = torch.zeros((len(features), width), dtype=torch.long)
    for row, f in enumerate(features):
        ids[row, : lengths[row]] = torch.tensor(f.input_ids)
        types[row, : lengths[row]] = torch.tensor(f.token_type_ids)
    mask = None
    if min(lengths, default=width) < width:
        mask = torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]
    return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}


@dataclass(frozen=True)
class SpanPrediction:
    """One n-best entry: answer text, its logits and its probability among the n best.

    ``start``/``end`` are the answer's character offsets in the context
    (``context[start:end] == text``); ``-1`` for the placeholder ``"empty"`` entry and ``0``
    for v2.0's null answer ``""``.
    """

    text: str
    start_logit: float
    end_logit: float
    probability: float = 0.0
    start: int = -1
    end: int = -1

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "probability": self.probability,
            "start_logit": self.start_logit,
            "end_logit": self.end_logit,
        }


def _top(logits: np.ndarray, n: int) -> np.ndarray:
    return np.argsort(-logits, kind="stable")[:n]


def postprocess(
    example: SquadExample,
    features: Sequence[SquadFeature],
    start_logits: Sequence[np.ndarray],
    end_logits: Sequence[np.ndarray],
    *,
    n_best_size: int = 20,
    max_answer_length: int = 30,
    version_2: bool = False,
    null_score_diff_threshold: float = 0.0,
) -> tuple[str, list[SpanPrediction], float | None]:
    """The answer to one example from the logits of its features.

    For every window, the top ``n_best_size`` start and end tokens are paired; a pair is
    dropped if either end is outside the context, ``end < start``, it is longer than
    ``max_answer_length`` tokens, or the start token is not at its max-context window. The
    score of a span is start + end logit; spans with the same text are merged (the best kept).

    Returns:
        ``(prediction, nbest, null_odds)``: the answer text; the n best spans with softmax
        probabilities; for v2.0 the score difference ``null - best span`` (``""`` is
        predicted when it exceeds ``null_score_diff_threshold``), else None.
    """
    prelim: list[tuple[float, float, float, int, int, int]] = []
    null_score = math.inf
    null_logits = (0.0, 0.0)
    for f, (feature, starts, ends) in enumerate(
        zip(features, start_logits, end_logits, strict=True)
    ):
        starts = np.asarray(starts, dtype=np.float64)[: len(feature.input_ids)]
        ends = np.asarray(ends, dtype=np.float64)[: len(feature.input_ids)]
        if version_2 and starts[0] + ends[0] < null_score:
            null_score = float(starts[0] + ends[0])
            null_logits = (float(starts[0]), float(ends[0]))
        offsets = feature.offsets
        for s in _top(starts, n_best_size):
            if offsets[s] is None or not feature.max_context[s]:
                continue
            for e in _top(ends, n_best_size):
                if offsets[e] is None or e < s or e - s + 1 > max_answer_length:
                    continue
                prelim.append(
                    (float(starts[s] + ends[e]), float(starts[s]), float(ends[e]), f, s, e)
                )
    prelim.sort(key=lambda p: p[0], reverse=True)

    entries: list[tuple[str, float, float, int, int]] = []
    seen: set[str] = set()
    for _, start_logit, end_logit, f, s, e in prelim:
        if len(entries) >= n_best_size:
            break
        offsets = features[f].offsets
        first, last = offsets[s][0], offsets[e][1]  # type: ignore[index]
        text = example.context[first:last]
        if text in seen:
            continue
        seen.add(text)
        entries.append((text, start_logit, end_logit, first, last))
    if version_2 and features:
        if "" not in seen:
            entries.append(("", *null_logits, 0, 0))
        if len(entries) == 1:  # only the null answer: add a nonce span (as run_squad.py)
            entries.insert(0, ("empty", 0.0, 0.0, -1, -1))
    if not entries:
        entries = [("empty", 0.0, 0.0, -1, -1)] if features else [("", 0.0, 0.0, 0, 0)]

    scores = np.array([a + b for _, a, b, _, _ in entries])
    probs = np.exp(scores - scores.max())
    probs /= probs.sum()
    nbest = [
        SpanPrediction(text, a, b, float(p), first, last)
        for (text, a, b, first, last), p in zip(entries, probs, strict=True)
    ]
    if not version_2:
        return nbest[0].text, nbest, None
    if not features:
        return "", nbest, 0.0
    best = next((p for p in nbest if p.text), None)
    if best is None:
        return "", nbest, 0.0
    diff = null_score - best.start_logit - best.end_logit
    return ("" if diff > null_score_diff_threshold else best.text), nbest, diff


def write_predictions(
    output_dir: str | os.PathLike[str],
    predictions: Mapping[str, str],
    nbest: Mapping[str, Sequence[SpanPrediction]] | None = None,
    null_odds: Mapping[str, float] | None = None,
) -> dict[str, Path]:
    """Writes ``predictions.json`` (qid -> text), ``nbest_predictions.json`` and, for v2.0,
    ``null_odds.json`` (qid -> null score difference) into ``output_dir``."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"predictions": out / "predictions.json"}
    _dump(paths["predictions"], dict(predictions))
    if nbest is not None:
        paths["nbest"] = out / "nbest_predictions.json"
        _dump(paths["nbest"], {q: [p.to_dict() for p in ps] for q, ps in nbest.items()})
    if null_odds is not None:
        paths["null_odds"] = out / "null_odds.json"
        _dump(paths["null_odds"], dict(null_odds))
    return paths


def _dump(path: Path, value: Any) -> None:
    atomic_write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


# ---------------------------------------------------------------------------------------------
# The official metric
# ---------------------------------------------------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalization: lowercase, drop punctuation, drop articles, collapse spaces."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def _tokens(text: str) -> list[str]:
    return normalize_answer(text).split() if text else []


def exact_match_score(prediction: str, gold: str) -> float:
    """1.0 if the normalized strings are equal, else 0.0."""
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str, *, version_2: bool = False) -> float:
    """Token-overlap F1 of the normalized strings. v2.0: if either side has no tokens, 1.0
    only when both have none."""
    pred, ref = _tokens(prediction), _tokens(gold)
    if version_2 and (not pred or not ref):
        return float(pred == ref)
    common = collections.Counter(pred) & collections.Counter(ref)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred)
    recall = same / len(ref)
    return 2 * precision * recall / (precision + recall)


def gold_answers(example: SquadExample, version_2: bool = False) -> list[str]:
    """The answers a prediction is scored against (v2.0: ``[""]`` when none)."""
    texts = [a.text for a in example.answers]
    if version_2:
        texts = [t for t in texts if normalize_answer(t)] or [""]
    return texts


def score_example(
    example: SquadExample, prediction: str, *, version_2: bool = False
) -> tuple[float, float]:
    """``(exact match, F1)`` of one prediction, each the max over the gold answers (0-1)."""
    golds = gold_answers(example, version_2)
    em = max(exact_match_score(prediction, g) for g in golds)
    f1 = max(f1_score(prediction, g, version_2=version_2) for g in golds)
    return em, f1


def squad_v1_metrics(
    examples: Iterable[SquadExample], predictions: Mapping[str, str]
) -> dict[str, float]:
    """``evaluate-v1.1.py``: ``{"exact_match", "f1"}`` in percent over all questions (an
    unanswered question scores 0), plus ``"total"`` and ``"missing"``."""
    em = f1 = 0.0
    total = missing = 0
    for example in examples:
        total += 1
        if example.qid not in predictions:
            missing += 1
            continue
        e, f = score_example(example, predictions[example.qid])
        em += e
        f1 += f
    return {
        "exact_match": 100.0 * em / total if total else 0.0,
        "f1": 100.0 * f1 / total if total else 0.0,
        "total": total,
        "missing": missing,
    }


def squad_v2_metrics(
    examples: Iterable[SquadExample],
    predictions: Mapping[str, str],
    na_probs: Mapping[str, float] | None = None,
    na_prob_thresh: float = 1.0,
) -> dict[str, float]:
    """``evaluate-v2.0.py``: ``exact``, ``f1``, ``total`` and the ``HasAns_*`` / ``NoAns_*``
    breakdowns (percent); with ``na_probs`` (e.g. the null odds) also ``best_exact``,
    ``best_exact_thresh``, ``best_f1``, ``best_f1_thresh``. As the official script, a question
    without a prediction is left out of every count.
    """
    examples = [e for e in examples if e.qid in predictions]
    has_answer = {e.qid: bool(e.answers) for e in examples}
    exact_raw: dict[str, float] = {}
    f1_raw: dict[str, float] = {}
    for example in examples:
        e, f = score_example(example, predictions[example.qid], version_2=True)
        exact_raw[example.qid], f1_raw[example.qid] = e, f
    exact, f1 = dict(exact_raw), dict(f1_raw)
    if na_probs is not None:
        for qid in exact:
            if na_probs.get(qid, 0.0) > na_prob_thresh:  # predicted unanswerable
                exact[qid] = f1[qid] = float(not has_answer[qid])

    def mean(scores: Mapping[str, float], qids: Sequence[str]) -> float:
        return 100.0 * sum(scores[q] for q in qids) / len(qids)

    qids = [e.qid for e in examples]
    out: dict[str, float] = {"exact": mean(exact, qids) if qids else 0.0}
    out["f1"] = mean(f1, qids) if qids else 0.0
    out["total"] = len(qids)
    for label, wanted in (("HasAns", True), ("NoAns", False)):
        part = [q for q in qids if has_answer[q] == wanted]
        if part:
            out[f"{label}_exact"] = mean(exact, part)
            out[f"{label}_f1"] = mean(f1, part)
            out[f"{label}_total"] = len(part)
    if na_probs is not None and qids:
        for name, raw in (("exact", exact_raw), ("f1", f1_raw)):
            best, thresh = _best_threshold(predictions, raw, na_probs, has_answer)
            out[f"best_{name}"], out[f"best_{name}_thresh"] = best, thresh
    return out


def _best_threshold(
    predictions: Mapping[str, str],
    scores: Mapping[str, float],
    na_probs: Mapping[str, float],
    has_answer: Mapping[str, bool],
) -> tuple[float, float]:
    """The official ``find_best_thresh``: sweep the no-answer threshold over ``na_probs``."""
    num_no_ans = sum(1 for q in has_answer if not has_answer[q])
    current = best = float(num_no_ans)
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda q: na_probs[q]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            diff = scores[qid]
        elif predictions[qid]:
            diff = -1.0
        else:
            diff = 0.0
        current += diff
        if current > best:
            best, best_thresh = current, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh
