"""The phases of a BERT pretraining run, as ``scripts/pretrain_bert.py`` wires them:

* the settings: each phase's (:class:`Phase`), resolved and checked with the run's schedule
  and learning rate (:func:`plan_phases`); what a run names exists (:func:`check_sources`);
* the data: where it and the vocabulary come from (:class:`PhaseSources`: the named shard
  directories or the built-in ones, the held-out masked tokens a run's trivial level is
  measured on), the shards opened and checked (:func:`open_phase_shards`), and the passes
  over them that a phase's steps take (:func:`phase_epochs`);
* the hand-over (:class:`PhaseChain`): phases already finished on resume, the run-wide step
  limit, each phase's directories, phase 2 starting from phase 1's saved model.

Options are explicit arguments, not a script's namespace; nothing here imports ``trainers``.
Every refusal is a :class:`PhaseError` whose message names the setting by its flag
(``--phase1-steps``), so that a script prints it as it is.

Example:
    >>> settings = [Phase(n, **PHASE_DEFAULTS[n]) for n in (1, 2)]
    >>> plan = plan_phases("1,2", settings, data={}, optimizer="lans")
    >>> plan.order, plan.phases[2].lr, plan.const_ratio
    ([1, 2], 0.005, 0.25)
    >>> sources = PhaseSources(plan.order, {}, {1: (128, 20), 2: (512, 80)})
    >>> tok = sources.tokenizer()  # doctest: +SKIP
    >>> data = sources.open(tok, max_position_embeddings=512)  # doctest: +SKIP
    >>> chain = PhaseChain("runs/pretrain", max_steps=100)
    >>> chain.limit(plan.phases[1].steps)
    100
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ... import registry
from ..bert import bert_from_checkpoint
from ..tokenizer import BertTokenizer
from .instances import ShardError
from .recipe import builtin_shards, masked_lm_labels, recipe_tokenizer, vocab_sha256
from .shards import PretrainingShards

__all__ = [
    "LR_SCHEDULES",
    "PHASE_DEFAULTS",
    "PHASE_FIELDS",
    "Phase",
    "PhaseChain",
    "PhaseConfigError",
    "PhaseDataError",
    "PhaseError",
    "PhaseModelError",
    "PhasePlan",
    "PhaseSources",
    "check_phases",
    "check_sources",
    "check_sequence_lengths",
    "default_lr",
    "open_phase_shards",
    "parse_phase_list",
    "phase_epochs",
    "plan_phases",
    "schedule_defaults",
]

PathLike = str | os.PathLike[str]

#: ``--lr-schedule``: the default rounds the phases to whole steps (the published runs use it).
LR_SCHEDULES = ("warmup_const_poly", "gluonnlp", "nvidia_poly_warmup")
#: A phase's settings (``--phase1-X`` / ``--phase2-X``).
PHASE_FIELDS = ("max_seq_length", "max_predictions", "steps", "batch_size", "accumulate", "lr",
                "warmup_ratio")  # fmt: skip
#: phase -> defaults of the settings above (the LANS recipe's shape, CPU-sized steps; ``lr``
#: ``None``: the run's lr).
PHASE_DEFAULTS = {
    1: dict(max_seq_length=128, max_predictions=20, steps=300, batch_size=16, accumulate=1,
            lr=None, warmup_ratio=0.05),
    2: dict(max_seq_length=512, max_predictions=80, steps=60, batch_size=4, accumulate=1,
            lr=None, warmup_ratio=0.05),
}  # fmt: skip
# The optimizers with a recipe lr of their own (the others: 1e-4).
_RECIPE_LR = {"lans": 5e-3, "lamb": 5e-3}


class PhaseError(ValueError):
    """A pretraining run's phases cannot be set up as asked (the message names the flag)."""


class PhaseConfigError(PhaseError):
    """Phase settings out of range or that do not go together."""


class PhaseDataError(PhaseError):
    """A phase's data is missing, unreadable, or does not fit the model or the batch."""


class PhaseModelError(PhaseError):
    """Phase 2's starting model is missing or does not fit the data's vocabulary."""


