"""One view of the distributed world: ranks from torchrun's environment, process-group set-up.

A script launched by ``torchrun`` finds ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT`` in
its environment; :meth:`DistEnv.from_env` reads them and initialises the default process
group (gloo on CPU, NCCL on GPU) when the world has more than one process. A script run
with plain ``python`` is a world of one: no process group, and every collective below is a
cheap local no-op, so the same code runs in both cases.

Example:
    >>> with DistEnv.from_env() as env:
    ...     env.seed_everything(0)
    ...     if env.is_main:
    ...         print(f"rank {env.rank} of {env.world_size} on {env.device}")
    rank 0 of 1 on cpu
"""

from __future__ import annotations

import dataclasses
import os
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["DistEnv"]

_REQUIRED_WHEN_DISTRIBUTED = ("MASTER_ADDR", "MASTER_PORT")


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as err:
        raise ValueError(
            f"environment variable {name}={value!r} is not an integer; it is set by torchrun, "
            "unset it or launch the script with torchrun"
        ) from err


@dataclass(frozen=True)
class DistEnv:
    """Rank, world size and device of this process; collectives that work for a world of one.

    Attributes:
        rank: global rank (0 ... world_size - 1).
        local_rank: rank within this node; selects the GPU.
        world_size: number of processes.
        local_world_size: number of processes on this node.
        restart_count: how many times the elastic agent restarted the workers
            (``TORCHELASTIC_RESTART_COUNT``; 0 on the first run).
        device: the device this rank computes on (``cuda:<local_rank>`` or ``cpu``).
        backend: the process-group backend, or ``None`` for a world of one.
        group: the process group of the collectives below; ``None``: the whole world. A
            data-parallel view (:meth:`data_parallel`) sets it to its ``dp`` group.
        global_rank: in a data-parallel view, this process's rank in the whole world (it
            decides :attr:`is_main`); ``None`` otherwise.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    restart_count: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    owns_process_group: bool = False
    group: Any = None
    global_rank: int | None = None

    @classmethod
    def from_env(cls, backend: str | None = None, *, device: str | None = None) -> DistEnv:
        """Read torchrun's environment and set up the process group when world_size > 1.

        Args:
            backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is used, else gloo.
            device: ``"cpu"`` or ``"cuda"`` to force one; default CUDA when available.

        If a default process group already exists (the caller made one), it is used as is
        and :meth:`destroy` leaves it alone. ``MODELZOO_DETERMINISTIC=1`` in the environment
        turns on ``torch.use_deterministic_algorithms`` (``scripts/reproduce.py`` sets it, with
        ``CUBLAS_WORKSPACE_CONFIG``, to rerun a CUDA log made that way; the run log's
        fingerprint records it).
        """
        if os.environ.get("MODELZOO_DETERMINISTIC") == "1":
            torch.use_deterministic_algorithms(True)
        use_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
        if use_cuda and not torch.cuda.is_available():
            raise RuntimeError("device='cuda' was requested but torch.cuda.is_available() is False")
        restart_count = _env_int("TORCHELASTIC_RESTART_COUNT", 0)

        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
            local_rank = _env_int("LOCAL_RANK", rank)
            local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
            return cls(
                rank=rank,
                local_rank=local_rank,
                world_size=world_size,
                local_world_size=local_world_size,
                restart_count=restart_count,
                device=_pick_device(use_cuda, local_rank),
                backend=dist.get_backend(),
                owns_process_group=False,
            )

        world_size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        local_rank = _env_int("LOCAL_RANK", rank if world_size > 1 else 0)
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(
                f"inconsistent torchrun environment: RANK={rank} WORLD_SIZE={world_size}; "
                "RANK must be in [0, WORLD_SIZE)"
            )
        dev = _pick_device(use_cuda, local_rank)
        if world_size == 1:
            return cls(restart_count=restart_count, device=dev)

        missing = [name for name in _REQUIRED_WHEN_DISTRIBUTED if not os.environ.get(name)]
        if missing:
            raise RuntimeError(
                f"WORLD_SIZE={world_size} but {', '.join(missing)} is not set; launch with "
                "torchrun (it sets them) or export MASTER_ADDR and MASTER_PORT"
            )
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(
            backend=backend, init_method="env://", rank=rank, world_size=world_size
        )
        return cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            restart_count=restart_count,
            device=dev,
            backend=backend,
            owns_process_group=True,
        )

    # -- properties -------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """True on rank 0 of the world, the only rank that logs and saves."""
        return (self.rank if self.global_rank is None else self.global_rank) == 0

    def data_parallel(self, mesh: Any) -> DistEnv:
        """The data-parallel view over the 1-D ``mesh`` (``mesh["dp"]`` of a ``(dp, tp)``
        mesh): rank and world size within the mesh, collectives over its group.

        What shards and averages data (samplers, metric sums, gradient averaging, seeds)
        sees the ``dp`` replicas only: the tensor-parallel ranks of one replica get the same
        batches and the same random streams. Logging and saving stay on the world's rank 0;
        :meth:`barrier` still waits for the whole world. The view owns no process group.
        """
        if mesh.ndim != 1:
            raise ValueError(f"data_parallel: expected a 1-D mesh (mesh['dp']), got {mesh}")
        return dataclasses.replace(
            self,
            rank=mesh.get_local_rank(),
            world_size=mesh.size(),
            group=mesh.get_group(),
            global_rank=self.rank if self.global_rank is None else self.global_rank,
            owns_process_group=False,
        )

    def _global(self, rank: int) -> int:
        """The world rank of ``rank`` of :attr:`group`."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    @property
    def distributed(self) -> bool:
        """True when a process group is in use (world_size > 1)."""
        return self.world_size > 1

    # -- context manager ----------------------------------------------------------------------
    def __enter__(self) -> DistEnv:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.destroy(barrier=exc_type is None)

    def destroy(self, *, barrier: bool = True) -> None:
        """Destroy the process group if :meth:`from_env` created it.

        ``barrier=True`` (the default, and a clean exit of the ``with`` block) first waits
        for every rank, so that no rank tears its gloo connections down while a peer still
        uses them (which can abort that peer at exit: "terminate called without an active
        exception"). ``barrier=False`` is for leaving after an error, when a peer may never
        arrive (the ``with`` block passes it when an exception is propagating).
        """
        if self.owns_process_group and dist.is_initialized():
            if barrier and self.distributed:
                self.barrier()
            dist.destroy_process_group()

    # -- collectives (no-ops for a world of one) -------------------------------------------
    def barrier(self) -> None:
        """Wait for every rank (of the whole world, also in a data-parallel view)."""
        whole = self.global_rank is not None and dist.is_initialized()
        if self.distributed or (whole and dist.get_world_size() > 1):
            if self.backend == "nccl":
                dist.barrier(device_ids=[self.device.index])
            else:
                dist.barrier()

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place and return it."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (picklable objects)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(
            box, src=self._global(src), group=self.group, device=self._object_device()
        )
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, indexed by rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` indexed by rank on rank ``dst``; ``None`` elsewhere."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, out, dst=self._global(dst), group=self.group)
        return out

    def _object_device(self) -> torch.device | None:
        return self.device if self.backend == "nccl" else None

    # -- seeding ------------------------------------------------------------------------------
    def seed_everything(self, seed: int) -> None:
        """Seed torch (CPU and CUDA), numpy and ``random`` with ``seed + rank``.

        Ranks get different streams (dropout differs per rank, as with independent
        workers); rank 0 of any world size gets the stream of a 1-process run.
        """
        s = int(seed) + self.rank
        random.seed(s)
        np.random.seed(s % 2**32)
        torch.manual_seed(s)  # also seeds every CUDA device

    def __repr__(self) -> str:
        return (
            f"DistEnv(rank={self.rank}, local_rank={self.local_rank}, "
            f"world_size={self.world_size}, local_world_size={self.local_world_size}, "
            f"restart_count={self.restart_count}, device={self.device}, backend={self.backend})"
        )


def _pick_device(use_cuda: bool, local_rank: int) -> torch.device:
    if use_cuda:
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")
