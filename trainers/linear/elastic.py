"""Elastic restarts for the linear solvers (``scripts/train_linear.py --elastic-dir DIR``).

The linear solvers run their own loops, not the :class:`~trainers.Trainer`, so they cannot
use :class:`trainers.elastic.ElasticState`; this module gives them the same contract
(docs/elastic.md, docs/linear.md "Elastic"): a durable ``DIR/state.pt`` written atomically by
rank 0 (:func:`trainers.checkpoint.save_checkpoint`) every ``checkpoint_steps`` steps and at
the end of every epoch or arriving batch; a worker group that ``torchrun`` restarts (any
world size) reads it and continues; the run log is cut back to what it held at that save,
so the redone steps are logged once, and a ``membership`` record says that the world
changed; rank 0 keeps the same per-step ledger as the Trainer (``DIR/ledger``, which
:func:`trainers.elastic.committed_samples` and :mod:`trainers.elastic_drill` read).

Why a world-size change is harmless here:

* L-BFGS is data parallel: the weights, the curvature pairs, the line-search state at an
  iteration boundary and the counters are identical on every rank, and the objective is a
  sum over all rows. The saved state is one rank's copy; the new world re-shards the rows
  and continues the same iterates up to the summation order of the all-reduce.
* SGD / CA-SGD are feature partitioned: each rank holds a column block of ``w``. The full
  ``w`` is gathered to rank 0 (:func:`gather_rows`) and each rank of the new world takes its
  new block (:func:`~trainers.linear.column_blocks`). The mini-batch sequence is a function of
  ``(seed, epoch)`` (:func:`~trainers.linear.epoch_batches`), so the saved (epoch, next
  mini-batch) position continues it exactly. The step size never depends on the world size
  (the mini-batch is global), so nothing is rescaled.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from ..checkpoint import load_checkpoint, save_checkpoint
from ..dist import DistEnv, UnsafeLaunchError, check_launch, peer_timeout, start_peer_watchdog
from ..elastic import LEDGER_DIR, STATE_FILE, repair_run_log

__all__ = ["FORMAT", "ElasticStateMismatch", "LinearElastic", "gather_rows", "open_linear_elastic"]

FORMAT = "train_linear/1"  # the ``format`` field of a linear solver's state.pt


class ElasticStateMismatch(ValueError):
    """``state.pt`` was written by another job (solver, data or model configuration)."""


def gather_rows(block: torch.Tensor, world_size: int, dst: int = 0) -> torch.Tensor | None:
    """The row blocks of every rank stacked in rank order, on ``dst`` (None elsewhere).

    A collective when ``world_size > 1``. Blocks may differ in rows by any amount (they
    are padded for the transfer); the trailing dimensions must agree.
    """
    if world_size == 1:
        return block.clone()
    rows = torch.tensor([block.shape[0]], dtype=torch.int64)
    sizes = [torch.zeros_like(rows) for _ in range(world_size)]
    dist.all_gather(sizes, rows)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros((longest, *block.shape[1:]), dtype=block.dtype)
    padded[: block.shape[0]] = block
    is_dst = dist.get_rank() == dst
    parts = [torch.empty_like(padded) for _ in range(world_size)] if is_dst else None
    dist.gather(padded, parts, dst=dst)
    if not is_dst:
        return None
    assert parts is not None
    return torch.cat([p[: int(n)] for p, n in zip(parts, sizes, strict=True)])


class LinearElastic:
    """``DIR/state.pt`` of one train_linear job: read, check, save, and the log's continuity.

    Every rank creates one with the same arguments. The caller's state (what the solver
    needs to continue, and where in its loop it is) is an opaque mapping of tensors and
    plain containers; this class adds the job's bookkeeping around it.

    Args:
        directory: the job's elastic directory (shared by every node).
        rank, world_size: this process in the current world.
        identity: the flags and data shape that fix the trajectory (solver, data set, loss,
            λ, step sizes, batch order, ...); a saved state with any other value is refused.
        checkpoint_steps: save every this many steps (L-BFGS iterations, mini-batches).
        ledger: rank 0 writes ``DIR/ledger/<run>.rank0.jsonl`` (start and step records).
        run_log: the run log's path (rank 0 cuts it back to the saved length on a resume).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        rank: int,
        world_size: int,
        identity: Mapping[str, Any],
        checkpoint_steps: int = 50,
        ledger: bool = True,
        run_log: str | os.PathLike[str] | None = None,
    ) -> None:
        if checkpoint_steps < 1:
            raise ValueError(f"checkpoint_steps must be at least 1, got {checkpoint_steps}")
        self.directory = Path(directory)
        self.path = self.directory / STATE_FILE
        self.rank, self.world_size = rank, world_size
        self.identity = dict(identity)
        self.checkpoint_steps = int(checkpoint_steps)
        self.ledger = ledger
        self.run_log = Path(run_log) if run_log is not None else None
        self.reference_world_size = world_size  # the world the job started with
        self.restarts = 0
        self.saved: dict[str, Any] | None = None  # the last state this process saved or read
        self.load_seconds = 0.0
        self._ledger_file: IO[str] | None = None
        self.run_id: str | None = None

    # -- reading ---------------------------------------------------------------------------------
    def read(self) -> dict[str, Any] | None:
        """The saved job state, checked against this job, or None when there is none yet.

        Raises:
            ElasticStateMismatch: another job's state (the message names the file and the
                first field that differs), a job that already finished, or a file that is
                not a train_linear state.
            trainers.checkpoint.CheckpointError: the file is unreadable.
        """
        if not self.path.is_file():
            return None
        start = time.perf_counter()
        state = load_checkpoint(self.path)
        where = str(self.path)
        if state.get("format") != FORMAT:
            raise ElasticStateMismatch(
                f"{where} is not a train_linear elastic state (format {state.get('format')!r}, "
                f"expected {FORMAT!r}); give this job its own --elastic-dir"
            )
        saved = state["identity"]
        for key in [*saved, *(k for k in self.identity if k not in saved)]:  # solver first
            if saved.get(key) != self.identity.get(key):
                raise ElasticStateMismatch(
                    f"{where} was saved by a job with {key}={saved.get(key)!r}, this job has "
                    f"{key}={self.identity.get(key)!r}; resume with the same flags and data, "
                    "or give a new --elastic-dir"
                )
        if state["finished"]:
            raise ElasticStateMismatch(
                f"{where}: this elastic job already finished at step {state['step']}; give a "
                "new --elastic-dir (or delete this one) to train again"
            )
        self.reference_world_size = int(state["reference_world_size"])
        self.restarts = int(state["restarts"]) + 1
        self.saved = state
        self.load_seconds = time.perf_counter() - start
        return state

    def resume_run_log(self, state: Mapping[str, Any] | None) -> bool:
        """Rank 0: make the run log continue at the saved state; whether to append to it.

        The records after the save belong to steps the new world redoes: the log is cut
        back to its length at the save (a torn last line goes too). Without a saved state,
        or without an existing log, a new log is started (False).
        """
        if state is None or self.run_log is None or self.rank != 0:
            return False
        if not repair_run_log(self.run_log):
            return False
        length, saved = self.run_log.stat().st_size, state.get("run_log_bytes")
        if saved is None:
            return True
        if length < saved:
            raise ElasticStateMismatch(
                f"run log {str(self.run_log)!r} has {length} bytes, but {self.path} was saved when "
                f"it had {saved}: it is not this job's log; pass the job's --run-log"
            )
        with open(self.run_log, "r+b") as f:
            f.truncate(saved)
        return True

    # -- writing ---------------------------------------------------------------------------------
    def due(self, before: int, after: int) -> bool:
        """Whether the steps ``before -> after`` crossed a multiple of ``checkpoint_steps``."""
        return after // self.checkpoint_steps > before // self.checkpoint_steps

    def save(self, state: Mapping[str, Any], *, step: int, finished: bool = False) -> None:
        """Rank 0 writes ``state`` (plus the job's bookkeeping) atomically; the others only
        remember it. Call it after the records of the steps it covers are in the run log."""
        record = {
            "format": FORMAT,
            "identity": self.identity,
            "step": int(step),
            "world_size": self.world_size,
            "reference_world_size": self.reference_world_size,
            "restarts": self.restarts,
            "finished": finished,
            "run_log_bytes": None,
            "time": time.time(),
            **state,
        }
        self.saved = record
        if self.rank != 0:
            return
        if self.run_log is not None and self.run_log.is_file():
            record["run_log_bytes"] = self.run_log.stat().st_size
        save_checkpoint(self.path, record)

    def finish(self) -> None:
        """Mark the job finished (a later start with this directory is refused)."""
        if self.saved is not None:
            self.save({k: v for k, v in self.saved.items() if k not in _BOOKKEEPING},
                      step=self.saved["step"], finished=True)  # fmt: skip
        if self._ledger_file is not None:
            self._ledger_file.close()
            self._ledger_file = None

    # -- the run log and the ledger -----------------------------------------------------------
    def start(self, logger: Any, state: Mapping[str, Any] | None) -> None:
        """After :meth:`read`: clean a dead writer's temp files, log the membership (when
        resuming) and open this worker group's ledger. Rank 0 only writes."""
        if self.rank != 0:
            return
        if self.directory.is_dir():
            for stale in self.directory.glob(f".{STATE_FILE}.*.tmp"):  # a writer that died
                stale.unlink(missing_ok=True)
        step = 0
        if state is not None:
            step = int(state["step"])
            logger.membership(
                step=step,
                old_world_size=int(state["world_size"]),
                new_world_size=self.world_size,
                restored_step=step,
                restarts=self.restarts,
                reference_world_size=self.reference_world_size,
                lr_scaling="none",  # the step size never depends on the world size here
                time=time.time(),
            )
        if not self.ledger:
            return
        self.run_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
        ledger_dir = self.directory / LEDGER_DIR
        ledger_dir.mkdir(parents=True, exist_ok=True)
        self._ledger_file = open(  # noqa: SIM115 (closed in finish())
            ledger_dir / f"{self.run_id}.rank0.jsonl", "a", encoding="utf-8"
        )
        self._ledger_write({"kind": "start", "run": self.run_id, "rank": 0,
                            "world_size": self.world_size, "restored_step": step,
                            "load_seconds": self.load_seconds, "time": time.time()})  # fmt: skip

    def ledger_step(self, *, epoch: int, step: int, ids: torch.Tensor | list[int]) -> None:
        """Rank 0: the training rows step ``step`` used (SGD: its mini-batches' rows;
        L-BFGS: none listed, every iteration uses every row)."""
        if self._ledger_file is None:
            return
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        self._ledger_write({"kind": "step", "run": self.run_id, "rank": 0,
                            "world_size": self.world_size, "epoch": int(epoch), "step": int(step),
                            "ids": ids, "time": time.time()})  # fmt: skip

    def _ledger_write(self, record: Mapping[str, Any]) -> None:
        assert self._ledger_file is not None
        self._ledger_file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._ledger_file.flush()


