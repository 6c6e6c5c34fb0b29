"""Elastic training: workers leave and join, training goes on, nothing is lost.

Two engines. Launched by ``python -m trainers.elastic inproc`` (:mod:`trainers.recovery`),
the workers are plain processes that never restart: on a membership change the survivors
re-form the process group and go on from their last in-memory commit (:meth:`ElasticState.
recover`, called by :meth:`Trainer.fit`), and a newcomer receives the state from a member
(docs/elastic.md). Otherwise the engine is ``torchrun``'s elastic agent (``--nnodes=MIN:MAX --max-restarts=R
--rdzv-backend=c10d``). On any membership change (a worker dies, a node leaves, a node
joins) the agents stop **every** worker and start new processes with new ``RANK`` and
``WORLD_SIZE``. Nothing held in a worker's memory survives that, so a worker group must come
back from disk. :class:`ElasticState` makes that automatic for the :class:`~trainers.Trainer`
(Horovod's ``elastic.TorchState`` is the model for the API):

* :meth:`ElasticState.commit` -- a cheap in-memory snapshot (model, optimizer, schedule,
  progress, this rank's RNG states) every ``commit_steps`` optimizer steps;
  :meth:`ElasticState.restore` goes back to it inside the same process (for failures that
  do not take the process down, e.g. an exception caught around :meth:`Trainer.fit`).
* :meth:`ElasticState.save` -- a durable checkpoint ``<directory>/state.pt`` every
  ``checkpoint_steps`` steps, written atomically by rank 0 (temp file, fsync, rename: a
  worker killed while writing leaves the previous file intact).
* When :meth:`Trainer.fit` starts and ``state.pt`` exists, every rank loads it: the run
  continues from the committed step with the new world size, the rest of the epoch's fixed
  permutation is re-split over the new ranks (:class:`~trainers.data.ShardedSampler`'s
  ``start``), the learning rate follows the rule below, and rank 0 writes a ``membership``
  record to the run log.

**What can be lost**: the optimizer steps after the last durable checkpoint (fewer than
``checkpoint_steps``), plus the restart time. Their samples are not lost: the committed
position in the epoch is where the new workers resume, so the samples of uncommitted steps
are used again, and each sample's *committed* use in an epoch is exactly once. The sample
ledger (one JSONL per rank and worker generation, :func:`committed_samples`) records the
ids each step consumed and shows it.

**Learning rate across membership changes (Dynamic SGD)**, after Lin et al., "Dynamic
Mini-batch SGD for Elastic Distributed Training" (2019). Let ``W_ref`` be the world size
the job started with (the recipe's ``--lr`` is for that global batch) and ``W`` the current
one. The target factor on the schedule's lr is ``W / W_ref`` (linear scaling: the global
batch is ``batch_size x accumulate x W``) or ``1`` (``lr_scaling="none"``, for Adasum, which
needs no scaling). On a change at step ``g`` the factor moves linearly from its value at
step ``g - 1`` to the new target over ``ramp_steps`` optimizer steps::

    factor(t) = f_from + (f_to - f_from) * min(1, (t - g + 1) / ramp_steps)   (t >= g)

so the ``ramp_steps``-th step after the change uses the target (``ramp_steps = 0``: at once).
Example, 2 -> 3 workers, ``W_ref = 2``, 4 ramp steps: 1.125, 1.25, 1.375, 1.5, 1.5, ...

The schedule itself (warm-up, cosine, ...) is a function of the step built by the script
for the *current* world size; to keep its progress in epochs continuous, its argument
becomes ``t + offset`` where the offset is updated on each change so that the position in
samples is kept (``(g + offset_old) * W_old / W_new - g``). Without a change the offset is 0
and the schedule sees exactly the step it sees without elastic training. The trainer asks the
state for both (``schedule_position`` and ``lr_factor``, see :meth:`Trainer.lr_at`).

**Momentum buffers**: torch's ``SGD`` (also Nesterov) keeps ``b = mu b + g`` and applies
``lr`` at the update, Adam/AdamW/LAMB/LANS keep moments of gradients: none folds ``lr``
into its state, so nothing needs compensating. Optimizers that do (MXNet-style ``m = mu m
- lr g; w += m``, many LARS implementations) get those state tensors rescaled by
``lr_new / lr_old`` at every step of the ramp (Goyal et al.'s momentum correction), which
keeps their updates equal to the unfolded form's. Declare them with
:func:`register_folded_momentum` or a class attribute ``folds_lr_into = ("momentum",)``.

**Rendezvous**: the c10d store must outlive the workers: run it apart
(``python -m trainers.elastic store --port 29400``) or on a node that never leaves, and
launch with ``python -m trainers.elastic torchrun ...`` (torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: a fresh worker store each round). An
:class:`ElasticState` refuses to start under a torchrun that shares one store across rounds
(:func:`trainers.dist.check_launch`); see docs/elastic.md for why and for the timeouts.
Under torchrun it also starts the peer watchdog (:class:`trainers.dist.PeerWatchdog`): a
rank whose peer or store goes silent for ``MODELZOO_PEER_TIMEOUT`` seconds (default 5)
exits, so that a network partition costs seconds instead of the collective timeout.

Example:
    >>> trainer = Trainer(model, optimizer, config, train_step=step, lr_schedule=schedule)
    >>> ElasticState(trainer, "/shared/job42", checkpoint_steps=50, ramp_steps=100)
    >>> trainer.fit(train_set, eval_dataset=val_set)  # resumes from /shared/job42 if needed
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from .checkpoint import load_checkpoint, save_checkpoint
from .data import ShardedSampler
from .dist import check_launch, peer_timeout, start_peer_watchdog
from .recovery import MembershipChange, RecoveryError, flag_from_rank0, is_peer_failure
from .recovery import active as active_membership

if TYPE_CHECKING:
    from .trainer import Trainer

__all__ = [
    "LEDGER_DIR",
    "LR_SCALING_MODES",
    "STATE_FILE",
    "ElasticState",
    "LRRamp",
    "committed_samples",
    "folded_momentum_keys",
    "register_folded_momentum",
    "repair_run_log",
    "rescale_folded_momentum",
    "serve_store",
    "target_lr_factor",
]

LR_SCALING_MODES = ("linear", "none")
STATE_FILE = "state.pt"
LEDGER_DIR = "ledger"
_FORMAT = 1


# -- the learning-rate rule -----------------------------------------------------------------
@dataclass(frozen=True)
class LRRamp:
    """A linear ramp of the lr factor: ``start_factor`` before ``start_step``, ``end_factor``
    from step ``start_step + steps - 1`` on (0-based optimizer steps); see the module docstring.
    """

    start_step: int = 0
    start_factor: float = 1.0
    end_factor: float = 1.0
    steps: int = 0

    def factor(self, step: int) -> float:
        """The lr factor of the 0-based optimizer step ``step``."""
        if step < self.start_step:
            return self.start_factor
        if self.steps <= 0:
            return self.end_factor
        done = min(1.0, (step - self.start_step + 1) / self.steps)
        return self.start_factor + (self.end_factor - self.start_factor) * done

    def after_change(self, step: int, target: float, steps: int) -> LRRamp:
        """The ramp for a membership change before step ``step``: from the factor of step
        ``step - 1`` (wherever this ramp was) to ``target`` over ``steps`` steps."""
        return LRRamp(step, self.factor(step - 1), float(target), int(steps))


def target_lr_factor(world_size: int, reference_world_size: int, scaling: str) -> float:
    """The lr factor a world of ``world_size`` ranks ramps to: ``W / W_ref`` or ``1``."""
    if scaling not in LR_SCALING_MODES:
        raise ValueError(f"lr scaling must be one of {LR_SCALING_MODES}, got {scaling!r}")
    return world_size / reference_world_size if scaling == "linear" else 1.0


# -- optimizers that fold the lr into their state ------------------------------------------
_FOLDED: dict[type, tuple[str, ...]] = {}


def register_folded_momentum(optimizer_class: type, *state_keys: str) -> None:
    """Declare that ``optimizer_class`` keeps the lr inside these per-parameter state tensors.

    Example: an MXNet-style SGD whose state ``"momentum"`` is ``mu m - lr g``:
    ``register_folded_momentum(MXSGD, "momentum")``. torch's own optimizers need nothing.
    """
    if not state_keys:
        raise ValueError("name at least one state key, e.g. 'momentum_buffer'")
    _FOLDED[optimizer_class] = tuple(state_keys)


def folded_momentum_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """State keys of ``optimizer`` that fold the lr in (empty for torch's optimizers)."""
    for cls in type(optimizer).__mro__:
        if cls in _FOLDED:
            return _FOLDED[cls]
    return tuple(getattr(optimizer, "folds_lr_into", ()))


@torch.no_grad()
def rescale_folded_momentum(optimizer: torch.optim.Optimizer, ratio: float) -> int:
    """Multiply the lr-folded state tensors by ``ratio = lr_new / lr_old``; returns how many."""
    keys = folded_momentum_keys(optimizer)
    if not keys or ratio == 1.0:
        return 0
    count = 0
    for state in optimizer.state.values():
        for key in keys:
            value = state.get(key)
            if isinstance(value, torch.Tensor):
                value.mul_(ratio)
                count += 1
    return count


# -- the state -------------------------------------------------------------------------------
class ElasticState:
    """Commits, durable checkpoints and membership changes for one :class:`Trainer`.

    Creating it registers it as one of the trainer's hooks (:meth:`Trainer.add_hook`); it
    never writes the trainer's fields: the trainer asks it where to read the schedule
    (:meth:`schedule_position`) and for the lr factor (:meth:`lr_factor`), see the module
    docstring, and :meth:`Trainer.fit` drives the rest. Every rank creates one with
    the same arguments; ``directory`` must be the same shared path for every node.

    Args:
        trainer: the trainer, built with this rank's :class:`DistEnv`.
        directory: where ``state.pt`` and the ledger live; one directory per job.
        checkpoint_steps: write ``state.pt`` every this many optimizer steps (0: only at the
            end). At most ``checkpoint_steps - 1`` steps are redone after a restart.
        commit_steps: in-memory commit every this many steps (default: ``checkpoint_steps``;
            0: only explicit :meth:`commit` calls).
        ramp_steps: optimizer steps over which the lr factor moves to its new target.
        lr_scaling: ``"linear"`` (lr x W / W_ref) or ``"none"`` (Adasum).
        ledger: write the per-rank sample ledger under ``directory/ledger``.
    """

    def __init__(
        self,
        trainer: Trainer,
        directory: str | os.PathLike[str],
        *,
        checkpoint_steps: int = 50,
        commit_steps: int | None = None,
        ramp_steps: int = 100,
        lr_scaling: str = "linear",
        ledger: bool = True,
    ) -> None:
        for name, value in (
            ("checkpoint_steps", checkpoint_steps),
            ("ramp_steps", ramp_steps),
            ("commit_steps", commit_steps or 0),
        ):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if lr_scaling not in LR_SCALING_MODES:
            raise ValueError(
                f"lr_scaling must be one of {LR_SCALING_MODES}, got {lr_scaling!r} "
                "(linear for averaged gradients, none for Adasum)"
            )
        check_launch(elastic=True)  # a shared torchrun store breaks the first restart
        self.trainer = trainer
        self.directory = Path(directory)
        self.path = self.directory / STATE_FILE
        self.checkpoint_steps = int(checkpoint_steps)
        self.commit_steps = self.checkpoint_steps if commit_steps is None else int(commit_steps)
        self.ramp_steps = int(ramp_steps)
        self.lr_scaling = lr_scaling
        self.ledger = ledger

        # Job state (in every checkpoint through state_dict()).
        self.reference_world_size = trainer.env.world_size
        self.ramp = LRRamp()
        self.schedule_offset = 0.0
        self.restarts = 0  # worker groups that resumed from state.pt
        self.finished = False
        self.finished_at: float | None = None  # wall-clock time of the final save

        self.restored_step: int | None = None  # where this worker group started
        self.load_seconds = 0.0  # time load() took
        self.last_saved_step: int | None = None
        self.run_id: str | None = None  # this worker group's ledger id (set by fit)
        self._committed: dict[str, Any] | None = None
        self._restores = 0
        self._rescaled_step: int | None = None
        self._ledger_file: IO[str] | None = None
        self._ledger_batches: Any = None
        self._ledger_left = 0

        self._check_lr()
        # In-process recovery (python -m trainers.elastic inproc; trainers.recovery): the
        # group is re-formed inside the running processes instead of by torchrun.
        self.membership = active_membership()
        self._last_step_end: float | None = None  # the collectives' timeout (recovery.adapt)
        self._step_intervals = 0
        self._slowest = 0.0
        self.recoveries: list[dict[str, float]] = []  # their phases, in seconds
        if self.membership is not None:
            self._check_in_process()
        trainer.add_hook(self)
        # A partition must cost seconds, not the 30-minute collective timeout: give up on a
        # silent peer so that torchrun re-forms the group without it (trainers.dist).
        self.watchdog = (
            None
            if self.membership is not None  # its heartbeats and collective timeout do that
            else start_peer_watchdog(trainer.env, peer_timeout(elastic=True))
        )

    @staticmethod
    def has_checkpoint(directory: str | os.PathLike[str]) -> bool:
        """Whether ``directory`` holds a durable state to resume from."""
        return (Path(directory) / STATE_FILE).is_file()

    # -- the Horovod-style API ---------------------------------------------------------------
    def commit(self) -> None:
        """Snapshot the trainer in memory (this rank only, no communication)."""
        self._committed = copy.deepcopy(self.trainer.local_state_dict())

    def restore(self) -> None:
        """Go back to the last :meth:`commit` in this process; call it between ``fit`` calls.

        For failures that leave the process alive (an exception out of ``fit``); a worker
        group that torchrun restarts comes back from :meth:`save`'s file instead.
        """
        if self._committed is None:
            raise RuntimeError("nothing to restore: no commit() yet in this process")
        self.trainer.load_state_dict(copy.deepcopy(self._committed), source="in-memory commit")
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self._rescaled_step = None
        self._restores += 1
        if self.run_id is not None:  # a new ledger generation: later steps are redone
            self._start_generation(self.trainer.global_step, f"{self.run_id}.r{self._restores}")

    def save(self) -> Path:
        """Write the durable checkpoint (a collective: every rank calls it; rank 0 writes)."""
        state = self.trainer.state_dict()
        if state is not None:
            save_checkpoint(self.path, state)
        self.last_saved_step = self.trainer.global_step
        return self.path

    def load(self) -> bool:
        """Continue from ``state.pt`` if it exists (every rank reads it); log the membership.

        Returns whether a state was loaded. :meth:`Trainer.fit` calls it when it starts.
        """
        if not self.path.is_file():
            return False
        start = time.perf_counter()
        trainer, env = self.trainer, self.trainer.env
        state = load_checkpoint(self.path)
        mine = _elastic_part(state, self.path)
        if mine["finished"]:
            if _finished_during_this_launch(mine.get("finished_at")):
                # A node joined while the job was ending and torchrun restarted its workers:
                # the job is complete, and refusing would only use up the restarts.
                print(f"[elastic] the job in {str(self.directory)!r} finished at step "
                      f"{state['step']} while torchrun restarted its workers: nothing left "
                      "to do", file=sys.stderr, flush=True)  # fmt: skip
                raise SystemExit(0)
            raise RuntimeError(
                f"the elastic job in {str(self.directory)!r} already finished at step "
                f"{state['step']}; give a new --elastic-dir (or delete this one) to train again"
            )
        old_world, new_world = int(state["world_size"]), env.world_size
        regrouped = self.membership is not None
        trainer.load_state_dict(state, source=str(self.path), regrouped=regrouped)
        self.load_seconds = time.perf_counter() - start
        self.restarts += 1
        self._changed(old_world, new_world)
        return True

    def _changed(self, old_world: int, new_world: int, **extra: Any) -> None:
        """The trainer was put back at a committed step in a group of ``new_world`` ranks:
        the lr ramp, the schedule offset and the run log's ``membership`` record."""
        trainer = self.trainer
        step = trainer.global_step
        self.restored_step = self.last_saved_step = step
        if old_world != new_world:
            self.schedule_offset = (step + self.schedule_offset) * old_world / new_world - step
            target = target_lr_factor(new_world, self.reference_world_size, self.lr_scaling)
            self.ramp = self.ramp.after_change(step, target, self.ramp_steps)
        trainer.logger.membership(
            step=step,
            old_world_size=old_world,
            new_world_size=new_world,
            restored_step=step,
            restarts=self.restarts,
            reference_world_size=self.reference_world_size,
            lr_scaling=self.lr_scaling,
            lr_ramp={
                "start_step": self.ramp.start_step,
                "steps": self.ramp.steps,
                "from_factor": self.ramp.start_factor,
                "to_factor": self.ramp.end_factor,
            },
            time=time.time(),
            **extra,
        )

    def lr_factor(self, step: int | None = None) -> float:
        """The ramp's lr factor at ``step`` (default: the next step); the trainer multiplies
        its scheduled lr by it."""
        return self.ramp.factor(self.trainer.global_step if step is None else step)

    def schedule_position(self, step: float) -> float:
        """Where the trainer reads its schedule for ``step``: the position in samples is kept
        across world-size changes (``step + schedule_offset``)."""
        return step if self.schedule_offset == 0 else step + self.schedule_offset

    # -- trainer hooks -------------------------------------------------------------------------
    def on_before_step(self, trainer: Trainer, step: int) -> None:
        """Dynamic SGD: when the lr factor changes, rescale lr-folded momentum (once a step)."""
        if self._rescaled_step == step:
            return
        previous = self.ramp.factor(step - 1)
        if step > 0 and previous > 0:
            rescale_folded_momentum(trainer.optimizer, self.ramp.factor(step) / previous)
        self._rescaled_step = step

    def on_train_start(self, trainer: Trainer) -> None:
        if self.run_id is not None:  # a later fit() in this process (e.g. after restore())
            return
        if self.membership is not None:  # in-process recovery: state from a member or disk
            self._hand_over(reason="start")
            return
        self.load()
        if trainer.env.is_main and self.directory.is_dir():
            for stale in self.directory.glob(f".{STATE_FILE}.*.tmp"):  # a writer that died
                stale.unlink(missing_ok=True)
        if self.restored_step is None:
            self.restored_step = trainer.global_step
        env = trainer.env
        token = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}" if env.is_main else None
        self._start_generation(self.restored_step, env.broadcast_object(token))

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        sampler = trainer.train_sampler
        if self._ledger_file is None or sampler is None:
            return
        replica = ShardedSampler(
            sampler.num_samples,
            batch_size=sampler.batch_size,
            world_size=sampler.world_size,
            rank=sampler.rank,
            seed=sampler.seed,
            epoch=sampler.epoch,
            start=sampler.start,
            drop_last=sampler.drop_last,
            shuffle=sampler.shuffle,
            with_epoch=False,
        )
        self._ledger_batches = iter(replica)
        self._ledger_left = len(sampler.global_batch_sizes())

    def on_step_end(self, trainer: Trainer, step: int) -> None:
        self._ledger_step(step)
        if self.membership is not None:  # size the collectives' timeout from the steps
            # (evaluations are left out: every rank evaluates its equal share, so they add
            # no wait inside a collective; rank 0's saves are in, the others wait for them)
            now = time.perf_counter() - trainer.paused_seconds
            if self._last_step_end is not None:
                self._step_intervals += 1
                if self._step_intervals > 2:  # after a newcomer's first (slow) steps
                    self._slowest = max(self._slowest, now - self._last_step_end)
                    self.membership.adapt(self._slowest)
            self._last_step_end = now
        committed = bool(self.commit_steps) and step % self.commit_steps == 0
        if committed:
            self.commit()
        if self.checkpoint_steps and step % self.checkpoint_steps == 0:
            self.save()
        if committed and self.membership is not None:
            # Rank 0 asks the store whether a newcomer waits; every rank follows its answer.
            waiting = trainer.env.is_main and self.membership.newcomer_waiting()
            if flag_from_rank0(waiting):
                raise MembershipChange(f"a newcomer waits at step {step}")

    # -- in-process recovery ---------------------------------------------------------------------
    def recover(self, trainer: Trainer, exc: BaseException) -> bool:
        """Re-form the group after ``exc`` (a peer failure, or a newcomer at a commit) and
        put every member back at the latest commit any of them holds; False: not ours.

        Called by :meth:`Trainer.fit` with an exception out of its loop. The phases (seconds)
        are appended to :attr:`recoveries` and printed on stderr.
        """
        if self.membership is None or not is_peer_failure(exc):
            return False
        failed_at = time.time()
        started = time.perf_counter()
        reason = "newcomer" if isinstance(exc, MembershipChange) else "failure"
        for _attempt in range(8):  # a peer may fail again while the group re-forms
            try:
                formed = self.membership.reform()
                timing = dict(self.membership.last_timing)
                trainer.env.regroup(formed.rank, formed.world_size)
                mark = time.perf_counter()
                trainer.regroup()
                timing["rewrap"] = time.perf_counter() - mark
                timing.update(self._hand_over(reason=reason))
                break
            except Exception as again:  # noqa: BLE001
                if not is_peer_failure(again):
                    raise
                print(f"[recovery] the group failed again while re-forming ({again}); "
                      "once more", file=sys.stderr, flush=True)  # fmt: skip
        else:
            raise RecoveryError("the group could not be re-formed in 8 attempts")
        timing["total"] = time.perf_counter() - started
        self.recoveries.append(timing)
        if self._ledger_file is not None:  # when and how long, for bench_elastic.py
            self._ledger_write(
                {
                    "kind": "recovery",
                    "run": self.run_id,
                    "rank": trainer.env.rank,
                    "reason": reason,
                    "member": self.membership.id,
                    # the lab node (trainers.netlab sets it), for the partition drill's timeline
                    "node": _int_or_none(os.environ.get("MODELZOO_NETLAB_NODE")),
                    "failed_at": failed_at,
                    "phases": timing,
                    "time": time.time(),
                }
            )
        print(
            f"[recovery] rank {trainer.env.rank} of {trainer.env.world_size} goes on at step "
            f"{trainer.global_step} ({reason}): "
            + ", ".join(f"{k} {v:.3f} s" for k, v in timing.items()),
            file=sys.stderr,
            flush=True,
        )
        return True

    def _hand_over(self, *, reason: str) -> dict[str, float]:
        """Every member of a new group: agree on the latest commit any member holds, send it
        to the members that lack it, load it (as after a world-size change), start a new
        ledger generation and commit. With no commit anywhere (the job starts, or every
        member is new): ``state.pt`` if it exists, else a fresh start."""
        trainer, env = self.trainer, self.trainer.env
        start = time.perf_counter()
        mine = -1 if self._committed is None else int(self._committed["step"])
        steps = env.all_gather_object(mine)
        best = max(steps)
        sent = 0.0
        if best < 0:
            self.load()
        else:
            source = steps.index(best)
            state = self._committed
            if any(s != best for s in steps):
                mark = time.perf_counter()
                state = env.broadcast_object(state if env.rank == source else None, src=source)
                sent = time.perf_counter() - mark
            assert state is not None
            old_world = int(state["world_size"])
            trainer.load_state_dict(copy.deepcopy(state), source="a member's commit",
                                    regrouped=True)  # fmt: skip
            trainer.optimizer.zero_grad(set_to_none=True)
            self._changed(
                old_world, env.world_size, in_process=True, reason=reason, source_rank=source
            )
        restored = time.perf_counter()
        token = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}" if env.is_main else None
        self._start_generation(trainer.global_step, env.broadcast_object(token))
        self.commit()
        self._last_step_end, self._step_intervals = None, 0  # measured afresh (adapt)
        return {"transfer": sent, "restore": restored - start - sent}

    def _check_in_process(self) -> None:
        trainer = self.trainer
        if not getattr(trainer.combiner, "regroups_in_process", False):
            from .comm import combiner_class, list_combiners  # noqa: PLC0415

            able = [n for n in list_combiners() if combiner_class(n).regroups_in_process]
            raise ValueError(
                f"in-process recovery does not re-form --grad-combine {trainer.combiner.name} "
                f"yet (it does {', '.join(able)}); launch this mode with python -m "
                "trainers.elastic torchrun"
            )
        if trainer.tensor_parallel or trainer.pipeline is not None:
            raise ValueError(
                "in-process recovery keeps each member's state in memory, which a tensor- or "
                "pipeline-parallel model spreads over ranks; use python -m trainers.elastic "
                "torchrun"
            )
        if not self.commit_steps:
            raise ValueError("in-process recovery needs commits: commit_steps must be > 0")

    def on_train_end(self, trainer: Trainer, metrics: Mapping[str, float]) -> None:
        if self.membership is not None:  # a death during the final save: back to the end
            self.commit()
        self.finished = True
        self.finished_at = time.time()
        self.save()
        if self._ledger_file is not None:
            self._ledger_file.close()
            self._ledger_file = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "elastic": _FORMAT,
            "reference_world_size": self.reference_world_size,
            "ramp": asdict(self.ramp),
            "schedule_offset": self.schedule_offset,
            "lr_scaling": self.lr_scaling,
            "restarts": self.restarts,
            "finished": self.finished,
            "finished_at": self.finished_at,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("elastic") != _FORMAT:
            raise ValueError(
                f"not an ElasticState state (keys {sorted(state)}); the trainer's hooks must be "
                "created in the same order as when the checkpoint was written"
            )
        self.reference_world_size = int(state["reference_world_size"])
        self.ramp = LRRamp(**state["ramp"])
        self.schedule_offset = float(state["schedule_offset"])
        self.restarts = int(state["restarts"])
        self.finished = bool(state["finished"])
        self.finished_at = state.get("finished_at")
        self._rescaled_step = None

    # -- internals -------------------------------------------------------------------------------
    def _check_lr(self) -> None:
        """The trainer's schedule must let the lr factor apply (see :meth:`Trainer.lr_at`)."""
        trainer = self.trainer
        schedule = trainer.lr_schedule
        if isinstance(schedule, torch.optim.lr_scheduler.LRScheduler):
            if self.lr_scaling == "linear":
                raise ValueError(
                    "elastic lr scaling needs a schedule that is a function of the step "
                    "(e.g. trainers.schedules.LRSchedule), not a torch LRScheduler; pass "
                    "one, or use lr_scaling='none'"
                )
            return
        if schedule is None and trainer.schedule_config is None and self.lr_scaling != "none":
            groups = trainer.optimizer.param_groups
            base_lrs = {g["lr"] / g.get("lr_scale", 1.0) for g in groups}
            if len(base_lrs) > 1:
                raise ValueError(
                    "parameter groups have different learning rates and no 'lr_scale'; give "
                    "the trainer an lr_schedule or set lr_scale on the groups"
                )

    def _start_generation(self, restored_step: int, run_id: str) -> None:
        self.run_id = run_id
        if not self.ledger:
            return
        env = self.trainer.env
        ledger_dir = self.directory / LEDGER_DIR
        ledger_dir.mkdir(parents=True, exist_ok=True)
        if self._ledger_file is not None:
            self._ledger_file.close()
        self._ledger_file = open(  # noqa: SIM115 (closed in on_train_end)
            ledger_dir / f"{run_id}.rank{env.rank}.jsonl", "a", encoding="utf-8"
        )
        self._ledger_write(
            {
                "kind": "start",
                "run": run_id,
                "rank": env.rank,
                "pid": os.getpid(),
                "world_size": env.world_size,
                "restored_step": int(restored_step),
                "load_seconds": self.load_seconds,
                "time": time.time(),
            }
        )

    def _ledger_step(self, step: int) -> None:
        if self._ledger_file is None or self._ledger_batches is None:
            return
        trainer = self.trainer
        micro = min(trainer.config.grad_accum_steps, self._ledger_left)
        self._ledger_left -= micro
        ids: list[int] = []
        for _ in range(micro):
            ids.extend(int(i) for i in next(self._ledger_batches))
        self._ledger_write(
            {
                "kind": "step",
                "run": self.run_id,
                "rank": trainer.env.rank,
                "world_size": trainer.env.world_size,
                "epoch": trainer.epoch,
                "step": step,
                "ids": ids,
                "time": time.time(),
            }
        )

    def _ledger_write(self, record: Mapping[str, Any]) -> None:
        assert self._ledger_file is not None
        self._ledger_file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._ledger_file.flush()


