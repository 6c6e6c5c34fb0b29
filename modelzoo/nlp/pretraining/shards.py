"""Pretraining shards: writing fixed-size instance arrays, the index, and reading them back."""

from __future__ import annotations

import bisect
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...fileio import atomic_write
from .instances import (
    _SHARD_NAME,
    INDEX_NAME,
    SHARD_FORMAT,
    InstanceConfig,
    ShardError,
    TrainingInstance,
    VocabInfo,
    _tokenized,
    create_instances,
    read_documents,
)

__all__ = [
    "PretrainingCollate",
    "PretrainingShards",
    "prepare_pretraining_data",
    "shard_dtype",
    "write_shards",
]


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
    atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


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
