"""One view of the distributed world: ranks from torchrun's environment, process-group set-up.

A script launched by ``torchrun`` finds ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RESTART_COUNT`` in
its environment; :meth:`DistEnv.from_env` reads them and initialises the default process
group (gloo on CPU, NCCL on GPU) when the world has more than one process. A script run
with plain ``python`` is a world of one: no process group, and every collective below is a
cheap local no-op, so the same code runs in both cases.

Under torchrun, two guards make a multi-node job fail fast instead of hanging or going wrong:

* **Peer watchdog** (:class:`PeerWatchdog`, started by :func:`start_peer_watchdog`: by an
  :class:`~trainers.elastic.ElasticState` under torchrun, or by :meth:`DistEnv.from_env` for
  any job when ``MODELZOO_PEER_TIMEOUT`` is set): a network partition leaves a gloo collective
  blocked until the process-group timeout (30 min) on every side of the cut. Each rank bumps
  a heartbeat counter in the job's store every ``timeout / 10`` seconds and reads everyone's;
  when a peer's counter stops moving, or the store stops answering, for
  ``MODELZOO_PEER_TIMEOUT`` seconds (default 5; 0 turns it off), the rank prints one line
  and exits with :data:`PEER_LOST_EXIT_CODE`, so that torchrun's agents re-form the group
  without the silent node (docs/elastic.md, "Network partitions"). A peer whose process
  ended is not silent (its sockets close and gloo fails at once), so the watchdog only
  judges live-but-unreachable peers, and it stands down once any rank has finished.
* **Shared rendezvous store**: torchrun (2.13) by default hands every worker group the same
  store server, kept from the first rendezvous round, and torch's process group writes the
  same gloo address keys into it each time; a restarted worker can read the dead group's
  address ("Gloo connectFullMesh failed ... Connection refused"). A worker that torchrun may
  restart refuses to start in that mode and names the fix (:data:`SHARED_STORE_MESSAGE`).

Example:
    >>> with DistEnv.from_env() as env:
    ...     env.seed_everything(0)
    ...     if env.is_main:
    ...         print(f"rank {env.rank} of {env.world_size} on {env.device}")
    rank 0 of 1 on cpu
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "PEER_LOST_EXIT_CODE",
    "PEER_TIMEOUT_ENV",
    "SHARED_STORE_MESSAGE",
    "DistEnv",
    "PeerWatchdog",
    "UnsafeLaunchError",
    "check_launch",
    "peer_timeout",
    "start_peer_watchdog",
]

_REQUIRED_WHEN_DISTRIBUTED = ("MASTER_ADDR", "MASTER_PORT")

#: seconds of silence from a peer (or the store) before a rank gives up; 0 turns it off
PEER_TIMEOUT_ENV = "MODELZOO_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT = 5.0
ALLOW_SHARED_STORE_ENV = "MODELZOO_ALLOW_SHARED_STORE"
#: the exit status of a rank that lost a peer (EX_TEMPFAIL: try again; torchrun restarts it)
PEER_LOST_EXIT_CODE = 75
SHARED_STORE_MESSAGE = (
    "torchrun is sharing one rendezvous store across worker restarts "
    "(TORCHELASTIC_USE_AGENT_STORE=True), so a restarted worker can read the previous group's "
    "gloo addresses and fail ('connectFullMesh ... Connection refused', pytorch#135712): "
    "launch with 'python -m trainers.elastic torchrun ...' or set "
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for torchrun (docs/elastic.md)"
)


class UnsafeLaunchError(RuntimeError):
    """The launcher's settings would make this job fail later: the message says what to set."""


