"""CSER (Xie, Zheng, Koyejo, Gupta, Li, Lin: "CSER: Communication-efficient SGD with Error
Reset", NeurIPS 2020) as its authors run it, CSER-PL, and the update-compressing form.

``--grad-combine cser`` is the authors' implementation (``xcgoner/NeurIPS2020_CSER``,
``gluon-cv/gluoncv/trainer/ersgd2_trainer_v2.py``, the trainer ``exp_CSER.sh`` runs). With
random-block compressors shared by the workers, the paper's algorithm reduces to partial
*model* averaging, and that is what runs:

* every worker takes its own optimizer step from its own model (gradients and momentum stay
  local);
* after every step, the workers average their parameters on one random block per tensor: a
  run of ``rows`` of the first dimension times a run of ``cols`` of the second (the rest of the
  dimensions whole), each tensor taking part with probability ``layers``;
* every ``period``-th step the block is the larger one (``reset_rows``, ``reset_cols``,
  ``reset_layers``): the error reset.

Averaging a block is the compressed synchronisation *and* the reset of the error on that
block: the errors are the replicas' differences from their mean, which are never stored.
Evaluation (and the end of ``fit``) uses a temporary average of the replicas and leaves the
local models untouched. The blocks are drawn as the authors draw them (Python's ``random``,
the same stream on every worker: per tensor ``uniform(0, 1) <= layers``, then the start of
each run as a multiple of its length); our stream is reseeded per step from the run seed, so
a resumed or rescheduled run draws the same blocks.

``--grad-combine cser-pl`` is CSER-PL (``partial_local_sgd_trainer_v1.py``, ``exp_CSERPL.sh``):
local SGD whose models are averaged on a random block only every ``period`` steps.

``--grad-combine cser-update`` is the paper's Algorithm 1 with an arbitrary compressor (top-k,
QSGD...): the step's *update* ``u`` is compressed, ``C1(u)`` averaged, the rest kept as a
residual ``e`` applied locally; every ``period`` steps ``x_i <- x_i - e_i + mean_j C2(e_j)``,
``e_i <- 0`` (with ``C2 = none`` an exact reset; otherwise the unsent part of ``e`` is dropped).
It is ours, not the authors' code.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..data import derive_seed
from ..dist import DistEnv
from .base import option, register_combiner
from .compressed import CompressedCombiner, CompressorOptions, _compressor_names, no_loss_scaling
from .compressors import create_compressor
from .flat import (
    allreduce_mean_,
    average_buffers_,
    flatten,
    restore_optimizer_state,
    unflatten_,
)
from .localsgd import _LocalCombiner

__all__ = [
    "CSERCombiner",
    "CSEROptions",
    "CSERPLCombiner",
    "CSERPLOptions",
    "CSERUpdateCombiner",
    "CSERUpdateOptions",
    "average_random_blocks_",
    "random_block",
]

_SALT = 0x43534552  # "CSER": the block stream is the run seed's, apart from other modes'


def random_block(shape: torch.Size | tuple[int, ...], rows: float, cols: float,
                 rng: random.Random) -> tuple[slice, ...]:  # fmt: skip
    """The authors' block of one tensor: ``k = max(1, round(n * ratio))`` consecutive entries
    of the first dimension, starting at a uniformly drawn multiple of ``k`` (the last run may
    be shorter), times the same along the second dimension when there is one.

    Draws ``rng.choice`` once per dimension used, in that order (as ``ersgd2_trainer_v2.py``).
    A 0-d tensor is one entry.
    """
    sizes = tuple(shape) or (1,)
    block = []
    for n, ratio in zip(sizes[:2], (rows, cols), strict=False):
        k = max(1, round(n * ratio))
        begin = rng.choice(range(math.ceil(n / k))) * k
        block.append(slice(begin, min(begin + k, n)))
    return tuple(block)


def average_random_blocks_(
    tensors: list[Tensor],
    env: DistEnv,
    rng: random.Random,
    *,
    rows: float,
    cols: float,
    layers: float,
    dtype: torch.dtype | None = torch.float32,
) -> int:
    """Average one random block per tensor over the workers, in place (one all-reduce).

    Every worker must pass the same ``rng`` state (the blocks must agree). Per tensor, in
    order: ``rng.uniform(0, 1) <= layers`` decides whether it takes part, then
    :func:`random_block` picks the block. Returns the bytes sent.
    """
    views = []
    for t in tensors:
        if rng.uniform(0, 1) <= layers:
            view = t.detach() if t.dim() else t.detach().view(1)
            views.append(view[random_block(t.shape, rows, cols, rng)])
    return allreduce_mean_(views, env, dtype=dtype)


def _check_ratio(value: float, name: str, flag: str) -> None:
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"{name} must be in (0, 1] (the fraction of the dimension in a block; the authors' "
            f"--input-sparse 32 is {flag} 0.03125), got {value}"
        )


def _check_period(value: int) -> None:
    if value < 1:
        raise ValueError(f"period must be >= 1 (steps between error resets), got {value}")


@dataclass(frozen=True)
class CSEROptions:
    period: int = option(8, "steps H between the larger-block resets", flag="--cser-period")
    rows: float = option(
        1 / 16,
        "fraction of each tensor's first dimension averaged after every step (the authors' "
        "1 / --input-sparse-1)",
        flag="--cser-rows",
    )
    cols: float = option(
        1.0, "fraction of the second dimension (1 / --output-sparse-1)", flag="--cser-cols"
    )
    layers: float = option(
        1.0,
        "probability that a tensor takes part in a step's averaging (1 / --layer-sparse-1)",
        flag="--cser-layers",
    )
    reset_rows: float = option(
        0.5,
        "cser: fraction of the first dimension averaged every H-th step (1 / --input-sparse-2)",
        flag="--cser-reset-rows",
    )
    reset_cols: float = option(
        1.0, "cser: the reset's second-dimension fraction (1 / --output-sparse-2)",
        flag="--cser-reset-cols",
    )  # fmt: skip
    reset_layers: float = option(
        1.0, "cser: the reset's per-tensor probability (1 / --layer-sparse-2)",
        flag="--cser-reset-layers",
    )  # fmt: skip

    def __post_init__(self) -> None:
        _check_period(self.period)
        for name in ("rows", "cols", "layers", "reset_rows", "reset_cols", "reset_layers"):
            _check_ratio(getattr(self, name), name, "--cser-" + name.replace("_", "-"))


@dataclass(frozen=True)
class CSERPLOptions:
    period: int = option(8, "steps H between the block averagings", flag="--cser-period")
    rows: float = option(
        0.25, "fraction of each tensor's first dimension averaged (1 / --input-sparse)",
        flag="--cser-rows",
    )  # fmt: skip
    cols: float = option(1.0, "fraction of the second dimension", flag="--cser-cols")
    layers: float = option(1.0, "probability that a tensor takes part", flag="--cser-layers")

    def __post_init__(self) -> None:
        _check_period(self.period)
        for name in ("rows", "cols", "layers"):
            _check_ratio(getattr(self, name), name, "--cser-" + name)


class _TemporaryAverage:
    """Evaluation on the replicas' average, leaving the local models untouched.

    :meth:`synchronize` (before evaluation) puts the average of the replicas' parameters and
    floating-point buffers in the module and keeps the local ones aside; the next step goes
    back to them (subclasses call :meth:`_restore_local` first). At the end of ``fit`` the
    module keeps the average: the model to evaluate and export. The authors average only
    the parameters for evaluation and keep each worker's BatchNorm statistics; averaging the
    statistics too makes every rank evaluate the same model.
    """

    model: nn.Module | None
    env: DistEnv | None
    _dtype: torch.dtype
    _local: list[Tensor] | None = None  # the local params + floating buffers while averaged
    _keep = False  # fit has ended: the module keeps the average

    def _replica(self) -> list[Tensor]:
        assert self.model is not None
        buffers = [b for b in self.model.buffers() if b.is_floating_point()]
        return list(self.model.parameters()) + buffers

    def _hold_average(self) -> None:
        """Put the replicas' average in the module (a collective), keeping the local aside."""
        assert self.env is not None
        if self._local is not None or not self.env.distributed:
            return
        with torch.no_grad():
            tensors = self._replica()
            self._local = [t.detach().clone() for t in tensors]
            self.counter.add(allreduce_mean_(tensors, self.env, dtype=self._dtype))  # type: ignore[attr-defined]

    def _restore_local(self) -> None:
        if self._local is not None:
            with torch.no_grad():
                for t, saved in zip(self._replica(), self._local, strict=True):
                    t.copy_(saved)
            self._local = None
        self._keep = False

    def synchronize(self) -> None:
        """Before evaluation (every rank): the module holds the replicas' average."""
        self._hold_average()

    def end_evaluation(self) -> None:
        """After evaluation: training goes on from the local models (unless ``fit`` ended)."""
        if not self._keep:
            self._restore_local()

    def close(self) -> None:
        """End of ``fit``: the module keeps the average (the model to evaluate and export)."""
        self._hold_average()
        self._keep = True

    def checkpoint_model(self) -> dict[str, Any] | None:
        """The checkpoint's model: the replicas' average (a collective); training goes on
        from the local models."""
        assert self.model is not None and self.env is not None
        if not self.env.distributed:
            return None
        with torch.no_grad():
            names = [n for n, _ in self.model.named_parameters()]
            names += [n for n, b in self.model.named_buffers() if b.is_floating_point()]
            average = [t.detach().clone() for t in self._replica()]
            if self._local is None:  # the module holds the local models: average them
                allreduce_mean_(average, self.env, dtype=self._dtype)
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            state.update(zip(names, average, strict=True))
        return state

    def _local_params(self) -> list[Tensor]:
        """This rank's own parameters (not the evaluated average), as copies."""
        assert self.model is not None
        if self._local is None:
            return [p.detach().clone() for p in self.model.parameters()]
        return [t.clone() for t in self._local[: len(list(self.model.parameters()))]]

    def _local_buffers(self) -> list[Tensor]:
        assert self.model is not None
        if self._local is None:
            return [b.detach().clone() for b in self.model.buffers()]
        floating = iter(self._local[len(list(self.model.parameters())) :])
        return [
            next(floating).clone() if b.is_floating_point() else b.detach().clone()
            for b in self.model.buffers()
        ]