@dataclass(frozen=True)
class Phase:
    """One phase's settings: its sequences (``max_seq_length`` tokens, ``max_predictions``
    masked positions), ``steps`` optimizer steps of ``batch_size x accumulate`` sequences per
    worker, at peak learning rate ``lr`` after ``warmup_ratio`` of the steps."""

    number: int
    max_seq_length: int
    max_predictions: int
    steps: int
    batch_size: int
    accumulate: int
    lr: float | None
    warmup_ratio: float

    def flag(self, field: str) -> str:
        """The flag of one of this phase's settings, e.g. ``--phase1-max-seq-length``."""
        return f"--phase{self.number}-{field.replace('_', '-')}"


# ---------------------------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------------------------


def parse_phase_list(text: str) -> list[int]:
    """The phases of ``"1,2"``, ``"1"`` or ``"2"``, sorted.

    Raises:
        PhaseConfigError: Anything else.
    """
    try:
        phases = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        phases = []
    if not phases or not set(phases) <= {1, 2}:
        raise PhaseConfigError(f"--phases must be 1, 2 or 1,2, got {text!r}")
    return phases


def schedule_defaults(
    lr_schedule: str, const_ratio: float | None, decay_power: float | None
) -> tuple[float, float]:
    """``(const_ratio, decay_power)`` with the defaults of ``lr_schedule`` filled in: 0.25 and
    1 (the LANS recipe's), or 0 and 0.5 for ``"nvidia_poly_warmup"`` (NVIDIA's).

    Raises:
        PhaseConfigError: A constant phase with ``nvidia_poly_warmup``; a power <= 0.
    """
    nvidia = lr_schedule == "nvidia_poly_warmup"
    if const_ratio is None:
        const_ratio = 0.0 if nvidia else 0.25
    if decay_power is None:
        decay_power = 0.5 if nvidia else 1.0
    if nvidia and const_ratio != 0:
        raise PhaseConfigError(
            "--lr-schedule nvidia_poly_warmup has no constant phase: drop --const-ratio"
        )
    if decay_power <= 0:
        raise PhaseConfigError(f"--decay-power must be positive, got {decay_power}")
    return const_ratio, decay_power


def default_lr(optimizer: str) -> float:
    """The recipe's learning rate for ``optimizer``: 5e-3 for LANS and LAMB, else 1e-4."""
    return _RECIPE_LR.get(optimizer, 1e-4)


def check_phases(phases: Iterable[Phase], *, const_ratio: float) -> None:
    """Every phase's counts are >= 1 and its warmup plus the constant part fit the steps.

    Raises:
        PhaseConfigError: The first phase setting that does not, by its flag.
    """
    for phase in phases:
        for field in ("steps", "batch_size", "accumulate", "max_seq_length", "max_predictions"):
            if getattr(phase, field) < 1:
                raise PhaseConfigError(f"{phase.flag(field)} must be >= 1")
        if not 0 <= phase.warmup_ratio + const_ratio <= 1:
            raise PhaseConfigError(
                f"{phase.flag('warmup_ratio')} + --const-ratio must be in [0, 1]"
            )


def check_sequence_lengths(phases: Iterable[Phase], max_position_embeddings: int) -> None:
    """The phases' sequences fit the model's positions (for data made to the phases' shape).

    Raises:
        PhaseConfigError: A phase's ``max_seq_length`` is longer.
    """
    for phase in phases:
        if phase.max_seq_length > max_position_embeddings:
            raise PhaseConfigError(
                f"{phase.flag('max_seq_length')} exceeds --max-position-embeddings "
                f"{max_position_embeddings}"
            )


@dataclass(frozen=True)
class PhasePlan:
    """A run's phases as :func:`plan_phases` resolves them.

    Attributes:
        order: The phases to run, in order (``[1, 2]``, ``[1]`` or ``[2]``).
        phases: Both phases' settings (also one not run), ``lr`` filled in.
        lr: The run's learning rate (the phases' default).
        const_ratio: The constant-lr fraction of every phase.
        decay_power: The polynomial decay's degree.
        builtin: No phase that runs names its data: the built-in shards, made to the phases'
            shape.
    """

    order: list[int]
    phases: dict[int, Phase]
    lr: float
    const_ratio: float
    decay_power: float
    builtin: bool


