"""An exponential moving average of the model's weights, as a Trainer hook (``--model-ema``).

Polyak & Juditsky, "Acceleration of Stochastic Approximation by Averaging" (1992); the
recipe of timm's ``ModelEmaV3`` (``train.py --model-ema --model-ema-decay 0.9998``). After
the ``t``-th optimizer step (1-based) every floating-point tensor of the model's
``state_dict`` (parameters and buffers such as BatchNorm statistics) is averaged:

.. math::
    \\bar w_1 = w_1, \\qquad \\bar w_t = d_t\\,\\bar w_{t-1} + (1 - d_t)\\,w_t

with :math:`d_t` the decay (timm's ``get_decay(step)``: the first update copies the
weights, as :class:`torch.optim.swa_utils.AveragedModel` does; with warmup
:math:`d_t = \\min(d, 1 - t^{-2/3})`, so early weights are forgotten fast). Non-float
tensors (``num_batches_tracked``) are copied. The average is evaluated after each
evaluation of the model, checkpointed with the trainer, and exportable.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

__all__ = ["EMAConfig", "ModelEMA", "ema_decay"]

DEFAULT_DECAY = 0.9998  # timm train.py's --model-ema-decay
_WARMUP_POWER = 2.0 / 3.0  # timm ModelEmaV3's warmup_power (warmup_gamma 1)


@dataclasses.dataclass(frozen=True)
class EMAConfig:
    """The EMA of a run (``--model-ema``), recorded in the run-log header.

    Args:
        decay: the decay ``d`` in ``[0, 1)``; the average's horizon is about ``1 / (1 - d)``
            steps (0.9998: 5000).
        warmup: timm's decay warmup, ``d_t = min(d, 1 - t^(-2/3))``.
    """

    decay: float = DEFAULT_DECAY
    warmup: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(
                f"EMA decay must be in [0, 1) (e.g. {DEFAULT_DECAY}, an average over about "
                f"{round(1 / (1 - DEFAULT_DECAY))} steps), got {self.decay}"
            )


def ema_decay(update: int, decay: float, warmup: bool = False) -> float:
    """The decay of the ``update``-th EMA update (1-based): timm ModelEmaV3's ``get_decay``.

    0 for the first update (the average starts as a copy of the weights), then ``decay``, or
    with ``warmup`` ``min(decay, 1 - (1 + (update - 1)) ** (-2/3))``.
    """
    k = update - 1
    if k <= 0:
        return 0.0
    if warmup:
        return min(decay, 1.0 - (1.0 + k) ** -_WARMUP_POWER)
    return decay


class ModelEMA:
    """Trainer hook: the exponential moving average of ``model``'s weights, evaluated and
    checkpointed with the run.

    Args:
        model: the bare module the :class:`~trainers.Trainer` trains (``trainer.model``).
        decay: see :class:`EMAConfig` (timm's default 0.9998).
        warmup: timm's decay warmup.
        eval_dataset: evaluated with the EMA weights after every evaluation of the model
            (the trainer's ``eval_dataset``); None: the EMA is kept but not evaluated there.
        collate_fn: the evaluation's collate function.
        prefix: of the EMA's metric names in the run log and the end record (``ema_top1``).
        on_evaluated: called ``(trainer, metrics)`` on every rank after each EMA evaluation
            (e.g. to write the EMA's prediction files).

    **What it does.** After every optimizer step (``on_step_end``) the average is updated on
    the model's device, from the weights the step left, with the decay of
    :func:`ema_decay`. After each evaluation of the model (``on_eval_end``) the EMA weights
    are evaluated too (:meth:`evaluate_and_log`): swapped into the model,
    :meth:`Trainer.evaluate <trainers.Trainer.evaluate>` (which leaves the training RNG
    untouched), swapped back bit for bit, and written as an ``eval`` record of
    ``ema_``-prefixed metrics at the same step; :meth:`final_metrics` puts the latest of
    them in the ``end`` record. A script that calls ``trainer.evaluate`` itself calls
    :meth:`evaluate_and_log` after it.

    **Checkpoints.** :meth:`state_dict` (the average and the number of updates) is saved in
    every trainer checkpoint; a resumed run continues the average bit for bit. A hook that
    got no state (a checkpoint written without ``--model-ema``) starts the average from the
    model's weights at the start of ``fit``. Add it before hooks that save or commit in
    ``on_step_end`` (the :class:`~trainers.elastic.ElasticState` that ``build_elastic``
    registers), so that what they save includes the step's update.

    **Distributed.** The combiner must keep the replicas equal after every optimizer step
    (``average``, ``fp16``, ``bf16``, ``powersgd``, ``adasum``, ``ef``, ``coded``, ...): then
    each rank's average is the average of the synchronized weights. Before each EMA
    evaluation rank 0's average (whose buffers are the ones DDP broadcasts) is broadcast,
    so every rank evaluates the same weights. Modes whose replicas differ between
    synchronizations (they override ``synchronize()``: local SGD, gossip, CSER, DEF,
    Pipe-SGD) are refused when ``fit`` starts.

    **Export.** The EMA weights, for writing files (rank 0):

    * :meth:`state_dict_for_export` -- a state dict with the model's keys, e.g.
      ``torch.save(ema.state_dict_for_export(), path)`` or ``model.load_state_dict(...)``;
    * :meth:`swap_in` -- a context manager that puts the EMA weights into the model and
      restores the trained ones after, for exporters that take the module::

        with ema.swap_in():
            save_hf_directory(trainer.model, tokenizer, out_dir / "ema")

    Rank 0's average is the one to write. Every rank holds an average, but under DDP the
    BatchNorm statistics differ between ranks: an exporter that needs the same weights on
    every rank calls :meth:`broadcast_from_rank0` (every rank) before :meth:`swap_in`.

    Example:
        >>> ema = ModelEMA(model, decay=0.9998, eval_dataset=val_set)
        >>> trainer = Trainer(model, optimizer, config, ..., hooks=[task, ema])
        >>> trainer.fit(train_set, eval_dataset=val_set)  # eval records: top1, then ema_top1
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        decay: float = DEFAULT_DECAY,
        warmup: bool = False,
        eval_dataset: Dataset | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        prefix: str = "ema_",
        on_evaluated: Callable[[Any, dict[str, float]], Any] | None = None,
    ) -> None:
        self.config = EMAConfig(decay=float(decay), warmup=bool(warmup))
        self.model = model
        self.eval_dataset = eval_dataset
        self.collate_fn = collate_fn
        self.prefix = prefix
        self.on_evaluated = on_evaluated
        state = model.state_dict(keep_vars=True)
        # One entry per distinct tensor: tied weights appear under several keys.
        seen: dict[int, str] = {}
        self._alias: dict[str, str] = {}  # every state-dict key -> its distinct tensor's key
        for name, tensor in state.items():
            self._alias[name] = seen.setdefault(id(tensor), name)
        self._names = list(dict.fromkeys(self._alias.values()))
        self.average: dict[str, torch.Tensor] = {}  # key -> the EMA tensor (model's device)
        self._copy_model()
        self.updates = 0  # EMA updates done (the optimizer steps it has seen)
        self.last_metrics: dict[str, float] = {}  # the latest EMA evaluation, prefixed

    @property
    def decay(self) -> float:
        return self.config.decay

    # -- the average -------------------------------------------------------------------------------
    def _model_tensors(self) -> list[torch.Tensor]:
        state = self.model.state_dict(keep_vars=True)
        return [state[name].detach() for name in self._names]

    @torch.no_grad()
    def _copy_model(self) -> None:
        self.average = {
            n: t.clone() for n, t in zip(self._names, self._model_tensors(), strict=True)
        }

    @torch.no_grad()
    def update(self) -> None:
        """One EMA update from the model's current weights (the trainer calls it after every
        optimizer step)."""
        self.updates += 1
        decay = ema_decay(self.updates, self.config.decay, self.config.warmup)
        # Same-device, same-dtype groups for the fused lerp (what AveragedModel does too).
        groups: dict[tuple[torch.device, torch.dtype], tuple[list, list]] = {}
        for name, current in zip(self._names, self._model_tensors(), strict=True):
            average = self.average[name]
            if decay == 0.0 or not average.is_floating_point():
                average.copy_(current)
                continue
            ours, theirs = groups.setdefault((average.device, average.dtype), ([], []))
            ours.append(average)
            theirs.append(current)
        for ours, theirs in groups.values():
            torch._foreach_lerp_(ours, theirs, 1.0 - decay)  # avg + (1 - d) (w - avg)

    def state_dict_for_export(self) -> dict[str, torch.Tensor]:
        """The EMA weights under the model's ``state_dict`` keys (copies; tied keys share
        one tensor), loadable with ``model.load_state_dict``."""
        copies = {name: t.detach().clone() for name, t in self.average.items()}
        return {key: copies[name] for key, name in self._alias.items()}

    @contextlib.contextmanager
    def swap_in(self) -> Iterator[nn.Module]:
        """Context manager: the model holds the EMA weights inside, its own after.

        The trained weights are copied aside and copied back on exit (also on an error), so
        the model leaves bit for bit as it came in and the average is not changed by what
        happens inside. Yields the model.
        """
        current = self._model_tensors()
        with torch.no_grad():
            kept = [t.clone() for t in current]
            for name, t in zip(self._names, current, strict=True):
                t.copy_(self.average[name])
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for t, saved in zip(current, kept, strict=True):
                    t.copy_(saved)

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate(
        self,
        trainer: Any,
        dataset: Dataset | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> dict[str, float]:
        """Evaluate the EMA weights with ``trainer.evaluate`` (every rank); returns the metrics
        with the prefix. ``dataset``/``collate_fn`` default to the constructor's."""
        dataset = dataset if dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("no dataset to evaluate the EMA on: pass eval_dataset= to ModelEMA")
        collate_fn = collate_fn if collate_fn is not None else self.collate_fn
        self.broadcast_from_rank0(trainer.env)
        with self.swap_in():
            metrics = trainer.evaluate(dataset, collate_fn)
        return {self.prefix + name: value for name, value in metrics.items()}

    def evaluate_and_log(
        self,
        trainer: Any,
        dataset: Dataset | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> dict[str, float]:
        """:meth:`evaluate`, then an ``eval`` record at the trainer's epoch and step; the
        metrics become :meth:`final_metrics`; ``on_evaluated`` is called."""
        metrics = self.evaluate(trainer, dataset, collate_fn)
        trainer.logger.eval(epoch=trainer.epoch, step=trainer.global_step, **metrics)
        self.last_metrics = dict(metrics)
        if self.on_evaluated is not None:
            self.on_evaluated(trainer, dict(metrics))
        return metrics

    @torch.no_grad()
    def broadcast_from_rank0(self, env: Any) -> None:
        """Give every rank rank 0's average (a collective; a no-op in a world of one)."""
        if env is None or not env.distributed:
            return
        import torch.distributed as dist  # noqa: PLC0415 (only in distributed runs)

        for tensor in self.average.values():
            dist.broadcast(tensor, src=0)

    # -- the hook protocol -------------------------------------------------------------------------
    def on_train_start(self, trainer: Any) -> None:
        _check_combiner(trainer.combiner)
        if self.updates == 0:  # no state loaded: start from the weights fit starts with
            self._copy_model()
            return
        devices = {n: t.device for n, t in zip(self._names, self._model_tensors(), strict=True)}
        self.average = {n: t.to(devices[n]) for n, t in self.average.items()}

    def on_step_end(self, trainer: Any, step: int) -> None:
        self.update()

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        if self.eval_dataset is not None:
            self.evaluate_and_log(trainer)

    def final_metrics(self) -> dict[str, float]:
        """The latest EMA evaluation (prefixed), for the ``end`` record."""
        return dict(self.last_metrics)

    def state_dict(self) -> dict[str, Any]:
        return {
            "ema": {n: t.detach().clone() for n, t in self.average.items()},
            "updates": self.updates,
            "decay": self.config.decay,
            "warmup": self.config.warmup,
            "last_metrics": dict(self.last_metrics),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or "ema" not in state or "updates" not in state:
            keys = sorted(state) if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(
                f"not a ModelEMA state (keys {keys}): the checkpoint's hooks differ from this "
                "run's; resume with the flags the checkpoint was written with"
            )
        saved = state["ema"]
        if sorted(saved) != sorted(self._names):
            missing = sorted(set(self._names) - set(saved))
            extra = sorted(set(saved) - set(self._names))
            raise ValueError(
                f"the checkpoint's EMA does not fit this model (missing {missing[:5]}, "
                f"unexpected {extra[:5]}); resume with the model it was trained with"
            )
        devices = {n: t.device for n, t in zip(self._names, self._model_tensors(), strict=True)}
        self.average = {n: saved[n].detach().to(devices[n]).clone() for n in self._names}
        self.updates = int(state["updates"])
        self.last_metrics = dict(state.get("last_metrics", {}))


def _check_combiner(combiner: Any) -> None:
    """Refuse modes whose replicas differ between synchronizations (see :class:`ModelEMA`)."""
    from .comm import GradCombiner  # noqa: PLC0415 (keeps this module light to import)

    cls = type(combiner)
    drifts = [
        name
        for name in ("synchronize", "end_evaluation", "checkpoint_model")
        if getattr(cls, name, None) is not getattr(GradCombiner, name)
    ]
    if drifts:
        mode = getattr(combiner, "name", cls.__name__)
        raise ValueError(
            f"--model-ema averages weights that every rank agrees on after each step, but "
            f"--grad-combine {mode} keeps different replicas between synchronizations (it "
            f"defines {', '.join(drifts)}); use a synchronous mode (average, fp16, bf16, "
            "powersgd, adasum, ef, coded) or drop --model-ema"
        )