_BOOKKEEPING = frozenset(
    ("format", "identity", "step", "world_size", "reference_world_size", "restarts",
     "finished", "run_log_bytes", "time")
)  # fmt: skip


def open_linear_elastic(
    directory: str | os.PathLike[str],
    env: DistEnv,
    *,
    identity: Mapping[str, Any],
    checkpoint_steps: int = 50,
    ledger: bool = True,
    run_log: str | os.PathLike[str] | None = None,
) -> tuple[LinearElastic, dict[str, Any] | None, bool]:
    """The job's :class:`LinearElastic` in ``directory`` (every rank calls it), the state to
    resume (``None``: a fresh job) and whether the run log is appended to (rank 0 cut it
    back to the save).

    As the Trainer's ElasticState, it refuses torchrun's shared store (a restart would read
    the dead group's addresses) and starts a watchdog that gives up on a silent peer (a
    partition) in seconds instead of at the 30-minute collective timeout, so that torchrun
    re-forms the group.

    Raises:
        ElasticStateMismatch: the saved state is another job's (:meth:`LinearElastic.read`).
        trainers.checkpoint.CheckpointError: the saved state is unreadable.
        trainers.dist.UnsafeLaunchError: the launcher's store is unsafe for restarts.
    """
    from ..recovery import active  # noqa: PLC0415

    if active() is not None:
        raise UnsafeLaunchError(
            "the linear learners do not recover in process (python -m trainers.elastic "
            "inproc); launch them with python -m trainers.elastic torchrun"
        )
    elastic = LinearElastic(directory, rank=env.rank, world_size=env.world_size,
                            identity=identity, checkpoint_steps=checkpoint_steps,
                            ledger=ledger, run_log=run_log)  # fmt: skip
    resume = elastic.read()  # every rank: the job's state, checked against this one
    appending = elastic.resume_run_log(resume)  # rank 0: cut the log back to the save
    check_launch(elastic=True)
    start_peer_watchdog(env, peer_timeout(elastic=True))
    return elastic, resume, appending