def plan_phases(
    phases: str,
    settings: Iterable[Phase],
    *,
    data: Mapping[int, PathLike | None],
    optimizer: str,
    lr: float | None = None,
    lr_schedule: str = "warmup_const_poly",
    const_ratio: float | None = None,
    decay_power: float | None = None,
    max_position_embeddings: int = 512,
    plan: bool = False,
    phase1_model: PathLike | None = None,
    resume: bool = False,
) -> PhasePlan:
    """The run's phases, their settings checked and their defaults filled in.

    Args:
        phases: ``"1,2"``, ``"1"`` or ``"2"`` (:func:`parse_phase_list`).
        settings: Phase 1's and 2's as given (``lr`` ``None``: the run's ``lr``).
        data: Phase -> its training shards (``None``: none named).
        optimizer: Its name: the default ``lr`` (:func:`default_lr`).
        lr: The run's learning rate (``None``: the optimizer's recipe lr).
        lr_schedule, const_ratio, decay_power: The schedule (:func:`schedule_defaults`).
        max_position_embeddings: The model's positions, which built-in shards must fit.
        plan: A placement plan is given (it places one phase).
        phase1_model: Phase 2's start when phase 1 does not run.
        resume: The run resumes (phase 2 alone may then find phase 1's model in its
            output directory).

    Raises:
        PhaseConfigError: The first setting that is out of range or does not go with the
            others, naming its flag.
    """
    order = parse_phase_list(phases)
    const_ratio, decay_power = schedule_defaults(lr_schedule, const_ratio, decay_power)
    lr = default_lr(optimizer) if lr is None else lr
    resolved = {
        p.number: p if p.lr is not None else dataclasses.replace(p, lr=lr) for p in settings
    }
    check_phases(resolved.values(), const_ratio=const_ratio)
    builtin = all(data.get(n) is None for n in order)
    if builtin:  # shards of the phases' shape: they must fit the positions
        check_sequence_lengths([resolved[n] for n in order], max_position_embeddings)
    if plan and len(order) > 1:
        raise PhaseConfigError(
            "--plan places one phase (its batch and sequence length): run --phases 1 and "
            "--phases 2 separately, each with its own plan"
        )
    if order == [2] and phase1_model is None and not resume:
        raise PhaseConfigError(
            "--phases 2 needs --phase1-model DIR (a phase-1 <output_dir>/phase1/model)"
        )
    return PhasePlan(order, resolved, lr, const_ratio, decay_power, builtin)


