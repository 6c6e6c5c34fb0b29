"""In-process recovery: a worker group that loses or gains a member goes on without restarting.

Under ``torchrun`` every membership change stops every worker and starts new processes, which
re-import torch, rebuild the model and reload ``state.pt`` (``docs/elastic.md``: 11-27 s).
Here the workers are ordinary processes that keep running: when a peer dies (its gloo
connections reset) or is cut off (a collective times out after three times the slowest
step, at least 2 s), the survivors agree on a new membership through a c10d store, destroy the broken
process group and create a new one (``torch.distributed.init_process_group`` with a
``PrefixStore`` per round: no key of an earlier round is ever read), go back to their last
in-memory commit and continue. A new process joins the same way: it registers, the group
admits it at its next commit, and it receives the model, optimizer and progress from a
survivor over the new process group. :class:`~trainers.elastic.ElasticState` drives it; the
scripts need nothing else than the launcher:

    python -m trainers.elastic store --port 29400                # once, on a stable host
    python -m trainers.elastic inproc --store HOST:29400 --job job42 --nodes 2:8 -- \\
        scripts/train_imagenet.py ... --elastic-dir /shared/job42   # on every node

**The membership protocol** (keys under ``<job>/`` in the store). Each process takes a unique
id (``add("next_id", 1)``) and a thread of it increments ``hb/<id>`` every ``timeout / 10``
seconds. Round ``r`` forms generation ``r`` of the group:

1. a participant appends its id to ``round/<r>/arrived`` (a survivor after a failure, every
   member at a commit where a newcomer waits, a newcomer when it starts);
2. it polls: the *candidates* are the members of round ``r - 1`` and the newcomers waiting
   (``joiners``); a candidate is *alive* while its heartbeat counter changes (on this
   process's clock: no clock is compared between hosts) and has not announced it left;
3. once every alive candidate has arrived, at least ``min_nodes`` (and for the first round,
   ``max_nodes`` or ``last_call`` seconds after ``min_nodes``), the first participant to see
   it writes the member list with ``compare_set("round/<r>/closed", "", list)``: one writer
   wins, everyone reads the same list. Survivors keep their order (rank 0 stays rank 0 while
   it lives), newcomers follow in id order;
4. a participant not in the list (it arrived late: taken for dead) tries round ``r + 1`` as a
   newcomer; the group admits it at its next commit.

A dead member is recognised when its heartbeat has not moved for ``timeout`` seconds
(``MODELZOO_PEER_TIMEOUT``, default 1 s here): that is most of a recovery's time.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "ENV_JOB",
    "ENV_NODES",
    "ENV_STORE",
    "Membership",
    "MembershipChange",
    "RecoveryError",
    "active",
    "is_peer_failure",
    "parse_nodes",
]

ENV_STORE = "MODELZOO_RECOVERY_STORE"  # host:port of the job's c10d store
ENV_JOB = "MODELZOO_RECOVERY_JOB"  # the job's name: the key prefix in the store
ENV_NODES = "MODELZOO_RECOVERY_NODES"  # MIN:MAX processes
ENV_COLLECTIVE_TIMEOUT = "MODELZOO_COLLECTIVE_TIMEOUT"
ENV_LAST_CALL = "MODELZOO_RECOVERY_LAST_CALL"
DEFAULT_HEARTBEAT_TIMEOUT = 1.0
# The collectives' timeout, unless MODELZOO_COLLECTIVE_TIMEOUT fixes it: ADAPT_FACTOR times
# the slowest step seen since the group formed (saves and evaluations included), at least
# ADAPT_FLOOR; STARTUP_TIMEOUT until that is measured (a newcomer imports, builds its model
# and traces its first step while the others wait in the first collectives).
ADAPT_FACTOR = 3.0
ADAPT_FLOOR = 2.0
STARTUP_TIMEOUT = 300.0
DEFAULT_LAST_CALL = 2.0
_POLL = 0.02

# What a collective raises when a peer is gone: gloo's transport errors and timeouts.
_PEER_FAILURE = re.compile(
    r"Connection (reset|closed|refused)|Broken pipe|Read error|Write error|"
    r"Timed out waiting \d+ ?ms for (recv|send)|connectFullMesh|"
    r"Application timeout caused pair closure|Socket Timeout|"
    r"process group .*(destroyed|aborted)",
)


class RecoveryError(RuntimeError):
    """The group cannot go on (fewer than ``min_nodes`` left, the store is gone, ...)."""


class MembershipChange(Exception):  # noqa: N818 (a signal, not an error)
    """Raised at a commit when a newcomer waits: the trainer re-forms the group with it."""


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is what a collective raises when a peer died or was cut off."""
    if isinstance(exc, MembershipChange):
        return True
    backend_error = getattr(dist, "DistBackendError", ())
    if not isinstance(exc, RuntimeError) and not (backend_error and isinstance(exc, backend_error)):
        return False
    return bool(_PEER_FAILURE.search(str(exc)))


