"""BERT pretraining data: raw text -> sharded, memory-mapped masked-LM + next-sentence instances.

The instance rules are Google's ``create_pretraining_data.py`` (Devlin et al. 2019,
https://github.com/google-research/bert), made streaming so that corpora larger than memory
work:

* **Input**: one sentence per line, a blank line between documents (Google's format).
* **Pairs**: each document is cut into chunks of about ``target_seq_length`` tokens
  (``max_seq_length - 3``; with probability ``short_seq_prob`` a random shorter target), each
  chunk split at a random sentence boundary into segment A and B. With probability
  ``random_next_prob`` (0.5) B is replaced by sentences from a *different* document (label 1,
  "random next"), and the chunk's unused sentences are put back; otherwise B is the real
  continuation (label 0). The pair is trimmed, longer side first, from a random end.
* **Masked LM**: ``min(max_predictions_per_seq, max(1, round(len(tokens) * masked_lm_prob)))``
  positions are chosen among the non-special tokens (never ``[CLS]``/``[SEP]``); of those 80 %
  become ``[MASK]``, 10 % a random vocabulary token and 10 % stay unchanged. With
  ``whole_word_mask`` a word's ``##`` pieces are chosen together.

Two deliberate differences from Google's script:

* Google forces a random next whenever a chunk holds a single sentence, so its share of
  random-next pairs is above one half. Here the coin is tossed for every pair; a
  single-sentence chunk whose coin says "actual next" is split inside the sentence at a
  random token (B is still the text that follows A), so the share is exactly
  ``random_next_prob`` in expectation. Chunks of fewer than 2 tokens are skipped.
* Google reads every document into memory to draw random-next documents from the whole
  corpus, then shuffles all instances. Here documents stream through a window of
  ``window_docs`` documents (the one being cut sits in the middle, up to ``window_docs // 2``
  read ahead): random-next sentences come from another document of that window, so memory
  is bounded by the window and by one shard of instances, whatever the corpus size. The
  instances are written in corpus order; the training sampler shuffles them globally (the
  shards are memory-mapped, so random access costs nothing).

Shard format (``SHARD_FORMAT``): a directory with ``index.json`` and ``shard-NNNNN.npy`` files,
each a structured numpy array (fields in :func:`shard_dtype`) read with
``np.load(mmap_mode="r")``. The index holds the format version, the settings, the vocabulary
size and hash, and every shard's name, instance count and byte size. A run builds the whole
directory under a temporary name and renames it into place at the end, so a failure never
leaves partial shards behind.

The stdlib corpus (:func:`write_stdlib_corpus`): real English text available offline, the
docstrings of the running interpreter's standard library, read with :mod:`ast` (no module
is imported, so nothing runs), one document per module, split into sentences; modules are
divided into train and dev by a hash of their name.

Example:
    >>> write_stdlib_corpus("corpus/train.txt", split="train")  # doctest: +SKIP
    >>> tok = get_tokenizer("minilm_l6_h384")  # doctest: +SKIP
    >>> prepare_pretraining_data(["corpus/train.txt"], "data/p1", tok,
    ...                          InstanceConfig(max_seq_length=128))  # doctest: +SKIP
    >>> data = PretrainingShards("data/p1")  # doctest: +SKIP
"""

from __future__ import annotations