def check_sources(
    *,
    bert_model: str | None = None,
    phase1_model: PathLike | None = None,
    vocab_file: PathLike | None = None,
) -> None:
    """What a run names exists, before any work: ``bert_model`` is a zoo BERT, ``phase1_model``
    a directory, ``vocab_file`` a file (``None``: not named).

    Raises:
        PhaseConfigError: The first that does not, naming its flag and what to do.
    """
    if bert_model is not None:
        try:
            modality = registry.model_modality(bert_model)
        except ValueError as err:
            raise PhaseConfigError(f"--bert-model {bert_model}: {err}") from None
        if modality != "text":
            raise PhaseConfigError(
                f"--bert-model {bert_model} is not a BERT; choose one of "
                f"{', '.join(registry.list_models(modality='text'))} or leave it out (a small "
                "BERT)"
            )
    if phase1_model and not Path(phase1_model).is_dir():
        raise PhaseConfigError(f"--phase1-model {phase1_model}: no such directory (phase 1 saves "
                               "<output-dir>/phase1/model)")  # fmt: skip
    if vocab_file is not None and not Path(vocab_file).is_file():
        raise PhaseConfigError(f"--vocab-file {vocab_file}: no such file")


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def open_phase_shards(
    dirs: Mapping[int, tuple[PathLike | None, PathLike | None]],
    tokenizer: BertTokenizer,
    *,
    max_position_embeddings: int | None = None,
) -> dict[int, tuple[PretrainingShards, PretrainingShards | None]]:
    """Each phase's training and held-out shards (``None``: no held-out set), read from
    ``dirs`` (phase -> ``(train, dev)`` directories, in the order to open them) and checked
    against ``tokenizer``'s vocabulary hash.

    Raises:
        PhaseDataError: A phase without training data (``--phaseN_data``); a directory
            that is not usable shards (the message names the file and the fix); instances
            longer than ``max_position_embeddings``.
    """
    for n, (train_dir, _) in dirs.items():
        if train_dir is None:
            raise PhaseDataError(f"--phase{n}_data is missing")
    sha = vocab_sha256(tokenizer)
    out = {}
    for n, (train_dir, eval_dir) in dirs.items():
        try:
            train = PretrainingShards(train_dir, vocab_sha256=sha)
            dev = PretrainingShards(eval_dir, vocab_sha256=sha) if eval_dir else None
        except ShardError as exc:
            raise PhaseDataError(str(exc)) from None
        if max_position_embeddings is not None and train.max_seq_length > max_position_embeddings:
            raise PhaseDataError(
                f"{train_dir} has {train.max_seq_length}-token instances, more than "
                f"--max-position-embeddings {max_position_embeddings}"
            )
        out[n] = (train, dev)
    return out