def parse_nodes(text: str) -> tuple[int, int]:
    """``"MIN:MAX"`` (or ``"N"``) -> ``(MIN, MAX)``; ``ValueError`` naming the value."""
    try:
        low, colon, high = text.partition(":")
        lo, hi = int(low), int(high if colon else low)
    except ValueError:
        lo = hi = -1
    if not 1 <= lo <= hi:
        raise ValueError(f"--nodes {text!r}: give MIN:MAX with 1 <= MIN <= MAX, e.g. 2:4")
    return lo, hi


def _seconds(name: str, default: float) -> float:
    value = os.environ.get(name, "")
    if value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"environment variable {name}={value!r}: give seconds > 0")
    return seconds


@dataclass(frozen=True)
class Round:
    """A formed generation: its number, the member ids in rank order, this process's rank."""

    number: int
    members: tuple[int, ...]
    rank: int

    @property
    def world_size(self) -> int:
        return len(self.members)


class Membership:
    """This process's membership of an in-process-recovering job (see the module docstring).

    Args:
        host, port: the job's c10d store (``python -m trainers.elastic store``).
        job: the job's name; every key lives under it.
        min_nodes, max_nodes: processes the group needs / takes at most.
        heartbeat_timeout: seconds without a heartbeat before a member counts as dead.
        collective_timeout: the process groups' timeout (a partitioned peer makes a
            collective fail after this long); ``None``: sized from the measured step time
            (:meth:`adapt`).
        last_call: the first round waits this long after ``min_nodes`` for more.
        join_timeout: how long a round may wait for ``min_nodes``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        job: str,
        min_nodes: int,
        max_nodes: int,
        *,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        collective_timeout: float | None = None,
        last_call: float = DEFAULT_LAST_CALL,
        join_timeout: float = 600.0,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}:{max_nodes}")
        self.host, self.port, self.job = host, int(port), job
        self.min_nodes, self.max_nodes = int(min_nodes), int(max_nodes)
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.collective_timeout = None if collective_timeout is None else float(collective_timeout)
        self.timeout = STARTUP_TIMEOUT  # the current groups' timeout (seconds)
        self.last_call = float(last_call)
        self.join_timeout = float(join_timeout)
        try:
            base = dist.TCPStore(
                host, self.port, is_master=False, timeout=datetime.timedelta(seconds=30)
            )
        except (RuntimeError, OSError) as exc:
            raise RecoveryError(
                f"cannot reach the job's store at {host}:{port} ({exc}); start it with "
                f"`python -m trainers.elastic store --port {port}` on a host that stays up"
            ) from None
        self._base = base
        self.store = dist.PrefixStore(job, base)
        self.id = int(self.store.add("next_id", 1))
        self.round: Round | None = None
        self.last_timing: dict[str, float] = {}
        self._stop = threading.Event()
        # The heartbeat has its own connection: a main thread blocked in a store call must
        # not stop it (nor the other way round).
        self._beat_store = dist.PrefixStore(job, base.clone())
        self._beats = threading.Thread(target=self._beat, name="membership-heartbeat", daemon=True)
        self._beats.start()

    @classmethod
    def from_env(cls) -> Membership | None:
        """The membership the launcher asked for (``MODELZOO_RECOVERY_*``), or ``None``."""
        address = os.environ.get(ENV_STORE, "")
        if not address:
            return None
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{ENV_STORE}={address!r}: give HOST:PORT of the job's store")
        job = os.environ.get(ENV_JOB, "") or "job"
        lo, hi = parse_nodes(os.environ.get(ENV_NODES, "1:64"))
        from .dist import PEER_TIMEOUT_ENV

        return cls(
            host, int(port), job, lo, hi,
            heartbeat_timeout=_seconds(PEER_TIMEOUT_ENV, DEFAULT_HEARTBEAT_TIMEOUT),
            collective_timeout=(
                _seconds(ENV_COLLECTIVE_TIMEOUT, 1.0)
                if os.environ.get(ENV_COLLECTIVE_TIMEOUT)
                else None
            ),
            last_call=_seconds(ENV_LAST_CALL, DEFAULT_LAST_CALL),
        )  # fmt: skip

    # -- rounds -----------------------------------------------------------------------------
    def join(self) -> Round:
        """Enter the job: wait for a round that admits this process, then form its group."""
        self.store.append("joiners", f"{self.id},")
        number = int(self.store.add("gen", 0)) + 1
        return self._enter(number)

    def reform(self) -> Round:
        """After a failure (or at a commit where a newcomer waits): the next generation."""
        assert self.round is not None, "reform() before join()"
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        return self._enter(self.round.number + 1)

    def newcomer_waiting(self) -> bool:
        """Whether a process waits to enter the next round (rank 0 asks; the others follow)."""
        assert self.round is not None
        if self.round.world_size >= self.max_nodes:
            return False  # no room: the newcomer waits for a member to leave
        return self.store.check([f"round/{self.round.number + 1}/arrived"])

    def leave(self) -> None:
        """Announce that this process ends (its peers stop counting on it at once)."""
        if self._stop.is_set():
            return
        self._stop.set()
        with contextlib.suppress(Exception):
            self.store.set(f"gone/{self.id}", "1")
        self._beats.join(timeout=2.0)

    def _enter(self, number: int) -> Round:
        start = time.perf_counter()
        deadline = time.monotonic() + self.join_timeout
        while True:
            formed = self._one_round(number, deadline)
            if formed is not None:
                break
            number += 1  # closed without this process: it counts as a newcomer now
            self.store.append("joiners", f"{self.id},")
        agreed = time.perf_counter()
        self._init_group(formed)
        self.round = formed
        self.last_timing = {
            "agree": agreed - start,
            "process_group": time.perf_counter() - agreed,
        }
        return formed

    def _one_round(self, number: int, deadline: float) -> Round | None:
        prefix = f"round/{number}"
        self.store.append(f"{prefix}/arrived", f"{self.id},")
        previous = self._closed(number - 1) if number > 1 else ()
        seen: dict[int, tuple[int, float]] = {}  # id -> (heartbeat counter, when it changed)
        enough_since: float | None = None
        while True:
            closed = self._closed(number)
            if closed:
                if self.id not in closed:
                    return None
                return Round(number, closed, closed.index(self.id))
            if time.monotonic() > deadline:
                raise RecoveryError(
                    f"round {number} of job {self.job!r} did not gather {self.min_nodes} "
                    f"processes within {self.join_timeout:.0f} s"
                )
            arrived = _ids(self.store.get(f"{prefix}/arrived"))
            joiners = _ids(self.store.get("joiners")) if self.store.check(["joiners"]) else []
            candidates = set(previous) | {j for j in joiners if j not in previous}
            now = time.monotonic()
            alive = {c for c in candidates | set(arrived) if self._alive(c, seen, now)}
            missing = alive - set(arrived)
            present = [a for a in dict.fromkeys(arrived) if a in alive]
            ready = not missing and len(present) >= self.min_nodes
            if ready and not previous:  # the job's first round: wait for more a little
                enough_since = enough_since if enough_since is not None else now
                ready = len(present) >= self.max_nodes or now - enough_since >= self.last_call
            if ready:
                order = [m for m in previous if m in present]
                order += sorted(set(present) - set(order))
                order = order[: self.max_nodes]
                self.store.compare_set(f"{prefix}/closed", "", ",".join(map(str, order)))
                continue
            time.sleep(_POLL)

    def _closed(self, number: int) -> tuple[int, ...]:
        key = f"round/{number}/closed"
        if not self.store.check([key]):
            return ()
        return tuple(_ids(self.store.get(key)))

    def _alive(self, member: int, seen: dict[int, tuple[int, float]], now: float) -> bool:
        if member == self.id:
            return True
        if self.store.check([f"gone/{member}"]):
            return False
        counter = int(self.store.add(f"hb/{member}", 0))
        last = seen.get(member)
        if last is None or last[0] != counter:
            seen[member] = (counter, now)
            return True
        return now - last[1] < self.heartbeat_timeout

    def adapt(self, slowest_step: float) -> float:
        """Size the collectives' timeout from the slowest step seen (seconds, saves and
        evaluations included): ``ADAPT_FACTOR`` x it, at least ``ADAPT_FLOOR``; or the fixed
        ``collective_timeout``. Returns the timeout in force. A survivor whose peers do not
        talk to it directly only learns of a death from this timeout (gloo's connections to
        a failed group stay open while its objects live), so it bounds detection."""
        if self.collective_timeout is not None:
            wanted = self.collective_timeout
        else:
            wanted = max(ADAPT_FLOOR, ADAPT_FACTOR * slowest_step)
        if abs(wanted - self.timeout) > 0.05 * self.timeout:
            self._set_timeout(wanted)
        return self.timeout

    def _set_timeout(self, seconds: float) -> None:
        self.timeout = float(seconds)
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=self.timeout))

    def _init_group(self, formed: Round) -> None:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        previous = set(self._closed(formed.number - 1)) if formed.number > 1 else set()
        if set(formed.members) - previous:  # newcomers: long until their first steps are done
            self.timeout = max(STARTUP_TIMEOUT, self.collective_timeout or 0.0)
        timeout = self.timeout  # else the survivors' measured one
        dist.init_process_group(
            backend="gloo",
            store=dist.PrefixStore(f"pg/{formed.number}", self.store),
            rank=formed.rank,
            world_size=formed.world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        if formed.rank == 0:
            gen = int(self.store.add("gen", 0))
            if gen < formed.number:
                self.store.add("gen", formed.number - gen)

    def _beat(self) -> None:
        interval = self.heartbeat_timeout / 10
        while not self._stop.wait(interval):
            try:
                self._beat_store.add(f"hb/{self.id}", 1)
            except Exception:  # noqa: BLE001 (the store is gone: the main thread will see)
                return

    def __repr__(self) -> str:
        where = f"{self.host}:{self.port}/{self.job}"
        return f"Membership(id={self.id}, {where}, nodes={self.min_nodes}:{self.max_nodes})"


def _ids(raw: bytes | str) -> list[int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    return [int(t) for t in text.split(",") if t]


_ACTIVE: Membership | None = None


def active() -> Membership | None:
    """The membership :meth:`~trainers.dist.DistEnv.from_env` joined, if any."""
    return _ACTIVE


def join_from_env() -> tuple[Membership, Round] | None:
    """Join the job the launcher named (``MODELZOO_RECOVERY_STORE`` ...): ``None`` if none."""
    global _ACTIVE
    membership = Membership.from_env()
    if membership is None:
        return None
    formed = membership.join()
    _ACTIVE = membership
    print(f"[recovery] process {membership.id} is rank {formed.rank} of {formed.world_size} "
          f"(round {formed.number})", file=sys.stderr, flush=True)  # fmt: skip
    return membership, formed


def reset_active() -> None:
    """Forget the active membership (tests; the end of a job)."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE.leave()
    _ACTIVE = None


def flag_from_rank0(value: bool) -> bool:
    """Rank 0's ``value`` on every rank (a one-element broadcast over the default group)."""
    flag = torch.tensor([1 if value else 0], dtype=torch.int32)
    dist.broadcast(flag, src=0)
    return bool(flag.item())