def _int_or_none(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


def _finished_during_this_launch(finished_at: float | None) -> bool:
    """Whether the torchrun agent that started this worker (its parent) was already running
    when the job finished: then torchrun restarted the workers of a job that had just ended
    (a node joining in its last seconds), not a user relaunching a finished directory."""
    if finished_at is None or not os.environ.get("TORCHELASTIC_RUN_ID"):
        return False
    started = _process_start_time(os.getppid())
    return started is not None and started < finished_at


def _process_start_time(pid: int) -> float | None:
    """A process's start as a Unix time (Linux ``/proc``; ``None`` elsewhere)."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(
            int(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _elastic_part(state: Mapping[str, Any], path: Path) -> Mapping[str, Any]:
    for part in state.get("hooks") or ():
        if isinstance(part, Mapping) and part.get("elastic") == _FORMAT:
            return part
    raise ValueError(
        f"{str(path)!r} is a trainer checkpoint without an ElasticState; point the elastic "
        "directory at a directory written by ElasticState (or use --resume for this file)"
    )


# -- reading the ledger ------------------------------------------------------------------------
def committed_samples(directory: str | os.PathLike[str]) -> dict[int, list[int]]:
    """The sample ids whose use is committed, per epoch, from a finished job's ledger.

    Worker generations are ordered by their ids (rank 0's start time). A generation's step
    records count up to the step the later generations resumed from (the earliest of
    them): later steps were not committed and were done again. ``directory`` is the elastic
    directory or its ``ledger`` folder. A torn last line (a killed writer) is ignored.
    """
    root = Path(directory)
    ledger = root / LEDGER_DIR if (root / LEDGER_DIR).is_dir() else root
    runs: dict[str, dict[str, Any]] = defaultdict(lambda: {"restored": None, "steps": []})
    for path in sorted(ledger.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            run = runs[record["run"]]
            if record["kind"] == "start":
                run["restored"] = int(record["restored_step"])
            elif record["kind"] == "step":
                run["steps"].append((int(record["epoch"]), int(record["step"]), record["ids"]))
    order = sorted(runs)
    samples: dict[int, list[int]] = defaultdict(list)
    for i, run_id in enumerate(order):
        later = [runs[r]["restored"] for r in order[i + 1 :] if runs[r]["restored"] is not None]
        limit = min(later) if later else math.inf
        for epoch, step, ids in sorted(runs[run_id]["steps"], key=lambda s: s[1]):
            if step <= limit:
                samples[epoch].extend(ids)
    return dict(samples)


# -- run logs across restarts --------------------------------------------------------------
def repair_run_log(path: str | os.PathLike[str]) -> bool:
    """Drop a torn last line (a rank 0 killed mid-write) so the log can be appended to.

    Returns whether the file exists and holds records (then append to it, no new header).
    """
    path = Path(path)
    if not path.is_file():
        return False
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        data = data[: data.rfind(b"\n") + 1]
        with open(path, "r+b") as f:
            f.truncate(len(data))
    return bool(data.strip())


# -- a rendezvous store that outlives the workers ------------------------------------------
def serve_store(host: str = "0.0.0.0", port: int = 29400) -> torch.distributed.TCPStore:
    """Host a c10d ``TCPStore`` for torchrun's rendezvous (``--rdzv-conf is_host=false``).

    The store holds the rendezvous state; the process hosting it must outlive every
    membership change. Keep the returned object alive.
    """
    return torch.distributed.TCPStore(host, port, is_master=True, wait_for_workers=False)


def torchrun(argv: list[str]) -> None:
    """torchrun with a fresh worker store every rendezvous round.

    ``python -m trainers.elastic torchrun ARGS`` is ``torchrun ARGS`` with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` in the agent's environment: torch 2.13's agents
    otherwise keep the first round's store server for every later round, and a restarted
    worker can read the previous group's gloo addresses (docs/elastic.md).
    """
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    from torch.distributed.run import main as torchrun_main

    torchrun_main(argv)


def inproc(argv: list[str]) -> int:
    """``python -m trainers.elastic inproc --store H:P --job ID --nodes MIN:MAX -- SCRIPT ...``:
    run SCRIPT as member(s) of an in-process-recovering job (:mod:`trainers.recovery`).

    Sets ``MODELZOO_RECOVERY_STORE``/``_JOB``/``_NODES`` and runs ``--nproc-per-node``
    copies of the script (default 1: the script replaces this process). Returns the exit
    status (the worst of the copies)."""
    from .recovery import ENV_JOB, ENV_NODES, ENV_STORE, parse_nodes

    parser = argparse.ArgumentParser(
        prog="python -m trainers.elastic inproc",
        description="Run a training script as member(s) of a job that recovers in process: "
        "a member that dies or is cut off costs the others a re-formed process group, not a "
        "restart; a new member joins at the group's next commit.",
    )
    parser.add_argument(
        "--store",
        required=True,
        metavar="HOST:PORT",
        help="the job's c10d store (python -m trainers.elastic store)",
    )
    parser.add_argument("--job", required=True, help="the job's name (its keys in the store)")
    parser.add_argument(
        "--nodes",
        default="1:64",
        metavar="MIN:MAX",
        help="members the job needs / takes at most (default 1:64)",
    )
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="N",
        help="members started by this command (default 1)",
    )
    parser.add_argument("script", help="the training script (python file)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)  # fmt: skip
    args = parser.parse_args(argv[1:] if argv[:1] == ["--"] else argv)
    host, _, port = args.store.rpartition(":")
    if not host or not port.isdigit():
        parser.error(f"--store {args.store!r}: give HOST:PORT, e.g. 10.0.0.1:29400")
    try:
        parse_nodes(args.nodes)
    except ValueError as exc:
        parser.error(str(exc))
    if args.nproc_per_node < 1:
        parser.error(f"--nproc-per-node {args.nproc_per_node}: give 1 or more")
    if not Path(args.script).is_file():
        parser.error(f"script {args.script!r} not found")
    os.environ.update({ENV_STORE: args.store, ENV_JOB: args.job, ENV_NODES: args.nodes})
    rest = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    command = [sys.executable, args.script, *rest]
    if args.nproc_per_node == 1:
        os.execv(sys.executable, command)
    import subprocess  # noqa: PLC0415

    children = [subprocess.Popen(command) for _ in range(args.nproc_per_node)]
    try:
        return max(child.wait() for child in children)
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["torchrun"]:
        torchrun(argv[1:])
        return
    if argv[:1] == ["inproc"]:
        raise SystemExit(inproc(argv[1:]))
    parser = argparse.ArgumentParser(
        prog="python -m trainers.elastic",
        description="Host the c10d rendezvous store of an elastic job until interrupted "
        "(store), launch torchrun safely for elastic jobs (torchrun ARGS: torchrun's own "
        "arguments, with a fresh worker store every rendezvous round), or run a script as "
        "a member of a job that recovers in process (inproc --help).",
    )
    parser.add_argument("command", choices=["store", "torchrun", "inproc"])
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=29400)
    args = parser.parse_args(argv)
    store = serve_store(args.host, args.port)
    print(f"c10d rendezvous store on {args.host}:{args.port}; Ctrl-C to stop", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    del store


if __name__ == "__main__":
    main()