@dataclass(frozen=True)
class PhaseSources:
    """Where a run's data and vocabulary come from.

    Attributes:
        order: The phases the run trains.
        data: Phase -> its ``(training, held-out)`` shard directories as named (``None``:
            not named). No training data named for any phase in ``order``: the built-in
            shards (:func:`~modelzoo.nlp.pretraining.recipe.builtin_shards`) of ``shapes``.
        shapes: Phases 1 and 2 -> ``(max_seq_length, max_predictions)``.
        vocab_file, phase1_model, corpus_vocab: The vocabulary's sources, in
            :func:`~modelzoo.nlp.pretraining.recipe.recipe_tokenizer`'s order.
        dupe_factor, seed, cache_dir: The built-in shards' masking passes, instance seed and
            cache.
    """

    order: Sequence[int]
    data: Mapping[int, tuple[PathLike | None, PathLike | None]]
    shapes: Mapping[int, tuple[int, int]]
    vocab_file: PathLike | None = None
    phase1_model: PathLike | None = None
    corpus_vocab: bool = False
    dupe_factor: int = 5
    seed: int = 12345
    cache_dir: PathLike | None = None

    @property
    def builtin(self) -> bool:
        """Whether the run trains on the built-in shards."""
        return all(self.data.get(n, (None, None))[0] is None for n in self.order)

    def tokenizer(self, *, progress: bool = True) -> BertTokenizer:
        """The run's vocabulary.

        Raises:
            PhaseDataError: None of the sources has one.
        """
        tokenizer = recipe_tokenizer(
            vocab_file=self.vocab_file,
            data_dirs=[self.data.get(n, (None, None))[0] for n in self.order],
            phase1_model=self.phase1_model, builtin=self.builtin,
            corpus_vocab=self.corpus_vocab, progress=progress,
        )  # fmt: skip
        if tokenizer is None:
            raise PhaseDataError("no vocab.txt beside the shards; pass --vocab-file")
        return tokenizer

    def dirs(
        self,
        tokenizer: BertTokenizer,
        *,
        phases: Sequence[int] = (1, 2),
        splits: Sequence[str] = ("train", "dev"),
        verbose: bool = True,
        progress: bool = True,
    ) -> dict[int, tuple[PathLike | None, PathLike | None]]:
        """The ``(train, dev)`` directories of the phases in ``order``: those named, or the
        built-in shards of ``phases`` and ``splits`` (made once, then reused)."""
        if not self.builtin:
            return {n: self.data.get(n, (None, None)) for n in self.order}
        made = builtin_shards(
            tokenizer, self.shapes, dupe_factor=self.dupe_factor, seed=self.seed,
            cache_dir=self.cache_dir, phases=phases, splits=splits, verbose=verbose,
            progress=progress,
        )  # fmt: skip
        return {n: made[n] for n in self.order if n in made}

    def open(
        self,
        tokenizer: BertTokenizer,
        *,
        max_position_embeddings: int | None = None,
        verbose: bool = True,
        progress: bool = True,
    ) -> dict[int, tuple[PretrainingShards, PretrainingShards | None]]:
        """Each phase's shards (:func:`open_phase_shards` of :meth:`dirs`)."""
        dirs = self.dirs(tokenizer, verbose=verbose, progress=progress)
        return open_phase_shards(dirs, tokenizer, max_position_embeddings=max_position_embeddings)

    def heldout(
        self, phase: int, tokenizer: BertTokenizer, *, verbose: bool = True, progress: bool = True
    ) -> tuple[PretrainingShards, str]:
        """Phase ``phase``'s held-out shards (the built-in ones made if needed) and what they
        are, in words.

        Raises:
            PhaseDataError: The phase names no held-out data.
        """
        dirs = self.dirs(tokenizer, phases=(phase,), splits=("dev",), verbose=verbose,
                         progress=progress)  # fmt: skip
        dev_dir = dirs[phase][1]
        if dev_dir is None:
            raise PhaseDataError(f"the run evaluated no held-out data (--phase{phase}-eval-data)")
        where = (f"the built-in corpus's held-out phase-{phase} instances" if self.builtin
                 else f"--phase{phase}-eval-data {dev_dir}")  # fmt: skip
        return PretrainingShards(dev_dir, vocab_sha256=vocab_sha256(tokenizer)), where

    def heldout_labels(
        self, phase: int, *, progress: bool = True
    ) -> tuple[list[int], str, Callable[[int], str]]:
        """What the trivial level of phase ``phase``'s masked-LM accuracy is measured on: the
        token ids at the masked positions of its held-out shards (:meth:`heldout`), what they
        are in words, and a token's name (``repr`` of the token) by its id. Read once per
        process for the sources that make the same held-out data (the seeds of a recipe, and
        recipes that differ only in training).

        Raises:
            PhaseDataError: No vocabulary, or the phase names no held-out data.
        """
        key = json.dumps(
            [phase, self.vocab_file, self.corpus_vocab, self.phase1_model,
             *(self.data.get(n, (None, None))[0] for n in (1, 2)),
             self.data.get(phase, (None, None))[1], *self.shapes[phase], self.dupe_factor,
             self.seed, self.cache_dir], default=str,
        )  # fmt: skip
        if key not in _HELDOUT_LABELS:
            tokenizer = self.tokenizer(progress=progress)
            dev, where = self.heldout(phase, tokenizer, progress=progress)
            _HELDOUT_LABELS[key] = (
                masked_lm_labels(dev), f"masked tokens of {where}",
                lambda i: repr(tokenizer.convert_ids_to_tokens([int(i)])[0]),
            )  # fmt: skip
        return _HELDOUT_LABELS[key]


# PhaseSources.heldout_labels's, by the settings that make the held-out data.
_HELDOUT_LABELS: dict[str, tuple[list[int], str, Callable[[int], str]]] = {}


def phase_epochs(phase: int, num_instances: int, *, steps: int, global_batch: int) -> int:
    """The passes over ``num_instances`` training instances that ``steps`` optimizer steps of
    ``global_batch`` instances (batch x accumulate x the combiner's data parts) start: whole
    steps per pass, the last pass cut short.

    Raises:
        PhaseDataError: Fewer instances than one global batch.
    """
    per_epoch = num_instances // global_batch
    if per_epoch < 1:
        raise PhaseDataError(
            f"phase {phase}: {num_instances} instances are fewer than one global batch of "
            f"{global_batch} (batch x accumulate x workers)"
        )
    return math.ceil(steps / per_epoch)


# ---------------------------------------------------------------------------------------------
# The hand-over between phases
# ---------------------------------------------------------------------------------------------


