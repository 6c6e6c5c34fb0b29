"""The shared training loop every script uses.

One :class:`Trainer` runs the same loop on one CPU process or many GPUs under ``torchrun``:
per-iteration learning-rate schedule, gradient accumulation (no gradient sync on
non-final micro-steps), mixed precision (bf16/fp16 autocast, loss scaling for fp16),
gradient clipping, data-parallel averaging through a pluggable :class:`GradCombiner`,
evaluation, throughput measurement, run logs, and checkpoints from which a run continues
bit-for-bit on CPU.

(Why one module of about 1000 lines, over the project's 800: the loop, its step count and
schedule, its checkpoint state and its evaluation share one set of invariants (step and
sample counters, the samplers, the meters, the RNG states, the schedule built from the data's
size) that a resume must restore together; what does not share them lives elsewhere: the
configs (:mod:`.config`), the bookkeeping (:mod:`.loop_state`), the non-finite watch
(:mod:`.nonfinite`) and the combiners (:mod:`.comm`).)

Contracts with the script:

* ``train_step(model, batch) -> (loss, metrics)``: called under autocast with the model the
  combiner prepared (``DistributedDataParallel`` when distributed: always call its
  ``forward`` through it), in train mode. ``batch`` is the collated batch already on the
  device. ``loss`` is the scalar mean loss of the micro-batch (the trainer divides it by the
  number of micro-batches of the step and runs backward). ``metrics`` maps names to sums
  (tensors or numbers, no ``.item()`` needed): they are summed over micro-batches, steps of
  the log interval and ranks; if a ``"count"`` key is present every other metric is reported
  as ``sum / count``, else as ``sum / number of micro-batches``. Return the same keys on
  every call.
* ``eval_step(model, batch) -> dict of sums``: called under ``torch.no_grad()`` and autocast
  with the bare module (never DDP) in eval mode; the same ``"count"`` rule turns the
  all-reduced sums into means, e.g. ``{"top1": correct1, "top5": correct5, "loss":
  loss_sum, "count": n}``.
* Hooks: any objects with some of ``on_train_start(trainer)``, ``on_epoch_start(trainer,
  epoch)``, ``on_step_end(trainer, step)``, ``on_epoch_end(trainer, epoch, metrics)``,
  ``on_eval_end(trainer, metrics)``, ``on_train_end(trainer, metrics)``,
  ``on_before_step(trainer, step)`` (after the gradients are final, before the lr is set and
  the optimizer steps) and optionally ``state_dict()``/``load_state_dict()`` (saved in
  checkpoints). ``on_epoch_start`` is called again when a run resumes mid-epoch, so make it
  a function of the epoch (DropBlock ramp, mixup off-epoch). Hooks never write the
  trainer's fields; they steer it through questions the trainer asks and public calls:
  ``schedule_position(step) -> float`` (where the schedule is read for ``step``),
  ``lr_factor(step) -> float`` (a multiplier of the scheduled lr), ``final_metrics() ->
  dict`` (merged into the end record), :meth:`Trainer.request_stop` and
  :meth:`Trainer.evaluate`. Add one after construction with :meth:`Trainer.add_hook`.
* ``lr_schedule``: ``None`` (keep the optimizer's lr), a callable ``step -> lr`` of the
  0-based global optimizer step (e.g. :class:`trainers.schedules.LRSchedule`; each group
  gets ``lr * group.get("lr_scale", 1)``), or a ``torch.optim.lr_scheduler.LRScheduler``
  (stepped after every optimizer step). Its ``state_dict`` is checkpointed if it has one.
  Or a schedule in epochs, an object with ``build(*, steps_per_epoch, epochs)`` returning
  one of the above (:class:`~trainers.config.ScheduleConfig`): the trainer builds it when
  :meth:`fit` learns the training set's size, at :meth:`steps_per_epoch` steps per epoch
  over ``config.epochs``, so a script never counts steps itself and a combining mode that
  changes the step count (``data_parts``) changes the schedule too.

Batch sizes: ``config.batch_size`` is per rank and per micro-step; one optimizer step
consumes ``batch_size * grad_accum_steps * world_size`` samples.

Non-finite losses: a NaN or infinite training loss on any rank stops :meth:`fit` with
:class:`~trainers.errors.NonFiniteError`, naming the step and the likely cause (the
learning rate, clipping, fp16). Without a host sync per step: each rank keeps its first
bad step on the device, and the ranks agree (one small all-reduce) where the loop waits
anyway: the log interval's reduction, the end of an epoch, before every evaluation and
checkpoint, and the end of ``fit`` (which also checks the weights). ``config.skip_nonfinite
= N`` instead skips the update of up to N such steps (agreed every step) and reports
``nonfinite_steps_skipped`` in the end record. fp16 steps whose *gradients* overflow with a
finite loss stay the GradScaler's business (skipped, scale lowered, not counted here).

A ``fit`` that ends early (``max_steps`` inside an epoch, or :meth:`request_stop`) evaluates
the model it has (when it has an eval dataset and this step was not evaluated yet), and the
end record's ``epochs`` counts the cut-short epoch's fraction (e.g. ``0.0312``).

Example:
    >>> env = DistEnv.from_env()
    >>> trainer = Trainer(model, optimizer, TrainerConfig(epochs=2, batch_size=32), env=env,
    ...                   train_step=train_step, eval_step=eval_step, lr_schedule=schedule)
    >>> trainer.fit(train_set, eval_dataset=val_set)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ._dtensor import is_pipeline_parallel, is_tensor_parallel
from .checkpoint import load_checkpoint, save_checkpoint
from .comm import AverageCombiner, GradCombiner
from .config import _PRECISIONS, COMPILE_MODES, ScheduleConfig, TrainerConfig
from .data import SeededDataset, ShardedSampler, derive_seed
from .dist import DistEnv
from .errors import UsageError
from .logs import RunLogger, progress_bar
from .loop_state import Meter as _Meter
from .loop_state import elapsed as _elapsed
from .loop_state import rng_state as _rng_state
from .loop_state import set_rng_state as _set_rng_state
from .nonfinite import NonFiniteWatch

__all__ = ["CHECKPOINT_FORMAT", "Trainer", "TrainerConfig", "resolve_compile"]

CHECKPOINT_FORMAT = 1


def resolve_compile(
    setting: str, device: torch.device | str, *, tensor_parallel: bool = False,
    pipeline: bool = False,
) -> bool:  # fmt: skip
    """Whether the trainer compiles the model (``TrainerConfig.compile``, ``--compile``).

    ``"off"``: no. ``"on"``: yes, except with tensor or pipeline parallelism, which
    ``torch.compile`` is not checked with here (a :class:`~trainers.errors.UsageError` saying
    so). ``"auto"``: on a CUDA device without tensor or pipeline parallelism, where it pays
    (ResNeSt-50 training on an H200 with torch 2.11: 2,357 images/s compiled against 1,555
    eager, the measurement that opened issue 41; ``benchmarks/gpu_check.py`` measures both);
    off on CPU, where eager keeps published logs exactly reproducible and a short run does
    not earn back the compilation.
    """
    if setting not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {setting!r}")
    split = "--pipeline-parallel" if pipeline else "--tensor-parallel" if tensor_parallel else None
    if setting == "on" and split is not None:
        raise UsageError(
            f"--compile on with {split}: torch.compile is not supported on a split model "
            "here; use --compile off (or auto)"
        )
    if setting == "auto":
        return torch.device(device).type == "cuda" and split is None
    return setting == "on"


TrainStep = Callable[[nn.Module, Any], tuple[torch.Tensor, Mapping[str, Any]]]
EvalStep = Callable[[nn.Module, Any], Mapping[str, Any]]


class Trainer:
    """The training loop: see the module docstring for the contracts.

    Args:
        model: the module; moved to ``env.device`` (and channels-last if configured).
        optimizer: built on ``model``'s parameters.
        config: a :class:`TrainerConfig`.
        env: the :class:`DistEnv` (default :meth:`DistEnv.from_env`).
        logger: a :class:`RunLogger` (default: console only, rank 0).
        lr_schedule: ``None``, a callable ``step -> lr`` or an ``LRScheduler``.
        train_step: ``(model, batch) -> (loss, metric sums)``.
        eval_step: ``(model, batch) -> metric sums``; required for evaluation.
        combiner: how gradients are combined across ranks (default :class:`AverageCombiner`).
        hooks: objects with ``on_*`` methods, called in order.

    Construction seeds every RNG with ``config.seed + rank`` (see
    :meth:`DistEnv.seed_everything`); build the model before, with your own seed.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: TrainerConfig,
        *,
        train_step: TrainStep,
        eval_step: EvalStep | None = None,
        env: DistEnv | None = None,
        logger: RunLogger | None = None,
        lr_schedule: Callable[[int], float] | ScheduleConfig | Any | None = None,
        combiner: GradCombiner | None = None,
        hooks: Iterable[Any] = (),
    ) -> None:
        self.config = config
        self.env = env if env is not None else DistEnv.from_env()
        self.logger = logger if logger is not None else RunLogger(None, enabled=self.env.is_main)
        self.optimizer = optimizer
        # A schedule in epochs becomes per-step in fit (or from a checkpoint's, on resume).
        in_epochs = callable(getattr(lr_schedule, "build", None))
        self.schedule_config = lr_schedule if in_epochs else None
        self.lr_schedule = None if self.schedule_config is not None else lr_schedule
        self._schedule_state: dict[str, Any] | None = None  # a checkpoint's, before fit
        self.train_step = train_step
        self.eval_step = eval_step
        self.hooks = list(hooks)

        model.to(self.env.device)
        if config.channels_last:
            model.to(memory_format=torch.channels_last)
        self.model = model  # the bare module: evaluation, checkpoints
        self.combiner = combiner if combiner is not None else AverageCombiner()
        # Tensor-parallel (trainers.parallel): env is the data-parallel view, checkpoints
        # gather the shards (model and optimizer state) into the unsplit format.
        self.tensor_parallel = is_tensor_parallel(model)
        # Pipeline-parallel (trainers.parallel.PipelinedModel): its train_step replaces
        # train_step + backward; env is the data-parallel view, as with tensor parallelism.
        self.pipeline: Any = model if is_pipeline_parallel(model) else None
        if (self.tensor_parallel or self.pipeline is not None) and (
            not self.combiner.supports_tensor_parallel
        ):
            kind = "--tensor-parallel" if self.tensor_parallel else "--pipeline-parallel"
            raise ValueError(
                f"--grad-combine {self.combiner.name} does not run on a model split by {kind}; "
                f"use --grad-combine average with {kind}"
            )
        if self.pipeline is not None and config.precision == "fp16":
            raise ValueError(
                "--pipeline-parallel runs in fp32 or bf16 (fp16's loss scaling is not wired "
                "into the pipeline schedules); use --dtype bf16 or float32"
            )
        self.compiled = resolve_compile(config.compile, self.env.device,
                                        tensor_parallel=self.tensor_parallel,
                                        pipeline=self.pipeline is not None)  # fmt: skip
        if self.compiled:
            self.logger.info("compile: torch.compile (inductor) of the training forward; "
                             "the first steps compile, evaluation runs eager")  # fmt: skip
        self.forward_model = self._forward_model()  # what train_step gets

        self.autocast_dtype = _PRECISIONS[config.precision]
        self.scaler = (
            torch.amp.GradScaler(self.env.device.type) if config.precision == "fp16" else None
        )

        # Progress; all of it is checkpointed.
        self.epoch = 0  # the epoch being trained (0-based)
        self.global_step = 0  # optimizer steps done
        self.epoch_samples = 0  # global samples of this epoch already consumed
        self.epoch_step = 0  # optimizer steps done in this epoch
        self._interval = _Meter()
        self._epoch_meter = _Meter()
        # train_step's metric names, None until this fit computed a step: a rank that skips a
        # step still offers them (as zeros) to the metric reduction, so it may skip only
        # once it knows them (else its vector is shorter than the others' and the
        # collective mismatches: the coded suite's run hung so under load)
        self._metric_names: list[str] | None = None
        slow = config.inject_straggler
        self._slow_factor = slow[1] - 1.0 if slow is not None and slow[0] == self.env.rank else 0.0
        self._epoch_seconds = 0.0  # training time of this epoch before a resume
        self._epoch_clock: tuple[float, float] | None = None  # (start, paused) while training
        self.last_eval: dict[str, float] = {}
        self.last_epoch: dict[str, float] = {}

        self._stop_requested = False  # set by request_stop(): fit ends before the next step
        self._ended_at_step: int | None = None  # the step of the end record, once written
        # The lr each group had at construction (divided by its lr_scale): the base that
        # hooks' lr factors multiply when there is no schedule.
        self._base_lr = float(optimizer.param_groups[0]["lr"]) / optimizer.param_groups[0].get(
            "lr_scale", 1.0
        )
        self._paused = 0.0  # seconds spent evaluating and saving (excluded from speed)
        self._last_saved_step: int | None = None
        self._last_eval_step: int | None = None  # global step of the latest evaluation
        # Non-finite losses and weights (trainers.nonfinite): found without a host sync,
        # agreed by the ranks where the loop waits anyway.
        self.nonfinite = NonFiniteWatch(self.env, self.logger, config, self.lr_at)
        self.train_sampler: ShardedSampler | None = None  # fit's sampler (read by hooks)
        self.env.seed_everything(config.seed)

    # ======================================================================================
    # fit
    # ======================================================================================
    def fit(
        self,
        train_dataset: Dataset,
        eval_dataset: Dataset | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> dict[str, float]:
        """Train until ``config.epochs`` (or ``config.max_steps``); returns the final metrics.

        A hook with ``recover(trainer, exc) -> bool`` (in-process recovery,
        :class:`~trainers.elastic.ElasticState` under ``python -m trainers.elastic inproc``)
        may take an exception out of the loop: when it answers True it has re-formed the
        group and put the trainer back at a commit, and training goes on from there.
        """
        from .recovery import active  # noqa: PLC0415 (recovery imports dist)

        if active() is not None and not any(hasattr(h, "recover") for h in self.hooks):
            raise UsageError(
                "launched by python -m trainers.elastic inproc, but nothing recovers this fit: "
                "give the script --elastic-dir DIR (an ElasticState), or launch it otherwise"
            )
        self._fit_start = time.perf_counter()  # the end record's total_time spans recoveries
        while True:
            try:
                return self._fit_once(train_dataset, eval_dataset, collate_fn)
            except Exception as exc:
                recover = [h.recover for h in self.hooks if callable(getattr(h, "recover", None))]
                if not any(r(self, exc) for r in recover):
                    raise

    def _forward_model(self) -> nn.Module:
        """The module ``train_step`` gets: the combiner's wrapping of the model (DDP for
        averaging), compiled when :attr:`compiled` (``torch.compile`` of the wrapper, as
        PyTorch advises for DDP; the wrapper shares the bare module's parameters, so
        ``self.model``, its ``state_dict`` keys, checkpoints and evaluation stay eager)."""
        prepared = self.combiner.prepare(self.model, self.optimizer, self.env)
        if not self.compiled:
            return prepared
        if prepared is not self.model and type(self.model).__module__.startswith("torch.nn"):
            self.logger.info(
                f"compile: the model is torch.nn's own {type(self.model).__name__}, and "
                "torch.compile of its data-parallel wrapper captures nothing of it (every "
                "frame is torch's); wrap it in a module of your own to compile it"
            )  # fmt: skip
        return torch.compile(prepared)

    def regroup(self) -> None:
        """After the process group was re-formed (``self.env`` has its new rank and world
        size): wrap the model for the new group again, rebuild an epoch schedule for the new
        steps per epoch, and let the new rank 0 write the run log."""
        self.forward_model = self._forward_model()
        if self.schedule_config is not None:
            self.lr_schedule = None  # rebuilt by fit for the new world size
        if self.env.is_main and not self.logger.enabled:
            self.logger.take_over()
        elif not self.env.is_main and self.logger.enabled:  # rank 0 no more: one writer
            self.logger.release()

    def _fit_once(
        self,
        train_dataset: Dataset,
        eval_dataset: Dataset | None,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> dict[str, float]:
        cfg, env = self.config, self.env
        if self.schedule_config is not None and self.lr_schedule is None:
            self.lr_schedule = self._build_schedule(len(train_dataset))  # type: ignore[arg-type]
            if self._schedule_state is not None and hasattr(self.lr_schedule, "load_state_dict"):
                self.lr_schedule.load_state_dict(self._schedule_state)
        sampler = self._train_sampler(len(train_dataset))  # type: ignore[arg-type]
        self.train_sampler = sampler
        loader = self._loader(train_dataset, sampler, collate_fn, persistent=True)
        self._call_hooks("on_train_start")

        while self.epoch < cfg.epochs and not self._reached_max_steps():
            epoch = self.epoch
            sampler.set_epoch(epoch, start=self.epoch_samples)
            self._check_epoch_batches(sampler)
            micro_sizes = sampler.global_batch_sizes()  # global samples of each micro-batch
            self._call_hooks("on_epoch_start", epoch)
            self.forward_model.train()

            self._epoch_clock = (time.perf_counter(), self._paused)
            interval_start, interval_paused = self._epoch_clock
            epoch_samples, interval_samples = 0, 0
            step_samples, group = 0, cfg.grad_accum_steps
            bar = progress_bar(
                loader,
                total=len(micro_sizes),
                desc=f"Epoch {epoch}",
                enabled=cfg.progress and env.is_main,
            )
            finished_epoch = True
            skip = False
            pending: list[tuple[Mapping[str, Any], torch.Tensor]] = []  # skip_nonfinite
            for j, batch in enumerate(bar):
                # ---- one micro-step: forward + backward, no gradient sync unless last -------
                if j % cfg.grad_accum_steps == 0:  # the last step of an epoch may be shorter
                    group = min(cfg.grad_accum_steps, len(micro_sizes) - j)
                    # a late rank the step does not need (never this fit's first step)
                    skip = self._metric_names is not None and self.combiner.skips_step()
                last_micro = j % cfg.grad_accum_steps == group - 1
                if skip:
                    self._interval.touch(self._metric_names)
                    self._epoch_meter.touch(self._metric_names)
                else:
                    started = time.perf_counter()
                    batch = self._to_device(batch)
                    sync = contextlib.nullcontext() if last_micro else self.combiner.no_sync()
                    with sync:
                        if self.pipeline is not None:  # forward and backward of every stage
                            with self._autocast():
                                loss, metrics = self.pipeline.train_step(
                                    self.train_step, batch, scale=1.0 / group
                                )
                        else:
                            with self._autocast():
                                loss, metrics = self.train_step(self.forward_model, batch)
                            self._backward(loss if group == 1 else loss / group)
                    if self._slow_factor:  # --inject-straggler: this rank computes slower
                        time.sleep(self._slow_factor * (time.perf_counter() - started))
                    self._metric_names = list(metrics)
                    self._watch_loss(loss)
                    if cfg.skip_nonfinite:  # counted once the step is known to be finite
                        pending.append((metrics, loss.detach()))
                    else:
                        self._interval.update(metrics, loss)
                        self._epoch_meter.update(metrics, loss)
                step_samples += micro_sizes[j]
                if not last_micro:
                    continue

                # ---- the optimizer step --------------------------------------------------
                if cfg.skip_nonfinite and self._skip_nonfinite_step():  # a collective
                    lr = self._skipped_update()
                else:
                    for sums, value in pending:
                        self._interval.update(sums, value)
                        self._epoch_meter.update(sums, value)
                    lr = self._optimizer_step()
                pending = []
                self.global_step += 1
                self.epoch_step += 1
                self.epoch_samples += step_samples
                epoch_samples += step_samples
                interval_samples += step_samples
                step_samples = 0
                self._call_hooks("on_step_end", self.global_step)

                if cfg.log_interval and self.epoch_step % cfg.log_interval == 0:
                    self._check_nonfinite()  # the reduction below waits for the step anyway
                    loss_mean, means = self._interval.reduce(env)  # syncs: honest timing
                    seconds = _elapsed(interval_start, interval_paused, self._paused)
                    self.logger.step(
                        epoch=epoch,
                        batch=self.epoch_step - 1,
                        step=self.global_step,
                        loss=loss_mean,
                        lr=lr,
                        samples_per_sec=interval_samples / max(seconds, 1e-9),
                        **means,
                        **self.combiner.metrics(),
                    )
                    self._interval = _Meter()
                    interval_start, interval_paused, interval_samples = (
                        time.perf_counter(),
                        self._paused,
                        0,
                    )
                if cfg.eval_interval_steps and self.global_step % cfg.eval_interval_steps == 0:
                    self._evaluate_and_log(eval_dataset, collate_fn)
                if cfg.save_interval_steps and self.global_step % cfg.save_interval_steps == 0:
                    self._save_named("latest.pt")
                if self._reached_max_steps():
                    finished_epoch = j == len(micro_sizes) - 1
                    break

            epoch_seconds = self._epoch_elapsed()
            self._epoch_clock = None
            if not finished_epoch:
                self._epoch_seconds = epoch_seconds
                break
            self._end_epoch(epoch, epoch_seconds, epoch_samples, eval_dataset, collate_fn)

        # a non-finite loss (or, from the last update, weights) never ends a fit quietly
        self._check_nonfinite(weights=self.pipeline is None and not self.tensor_parallel)
        if self.epoch < cfg.epochs and self._last_eval_step != self.global_step:
            # ended early (max_steps, request_stop): evaluate the model it has
            between = self.epoch_samples == 0 and self.epoch > 0
            self._evaluate_and_log(eval_dataset, collate_fn, epoch=self.epoch - int(between))
        self.combiner.close()  # background communication (async gossip) ends with fit
        if cfg.save_dir and not self._saved_at_current_step():
            self._save_named("latest.pt")
        total_time = time.perf_counter() - self._fit_start
        final = dict(self.last_eval)
        for hook in self.hooks:
            more = getattr(hook, "final_metrics", None)
            if more is not None:
                final.update(more())
        if "loss" in self.last_epoch:
            final["train_loss"] = self.last_epoch["loss"]
        if cfg.skip_nonfinite:
            final["nonfinite_steps_skipped"] = len(self.nonfinite_skipped)
        if self._ended_at_step != self.global_step:  # once, also if a recovery redoes the end
            self.logger.end(
                total_time=total_time, steps=self.global_step, epochs=self._epochs_done(), **final
            )
            self._ended_at_step = self.global_step
        self._call_hooks("on_train_end", final)
        return final

    # ======================================================================================
    # what hooks may call
    # ======================================================================================
    @property
    def paused_seconds(self) -> float:
        """Seconds this fit spent evaluating and saving (left out of the measured speed)."""
        return self._paused

    def add_hook(self, hook: Any) -> None:
        """Append ``hook`` (called after the hooks given at construction)."""
        self.hooks.append(hook)

    def global_batch_size(self) -> int:
        """Samples of one optimizer step: ``batch_size x grad_accum_steps x`` the combiner's
        data parts (the data-parallel world size, but for coded modes)."""
        cfg = self.config
        return cfg.batch_size * cfg.grad_accum_steps * self.combiner.data_parts(self.env.world_size)

    def steps_per_epoch(self, num_samples: int) -> int:
        """Whole optimizer steps in an epoch of ``num_samples`` training samples: what a
        schedule in epochs counts (:class:`~trainers.config.ScheduleConfig`).

        Raises:
            UsageError: Fewer samples than one global batch.
        """
        steps = num_samples // self.global_batch_size()
        if steps < 1:
            cfg = self.config
            raise UsageError(
                f"{num_samples} training samples are fewer than one global batch of "
                f"{self.global_batch_size()} (batch size {cfg.batch_size} x accumulation "
                f"{cfg.grad_accum_steps} x {self.combiner.data_parts(self.env.world_size)} "
                "workers: --batch-size x --accumulate x workers); lower the batch size"
            )
        return steps

    def _build_schedule(self, num_samples: int) -> Any:
        steps = self.steps_per_epoch(num_samples)
        schedule = self.schedule_config
        try:
            return schedule.build(steps_per_epoch=steps, epochs=self.config.epochs)
        except ValueError as err:  # whole steps: a warmup that fits in epochs may not in steps
            warmup = getattr(schedule, "warmup_epochs", None)
            what = f" (warmup {warmup:g} epochs, --warmup-epochs)" if warmup is not None else ""
            raise UsageError(
                f"the learning-rate schedule{what} at {steps} steps per epoch x "
                f"{self.config.epochs} epochs: {err}"
            ) from None

    @property
    def nonfinite_skipped(self) -> list[int]:
        """The steps whose update ``skip_nonfinite`` skipped."""
        return self.nonfinite.skipped

    @nonfinite_skipped.setter
    def nonfinite_skipped(self, steps: list[int]) -> None:
        self.nonfinite.skipped = list(steps)

    def request_stop(self) -> None:
        """End :meth:`fit` before the next optimizer step (e.g. early stopping)."""
        self._stop_requested = True

    def lr_at(self, step: int) -> float:
        """The base lr of the 0-based optimizer step ``step``: the schedule, read where the
        hooks' ``schedule_position`` says, times their ``lr_factor``s. No side effects."""
        schedule = self.lr_schedule
        factors = [h.lr_factor for h in self.hooks if hasattr(h, "lr_factor")]
        if isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
            return float(schedule.get_last_lr()[0])
        if schedule is None:
            if not factors:
                return float(self.optimizer.param_groups[0]["lr"])
            lr = self._base_lr
        else:
            position: float = step
            for hook in self.hooks:
                if hasattr(hook, "schedule_position"):
                    position = hook.schedule_position(position)
            lr = float(schedule(position))
        for factor in factors:
            lr = lr * factor(step)
        return lr

    def _end_epoch(
        self,
        epoch: int,
        seconds: float,
        samples: int,
        eval_dataset: Dataset | None,
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        """Epoch record, evaluation, then the checkpoint of the next epoch's start."""
        cfg = self.config
        self._check_nonfinite()
        loss, means = self._epoch_meter.reduce(self.env)
        self.last_epoch = {"loss": loss, **means}
        run_seconds = seconds - self._epoch_seconds  # this process's share, for the speed
        self.logger.epoch(
            epoch=epoch,
            loss=loss,
            samples_per_sec=samples / max(run_seconds, 1e-9),
            time_cost=seconds,
            **means,
        )
        self._call_hooks("on_epoch_end", epoch, dict(self.last_epoch))
        if cfg.eval_interval and (epoch + 1) % cfg.eval_interval == 0:
            self._evaluate_and_log(eval_dataset, collate_fn)

        self.epoch = epoch + 1
        self.epoch_samples = 0
        self.epoch_step = 0
        self._epoch_seconds = 0.0
        self._interval = _Meter()
        self._epoch_meter = _Meter()
        if cfg.save_dir and cfg.save_frequency and (epoch + 1) % cfg.save_frequency == 0:
            self._save_named(f"epoch{epoch}.pt", also_latest=True, record_epoch=epoch)

    # ======================================================================================
    # the pieces of a step
    # ======================================================================================
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.env.device.type, dtype=self.autocast_dtype)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def _optimizer_step(self) -> float:
        """Combine, unscale, clip, set the lr, step, update the scaler; returns the lr."""
        if self.pipeline is not None:  # parameters shared by stages (tied embeddings)
            self.pipeline.reduce_tied_gradients()
        self.combiner.reduce_gradients(self.scaler)
        if self.config.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(self.optimizer)
            if self.tensor_parallel:
                from .parallel.tensor import clip_grad_norm_

                clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
            elif self.pipeline is not None:  # the norm over every stage
                self.pipeline.clip_grad_norm_(self.config.clip_grad_norm)
            else:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.clip_grad_norm)
        self._call_hooks("on_before_step", self.global_step)
        lr = self._apply_lr()
        self.combiner.step(self.optimizer, self.scaler)
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(self.lr_schedule, torch.optim.lr_scheduler.LRScheduler):
            self.lr_schedule.step()
        return lr

    def _apply_lr(self) -> float:
        """Set every group's lr for the coming step; returns the base lr (for the logs)."""
        schedule = self.lr_schedule
        if isinstance(schedule, torch.optim.lr_scheduler.LRScheduler) or (
            schedule is None and not any(hasattr(h, "lr_factor") for h in self.hooks)
        ):
            return self.lr_at(self.global_step)
        lr = self.lr_at(self.global_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        return lr

    def _to_device(self, batch: Any) -> Any:
        device, channels_last = self.env.device, self.config.channels_last
        if device.type == "cpu" and not channels_last:
            return batch

        def move(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                x = x.to(device, non_blocking=True)
                if channels_last and x.dim() == 4 and x.is_floating_point():
                    x = x.contiguous(memory_format=torch.channels_last)
                return x
            if isinstance(x, Mapping):
                return type(x)({k: move(v) for k, v in x.items()})  # type: ignore[call-arg]
            if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
                return type(x)(*(move(v) for v in x))
            if isinstance(x, (list, tuple)):
                return type(x)(move(v) for v in x)
            return x

        return move(batch)

    def _call_hooks(self, name: str, *args: Any) -> None:
        for hook in self.hooks:
            fn = getattr(hook, name, None)
            if fn is not None:
                fn(self, *args)

    def _epoch_elapsed(self) -> float:
        """Training seconds of the current epoch, across resumes, without eval/saving."""
        if self._epoch_clock is None:
            return self._epoch_seconds
        return self._epoch_seconds + _elapsed(*self._epoch_clock, self._paused)

    def _reached_max_steps(self) -> bool:
        if self._stop_requested:
            return True
        return self.config.max_steps is not None and self.global_step >= self.config.max_steps

    def _epochs_done(self) -> float:
        """Epochs trained: whole ones, plus the fraction of one cut short (the end record)."""
        sampler = self.train_sampler
        if not self.epoch_samples or sampler is None:
            return self.epoch
        n, batch = sampler.num_samples, sampler.global_batch_size
        per_epoch = n - n % batch if sampler.drop_last else n
        return round(self.epoch + self.epoch_samples / max(per_epoch, 1), 4)

    # ======================================================================================
    # non-finite losses
    # ======================================================================================
    def _watch_loss(self, loss: torch.Tensor) -> None:
        self.nonfinite.watch(loss, self.global_step)

    def _check_nonfinite(self, *, weights: bool = False) -> None:
        """A collective: raise :class:`NonFiniteError` if some rank saw a non-finite loss
        (or, with ``weights``, holds a non-finite parameter)."""
        self.nonfinite.check(self.model, self.global_step, weights=weights)

    def _skip_nonfinite_step(self) -> bool:
        return self.nonfinite.skip_step(self.model, self.global_step)

    def _skipped_update(self) -> float:
        """No update for this step: its gradients are dropped; the optimizer, loss scaler and
        combiner are not called; a torch ``LRScheduler`` still advances with the step count,
        as a callable schedule does. Returns the lr the step would have had."""
        names = self._metric_names or []
        self._interval.touch(names)  # every rank still offers the same metric vector
        self._epoch_meter.touch(names)
        lr = self.lr_at(self.global_step)
        self.optimizer.zero_grad(set_to_none=True)
        if isinstance(self.lr_schedule, torch.optim.lr_scheduler.LRScheduler):
            with warnings.catch_warnings():  # "lr_scheduler.step() before optimizer.step()"
                warnings.simplefilter("ignore", UserWarning)
                self.lr_schedule.step()
        return lr

    # ======================================================================================
    # data
    # ======================================================================================
    def _train_sampler(self, num_samples: int) -> ShardedSampler:
        part, parts = self.combiner.data_shard()  # (rank, world size) but for coded modes
        return ShardedSampler(
            num_samples,
            batch_size=self.config.batch_size,
            world_size=parts,
            rank=part,
            seed=self.config.seed,
            epoch=self.epoch,
            start=min(self.epoch_samples, num_samples),
            drop_last=self.config.drop_last,
            shuffle=self.config.shuffle,
        )

    def _check_epoch_batches(self, sampler: ShardedSampler) -> None:
        sizes = sampler.global_batch_sizes()
        if not sizes and self.epoch_samples == 0:
            raise ValueError(
                f"the training set has {sampler.num_samples} samples, fewer than one global "
                f"batch ({sampler.global_batch_size} = batch_size {sampler.batch_size} x "
                f"world_size {sampler.world_size}); lower the batch size or set drop_last=False"
            )
        if sizes and sizes[-1] < sampler.world_size:  # data shards: ranks, but for coded
            raise ValueError(
                f"the last batch of epoch {sampler.epoch} has {sizes[-1]} samples for "
                f"{sampler.world_size} data shards, so some rank would get none; set "
                "drop_last=True or change the batch size"
            )

    def _loader(
        self,
        dataset: Dataset,
        sampler: ShardedSampler,
        collate_fn: Callable[[list[Any]], Any] | None,
        persistent: bool,
    ) -> DataLoader:
        workers = self.config.num_workers
        return DataLoader(
            SeededDataset(dataset, self.config.seed),
            batch_sampler=sampler,
            num_workers=workers,
            collate_fn=collate_fn,
            pin_memory=self.env.device.type == "cuda",
            persistent_workers=persistent and workers > 0,
            # Its own generator: creating an iterator must not draw from the global RNG.
            generator=torch.Generator().manual_seed(derive_seed(self.config.seed, self.env.rank)),
        )

    # ======================================================================================
    # evaluation
    # ======================================================================================
    @torch.no_grad()
    def evaluate(
        self,
        dataset: Dataset,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        remember: bool = False,
    ) -> dict[str, float]:
        """Run ``eval_step`` over ``dataset`` (each sample exactly once across ranks).

        Returns the all-reduced sums turned into means (the ``"count"`` rule). Training
        randomness is untouched: the RNG state is restored afterwards. The combiner's
        ``synchronize()`` runs first, so replicas that drifted apart (local SGD, CSER) are
        made equal and the evaluated model is the same on every rank. ``remember=True``
        makes them the trainer's ``last_eval`` (the end record's metrics).
        """
        if self.eval_step is None:
            raise ValueError("evaluation needs an eval_step; pass eval_step= to the Trainer")
        self._check_nonfinite()  # a collective: no rank evaluates a diverged model
        env = self.env
        self.combiner.synchronize()  # replicas that drifted apart (local SGD, CSER) agree
        if self.pipeline is not None:  # every stage's weights on every rank: the whole model
            self.pipeline.synchronize()
        sampler = ShardedSampler(
            len(dataset),  # type: ignore[arg-type]
            batch_size=self.config.eval_batch_size or self.config.batch_size,
            world_size=env.world_size,
            rank=env.rank,
            seed=self.config.seed,
            drop_last=False,
            shuffle=False,
        )
        loader = self._loader(dataset, sampler, collate_fn, persistent=False)
        meter = _Meter()
        was_training = self.model.training
        self.model.eval()
        cuda_devices = [env.device.index] if env.device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=cuda_devices):
                for batch in loader:
                    with self._autocast():
                        meter.update(self.eval_step(self.model, self._to_device(batch)))
        finally:
            self.model.train(was_training)
            self.combiner.end_evaluation()
        keys = sorted({k for ks in env.all_gather_object(sorted(meter.sums)) for k in ks})
        metrics = meter.reduce(env, keys)[1]
        if remember:
            self.last_eval = dict(metrics)
            self._last_eval_step = self.global_step
        return metrics

    def _evaluate_and_log(
        self,
        dataset: Dataset | None,
        collate_fn: Callable[[list[Any]], Any] | None,
        *,
        epoch: int | None = None,
    ) -> None:
        if dataset is None or self.eval_step is None:
            return
        start = time.perf_counter()
        metrics = self.evaluate(dataset, collate_fn, remember=True)
        epoch = self.epoch if epoch is None else epoch
        self.logger.eval(epoch=epoch, step=self.global_step, **metrics)
        self._call_hooks("on_eval_end", dict(metrics))
        self._paused += time.perf_counter() - start

    # ======================================================================================
    # checkpoints
    # ======================================================================================
    def state_dict(self) -> dict[str, Any] | None:
        """Everything needed to continue; a collective (every rank calls it).

        Returns the state on rank 0 and ``None`` elsewhere: per-rank parts (RNG states,
        combiner state, partial metric sums) are gathered to rank 0. Raises
        :class:`NonFiniteError` on every rank when some rank saw a non-finite loss.
        """
        self._check_nonfinite()
        model = self.combiner.checkpoint_model()  # a collective too (DEF: the average)
        shards = None
        if self.tensor_parallel:  # gathering the shards is a collective over the tp group
            from .parallel.tensor import gather_optimizer_state

            shards = {
                "model": self.model.state_dict(),
                "optimizer": gather_optimizer_state(
                    self.model, self.optimizer, self.optimizer.state_dict()
                ),
            }
        elif self.pipeline is not None:  # the whole model, and every stage's optimizer state
            shards = {
                "model": self.model.state_dict(),
                "optimizer": self.pipeline.optimizer_state(self.optimizer),
            }
        ranks = self.env.gather_object(self._rank_state())
        if not self.env.is_main:
            return None
        state = self._full_state(ranks, shards)
        if model is not None:
            state["model"] = model
        return state

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's state without any communication (in-memory commits, see elastic.py).

        Like :meth:`state_dict`, but ``ranks`` holds only this rank's part (``None`` for
        the others): :meth:`load_state_dict` takes it back on the same rank of a world of
        the same size. The tensors are the live ones: copy them to keep a snapshot.
        """
        if self.tensor_parallel or self.pipeline is not None:
            raise ValueError(
                "local_state_dict: a tensor- or pipeline-parallel model's state is gathered "
                "from its ranks (a collective), so in-memory elastic commits do not support "
                "it; use state_dict() / save_checkpoint()"
            )
        ranks: list[dict[str, Any] | None] = [None] * self.env.world_size
        ranks[self.env.rank] = self._rank_state()
        return self._full_state(ranks)

    def _rank_state(self) -> dict[str, Any]:
        return {
            "rng": _rng_state(),
            "combiner": self.combiner.state_dict(),
            "interval": self._interval.state_dict(),
            "epoch_meter": self._epoch_meter.state_dict(),
        }

    def _full_state(
        self, ranks: list[Any], gathered: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """The checkpoint; ``gathered``: the model and optimizer states when they had to be
        gathered on every rank first (tensor parallelism)."""
        schedule = self.lr_schedule
        if gathered is None:
            gathered = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        return {
            "format": CHECKPOINT_FORMAT,
            "model": gathered["model"],
            "optimizer": gathered["optimizer"],
            "lr_schedule": schedule.state_dict() if hasattr(schedule, "state_dict") else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": self.epoch,
            "step": self.global_step,
            "epoch_samples": self.epoch_samples,
            "epoch_step": self.epoch_step,
            "epoch_seconds": self._epoch_elapsed(),
            "world_size": self.env.world_size,
            "config": dataclasses.asdict(self.config),
            "hooks": [h.state_dict() if hasattr(h, "state_dict") else None for h in self.hooks],
            "ranks": ranks,
            "last_eval": dict(self.last_eval),
            "last_epoch": dict(self.last_epoch),
            "last_eval_step": self._last_eval_step,
            "nonfinite_skipped": list(self.nonfinite_skipped),
        }

    def save_checkpoint(
        self, path: str | Path, *more_paths: str | Path, record_epoch: int | None = None
    ) -> Path:
        """Write the checkpoint atomically to each path (rank 0 only) and log it.

        A collective: every rank must call it. ``record_epoch`` is the epoch written in the
        ``checkpoint`` log record (default: the epoch in progress, or the one just finished
        when the checkpoint falls between epochs).
        """
        start = time.perf_counter()
        state = self.state_dict()
        if state is not None:
            epoch = record_epoch
            if epoch is None:
                between = self.epoch_samples == 0 and self.epoch > 0
                epoch = self.epoch - 1 if between else self.epoch
            for p in (path, *more_paths):
                save_checkpoint(p, state)
                self.logger.checkpoint(epoch=epoch, step=self.global_step, path=p)
        self.env.barrier()
        self._last_saved_step = self.global_step
        self._paused += time.perf_counter() - start
        return Path(path)

    def _save_named(
        self, name: str, *, also_latest: bool = False, record_epoch: int | None = None
    ) -> None:
        assert self.config.save_dir is not None
        save_dir = Path(self.config.save_dir)
        more = [save_dir / "latest.pt"] if also_latest else []
        self.save_checkpoint(save_dir / name, *more, record_epoch=record_epoch)

    def _saved_at_current_step(self) -> bool:
        return self._last_saved_step == self.global_step

    def resume(self, path: str | Path) -> None:
        """Load a checkpoint written by :meth:`save_checkpoint`; call before :meth:`fit`.

        Every rank reads the file. With the same world size each rank gets back its own RNG
        states, combiner state and partial sums, and the run continues bit-for-bit (CPU).
        With another world size the RNGs are reseeded from ``(seed, step)``, the combiner
        gets every old rank's state (``load_other_world``: decentralized modes rebuild the
        exact average of the old replicas, the others start fresh from rank 0's model), and
        the rest of the epoch's samples are re-split over the new ranks.
        """
        self.load_state_dict(load_checkpoint(path), source=str(path))

    def load_state_dict(
        self, state: Mapping[str, Any], *, source: str = "state", regrouped: bool = False
    ) -> None:
        """Continue from a :meth:`state_dict` (or :meth:`local_state_dict`); see :meth:`resume`.

        ``source`` names the state in error messages (the checkpoint path). ``regrouped``:
        a :meth:`local_state_dict` of some member of a group that has since been re-formed
        (in-process recovery): loaded as after a world-size change, from the parts it holds.
        """
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(
                f"checkpoint {source!r} has format {state.get('format')!r}, this trainer "
                f"reads format {CHECKPOINT_FORMAT}"
            )
        ranks = state["ranks"]
        same_world = int(state["world_size"]) == self.env.world_size and not regrouped
        own_part = same_world and ranks[self.env.rank] is not None
        if any(r is None for r in ranks) and not own_part and not regrouped:
            raise ValueError(
                f"{source!r} is a local_state_dict of another rank or world size; resume "
                "from a state_dict() (a checkpoint) instead"
            )
        self.model.load_state_dict(state["model"])
        if self.pipeline is not None:
            self.pipeline.load_optimizer_state(self.optimizer, state["optimizer"], source=source)
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.tensor_parallel:  # each rank keeps its shards of the unsplit state
            from .parallel.tensor import shard_optimizer_state_

            shard_optimizer_state_(self.model, self.optimizer)
        # An elastic job reads its schedule at a position in steps of the current world
        # (ElasticState.schedule_position), so after a world-size change the schedule must be
        # the one fit builds for this world, not the saved one of the old world.
        rescheduled = not same_world and any(hasattr(h, "schedule_position") for h in self.hooks)
        if rescheduled and self.schedule_config is not None:
            self._schedule_state = None  # the one fit built (or builds) for this world stays
        elif state["lr_schedule"] is not None and self.schedule_config is not None:
            if self.lr_schedule is None:  # resumed before fit built it: loaded once it is
                self._schedule_state = state["lr_schedule"]
            else:
                self.lr_schedule.load_state_dict(state["lr_schedule"])
        elif state["lr_schedule"] is not None and hasattr(self.lr_schedule, "load_state_dict"):
            self.lr_schedule.load_state_dict(state["lr_schedule"])  # type: ignore[union-attr]
        if self.scaler is not None and state["scaler"] is not None:
            self.scaler.load_state_dict(state["scaler"])
        self.epoch = int(state["epoch"])
        self.global_step = int(state["step"])
        self.epoch_samples = int(state["epoch_samples"])
        self.epoch_step = int(state["epoch_step"])
        self._epoch_seconds = float(state["epoch_seconds"])
        self.last_eval = dict(state["last_eval"])
        self.last_epoch = dict(state["last_epoch"])
        self._last_eval_step = state.get("last_eval_step")  # absent in older checkpoints
        self.nonfinite_skipped = [int(s) for s in state.get("nonfinite_skipped", [])]
        for hook, hook_state in zip(self.hooks, state["hooks"], strict=False):
            if hook_state is not None and hasattr(hook, "load_state_dict"):
                hook.load_state_dict(hook_state)

        if same_world:
            own = ranks[self.env.rank]
            _set_rng_state(own["rng"], self.env.device)
            self.combiner.load_state_dict(own["combiner"])
            self._interval.load_state_dict(own["interval"])
            self._epoch_meter.load_state_dict(own["epoch_meter"])
        else:
            self.env.seed_everything(derive_seed(self.config.seed, self.global_step) % 2**31)
            parts = [r for r in ranks if r is not None]
            self.combiner.load_other_world([r["combiner"] for r in parts])
            keep = self.env.is_main
            self._interval.load_state_dict(_Meter.merged([r["interval"] for r in parts], keep))
            self._epoch_meter.load_state_dict(
                _Meter.merged([r["epoch_meter"] for r in parts], keep)
            )
        self._last_saved_step = self.global_step
