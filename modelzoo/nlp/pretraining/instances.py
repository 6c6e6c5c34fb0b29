"""BERT pretraining instances: masking, next-sentence pairs, documents (GluonNLP / Google rules)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "INDEX_NAME",
    "SHARD_FORMAT",
    "InstanceConfig",
    "ShardError",
    "TrainingInstance",
    "VocabInfo",
    "create_instances",
    "mask_tokens",
    "read_documents",
]

SHARD_FORMAT = 1
INDEX_NAME = "index.json"
_SHARD_NAME = "shard-{:05d}.npy"


class ShardError(ValueError):
    """A shard directory that cannot be used (the message names the file and the fix)."""


# ---------------------------------------------------------------------------------------------
# Settings and vocabulary
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceConfig:
    """How instances are made (Google's ``create_pretraining_data.py`` flags).

    Attributes:
        max_seq_length: Tokens per instance, ``[CLS]`` and both ``[SEP]`` included.
        max_predictions_per_seq: At most this many masked positions per instance.
        masked_lm_prob: Fraction of the tokens to mask (15 %).
        short_seq_prob: Probability of a shorter random target length.
        random_next_prob: Probability that segment B comes from another document.
        whole_word_mask: Mask all pieces of a word together.
        dupe_factor: Passes over the corpus, each with different masks and pairs.
        window_docs: Documents held in memory for random-next sampling.
        seed: Seed of the one random stream that makes every choice.
    """

    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    random_next_prob: float = 0.5
    whole_word_mask: bool = False
    dupe_factor: int = 1
    window_docs: int = 256
    seed: int = 12345

    def __post_init__(self) -> None:
        if self.max_seq_length < 5:
            raise ValueError(f"max_seq_length must be >= 5, got {self.max_seq_length}")
        if self.max_seq_length > 65535:
            raise ValueError(f"max_seq_length must be < 65536, got {self.max_seq_length}")
        if self.max_predictions_per_seq < 1:
            raise ValueError(
                f"max_predictions_per_seq must be >= 1, got {self.max_predictions_per_seq}"
            )
        for name in ("masked_lm_prob", "short_seq_prob", "random_next_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.dupe_factor < 1:
            raise ValueError(f"dupe_factor must be >= 1, got {self.dupe_factor}")
        if self.window_docs < 2:
            raise ValueError(
                f"window_docs must be >= 2 (random next needs another document), got "
                f"{self.window_docs}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class VocabInfo:
    """What instance creation needs to know about the vocabulary.

    Attributes:
        size: Number of tokens (random replacements are drawn from ``[0, size)``).
        cls_id, sep_id, mask_id, pad_id: Special token ids.
        continuation: ``continuation[id]`` is True for ``##`` word pieces (whole-word masking).
        sha256: Hash of the token list (shards remember which vocabulary made them).
    """

    size: int
    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    continuation: np.ndarray
    sha256: str

    @classmethod
    def from_tokens(
        cls,
        tokens: Sequence[str],
        *,
        cls_token: str = "[CLS]",
        sep_token: str = "[SEP]",
        mask_token: str = "[MASK]",
        pad_token: str = "[PAD]",
    ) -> VocabInfo:
        """From the token list (ids are positions); the special tokens by name."""
        index = {t: i for i, t in enumerate(tokens)}
        missing = [t for t in (cls_token, sep_token, mask_token, pad_token) if t not in index]
        if missing:
            raise ValueError(f"the vocabulary lacks the special tokens {missing}")
        digest = hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()
        return cls(
            size=len(tokens),
            cls_id=index[cls_token],
            sep_id=index[sep_token],
            mask_id=index[mask_token],
            pad_id=index[pad_token],
            continuation=np.array([t.startswith("##") for t in tokens], dtype=bool),
            sha256=digest,
        )

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> VocabInfo:
        """From a :class:`~modelzoo.nlp.tokenizer.BertTokenizer`."""
        tokens = tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
        s = tokenizer.specials
        return cls.from_tokens(
            tokens, cls_token=s["cls"], sep_token=s["sep"], mask_token=s["mask"],
            pad_token=s["pad"],
        )  # fmt: skip


@dataclass
class TrainingInstance:
    """One pair: ``input_ids`` (masked, with ``[CLS] A [SEP] B [SEP]``), the length of A,
    the masked positions with their original ids, and whether B is a random next."""

    input_ids: list[int]
    len_a: int
    masked_positions: list[int]
    masked_ids: list[int]
    is_random_next: bool

    @property
    def token_type_ids(self) -> list[int]:
        first = self.len_a + 2
        return [0] * first + [1] * (len(self.input_ids) - first)


# ---------------------------------------------------------------------------------------------
# Masking and pairs
# ---------------------------------------------------------------------------------------------


def mask_tokens(
    tokens: Sequence[int],
    vocab: VocabInfo,
    rng: random.Random,
    *,
    masked_lm_prob: float = 0.15,
    max_predictions: int = 20,
    whole_word: bool = False,
) -> tuple[list[int], list[int], list[int]]:
    """Google's ``create_masked_lm_predictions``: ``(masked tokens, positions, original ids)``.

    ``[CLS]`` and ``[SEP]`` are never chosen. The positions come back sorted.
    """
    specials = (vocab.cls_id, vocab.sep_id)
    groups: list[list[int]] = []
    for i, token in enumerate(tokens):
        if token in specials:
            continue
        if whole_word and groups and vocab.continuation[token] and groups[-1][-1] == i - 1:
            groups[-1].append(i)
        else:
            groups.append([i])
    rng.shuffle(groups)
    num_to_predict = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    output = list(tokens)
    chosen: list[int] = []
    for group in groups:
        if len(chosen) >= num_to_predict:
            break
        if len(chosen) + len(group) > num_to_predict:
            continue  # a whole word that does not fit is skipped, never split
        for i in group:
            if rng.random() < 0.8:
                output[i] = vocab.mask_id
            elif rng.random() < 0.5:
                pass  # 10 %: keep the original token
            else:
                output[i] = rng.randint(0, vocab.size - 1)
            chosen.append(i)
    chosen.sort()
    return output, chosen, [int(tokens[i]) for i in chosen]


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, rng: random.Random) -> None:
    """Trim the longer segment, from the front or the back at random, until both fit."""
    while len(a) + len(b) > max_tokens:
        longer = a if len(a) > len(b) else b
        if rng.random() < 0.5:
            del longer[0]
        else:
            longer.pop()


def _instances_from_document(
    doc_index: int,
    window: Sequence[tuple[int, list[list[int]]]],
    vocab: VocabInfo,
    config: InstanceConfig,
    rng: random.Random,
) -> Iterator[TrainingInstance]:
    """Google's ``create_instances_from_document`` for ``window[doc_index]``; random-next
    sentences come from the window's other documents."""
    doc_id, document = window[doc_index]
    max_tokens = config.max_seq_length - 3
    target = max_tokens
    if rng.random() < config.short_seq_prob:
        target = rng.randint(2, max_tokens)
    chunk: list[list[int]] = []
    length = 0
    i = 0
    while i < len(document):
        chunk.append(document[i])
        length += len(document[i])
        if i == len(document) - 1 or length >= target:
            if length >= 2:
                a_end = rng.randint(1, len(chunk) - 1) if len(chunk) >= 2 else 1
                a = [t for s in chunk[:a_end] for t in s]
                b: list[int] = []
                is_random = rng.random() < config.random_next_prob
                if is_random:
                    others = [k for k in range(len(window)) if window[k][0] != doc_id]
                    other = window[others[rng.randint(0, len(others) - 1)]][1]
                    target_b = max(1, target - len(a))
                    for j in range(rng.randint(0, len(other) - 1), len(other)):
                        b.extend(other[j])
                        if len(b) >= target_b:
                            break
                    i -= len(chunk) - a_end  # the unused sentences start the next chunk
                elif len(chunk) >= 2:
                    b = [t for s in chunk[a_end:] for t in s]
                else:  # one sentence: B is its own continuation, split at a random token
                    cut = rng.randint(1, len(a) - 1)
                    a, b = a[:cut], a[cut:]
                _truncate_pair(a, b, max_tokens, rng)
                tokens = [vocab.cls_id, *a, vocab.sep_id, *b, vocab.sep_id]
                masked, positions, labels = mask_tokens(
                    tokens,
                    vocab,
                    rng,
                    masked_lm_prob=config.masked_lm_prob,
                    max_predictions=config.max_predictions_per_seq,
                    whole_word=config.whole_word_mask,
                )
                yield TrainingInstance(masked, len(a), positions, labels, is_random)
            chunk, length = [], 0
        i += 1


def create_instances(
    documents: Iterable[list[list[int]]],
    vocab: VocabInfo,
    config: InstanceConfig,
    rng: random.Random,
) -> Iterator[TrainingInstance]:
    """Instances of tokenized documents (each a list of sentences of token ids), streamed.

    Memory holds at most ``config.window_docs`` documents: each document is cut when
    ``window_docs // 2`` documents after it have been read (or the input ended), with the
    window's other documents as the random-next pool.

    Raises:
        ValueError: Fewer than two documents (random next needs another document).
    """
    window: deque[tuple[int, list[list[int]]]] = deque()
    ahead = config.window_docs // 2
    pending = 0  # window index of the next document to cut
    seen = 0
    for document in documents:
        document = [s for s in document if s]
        if not document:
            continue
        window.append((seen, document))
        seen += 1
        while len(window) - pending > ahead and seen >= 2:
            yield from _instances_from_document(pending, window, vocab, config, rng)
            pending += 1
        while len(window) > config.window_docs:
            window.popleft()
            pending -= 1
    if seen < 2:
        raise ValueError(
            f"the corpus has {seen} non-empty document(s); next-sentence prediction needs at "
            "least 2 (separate documents with a blank line)"
        )
    while pending < len(window):
        yield from _instances_from_document(pending, window, vocab, config, rng)
        pending += 1


# ---------------------------------------------------------------------------------------------
# Reading text
# ---------------------------------------------------------------------------------------------


def read_documents(
    paths: Sequence[str | os.PathLike[str]], *, progress: Any = None
) -> Iterator[list[str]]:
    """Documents of text files (one sentence per line, blank line between documents),
    streamed line by line. ``progress`` (a tqdm bar) is advanced by the bytes read."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such corpus file")
        document: list[str] = []
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                if progress is not None:
                    progress.update(len(raw))
                try:
                    line = raw.decode("utf-8").strip()
                except UnicodeDecodeError as exc:
                    raise ValueError(
                        f"{path}:{lineno}: not UTF-8 text ({exc}); convert the corpus to UTF-8"
                    ) from None
                if line:
                    document.append(line)
                elif document:
                    yield document
                    document = []
        if document:
            yield document


def _tokenized(documents: Iterable[list[str]], tokenizer: Any) -> Iterator[list[list[int]]]:
    for document in documents:
        yield [e.ids for e in tokenizer.encode_batch(document)]