def check_launch(environ: dict[str, str] | None = None, *, elastic: bool = False) -> None:
    """Refuse a torchrun launch whose restarts would reuse the first round's store.

    Unsafe: torchrun shares its store (``TORCHELASTIC_USE_AGENT_STORE=True``, the default
    without ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) and the worker group can be started
    again: ``--max-restarts`` above 0, a restart already happened, or ``elastic`` (the caller
    knows that nodes may join or leave, e.g. an :class:`~trainers.elastic.ElasticState`).
    A one-generation job (``torchrun --nproc-per-node 4 ...``) is left alone, and so is any
    job with ``MODELZOO_ALLOW_SHARED_STORE=1`` (only to reproduce the failure).
    """
    environ = os.environ if environ is None else environ
    if environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    if environ.get(ALLOW_SHARED_STORE_ENV) == "1":  # to reproduce the failure, nothing else
        return
    restarts = _env_int("TORCHELASTIC_MAX_RESTARTS", 0, environ)
    restarted = _env_int("TORCHELASTIC_RESTART_COUNT", 0, environ)
    if elastic or restarts > 0 or restarted > 0:
        raise UnsafeLaunchError(SHARED_STORE_MESSAGE)


def peer_timeout(environ: dict[str, str] | None = None, *, elastic: bool = False) -> float:
    """The watchdog's timeout: ``MODELZOO_PEER_TIMEOUT`` if set; else, for an ``elastic`` job
    under torchrun (``TORCHELASTIC_RUN_ID`` set), 5 s; else 0 (off).

    Off by default for a job of fixed size: it needs every node anyway, and a short cut
    (TCP retransmissions stretch a 3 s cut to up to ~6 s of silence) is better waited out
    than turned into a restart. An elastic job goes on without the node instead.
    """
    environ = os.environ if environ is None else environ
    value = environ.get(PEER_TIMEOUT_ENV, "")
    if value == "":
        return DEFAULT_PEER_TIMEOUT if elastic and environ.get("TORCHELASTIC_RUN_ID") else 0.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(
            f"environment variable {PEER_TIMEOUT_ENV}={value!r}: give seconds >= 0 (0: off)"
        )
    return seconds