class PhaseChain:
    """The phases of one run in order, under ``output_dir``: phase ``N`` checkpoints in
    ``<output_dir>/phaseN`` and saves its model to ``<output_dir>/phaseN/model``, which the next
    phase starts from.

    Args:
        output_dir: The run's directory.
        max_steps: The run's optimizer steps over all its phases (``None``: each phase's own).
        resuming: Phases whose model is saved already count as done (:meth:`finished`).
        phase1_model: Phase 2's start when this run has no phase 1 (``--phase1-model``).

    Attributes:
        done: The optimizer steps of the phases before the current one.
        previous: The model directory of the latest finished phase, if any.
    """

    def __init__(
        self,
        output_dir: PathLike,
        *,
        max_steps: int | None = None,
        resuming: bool = False,
        phase1_model: PathLike | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.max_steps = max_steps
        self.resuming = resuming
        self.phase1_model = Path(phase1_model) if phase1_model else None
        self.done = 0
        self.previous: Path | None = None
        self._saved = False

    def save_dir(self, phase: int) -> Path:
        """Where phase ``phase`` checkpoints (``latest.pt``)."""
        return self.output_dir / f"phase{phase}"

    def model_dir(self, phase: int) -> Path:
        """Where phase ``phase`` saves its model (a Hugging Face directory)."""
        return self.save_dir(phase) / "model"

    def checkpoint(self, phase: int) -> Path | None:
        """On resume, phase ``phase``'s latest checkpoint if it has one."""
        latest = self.save_dir(phase) / "latest.pt"
        return latest if self.resuming and latest.is_file() else None

    def finished(self, phase: int, steps: int) -> bool:
        """On resume, whether phase ``phase`` saved its model already; if so its ``steps``
        count as done and its model is the next phase's start."""
        model_dir = self.model_dir(phase)
        if not (self.resuming and (model_dir / "config.json").is_file()):
            return False
        self.done += steps
        self.previous = model_dir
        return True

    def limit(self, steps: int) -> int:
        """The steps a phase of ``steps`` may take under ``max_steps`` (<= 0: none left)."""
        return steps if self.max_steps is None else min(steps, self.max_steps - self.done)

    def start_model(self, vocab_size: int) -> torch.nn.Module:
        """Phase 2's model: the previous phase's saved one, else ``phase1_model``, with its
        pretraining heads.

        Raises:
            PhaseModelError: Neither has a ``config.json``, or its vocabulary is not
                ``vocab_size`` tokens.
        """
        source = self.previous or self.phase1_model
        if source is None or not (source / "config.json").is_file():
            raise PhaseModelError(
                f"phase 2 starts from phase 1's model, but {source} has no config.json; run "
                "phase 1 first or pass --phase1-model DIR"
            )
        model = bert_from_checkpoint(source, head="pretraining")
        if model.config.vocab_size != vocab_size:
            raise PhaseModelError(
                f"{source} has a {model.config.vocab_size}-token vocabulary, the data {vocab_size}"
            )
        return model

    def pending(
        self, phases: Iterable[Phase], *, info: Callable[[str], None] = print
    ) -> Iterator[Phase]:
        """The phases to train, in order: one already finished (:meth:`finished`) is skipped
        (said with ``info``); the run stops where ``max_steps`` leaves no step, or after a
        phase that :meth:`end_phase` did not mark saved (``max_steps`` ended it)."""
        for phase in phases:
            if self.finished(phase.number, phase.steps):
                info(f"[Phase {phase.number}] already finished: {self.model_dir(phase.number)}")
                continue
            if self.limit(phase.steps) <= 0:
                return
            self._saved = False
            yield phase
            if not self._saved:
                return  # max_steps ended the run inside this phase

    def end_phase(self, phase: int, trained: int, *, saved: bool) -> None:
        """Phase ``phase`` took ``trained`` optimizer steps (resumed ones included); with
        ``saved`` its model (:meth:`model_dir`) is the next phase's start."""
        if saved:
            self.previous = self.model_dir(phase)
        self.done += trained
        self._saved = saved
