"""``--grad-combine adpsgd``: asynchronous decentralized parallel SGD (Lian et al., ICML 2018),
and its hierarchical form H-ADPSGD (Zhang et al., for speech recognition).

Each worker averages its model with **one** other worker's instead of all-reducing
gradients; pair averaging keeps the mean model, so the mean follows SGD on the mean
gradient. Two variants:

* **Asynchronous** (the default, the paper's algorithm). No barrier: a communication
  thread on each rank, with its own gloo process group, averages with a random peer while
  the main thread computes. The ranks split into *active* (even) and *passive* (odd) ones,
  which rules out deadlock (the paper's bipartite graph): an active rank's thread sends its
  latest model to a passive rank chosen at random, the passive rank's thread replies with
  the average and both move to it. The main thread applies what the thread contributed at
  its next step (the thread never writes the parameters, so a forward/backward is never
  torn), computing its gradient on a model that may be a step stale, as the paper allows. A
  slow rank does not slow the others: its thread still serves requests. Nondeterministic by
  nature; tested by its properties (the sum of the models kept exactly at lr 0 while
  exchanges run; a fast rank's steps not paced by a slow peer).
* **Synchronous rounds** (``asynchronous=False``, ``--no-adpsgd-async``; deterministic and
  exactly testable). At step ``k`` every rank draws the same random perfect matching of the
  ranks from the run seed (one rank sits out when ``n`` is odd); partners average their
  models, then each applies its own gradient, computed before the averaging::

      x_i <- (x_i + x_j) / 2 - lr * update(g_i)      # g_i = grad F(x_i) before averaging

  so ``mean(x) <- mean(x) - lr * mean(g)`` for plain SGD, and identical data on every rank
  is single-process SGD. Every rank waits for its partner at every step.

**H-ADPSGD** (``hierarchical=True``, or a ``node_size``): the ``node_size`` ranks of each node form one "super
learner": they all-reduce their gradients every step (synchronous inside the node, like
DDP), and the nodes run AD-PSGD among themselves. Synchronous rounds match nodes; local rank
``r`` of one node exchanges with local rank ``r`` of its partner node, so every link
carries a share and the node's replicas stay equal. Asynchronously, the first rank of each
node runs the communication thread and broadcasts its contribution inside the node at every
step. On one node H-ADPSGD is DDP.

:meth:`synchronize` (before evaluation) stops the threads, applies what they contributed and
all-reduces the models: every rank holds the exact average. An elastic membership change
starts the new world from the average of the saved replicas. Floating-point buffers
(BatchNorm statistics) are averaged with the parameters.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..data import derive_seed
from ..dist import DistEnv
from .base import (
    CommCounter,
    CountingCombiner,
    option,
    refuse_loss_scaling,
    register_combiner,
)
from .cost import message_time
from .flat import (
    allreduce_mean_,
    exchange,
    flatten,
    replica_tensors,
    restore_optimizer_state,
    unflatten_,
)

__all__ = ["ADPSGDCombiner", "ADPSGDOptions", "random_matching"]

_SALT = 0xAD95  # the matching's generator: derive_seed(seed, step, _SALT)
_TAG = 9_000
_TAG_SPAN = 1 << 20
# Message tags of the asynchronous protocol (on its own process group).
_REQUEST, _MODEL, _REPLY = 1, 2, 3
_EXCHANGE, _STOP = 1, 0


def random_matching(n: int, seed: int, step: int) -> list[int]:
    """``partner[i]`` of a random perfect matching of ``range(n)`` (``i`` itself: sits out).

    Drawn from ``derive_seed(seed, step)``: every rank computes the same matching.
    """
    g = torch.Generator().manual_seed(derive_seed(seed, step, _SALT))
    perm = torch.randperm(n, generator=g).tolist()
    partner = list(range(n))
    for a, b in zip(perm[0::2], perm[1::2], strict=False):
        partner[a], partner[b] = b, a
    return partner


@dataclass(frozen=True)
class ADPSGDOptions:
    asynchronous: bool = option(
        True,
        "on by default: the paper's asynchronous algorithm (a communication thread, no barrier; "
        "nondeterministic); --no-adpsgd-async: synchronous random-matching rounds "
        "(deterministic, every rank waits for its partner)",
        flag="--adpsgd-async",
    )
    hierarchical: bool = option(
        False,
        "H-ADPSGD: all-reduce gradients inside each node, AD-PSGD across nodes",
        flag="--adpsgd-hierarchical",
    )
    node_size: int = option(
        0,
        "ranks per node of H-ADPSGD; implies --adpsgd-hierarchical (0: torchrun's "
        "LOCAL_WORLD_SIZE)",
        flag="--adpsgd-node-size",
    )

    def __post_init__(self) -> None:
        if self.node_size < 0:
            raise ValueError(
                f"node_size must be >= 0 (0: the local world size), got {self.node_size}"
            )

    @property
    def nodes_of(self) -> int | None:
        """The node size of H-ADPSGD (0: the local world size), ``None``: flat AD-PSGD."""
        return self.node_size if (self.hierarchical or self.node_size) else None


@register_combiner("adpsgd", ADPSGDOptions)
class ADPSGDCombiner(CountingCombiner):
    """AD-PSGD and H-ADPSGD (see the module docstring)."""

    summary = "decentralized: pairwise model averaging (async, or sync rounds; H-ADPSGD)"

    @classmethod
    def is_deterministic(cls, options: ADPSGDOptions) -> bool:
        return not options.asynchronous

    def comm_time(self, grad_bytes: float, workers: int, gbps: float, latency_s: float) -> float:
        """AD-PSGD (flat; H-ADPSGD's intra-node all-reduce is not modelled): the model to
        one partner, and back from it when asynchronous (its thread swaps both ways), one
        message ``S / B + a`` each."""
        if self.options.hierarchical or self.options.node_size:
            raise ValueError(
                "adpsgd's cost formula is for flat AD-PSGD; H-ADPSGD (--adpsgd-hierarchical) "
                "has none"
            )
        one = message_time(grad_bytes, gbps, latency_s)
        return 2 * one if self.options.asynchronous else one

    def step_time(
        self, compute: float, comm: float, *, straggler: float = 1.0, overlap: float = 0.0
    ) -> tuple[float, float]:
        """Synchronous rounds: every rank waits for its partner, ``s T_c + T_m``.
        Asynchronous: the exchange runs in its own thread, so the fast ranks step at ``T_c``
        and the straggler at ``s T_c``."""
        slow = straggler * compute
        if self.options.asynchronous:
            return compute, slow
        return slow + comm, slow + comm

    def __init__(self, options: ADPSGDOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.steps = 0
        # Set in prepare().
        self.node_size = 1
        self.node = 0  # this rank's node (0 .. nodes - 1)
        self.nodes = 1
        self.node_group: Any = None  # the ranks of this node (hierarchical)
        # The asynchronous protocol (see _Gossiper).
        self.gossiper: _Gossiper | None = None

    # -- set-up -----------------------------------------------------------------------------------
    def _tensors(self) -> list[Tensor]:
        assert self.model is not None
        return replica_tensors(self.model)

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.start_replicas(model, env)
        self.counter.peers = 0
        if not env.distributed:
            return model
        n = env.world_size
        size = 1
        if self.options.nodes_of is not None:
            size = self.options.nodes_of or env.local_world_size
            if size < 1 or n % size:
                raise ValueError(
                    f"--adpsgd-hierarchical: {n} ranks do not split into nodes of "
                    f"{size} (--adpsgd-node-size); choose a divisor of the world size"
                )
        self.node_size, self.nodes, self.node = size, n // size, env.rank // size
        if size > 1:  # every rank creates every node's group, in the same order
            for node in range(self.nodes):
                group = dist.new_group(list(range(node * size, (node + 1) * size)))
                if node == self.node:
                    self.node_group = group
        if self.options.asynchronous and self.nodes > 1:
            leaders = [node * size for node in range(self.nodes)]
            group = dist.new_group(leaders, backend="gloo")
            if env.rank in leaders:
                self.gossiper = _Gossiper(
                    rank=self.node,
                    world=self.nodes,
                    ranks=leaders,
                    group=group,
                    seed=derive_seed(self.seed, env.rank, _SALT),
                    counter=self.counter,
                )
        return model

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        refuse_loss_scaling(scaler, self.name, "steps local models whose loss scales would differ")
        if self.node_group is not None:  # H-ADPSGD: the node averages its gradients
            assert self.model is not None
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            with torch.no_grad():
                flat = flatten(grads)
                dist.all_reduce(flat, group=self.node_group)
                flat /= self.node_size
                unflatten_(grads, flat)
            self.counter.add(2 * (self.node_size - 1) * flat.numel() * 4 // self.node_size)

    # -- the step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        env = self.env
        assert env is not None
        if env.distributed and self.nodes > 1:
            if self.options.asynchronous:
                self._apply_gossip()
            else:
                self._pair_average()
        super().step(optimizer, scaler)
        if self.gossiper is not None:
            self.gossiper.publish(flatten(self._tensors()))
        self.steps += 1
        self.counter.step()

    def _pair_average(self) -> None:
        """Synchronous round: average with this step's partner (the same local rank of the
        partner node)."""
        env = self.env
        assert env is not None
        partner_node = random_matching(self.nodes, self.seed, self.steps)[self.node]
        if partner_node == self.node:
            return
        peer = partner_node * self.node_size + env.rank % self.node_size
        tensors = self._tensors()
        mine = flatten(tensors)
        theirs = torch.empty_like(mine)
        for r in exchange(mine, peer, theirs, peer, tag=_TAG + self.steps % _TAG_SPAN):
            r.wait()
        unflatten_(tensors, (mine + theirs) / 2)  # the same bits on both (+ commutes)
        self.counter.add(mine.numel() * mine.element_size())
        self.counter.add_peers(1)

    def _apply_gossip(self) -> None:
        """Asynchronous: add what the thread contributed since the last step (the node's
        first rank broadcasts it to the node)."""
        tensors = self._tensors()
        if self.gossiper is not None:
            delta = self.gossiper.take(flatten(tensors))
        else:
            delta = torch.zeros(sum(t.numel() for t in tensors), device=tensors[0].device)
        if self.node_group is not None:
            dist.broadcast(delta, src=self.node * self.node_size, group=self.node_group)
        if delta.any():
            unflatten_(tensors, flatten(tensors) + delta)

    # -- evaluation, metrics ------------------------------------------------------------------------
    @torch.no_grad()
    def synchronize(self) -> None:
        """Stop the threads, apply their contributions, then the exact average everywhere."""
        env = self.env
        if env is None or not env.distributed:
            return
        if self.options.asynchronous and self.nodes > 1:
            if self.gossiper is not None:
                self.gossiper.stop()
            self._apply_gossip()
        self.counter.add(allreduce_mean_(self._tensors(), env))
        # the threads start again at the next step (publish)

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics() if self.env is not None and self.env.distributed else {}

    def close(self) -> None:
        """Stop the communication threads (end of fit; they start again at the next step)."""
        env = self.env
        if env is None or not env.distributed or not self.options.asynchronous or self.nodes < 2:
            return
        if self.gossiper is not None:
            self.gossiper.stop()
        with torch.no_grad():
            self._apply_gossip()

    # -- checkpoints --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        assert self.optimizer is not None
        state: dict[str, Any] = {
            "steps": self.steps,
            "tensors": [t.detach().clone() for t in self._tensors()],
            "optimizer": self.optimizer.state_dict()["state"],
        }
        if self.gossiper is not None:
            state["pending"] = self.gossiper.peek()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        with torch.no_grad():
            tensors = self._tensors()
            for t, saved in zip(tensors, state_dict["tensors"], strict=True):
                t.copy_(saved)
            pending = state_dict.get("pending")
            if pending is not None:
                unflatten_(tensors, flatten(tensors) + pending)
        assert self.optimizer is not None
        restore_optimizer_state(self.optimizer, state_dict.get("optimizer"))

    @torch.no_grad()
    def load_other_world(self, states: list[dict[str, Any]]) -> None:
        """The exact average of the old replicas (with their threads' contributions)."""
        total: Tensor | None = None
        for state in states:
            x = torch.cat([t.reshape(-1).float() for t in state["tensors"]])
            if state.get("pending") is not None:
                x += state["pending"]
            total = x if total is None else total + x
        assert total is not None
        unflatten_(self._tensors(), total / len(states))
        self.steps = 0

    def __del__(self) -> None:
        gossiper = getattr(self, "gossiper", None)
        if gossiper is not None:
            gossiper.abandon()


class _Gossiper:
    """The asynchronous AD-PSGD protocol among ``world`` members of ``group``.

    The main thread :meth:`publish`-es its model after each step and :meth:`take`-s the sum
    of what the thread changed since (``pending``); the thread never touches the model.
    Members with an even index are active (they start exchanges), odd ones passive (their
    thread answers). ``x_eff = snapshot + pending`` is this member's model as the thread sees
    it; an exchange moves both ends to ``(x_a + x_p) / 2``, which keeps their sum.
    """

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        ranks: list[int],
        group: Any,
        seed: int,
        counter: CommCounter,
    ) -> None:
        self.index, self.world, self.ranks, self.group = rank, world, ranks, group
        self.active = rank % 2 == 0
        self.passive_members = [i for i in range(world) if i % 2 == 1]
        self.active_members = [i for i in range(world) if i % 2 == 0]
        self.generator = torch.Generator().manual_seed(seed)
        self.counter = counter
        self.lock = threading.Lock()
        self.fresh = threading.Event()  # a new snapshot to exchange (active side)
        self.snapshot: Tensor | None = None
        self.pending: Tensor | None = None
        self.exchanges = 0
        self.stopping = False
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    # -- main thread ------------------------------------------------------------------------------
    def start(self, model: Tensor) -> None:
        self.snapshot = model.cpu().clone()
        self.pending = torch.zeros_like(self.snapshot)
        self.stopping = False
        self.fresh.set()
        target = self._active_loop if self.active else self._passive_loop
        self.thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self.thread.start()

    def publish(self, model: Tensor) -> None:
        if self.thread is None:
            self.start(model)
            return
        self._check()
        with self.lock:
            assert self.pending is not None
            self.snapshot = model.cpu().clone()  # x_eff = the model + what is pending
        self.fresh.set()

    def take(self, model: Tensor) -> Tensor:
        """What the thread contributed since the last call (and reset it)."""
        self._check()
        if self.pending is None:
            return torch.zeros_like(model)
        with self.lock:
            delta = self.pending.clone()
            self.pending.zero_()
            assert self.snapshot is not None
            self.snapshot += delta
        return delta.to(model.device)

    def peek(self) -> Tensor | None:
        with self.lock:
            return None if self.pending is None else self.pending.clone()

    def stop(self) -> None:
        """Finish the current exchange; every member must call it (the passive threads end
        when every active member has said stop)."""
        if self.thread is None:
            return
        self.stopping = True
        self.fresh.set()
        self.thread.join()
        self.thread = None
        self._check()

    def abandon(self) -> None:
        self.stopping = True
        self.fresh.set()

    def _check(self) -> None:
        if self.error is not None:
            raise RuntimeError("AD-PSGD's communication thread failed") from self.error

    # -- the thread -------------------------------------------------------------------------------
    def _run(self, target: Any) -> None:
        try:
            target()
        except BaseException as e:  # reported to the main thread at its next call
            self.error = e

    def _active_loop(self) -> None:
        header = torch.empty(1, dtype=torch.int64)
        while True:
            self.fresh.wait()
            self.fresh.clear()
            if self.stopping:
                break
            if not self.passive_members:
                continue
            pick = int(torch.randint(len(self.passive_members), (1,), generator=self.generator))
            peer = self.ranks[self.passive_members[pick]]
            with self.lock:
                assert self.snapshot is not None and self.pending is not None
                mine = self.snapshot + self.pending
            header.fill_(_EXCHANGE)
            dist.send(header, peer, group=self.group, tag=_REQUEST)
            dist.send(mine, peer, group=self.group, tag=_MODEL)
            average = torch.empty_like(mine)
            dist.recv(average, peer, group=self.group, tag=_REPLY)
            with self.lock:
                self.pending += average - mine
                self.counter.add(mine.numel() * mine.element_size())
                self.counter.add_peers(1)
                self.exchanges += 1
        header.fill_(_STOP)
        for member in self.passive_members:
            dist.send(header, self.ranks[member], group=self.group, tag=_REQUEST)

    def _passive_loop(self) -> None:
        header = torch.empty(1, dtype=torch.int64)
        running = len(self.active_members)
        while running:
            src = dist.recv(header, None, group=self.group, tag=_REQUEST)
            if int(header) == _STOP:
                running -= 1
                continue
            theirs = torch.empty_like(self.snapshot)
            dist.recv(theirs, src, group=self.group, tag=_MODEL)
            with self.lock:
                assert self.snapshot is not None and self.pending is not None
                mine = self.snapshot + self.pending
                average = (theirs + mine) / 2
                self.pending += average - mine
                self.counter.add(average.numel() * average.element_size())
                self.counter.add_peers(1)
                self.exchanges += 1
            dist.send(average, src, group=self.group, tag=_REPLY)
