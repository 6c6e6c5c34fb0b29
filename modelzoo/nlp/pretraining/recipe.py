"""The BERT pretraining recipe's data and model, as ``scripts/pretrain_bert.py`` wires them:
the built-in shards of the stdlib-docstring corpus (made once, cached), the vocabulary a run
uses and its hash (what shard indexes record), the masked-LM labels of held-out shards (the
trivial level of a run's claims), a fresh BERT with its pretraining heads, the phases'
learning-rate schedule shapes (``--lr-schedule``), and the exported artifact.

Split out of the script so that other code (notebooks, other recipes, the trivial levels of
``scripts/publish.py``) builds the same data and model; nothing here imports ``trainers``
(the schedule is described as :func:`trainers.schedules.create_schedule`'s arguments).

Example:
    >>> tok = recipe_tokenizer(builtin=True)  # doctest: +SKIP
    >>> dirs = builtin_shards(tok, {1: (128, 20), 2: (512, 80)}, dupe_factor=5,
    ...                       seed=12345)  # doctest: +SKIP
    >>> train = PretrainingShards(dirs[1][0], vocab_sha256=vocab_sha256(tok))  # doctest: +SKIP
    >>> model = new_pretraining_bert(len(tok), seed=0)  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ...artifact import save_artifact
from ...registry import get_model_entry
from ...store import cache_root
from ..bert import BertConfig, build_bert
from ..tokenizer import BertTokenizer, get_tokenizer
from .corpus import corpus_vocabulary, write_stdlib_corpus
from .instances import InstanceConfig
from .shards import PretrainingShards, prepare_pretraining_data

__all__ = [
    "BUILTIN_TOKENIZER",
    "builtin_cache_root",
    "builtin_shards",
    "masked_lm_labels",
    "new_pretraining_bert",
    "recipe_tokenizer",
    "save_pretraining_artifact",
    "schedule_shape",
    "vocab_sha256",
]

#: The built-in corpus's vocabulary: MiniLM's uncased WordPiece (BERT's 30,522 tokens).
BUILTIN_TOKENIZER = "minilm_l6_h384"


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def vocab_sha256(tokenizer: BertTokenizer) -> str:
    """The hash of the vocabulary, in id order, that shard indexes record."""
    tokens = tokenizer.convert_ids_to_tokens(range(len(tokenizer)))
    return hashlib.sha256("\n".join(tokens).encode("utf-8")).hexdigest()


def builtin_cache_root(cache_dir: str | Path | None = None) -> Path:
    """Where the built-in shards are made: ``cache_dir``, else ``$MODELZOO_HOME/pretraining``."""
    if cache_dir:
        return Path(cache_dir)
    return cache_root() / "pretraining"


def builtin_shards(
    tokenizer: BertTokenizer,
    shapes: Mapping[int, tuple[int, int]],
    *,
    dupe_factor: int,
    seed: int,
    cache_dir: str | Path | None = None,
    phases: Sequence[int] = (1, 2),
    splits: Sequence[str] = ("train", "dev"),
    verbose: bool = True,
    progress: bool = True,
) -> dict[int, tuple[Path | None, Path | None]]:
    """Train/dev shard directories of the stdlib-docstring corpus for each phase, made once
    (under a file lock, so concurrent ranks build them once) and reused; only the ``splits``
    asked for are made (``None`` for the others).

    Args:
        tokenizer: The vocabulary the instances are tokenized with.
        shapes: Every phase of the recipe -> its ``(max_seq_length, max_predictions)``; all
            of them name the cache directory, also those not in ``phases``.
        dupe_factor: Masking passes over the training text (the held-out text gets one).
        seed: The training instances' seed (the held-out ones: ``seed + 1``).
        cache_dir: See :func:`builtin_cache_root`.
        phases: The phases to make.
        splits: ``"train"`` and/or ``"dev"``.
        verbose: Print each corpus file written (the main rank's).
        progress: Show the instance writer's progress.
    """
    from filelock import FileLock

    key = {
        "python": sys.version.split()[0],
        "vocab": vocab_sha256(tokenizer),
        "dupe_factor": dupe_factor,
        "seed": seed,
        "phases": {n: tuple(shape) for n, shape in shapes.items()},
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    root = builtin_cache_root(cache_dir) / f"stdlib-{digest}"
    root.parent.mkdir(parents=True, exist_ok=True)
    out: dict[int, tuple[Path | None, Path | None]] = {}
    with FileLock(str(root) + ".lock"):
        corpus = {s: root / "corpus" / f"{s}.txt" for s in splits}
        for split, path in corpus.items():
            if not path.is_file():
                stats = write_stdlib_corpus(path, split)
                if verbose:
                    print(f"wrote {path}: {stats}", flush=True)
        for n in phases:
            dirs: dict[str, Path | None] = {"train": None, "dev": None}
            max_seq_length, max_predictions = shapes[n]
            for split in splits:
                directory = root / f"phase{n}-{split}"
                if not (directory / "index.json").is_file():
                    config = InstanceConfig(
                        max_seq_length=max_seq_length,
                        max_predictions_per_seq=max_predictions,
                        dupe_factor=dupe_factor if split == "train" else 1,
                        seed=seed + (0 if split == "train" else 1),
                    )
                    prepare_pretraining_data(
                        [corpus[split]], directory, tokenizer, config, overwrite=True,
                        progress=progress,
                    )  # fmt: skip
                dirs[split] = directory
            out[n] = (dirs["train"], dirs["dev"])
    return out


def recipe_tokenizer(
    *,
    vocab_file: str | Path | None = None,
    data_dirs: Sequence[str | Path | None] = (),
    phase1_model: str | Path | None = None,
    builtin: bool = False,
    corpus_vocab: bool = False,
    progress: bool = True,
) -> BertTokenizer | None:
    """The vocabulary of a run, the first there is of: ``vocab_file``; the ``vocab.txt`` of
    the first of ``data_dirs`` (the phases' shards) that has one; ``phase1_model``'s; with
    ``builtin`` (the built-in corpus), MiniLM's (:data:`BUILTIN_TOKENIZER`), cut to the
    tokens the corpus uses with ``corpus_vocab`` (:func:`corpus_vocabulary`); else ``None``.
    """
    if vocab_file:
        return BertTokenizer.from_file(vocab_file)
    for data in data_dirs:
        if data and (Path(data) / "vocab.txt").is_file():
            return BertTokenizer.from_dir(data)
    if phase1_model and (Path(phase1_model) / "vocab.txt").is_file():
        return BertTokenizer.from_dir(phase1_model)
    if not builtin:
        return None
    tokenizer = get_tokenizer(BUILTIN_TOKENIZER, progress=progress)
    return corpus_vocabulary(tokenizer) if corpus_vocab else tokenizer


def masked_lm_labels(shards: PretrainingShards) -> list[int]:
    """The token ids at every masked position of ``shards``, instance by instance (what the
    best constant prediction of the masked-LM task is measured on)."""
    labels: list[int] = []
    for index in range(len(shards)):
        record = shards[index]
        labels.extend(record["masked_ids"][: int(record["num_masked"])].tolist())
    return labels


# ---------------------------------------------------------------------------------------------
# Model and schedule
# ---------------------------------------------------------------------------------------------


def new_pretraining_bert(
    vocab_size: int,
    *,
    seed: int,
    bert_model: str | None = None,
    num_layers: int = 2,
    hidden_size: int = 128,
    num_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 512,
    dropout: float = 0.1,
    initializer_range: float = 0.02,
) -> torch.nn.Module:
    """A freshly initialised BERT with the masked-LM and next-sentence heads: the zoo's
    ``bert_model`` (its size; the shape arguments are then unused), or one of the given shape.
    ``torch.manual_seed(seed)`` first, so every rank and every rerun starts from the same
    weights."""
    torch.manual_seed(seed)
    drop = dict(
        hidden_dropout=dropout,
        attention_dropout=dropout,
        initializer_range=initializer_range,
    )
    if bert_model:
        entry = get_model_entry(bert_model)
        return entry.builder(head="pretraining", vocab_size=vocab_size, **drop)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        **drop,
    )
    return build_bert(config, head="pretraining")


def schedule_shape(
    lr_schedule: str, steps: int, *, warmup_ratio: float, const_ratio: float
) -> tuple[str, dict[str, Any]]:
    """A phase's schedule as ``(mode, shape)``, the arguments of
    ``trainers.schedules.create_schedule`` besides the lr, the steps and the power:
    ``warmup_const_poly`` with its phases rounded to whole steps (``lr_schedule``
    ``"warmup_const_poly"``), the same with gluon-nlp's unrounded fractions (``"gluonnlp"``),
    or NVIDIA's ``"nvidia_poly_warmup"`` (warmup, no constant phase)."""
    if lr_schedule == "nvidia_poly_warmup":
        shape: dict[str, Any] = {"warmup_ratio": warmup_ratio}
    elif lr_schedule == "gluonnlp":  # gluon-nlp's unrounded fractions
        shape = {"warmup_ratio": warmup_ratio, "constant_ratio": const_ratio}
    else:  # whole steps, rounded from the fractions
        shape = {
            "warmup_steps": round(steps * warmup_ratio),
            "constant_steps": round(steps * const_ratio),
        }
    mode = "nvidia_poly_warmup" if lr_schedule == "nvidia_poly_warmup" else "warmup_const_poly"
    return mode, shape


def save_pretraining_artifact(
    directory: str | os.PathLike[str],
    model: torch.nn.Module,
    tokenizer: BertTokenizer,
    *,
    model_name: str,
    metrics: Mapping[str, Any],
    source: Mapping[str, Any],
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """The artifact folder of a pretrained BERT with its masked-LM and next-sentence heads
    (task ``fill-mask``): the model (or ``state_dict``'s weights, e.g. an EMA's) and its
    vocabulary; ``modelzoo.get_model(directory)`` loads it, ``finetune_squad.py`` fine-tunes it.
    """
    return save_artifact(
        directory, model, model_name=model_name, model_kwargs={"head": "pretraining"},
        task="fill-mask", tokenizer=tokenizer, metrics=metrics, source=source,
        state_dict=state_dict,
    )  # fmt: skip
