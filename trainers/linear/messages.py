"""The one collective of the linear solvers: a counted (and optionally delayed) all-reduce.

Both solvers of :mod:`trainers.linear` talk through a :class:`Messenger`, so the number of
messages and bytes each one sends is measured where it is sent, not derived from a
formula. ``latency`` sleeps that many seconds before each all-reduce, to model a network
whose per-message cost dominates (the benchmark's setting, ``benchmarks/bench_linear.py``).
In a world of one there is nothing to reduce; the message is still counted (what the same
run would send with more ranks) but not delayed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Messenger"]


@dataclass
class Messenger:
    """Sum-all-reduce over ``group`` (default: the world), counting what is sent.

    Attributes:
        group: the process group, or None for the default one.
        latency: seconds to sleep before each all-reduce when the world has several ranks.
        messages: all-reduce calls so far.
        bytes: bytes of the tensors reduced so far (one rank's contribution).
    """

    group: object | None = None
    latency: float = 0.0
    messages: int = 0
    bytes: int = 0

    @property
    def world_size(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.group)
        return 1

    @property
    def rank(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(self.group)
        return 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place and return it."""
        self.messages += 1
        self.bytes += tensor.numel() * tensor.element_size()
        if self.world_size > 1:
            if self.latency > 0:
                time.sleep(self.latency)
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor
