"""Any registered mode in a plain PyTorch loop: ``combiner.wrap(optimizer, model)``.

Horovod's ``hvd.DistributedOptimizer`` experience for every ``--grad-combine`` mode, without
the :class:`~trainers.Trainer`::

    import torch.distributed as dist
    from trainers.comm import create_combiner

    combiner = create_combiner("localsgd", period=4, seed=0)
    opt = combiner.wrap(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    model = opt.model                       # call this one (DDP for the averaging modes)
    part, parts = opt.data_shard()          # this rank's shard of each global batch
    for x, y in loader:                     # the shard's batches
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()                          # combine as the mode says, then the update
    with opt.evaluating():                  # replicas that drifted apart agree here
        evaluate(model)

The wrapper runs the same protocol the Trainer drives (:mod:`trainers.comm.base`):
``prepare`` once, then per optimizer step ``reduce_gradients`` and ``step``; ``no_sync()``
around the backward of non-final micro-batches (gradient accumulation); ``synchronize`` and
``end_evaluation`` around an evaluation (:meth:`DistributedOptimizer.evaluating`). It is a
:class:`torch.optim.Optimizer` sharing the wrapped optimizer's ``param_groups`` and ``state``,
so learning-rate schedulers attach to it as to the optimizer.

What the Trainer adds and a plain loop must do itself: shard the data
(:meth:`DistributedOptimizer.data_shard`), evaluate under :meth:`~DistributedOptimizer.evaluating`,
call :meth:`~DistributedOptimizer.close` when training ends (asynchronous gossip stops its
thread there), and, for CodedReduce, skip a step's forward and backward when
:meth:`~DistributedOptimizer.skips_step` says so (then call :meth:`step` without gradients).
fp16 loss scaling is the Trainer's (``GradScaler``); here train in float32 or bfloat16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..dist import DistEnv

if TYPE_CHECKING:
    from .base import GradCombiner

__all__ = ["DistributedOptimizer"]


class DistributedOptimizer(torch.optim.Optimizer):
    """``optimizer`` driven by ``combiner`` (see the module docstring); made by
    :meth:`GradCombiner.wrap <trainers.comm.GradCombiner.wrap>`.

    Attributes:
        model: the module to call (the combiner's: DDP for the averaging modes, else
            ``model`` itself).
        optimizer: the wrapped optimizer (its update is the one applied).
        combiner: the mode.
        env: the :class:`~trainers.DistEnv` (the default process group).
    """

    def __init__(  # the base class's __init__ is not called: the state is the wrapped one's
        self,
        combiner: GradCombiner,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        env: DistEnv | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"wrap: expected a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("wrap: this optimizer is already wrapped by a combiner")
        if not isinstance(model, nn.Module):
            raise TypeError(f"wrap: expected the model (an nn.Module), got {type(model).__name__}")
        if combiner.model is not None:
            raise ValueError(
                f"wrap: combiner {combiner.name!r} is already prepared for a model; "
                "create one combiner per model"
            )
        self.combiner = combiner
        self.optimizer = optimizer
        self.env = env if env is not None else DistEnv.from_env()
        self.model = combiner.prepare(model, optimizer, self.env)
        self.defaults = optimizer.defaults

    # the wrapped optimizer's state, shared (schedulers and user code read and write it)
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    # -- the step ------------------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Combine the gradients as the mode says, then the wrapped optimizer's update (the
        mode may change what it updates: local models, averaged models, a delayed gradient)."""
        if closure is not None:
            raise ValueError(
                "wrap: step(closure) is not supported (the mode decides when the wrapped "
                "optimizer steps); compute the loss and backward before step()"
            )
        self.combiner.reduce_gradients(None)
        self.combiner.step(self.optimizer, None)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Around the backward of every micro-batch but the last of an optimizer step."""
        with self.combiner.no_sync():
            yield

    def skips_step(self) -> bool:
        """Before a step's first forward: whether this rank's gradient no longer matters
        (CodedReduce's late ranks); skip the forward and backward and call :meth:`step`."""
        return self.combiner.skips_step()

    def data_shard(self) -> tuple[int, int]:
        """``(part, parts)``: train on shard ``part`` of ``parts`` of every global batch."""
        return self.combiner.data_shard()

    # -- evaluation, metrics, the end ----------------------------------------------------------
    @contextlib.contextmanager
    def evaluating(self) -> Iterator[nn.Module]:
        """Evaluate inside this (every rank): replicas that drifted apart (local SGD, CSER,
        gossip) are made equal first, and whatever was set up for the evaluation only
        (DEF's averaged model) is undone after. Yields :attr:`model`."""
        self.combiner.synchronize()
        try:
            yield self.model
        finally:
            self.combiner.end_evaluation()

    def metrics(self) -> dict[str, float]:
        """The mode's numbers for the last step (``bytes_sent``, ``grad_bytes``, ...)."""
        return self.combiner.metrics()

    def close(self) -> None:
        """When training ends (every rank): stop background communication."""
        self.combiner.close()

    # -- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state and this rank's combiner state (save it per rank)."""
        return {"optimizer": self.optimizer.state_dict(), "combiner": self.combiner.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        if set(state_dict) != {"optimizer", "combiner"}:
            raise ValueError(
                "wrap: load_state_dict expects what DistributedOptimizer.state_dict() saved "
                f"(keys 'optimizer', 'combiner'), got keys {sorted(state_dict)}"
            )
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.combiner.load_state_dict(state_dict["combiner"])

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            "wrap: parameters cannot be added after wrapping (the mode was prepared for the "
            "model's parameters); build the optimizer with every group first"
        )

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.combiner!r}, {self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("wrap: a DistributedOptimizer is not picklable; save state_dict()")