class _BlockAveraging(_TemporaryAverage, _LocalCombiner):
    """Local models and random-block model averaging (:class:`_TemporaryAverage` for the
    evaluation). Each worker keeps its own model and optimizer state (momentum)."""

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.period = int(self.options.period)

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)  # rank 0's start everywhere
        double = next(model.parameters()).dtype == torch.float64
        self._dtype = torch.float64 if double else torch.float32
        return model

    def _params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def _rng(self) -> random.Random:
        return random.Random(derive_seed(self.seed, self.steps, _SALT))

    def _average_blocks(self, rows: float, cols: float, layers: float) -> None:
        assert self.env is not None
        if not self.env.distributed:
            return
        with torch.no_grad():
            sent = average_random_blocks_(
                self._params(), self.env, self._rng(), rows=rows, cols=cols, layers=layers,
                dtype=self._dtype,
            )  # fmt: skip
        self.counter.add(sent)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        self._restore_local()
        super().step(optimizer, scaler)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["params"], state["buffers"] = self._local_params(), self._local_buffers()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._local, self._keep = None, False
        super().load_state_dict(state_dict)

    def load_other_world(self, states: list[dict[str, Any]]) -> None:
        """After a world-size change: every worker starts at the old replicas' average (the
        momentum is rank 0's: the trainer has loaded its optimizer)."""
        assert self.model is not None
        self.steps = int(states[0]["steps"])
        self._local, self._keep = None, False
        with torch.no_grad():
            for i, p in enumerate(self.model.parameters()):
                p.copy_(torch.stack([s["params"][i] for s in states]).mean(0))
            for i, b in enumerate(self.model.buffers()):
                if b.is_floating_point():
                    b.copy_(torch.stack([s["buffers"][i] for s in states]).mean(0))


