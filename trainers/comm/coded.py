"""``--grad-combine coded``: straggler-tolerant tree reduction by gradient coding (CodedReduce).

CodedReduce (Reisizadeh, Prakash, Pedarsani, Avestimehr, arXiv 1902.01981) puts gradient
coding (Tandon et al., ICML 2017) on a tree of workers so that each parent needs only its
fastest children. **The scheme implemented here is fractional repetition on a regular tree**, a
special case of theirs whose details we could pin down without the paper:

* The ranks form a tree in breadth-first order (rank 0 the root; the children of ``r`` are
  ``b r + 1 ... b r + b``, ``b = --coded-branching``). Each parent's children are split into
  groups of ``s + 1`` consecutive ranks (``s = --coded-stragglers``).
* The members of a group, and their subtrees position by position, train on the **same** data
  part: a rank's part is that of the first member of its group at every level of its path to
  the root. With ``P`` distinct parts, each step consumes ``P x batch`` samples while
  ``n x batch`` are computed: the redundancy ``n / P`` buys the tolerance.
* Upward, every node sends ``its gradient + the sum of one message per group of its
  children`` to its parent, tagged with the step; it waits only for the **first** member of
  each group (members' messages are equal bit for bit: same model, same data, same
  arithmetic), so any ``s`` slow children of a parent are not waited for, and their late
  messages are received later and discarded (a rank more than 8 steps overdue is waited
  for: that bounds the buffers kept). The root divides by ``P``: the mean gradient over the
  step's ``P`` parts, exactly the averaged gradient of synchronous SGD at ``P`` workers.
* Downward, the root sends the mean gradient and its floating-point buffers (BatchNorm
  statistics) to every rank directly (point to point), so a slow internal node delays
  nobody's update; every rank takes the same optimizer step.

With ``s = 0`` every part is distinct (``P = n``) and it is a tree reduce equal to the
all-reduce average. Metric logging (``--log-interval``) and evaluation are collectives: at those
steps every rank waits for the slowest (log less often to keep stragglers off the critical
path).

**Catching up.** After sending step ``t``'s update the root records ``t + 1`` steps decided in
the job's rendezvous store. Before each step a non-root rank reads that count: if its step is
already decided, its gradient cannot matter, so it skips the step's forward and backward
(:meth:`~trainers.comm.base.GradCombiner.skips_step`; the batches are still drawn), sends its
parent a message of zeros (which is discarded like every late message: the root took this
step's parts from faster members), and applies the received update like every rank. A rank
slowed once thus catches up, and a rank slowed at every step (``--inject-straggler 2:2``)
computes about every other step while the others keep their pace. An inner node that skips
still drains its children's messages; everything it sends up for a decided step is late at
its destination and discarded. A fit's first step is always computed (the trainer needs this
rank's metric names for the metric reductions; a rank that skipped it offered a shorter vector
and the collective hung, which is why deeper trees did not skip before). Without the store (a
process group not made by ``init_process_group``) late ranks compute every step and stay
behind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..dist import DistEnv
from .base import CountingCombiner, option, refuse_loss_scaling, register_combiner
from .cost import message_time
from .flat import flat_grads, flatten, unflatten_

__all__ = ["CodedOptions", "CodedReduceCombiner", "CodedTree"]

_SLOTS = 1024  # tag = step * _SLOTS + slot: slot 0 the update down, 1 + g group g's messages up
_MAX_LAG = 8  # a message more than this many steps overdue is waited for (bounded memory)


_DECIDED = "modelzoo/coded/decided"  # store key: steps whose update the root has sent


def _tag(step: int, slot: int) -> int:
    return step * _SLOTS + slot


def _default_store() -> Any:
    """The default process group's rendezvous store (``None`` if there is none).

    torch has no public accessor; ``_get_default_store`` has been there since 1.x. Without it
    late ranks only lose the catching up (module docstring).
    """
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except (RuntimeError, ValueError):
        return None


@dataclass(frozen=True)
class CodedOptions:
    stragglers: int = option(
        1, "slow children tolerated per parent (s; groups of s + 1 share data)",
        flag="--coded-stragglers",
    )  # fmt: skip
    branching: int | None = option(
        None, "children per parent (a multiple of s + 1; default: world size - 1, one level)",
        flag="--coded-branching",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.stragglers < 0:
            raise ValueError(f"stragglers must be >= 0, got {self.stragglers}")
        if self.branching is not None and self.branching < 1:
            raise ValueError(f"branching must be >= 1, got {self.branching}")


class CodedTree:
    """The tree of ``world`` ranks with ``branching`` children per parent, groups of
    ``stragglers + 1`` children, and each rank's data part (see the module docstring).

    Raises:
        ValueError: a parent whose children do not split into whole groups, or groups whose
            subtrees differ in shape (the world size does not fit the tree; the message names
            the sizes that do).
    """

    def __init__(self, world: int, branching: int, stragglers: int) -> None:
        self.world, self.branching, self.stragglers = world, branching, stragglers
        g = stragglers + 1
        if branching % g:
            raise ValueError(
                f"branching {branching} is not a multiple of stragglers + 1 = {g}: each "
                f"parent's children form groups of {g}"
            )
        self.children = {
            r: list(range(branching * r + 1, min(branching * r + branching, world - 1) + 1))
            for r in range(world)
        }
        for r, kids in self.children.items():
            if len(kids) % g:
                raise ValueError(
                    f"world size {world} with branching {branching}: rank {r} has {len(kids)} "
                    f"children, not a multiple of stragglers + 1 = {g}; use a world size where "
                    f"every parent has a multiple of {g} children (e.g. {self._fitting_sizes()})"
                )
        self.groups = {r: [kids[i : i + g] for i in range(0, len(kids), g)] for r, kids in self.children.items()}  # fmt: skip
        self.parent = {c: r for r, kids in self.children.items() for c in kids}
        for kids in self.groups.values():
            for group in kids:
                shapes = {self._shape(c) for c in group}
                if len(shapes) > 1:
                    raise ValueError(
                        f"world size {world} with branching {branching}: ranks {group} share "
                        f"data but their subtrees differ; use one of {self._fitting_sizes()}"
                    )
        canonical = [self._canonical(r) for r in range(world)]
        parts = sorted(set(canonical))
        self.part_of = [parts.index(c) for c in canonical]
        self.parts = len(parts)

    def _shape(self, r: int) -> tuple:
        return tuple(self._shape(c) for c in self.children[r])

    def _canonical(self, r: int) -> int:
        """The rank whose data ``r`` repeats: the first member of its group at every level."""
        path = []
        while r != 0:
            p = self.parent[r]
            path.append(r - (self.branching * p + 1))  # index among the parent's children
            r = p
        g = self.stragglers + 1
        for index in reversed(path):
            r = self.branching * r + 1 + (index // g) * g
        return r

    def _fitting_sizes(self) -> str:
        """World sizes of complete trees with this branching (1, 2 and 3 levels below the root)."""
        b = self.branching
        return ", ".join(str(sum(b**i for i in range(levels + 1))) for levels in (1, 2, 3))


@register_combiner("coded", CodedOptions)
class CodedReduceCombiner(CountingCombiner):
    """Gradient coding on a tree (fractional repetition; module docstring)."""

    summary = "tree reduction that waits for the fastest s+1-th of each group (CodedReduce)"

    @classmethod
    def is_deterministic(cls, options: CodedOptions) -> bool:
        """With ``s >= 1`` timing decides which members compute a step (a late rank skips
        it), so the logged training loss and metrics, means over the computed micro-batches,
        vary between runs; the applied model does not (tests/trainers/test_coded.py)."""
        return options.stragglers == 0

    def comm_time(self, grad_bytes: float, workers: int, gbps: float, latency_s: float) -> float:
        """The default one-level tree: the root's link carries the ``n - 1`` children's
        gradients up and ``n - 1`` copies of the update down, ``2 (n - 1) (S / B + a)``."""
        if self.options.branching is not None and self.options.branching < workers - 1:
            raise ValueError(
                "coded's cost formula is for its default one-level tree; a deeper tree "
                f"(--coded-branching {self.options.branching} < {workers - 1}) has none"
            )
        return 2 * (workers - 1) * message_time(grad_bytes, gbps, latency_s)

    def step_time(
        self, compute: float, comm: float, *, straggler: float = 1.0, overlap: float = 0.0
    ) -> tuple[float, float]:
        """A straggler within the tolerance is not waited for: ``T_c + T_m`` for the fast
        ranks, ``s T_c + T_m`` for the straggler."""
        return compute + comm, straggler * compute + comm

    def __init__(self, options: CodedOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.tree: CodedTree | None = None
        self.steps = 0
        # (step, request, buffer): receives of the group members that came second, and sends
        # not yet confirmed (the buffers must live until then)
        self.late: list[tuple[int, Any, Tensor]] = []
        self.outgoing: list[tuple[int, Any, Tensor]] = []
        self.waited: list[float] = []  # seconds this rank waited for its children, per step
        self.skipped = 0  # steps this rank did not compute (already decided when it got there)
        self._skip = False
        self._store: Any = None
        self._catches_up = False  # set in prepare(): a non-root rank

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.tree = self._tree(env.world_size)
        self._catches_up = env.distributed and env.rank != 0  # module docstring
        if env.distributed:
            self._store = _default_store()
            if env.rank == 0 and self._store is not None:  # before the broadcast: others read it
                self._store.set(_DECIDED, "0")  # a store reused from an earlier run starts over
        self.start_replicas(model, env)
        return model

    def skips_step(self) -> bool:
        """Whether the root has already decided this step (module docstring)."""
        env, store = self.env, self._store
        self._skip = False
        if self._catches_up and env is not None and store is not None:
            self._skip = int(store.get(_DECIDED)) > self.steps
        self.skipped += self._skip
        return self._skip

    def _tree(self, world_size: int) -> CodedTree:
        s = self.options.stragglers
        return CodedTree(world_size, self.options.branching or max(s + 1, world_size - 1), s)

    def data_parts(self, world_size: int) -> int:
        """The tree's distinct data parts ``P`` (a step consumes ``P x batch`` samples)."""
        return self._tree(world_size).parts

    def data_shard(self) -> tuple[int, int]:
        assert self.tree is not None and self.env is not None
        return self.tree.part_of[self.env.rank], self.tree.parts

    def _params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def _buffers(self) -> list[Tensor]:
        assert self.model is not None
        return [b for b in self.model.buffers() if b.is_floating_point()]

    @torch.no_grad()
    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        refuse_loss_scaling(scaler, self.name, "its messages carry unscaled sums across steps")
        env, tree = self.env, self.tree
        assert env is not None and tree is not None
        params = self._params()
        dtype = torch.float64 if all(p.dtype == torch.float64 for p in params) else torch.float32
        grad = flat_grads(params, dtype)
        if not env.distributed:
            mean = grad
        else:
            rank, down = env.rank, _tag(self.steps, 0)
            total = grad.clone()
            start = time.perf_counter()
            for g, group in enumerate(tree.groups[rank]):
                tag = _tag(self.steps, 1 + g)
                if self._skip:  # decided: the children's messages are all late; drain them
                    for member in group:
                        late = torch.empty_like(grad)
                        self.late.append((self.steps, dist.irecv(late, member, tag=tag), late))
                else:
                    total += self._first_of(group, grad, tag)
            self.waited.append(time.perf_counter() - start)
            self._bound_lag()
            buffers = self._buffers()
            size = grad.numel() + sum(b.numel() for b in buffers)
            # sends are not waited for here: a slow receiver must not hold this rank
            if rank != 0:
                p = tree.parent[rank]
                slot = 1 + next(i for i, grp in enumerate(tree.groups[p]) if rank in grp)
                send = dist.isend(total, p, tag=_tag(self.steps, slot))
                self.outgoing.append((self.steps, send, total))
                self.counter.add(total.element_size() * total.numel())
                message = torch.empty(size, dtype=dtype)
                dist.recv(message, 0, tag=down)
            else:
                total /= tree.parts
                message = torch.cat([total, flatten(buffers, dtype)]) if buffers else total
                for r in range(1, env.world_size):
                    self.outgoing.append((self.steps, dist.isend(message, r, tag=down), message))
                self.counter.add((env.world_size - 1) * message.element_size() * message.numel())
                if self._store is not None:
                    self._store.set(_DECIDED, str(self.steps + 1))
            mean = message[: grad.numel()]
            if rank != 0 and buffers:
                unflatten_(buffers, message[grad.numel() :])
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        unflatten_([p.grad for p in params], mean)
        self.counter.step()

    def _first_of(self, group: list[int], like: Tensor, tag: int) -> Tensor:
        """The first of ``group``'s messages of this step (a receive from any source on the
        group's tag); the other members' equal messages are received later, into buffers
        nobody reads (:meth:`_bound_lag`, :meth:`close`)."""
        first = torch.empty_like(like)
        if len(group) == 1:
            dist.recv(first, group[0], tag=tag)
            return first
        sender = dist.recv(first, None, tag=tag)
        for member in group:
            if member != sender:
                late = torch.empty_like(like)
                self.late.append((self.steps, dist.irecv(late, member, tag=tag), late))
        return first

    def _bound_lag(self) -> None:
        """Wait for the late receives and unconfirmed sends more than ``_MAX_LAG`` steps
        old (gloo's requests report completion only through ``wait``)."""
        for pending in (self.late, self.outgoing):
            while pending and pending[0][0] < self.steps - _MAX_LAG:
                pending.pop(0)[1].wait()

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        self.steps += 1
        self._skip = False  # until skips_step() says otherwise for the next step

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics() if self.env is not None and self.env.distributed else {}

    def close(self) -> None:
        """End of ``fit``: finish every late receive and pending send."""
        for _, request, _ in self.late + self.outgoing:
            request.wait()
        self.late, self.outgoing = [], []

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