import ast
import bisect
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import sysconfig
import tempfile
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = [
    "INDEX_NAME",
    "SHARD_FORMAT",
    "InstanceConfig",
    "PretrainingCollate",
    "PretrainingShards",
    "ShardError",
    "TrainingInstance",
    "VocabInfo",
    "create_instances",
    "mask_tokens",
    "prepare_pretraining_data",
    "read_documents",
    "shard_dtype",
    "stdlib_documents",
    "write_shards",
    "write_stdlib_corpus",
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


# ---------------------------------------------------------------------------------------------
# Shards
# ---------------------------------------------------------------------------------------------


def shard_dtype(max_seq_length: int, max_predictions: int, vocab_size: int) -> np.dtype:
    """The structured record of one instance (ids as uint16 when the vocabulary fits)."""
    ids = np.uint16 if vocab_size <= 65536 else np.int32
    return np.dtype(
        [
            ("input_ids", ids, (max_seq_length,)),
            ("length", np.uint16),
            ("len_a", np.uint16),
            ("masked_positions", np.uint16, (max_predictions,)),
            ("masked_ids", ids, (max_predictions,)),
            ("num_masked", np.uint16),
            ("next_sentence_label", np.uint8),
        ]
    )


def _atomic_save(path: Path, array: np.ndarray) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_shards(
    instances: Iterable[TrainingInstance],
    output_dir: str | os.PathLike[str],
    *,
    vocab: VocabInfo,
    config: InstanceConfig,
    instances_per_shard: int = 65536,
    overwrite: bool = False,
    meta: dict[str, Any] | None = None,
    add_files: Callable[[Path], Any] | None = None,
) -> dict[str, Any]:
    """Writes instances as shards + ``index.json`` into ``output_dir``; returns the index.

    The directory is built under a temporary name beside it and renamed into place only
    when complete; on any error the partial directory is removed. ``add_files(directory)``
    may write more files (the vocabulary) into it before the rename.

    Raises:
        FileExistsError: ``output_dir`` exists and is not empty (pass ``overwrite``).
    """
    output_dir = Path(output_dir)
    if output_dir.exists() and any(output_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{output_dir} exists and is not empty; choose another directory or overwrite it"
        )
    if instances_per_shard < 1:
        raise ValueError(f"instances_per_shard must be >= 1, got {instances_per_shard}")
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(dir=output_dir.parent, prefix=f".{output_dir.name}.partial-"))
    L, P = config.max_seq_length, config.max_predictions_per_seq
    dtype = shard_dtype(L, P, vocab.size)
    buffer = np.zeros(instances_per_shard, dtype=dtype)
    shards: list[dict[str, Any]] = []
    totals = {"instances": 0, "random_next": 0, "tokens": 0, "masked": 0}

    def flush(count: int) -> None:
        name = _SHARD_NAME.format(len(shards))
        _atomic_save(tmp_dir / name, buffer[:count])
        size = (tmp_dir / name).stat().st_size
        shards.append({"file": name, "instances": count, "bytes": size})

    try:
        n = 0
        for inst in instances:
            length = len(inst.input_ids)
            if length > L or len(inst.masked_positions) > P:
                raise ValueError(
                    f"instance of {length} tokens / {len(inst.masked_positions)} masks exceeds "
                    f"max_seq_length {L} / max_predictions_per_seq {P}"
                )
            row = buffer[n]
            row["input_ids"][:] = vocab.pad_id
            row["input_ids"][:length] = inst.input_ids
            row["length"] = length
            row["len_a"] = inst.len_a
            row["masked_positions"][:] = 0
            row["masked_ids"][:] = 0
            row["masked_positions"][: len(inst.masked_positions)] = inst.masked_positions
            row["masked_ids"][: len(inst.masked_ids)] = inst.masked_ids
            row["num_masked"] = len(inst.masked_positions)
            row["next_sentence_label"] = int(inst.is_random_next)
            totals["instances"] += 1
            totals["random_next"] += int(inst.is_random_next)
            totals["tokens"] += length
            totals["masked"] += len(inst.masked_positions)
            n += 1
            if n == instances_per_shard:
                flush(n)
                n = 0
        if n:
            flush(n)
        if not shards:
            raise ValueError("no instances were made: the corpus has no text")
        index = {
            "format": SHARD_FORMAT,
            "kind": "bert_pretraining",
            "config": config.to_dict(),
            "vocab_size": vocab.size,
            "vocab_sha256": vocab.sha256,
            "pad_id": vocab.pad_id,
            "dtype": dtype.descr,
            "shards": shards,
            "totals": totals,
            **({"meta": meta} if meta else {}),
        }
        (tmp_dir / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n", encoding="utf-8")
        if add_files is not None:
            add_files(tmp_dir)
        if output_dir.exists():
            shutil.rmtree(output_dir)
        os.replace(tmp_dir, output_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return index


def prepare_pretraining_data(
    inputs: Sequence[str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    tokenizer: Any,
    config: InstanceConfig,
    *,
    instances_per_shard: int = 65536,
    overwrite: bool = False,
    progress: bool = True,
    meta: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Text files -> shard directory (:func:`create_instances` + :func:`write_shards`).

    The corpus is read ``config.dupe_factor`` times, streaming; one ``random.Random(seed)``
    makes every choice, so the shards are a function of the inputs, the vocabulary and the
    settings. ``progress`` shows a tqdm bar over the bytes read. The tokenizer's vocabulary
    is saved beside the shards (``vocab.txt``).
    """
    from tqdm import tqdm

    paths = [Path(p) for p in inputs]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such corpus file")
    vocab = VocabInfo.from_tokenizer(tokenizer)
    rng = random.Random(config.seed)
    total = sum(p.stat().st_size for p in paths) * config.dupe_factor
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc="instances", disable=not progress,
        dynamic_ncols=True,
    )  # fmt: skip

    def instances() -> Iterator[TrainingInstance]:
        # One window per pass, so a document never meets its own copy from another pass.
        for _ in range(config.dupe_factor):
            documents = _tokenized(read_documents(paths, progress=bar), tokenizer)
            yield from create_instances(documents, vocab, config, rng)

    try:
        return write_shards(
            instances(),
            output_dir,
            vocab=vocab,
            config=config,
            instances_per_shard=instances_per_shard,
            overwrite=overwrite,
            meta={"inputs": [str(p) for p in paths], **(meta or {})},
            add_files=getattr(tokenizer, "save", None),  # vocab.txt beside the shards
        )
    finally:
        bar.close()


class PretrainingShards(torch.utils.data.Dataset):
    """The instances of a shard directory, memory-mapped (each process maps the files on
    first access, so DataLoader workers share the page cache instead of copies).

    Args:
        directory: A directory written by :func:`write_shards`.
        vocab_sha256: If given, the hash the shards' vocabulary must have.

    Raises:
        ShardError: A missing or unreadable index, another format version, or a shard whose
            file, size, dtype or length does not match the index (the message names it).
    """

    def __init__(self, directory: str | os.PathLike[str], *, vocab_sha256: str | None = None):
        self.directory = Path(directory)
        index_path = self.directory / INDEX_NAME
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ShardError(
                f"{index_path}: no shard index; make the directory with "
                "scripts/prepare_bert_data.py"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ShardError(f"{index_path}: unreadable shard index ({exc}); remake it") from None
        if not isinstance(index, dict) or index.get("format") != SHARD_FORMAT:
            found = index.get("format") if isinstance(index, dict) else None
            raise ShardError(
                f"{index_path}: shard format {found!r}, this version reads format "
                f"{SHARD_FORMAT}; remake the shards with scripts/prepare_bert_data.py"
            )
        try:
            self.config = InstanceConfig(**index["config"])
            self.vocab_size = int(index["vocab_size"])
            self.vocab_sha256 = str(index["vocab_sha256"])
            self.pad_id = int(index["pad_id"])
            shards = [
                (str(s["file"]), int(s["instances"]), int(s["bytes"])) for s in index["shards"]
            ]
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardError(f"{index_path}: malformed shard index ({exc!r}); remake it") from None
        if vocab_sha256 is not None and vocab_sha256 != self.vocab_sha256:
            raise ShardError(
                f"{index_path}: the shards were made with another vocabulary (sha256 "
                f"{self.vocab_sha256[:12]}..., the model's is {vocab_sha256[:12]}...); prepare "
                "them with the model's vocab.txt"
            )
        self.index = index
        self.dtype = shard_dtype(
            self.config.max_seq_length, self.config.max_predictions_per_seq, self.vocab_size
        )
        self.files = [self.directory / name for name, _, _ in shards]
        self.counts = [count for _, count, _ in shards]
        for path, (_, _, size) in zip(self.files, shards, strict=True):
            if not path.is_file():
                raise ShardError(f"{path}: listed in {index_path} but missing; remake the shards")
            if path.stat().st_size != size:
                raise ShardError(
                    f"{path}: {path.stat().st_size} bytes, the index says {size} (truncated or "
                    "rewritten); remake the shards"
                )
        self.offsets = np.cumsum([0, *self.counts]).tolist()
        self._arrays: list[np.ndarray] | None = None
        self._open()  # check every shard's header now, in the constructing process

    @property
    def max_seq_length(self) -> int:
        return self.config.max_seq_length

    def _open(self) -> list[np.ndarray]:
        if self._arrays is None:
            arrays = []
            for path, count in zip(self.files, self.counts, strict=True):
                try:
                    array = np.load(path, mmap_mode="r", allow_pickle=False)
                except (OSError, ValueError) as exc:
                    raise ShardError(f"{path}: not a readable shard ({exc}); remake it") from None
                if array.dtype != self.dtype or array.shape != (count,):
                    raise ShardError(
                        f"{path}: holds {array.shape} of {array.dtype}, the index says "
                        f"({count},) of {self.dtype}; remake the shards"
                    )
                arrays.append(array)
            self._arrays = arrays
        return self._arrays

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_arrays"] = None  # workers map the files themselves
        return state

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> np.void:
        if not 0 <= index < len(self):
            raise IndexError(f"instance {index} out of range [0, {len(self)})")
        shard = bisect.bisect_right(self.offsets, index) - 1
        return np.array(self._open()[shard][index - self.offsets[shard]])

    def instance(self, index: int) -> TrainingInstance:
        """Instance ``index`` as a :class:`TrainingInstance`."""
        r = self[index]
        length, masks = int(r["length"]), int(r["num_masked"])
        return TrainingInstance(
            input_ids=r["input_ids"][:length].tolist(),
            len_a=int(r["len_a"]),
            masked_positions=r["masked_positions"][:masks].tolist(),
            masked_ids=r["masked_ids"][:masks].tolist(),
            is_random_next=bool(r["next_sentence_label"]),
        )


class PretrainingCollate:
    """Records of :class:`PretrainingShards` -> a padded batch of tensors.

    The batch is cut to its longest instance. ``masked_labels`` holds ``-100`` (ignored by
    cross entropy) where an instance has fewer than ``max_predictions_per_seq`` masks;
    ``attention_mask`` is None when no instance is padded.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, records: Sequence[np.void]) -> dict[str, torch.Tensor | None]:
        batch = np.stack(records)
        lengths = torch.from_numpy(batch["length"].astype(np.int64))
        width = int(lengths.max())
        ids = torch.from_numpy(batch["input_ids"][:, :width].astype(np.int64))
        positions = torch.arange(width)[None, :]
        first = torch.from_numpy(batch["len_a"].astype(np.int64))[:, None] + 2
        types = ((positions >= first) & (positions < lengths[:, None])).long()
        mask = None
        if int(lengths.min()) < width:
            mask = positions < lengths[:, None]
        num_masked = torch.from_numpy(batch["num_masked"].astype(np.int64))
        slots = torch.arange(batch["masked_positions"].shape[1])[None, :]
        labels = torch.from_numpy(batch["masked_ids"].astype(np.int64))
        labels = labels.masked_fill(slots >= num_masked[:, None], -100)
        return {
            "input_ids": ids,
            "token_type_ids": types,
            "attention_mask": mask,
            "masked_positions": torch.from_numpy(batch["masked_positions"].astype(np.int64)),
            "masked_labels": labels,
            "next_sentence_labels": torch.from_numpy(batch["next_sentence_label"].astype(np.int64)),
        }


# ---------------------------------------------------------------------------------------------
# The stdlib corpus
# ---------------------------------------------------------------------------------------------

_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages",
     "lib2to3", "ensurepip", "pydoc_data", "__pycache__", "config-3"}
)  # fmt: skip
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
_DEV_FRACTION = 0.1


def _module_files(root: Path) -> list[tuple[str, Path]]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("config-", "."))
        )
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = Path(dirpath) / name
            module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".")
            module = module.removesuffix(".__init__")
            if any(part.startswith("_") and part != "__main__" for part in module.split(".")):
                continue  # private modules
            files.append((module, path))
    return files