@register_combiner("cser", CSEROptions)
class CSERCombiner(_BlockAveraging):
    """CSER as the authors run it: a random block of the models averaged after every step,
    the larger reset block every ``period``-th step (module docstring).

    With ``rows = cols = layers = 1`` (whole tensors every step) it is synchronous SGD when
    the optimizer is linear in the gradient (SGD with or without momentum, from equal
    starts): the models stay equal.
    """

    summary = "random-block model averaging every step, a larger block every H (the authors')"

    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        o = self.options
        if self.steps % self.period == 0:
            self._average_blocks(o.reset_rows, o.reset_cols, o.reset_layers)
        else:
            self._average_blocks(o.rows, o.cols, o.layers)


@register_combiner("cser-pl", CSERPLOptions)
class CSERPLCombiner(_BlockAveraging):
    """CSER-PL: local steps, a random block of the models averaged every ``period`` steps."""

    summary = "local SGD averaging a random block of the models every H steps"

    def _communicate(self, optimizer: torch.optim.Optimizer) -> None:
        if self.steps % self.period == 0:
            o = self.options
            self._average_blocks(o.rows, o.cols, o.layers)


@dataclass(frozen=True)
class CSERUpdateOptions(CompressorOptions):
    period: int = option(8, "error-reset period H (optimizer steps)", flag="--cser-period")
    reset_compressor: str = option(
        "none",
        "compressor C2 of the error reset (none: an exact reset)",
        flag="--cser-reset-compressor",
        choices=_compressor_names,
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.period < 1:
            raise ValueError(f"period must be >= 1 (steps between error resets), got {self.period}")
        create_compressor(self.reset_compressor)


@register_combiner("cser-update", CSERUpdateOptions)
class CSERUpdateCombiner(_TemporaryAverage, CompressedCombiner):
    """The paper's Algorithm 1 with any compressor (ours): ``C1`` of the update every step,
    an error reset with ``C2`` every H (module docstring).

    Each worker keeps its own optimizer state (momentum) and model ``x_i = xbar + e_i``: the
    synchronised part ``xbar`` (the same on every worker: it only ever changes by
    all-reduced amounts) plus its residual. Every ``period``-th step resets the residuals,
    after which every replica is exactly ``xbar`` (with ``C2 = none``). Floating-point
    buffers (BatchNorm statistics) stay local and are averaged at the resets. Evaluation
    uses the replicas' temporary average (:class:`_TemporaryAverage`): it does not change
    the trajectory.
    """

    summary = "compressed updates, residuals reset every H steps (any --compressor)"

    def __init__(self, options: CSERUpdateOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.period = self.options.period
        self.reset_compressor = create_compressor(self.options.reset_compressor)
        self.synced: Tensor | None = None  # xbar, flat fp32
        self.residual: Tensor | None = None  # e_i, flat fp32

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)
        self._dtype = torch.float32
        self.reset_compressor.bind(env.world_size)
        self.synced = flatten(self._params())
        self.residual = torch.zeros_like(self.synced)
        return model

    def _params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        no_loss_scaling(scaler, self.name)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        assert self.synced is not None and self.residual is not None
        self._restore_local()
        params = self._params()
        with torch.no_grad():
            start = flatten(params)
            super().step(optimizer, scaler)
            update = flatten(params) - start
            mean, own = self._reduce(update, self.compressor, salt=0)
            self.synced += mean  # the averaged compressed part
            self.residual += update - own  # the rest: applied locally, remembered
            unflatten_(params, self.synced + self.residual)
        self.counter.step()
        self.steps += 1
        if self.steps % self.period == 0:
            self._reset()

    def _reset(self) -> None:
        """``xbar += mean_j C2(e_j)``; ``e_i <- 0``; ``x_i <- xbar``; buffers averaged."""
        assert self.model is not None and self.env is not None
        assert self.synced is not None and self.residual is not None
        with torch.no_grad():
            mean, _ = self._reduce(self.residual, self.reset_compressor, salt=1)
            self.synced += mean
            self.residual.zero_()
            unflatten_(self._params(), self.synced)
        self.counter.add(average_buffers_(self.model, self.env))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        assert self.synced is not None and self.residual is not None
        assert self.optimizer is not None
        state["synced"] = self.synced.clone()
        state["residual"] = self.residual.clone()
        state["params"] = self._local_params()
        state["buffers"] = self._local_buffers()
        state["optimizer"] = self.optimizer.state_dict()["state"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        assert self.optimizer is not None and self.model is not None
        self._local, self._keep = None, False
        self.synced = state_dict["synced"].clone()
        self.residual = state_dict["residual"].clone()
        with torch.no_grad():
            for p, saved in zip(self.model.parameters(), state_dict["params"], strict=True):
                p.copy_(saved)
            for b, saved in zip(self.model.buffers(), state_dict["buffers"], strict=True):
                b.copy_(saved)
        restore_optimizer_state(self.optimizer, state_dict.get("optimizer"))