def _env_int(name: str, default: int, environ: Any = None) -> int:
    value = (os.environ if environ is None else environ).get(name)
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
        and :meth:`destroy` leaves it alone. Otherwise a launch that torchrun could restart
        into a stale shared store is refused (:func:`check_launch`), and with
        ``MODELZOO_PEER_TIMEOUT`` set a :class:`PeerWatchdog` is started (module docstring). ``MODELZOO_DETERMINISTIC=1`` in the environment
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

        from .recovery import join_from_env  # noqa: PLC0415 (recovery imports this module)

        if os.environ.get("MODELZOO_RECOVERY_STORE"):  # trainers.elastic inproc launched us
            if use_cuda:
                raise RuntimeError(
                    "in-process recovery (python -m trainers.elastic inproc) runs on gloo and "
                    "CPU workers; launch GPU jobs with python -m trainers.elastic torchrun"
                )
            joined = join_from_env()
            assert joined is not None
            _, formed = joined
            return cls(
                rank=formed.rank,
                world_size=formed.world_size,
                device=torch.device("cpu"),
                backend="gloo",
                owns_process_group=True,
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
        check_launch()
        timeout = peer_timeout()
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(
            backend=backend, init_method="env://", rank=rank, world_size=world_size
        )
        env = cls(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            restart_count=restart_count,
            device=dev,
            backend=backend,
            owns_process_group=True,
        )
        start_peer_watchdog(env, timeout)
        return env

    def regroup(self, rank: int, world_size: int) -> None:
        """Take a new rank and world size in place, after the process group was re-formed
        (in-process recovery, :mod:`trainers.recovery`): every holder of this env (the
        script, the trainer, the combiner) sees the new membership. Only an env that owns
        the default group may change so."""
        if not self.owns_process_group or self.group is not None:
            raise RuntimeError("regroup: only the env that made the default process group")
        if not 0 <= rank < world_size:
            raise ValueError(f"regroup: rank {rank} outside a world of {world_size}")
        object.__setattr__(self, "rank", int(rank))
        object.__setattr__(self, "world_size", int(world_size))

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
                _leave_together(self)
            while _WATCHDOGS:  # before the store goes: the job is ending
                _WATCHDOGS.pop().stop()
            dist.destroy_process_group()
        if self.owns_process_group:
            from .recovery import reset_active  # noqa: PLC0415

            reset_active()  # an in-process-recovering member says it left

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


class PeerWatchdog:
    """Exit this rank when a peer or the job's store goes silent (a network partition).

    Every ``interval`` seconds (``timeout / 10``) a heartbeat thread adds 1 to this rank's
    counter in ``store`` and reads every rank's counter (3 store round trips whatever the
    world size). It calls ``on_silence(reason)`` (default: print the reason and
    ``os._exit(PEER_LOST_EXIT_CODE)``) when

    * a peer's counter has not moved across this rank's own reads spanning ``timeout``
      seconds (judged on reads, so a rank that was itself starved of CPU does not blame its
      peers), or
    * a store round trip has been in flight for ``timeout`` seconds (checked by a second
      thread: a TCPStore request to an unreachable host blocks for as long as the cut lasts,
      whatever the store's own timeout; measured in the lab network).

    A store request that fails outright (refused, reset) means the store's process ended:
    that is no partition (gloo sees a dead process at once), and the watchdog stands down, as
    it does once any rank has called :meth:`stop` with ``finished=True`` (the job is ending).

    Args:
        store: a c10d store every rank reaches (a clone of the default process group's).
        rank: this rank.
        world_size: ranks in the job.
        timeout: seconds of silence before giving up.
        on_silence: what to do then (tests pass a recorder).
        clock: the time source (tests pass a fake one).
    """

    KEY = "modelzoo/heartbeat/"

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        timeout: float,
        *,
        on_silence: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = float(timeout)
        self.interval = self.timeout / 10
        self.on_silence = on_silence or _exit_on_silence
        self.clock = clock
        self.keys = [f"{self.KEY}{r}" for r in range(world_size)]
        self.done_key = f"{self.KEY}finished"
        self.fired: str | None = None
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, time it last moved)
        self._in_flight_since: float | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    # -- the rule (pure, tested without threads) ----------------------------------------------
    def observe(self, counters: list[int], now: float) -> str | None:
        """Record one read of every rank's counter; the reason to give up, or ``None``."""
        for rank, value in enumerate(counters):
            if rank == self.rank:
                continue
            last = self._seen.get(rank)
            if last is None or value != last[0]:
                self._seen[rank] = (value, now)
            elif now - last[1] >= self.timeout:
                return (
                    f"rank {rank}'s heartbeat has not moved for {now - last[1]:.1f} s "
                    f"(network partition or a frozen node)"
                )
        return None

    def stalled(self, now: float) -> str | None:
        """The reason to give up if a store round trip has been in flight too long."""
        started = self._in_flight_since
        if started is not None and now - started >= self.timeout:
            return (
                f"the job's store has not answered for {now - started:.1f} s "
                f"(network partition or a frozen node)"
            )
        return None

    # -- threads -----------------------------------------------------------------------------------
    def start(self) -> PeerWatchdog:
        for target, name in ((self._beat, "heartbeat"), (self._watch, "store-watch")):
            thread = threading.Thread(target=target, name=f"modelzoo-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, *, finished: bool = True, wait: float = 1.0) -> None:
        """Stop the threads; ``finished``: also tell the other ranks to stand down (at most
        ``wait`` seconds: the store may be unreachable)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if finished:
            announce = threading.Thread(target=self._announce, daemon=True)
            announce.start()
            announce.join(wait)

    def _announce(self) -> None:
        with contextlib.suppress(Exception):  # the store's process may be gone: nothing to tell
            self.store.add(self.done_key, 1)

    def _fire(self, reason: str) -> None:
        with self._lock:
            if self._stop.is_set() or self.fired is not None:
                return
            self.fired = reason
            self._stop.set()
        self.on_silence(f"rank {self.rank}: {reason}")

    def _beat(self) -> None:
        while not self._stop.is_set():
            self._in_flight_since = self.clock()
            try:
                self.store.add(self.keys[self.rank], 1)
                finished = self.store.add(self.done_key, 0)
                counters = None
                if self.store.check(self.keys):
                    counters = [int(v) for v in self.store.multi_get(self.keys)]
            except Exception:  # noqa: BLE001 (refused/reset: the store's process ended)
                self._stop.set()
                return
            finally:
                self._in_flight_since = None
            if finished:
                self._stop.set()
                return
            if counters is not None:
                reason = self.observe(counters, self.clock())
                if reason:
                    self._fire(reason)
                    return
            self._stop.wait(self.interval)

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            reason = self.stalled(self.clock())
            if reason:
                self._fire(reason)
                return


def _exit_on_silence(reason: str) -> None:
    """Leave now, so that torchrun's agent restarts the worker group without the lost peer."""
    message = (
        f"[DistEnv] {reason}; exiting with {PEER_LOST_EXIT_CODE} so that torchrun re-forms "
        f"the group ({PEER_TIMEOUT_ENV} sets the timeout) at {time.time():.3f}\n"
    )
    try:
        sys.stdout.flush()
        sys.stderr.write(message)
        sys.stderr.flush()
    finally:
        os._exit(PEER_LOST_EXIT_CODE)


_WATCHDOGS: list[PeerWatchdog] = []  # this process's (one at most); destroy() stops it
_EXITS = [0]  # destroy()s so far in this process: the key of the next exit count


def _leave_together(env: DistEnv, timeout: float = 60.0) -> None:
    """After the closing barrier: wait in the rendezvous store until every rank has returned
    from it, so that no rank tears its gloo pairs down while a peer's barrier may still be
    reading from them (a gloo barrier can return on one rank before its last message reached
    another; rank 1 then aborted at exit, "terminate called without an active exception", in
    about one CI run of six). Bounded: after ``timeout`` s it goes on (a peer died).

    The key names this group's exit: the largest of the members' torchrun restart counts (a
    store may outlive a group) and this process's count of exits. Each torchrun agent counts
    its own restarts, so members of one group can differ (the nodes that lost a peer restarted
    once more than a node that was cut off and came back); a key from each member's own count
    had them wait on different keys until the timeout (a lab partition drill in CI)."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))])
    if env.backend == "nccl":
        count = count.to(env.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    key = f"modelzoo/exit/{int(count.item())}/{_EXITS[0]}"
    _EXITS[0] += 1
    if store.add(key, 1) == dist.get_world_size():  # the last rank to arrive opens the door
        store.set(f"{key}/all", "1")
    with contextlib.suppress(RuntimeError):  # the store's timeout (a peer died): go on
        store.wait([f"{key}/all"], datetime.timedelta(seconds=timeout))


def start_peer_watchdog(env: DistEnv, timeout: float | None = None) -> PeerWatchdog | None:
    """Start this process's :class:`PeerWatchdog` on ``env``'s default process group (on a
    clone of its store: a connection of its own); ``timeout`` defaults to
    :func:`peer_timeout`. Returns the running one if there is one, ``None`` when off (a
    timeout of 0, or a world of one). Stopped by
    :meth:`DistEnv.destroy` and at exit."""
    if _WATCHDOGS:
        return _WATCHDOGS[0]
    timeout = peer_timeout() if timeout is None else timeout
    if timeout <= 0 or not env.distributed or not dist.is_initialized():
        return None
    store = dist.distributed_c10d._get_default_store()
    watchdog = PeerWatchdog(store.clone(), dist.get_rank(), dist.get_world_size(), timeout)
    _WATCHDOGS.append(watchdog.start())
    atexit.register(watchdog.stop)
    return watchdog