def _sentences(docstring: str) -> list[str]:
    """Prose sentences of a docstring: code, doctests and indented blocks are dropped."""
    out = []
    for paragraph in docstring.split("\n\n"):
        lines = paragraph.strip("\n").split("\n")
        if any(
            line.lstrip().startswith((">>>", "...", "$ ", "%")) or line[:1].isspace()
            for line in lines
        ):
            continue
        text = " ".join(" ".join(lines).split())
        for sentence in _SENTENCE_END.split(text):
            words = sentence.split()
            letters = sum(c.isalpha() for c in sentence)
            if len(words) >= 3 and letters >= 0.6 * len(sentence):
                out.append(sentence)
    return out


def _is_dev(module: str) -> bool:
    return hashlib.sha256(module.encode()).digest()[0] < 256 * _DEV_FRACTION


def stdlib_documents(
    split: str = "train", *, root: str | os.PathLike[str] | None = None
) -> Iterator[list[str]]:
    """Documents (lists of sentences) of the standard library's docstrings, one per module.

    Args:
        split: ``"train"``, ``"dev"`` (about 10 % of the modules, by a hash of the name)
            or ``"all"``.
        root: The standard library's directory (default: the running interpreter's).
    """
    if split not in ("train", "dev", "all"):
        raise ValueError(f"split must be 'train', 'dev' or 'all', got {split!r}")
    root = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    for module, path in _module_files(root):
        if split != "all" and _is_dev(module) != (split == "dev"):
            continue
        try:
            tree = ast.parse(path.read_bytes(), filename=str(path))
        except (SyntaxError, ValueError):
            continue  # e.g. a file for another Python version
        document: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if not isinstance(node, ast.Module) and node.name.startswith("_"):
                    continue
                doc = ast.get_docstring(node)
                if doc:
                    document.extend(_sentences(doc))
        if len(document) >= 2:
            yield document


def write_stdlib_corpus(
    path: str | os.PathLike[str],
    split: str = "train",
    *,
    root: str | os.PathLike[str] | None = None,
) -> dict[str, int]:
    """Writes :func:`stdlib_documents` as a corpus file (one sentence per line, a blank line
    between documents), atomically; returns ``{"documents", "sentences", "bytes"}``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    documents = sentences = 0
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for document in stdlib_documents(split, root=root):
                if documents:
                    f.write("\n")
                f.write("\n".join(document) + "\n")
                documents += 1
                sentences += len(document)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return {"documents": documents, "sentences": sentences, "bytes": path.stat().st_size}
