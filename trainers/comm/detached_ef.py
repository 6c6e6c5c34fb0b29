"""``--grad-combine def``: detached error feedback (Xu & Huang, ICML 2022, arXiv 2004.05298).

State per worker ``i``: the shared model ``x`` (equal on every worker: it only changes by
all-reduced amounts), the error ``e_i``, the local model ``y_i`` (the module's parameters,
where gradients are taken) and the local optimizer state (momentum ``m_i``). Each optimizer
step, the worker's own optimizer steps ``y_i`` (for SGD: ``m_i <- mu m_i + g + wd y_i``;
``y_i <- y_i - lr m_i``), and the step's update is added to ``delta_i`` (``delta_i <- delta_i +
lr m_i``). Every ``period`` steps (default 1)::

    c      = mean_j C(delta_j)            # one compressed all-reduce
    e_i    = delta_i - C(delta_i)
    x      = x - c
    y_i    = x - coeff * e_i              # the "detached" local model
    delta_i = e_i

so with period 1, ``delta_i = e_i + lr m_i``. ``coeff = 0`` is error feedback on the updates
(every worker steps from ``x``); ``coeff = 1`` puts each worker at its own ``x - e_i``; the
authors' CIFAR recipe uses 0.3 with random-block sparsification at ratio 1/64 on 4 workers.
For any compressor ``x - mean(e)`` moves exactly by ``-lr mean_i m_i`` each step: the
averaged model is the one synchronous momentum SGD would step, with the gradients taken at
the detached points. Evaluation (``synchronize``) and the model left at the end of ``fit``
are ``x - mean_j e_j`` (the authors' evaluation point), and so is the ``model`` entry of every
checkpoint; training resumes from ``y_i`` (every rank's ``x``, ``e_i``, ``delta_i``, ``y_i`` and
momentum are in the checkpoint's per-rank state).

``blocks="tensor"`` (``--def-blocks tensor``) compresses each parameter tensor on its own (their
reducer sends one random block per tensor), all tensors' payloads in one all-reduce.

The rule follows the authors' code (``anxuthu/DEF``, ``optimizers/Def.py``: the update is
accumulated into ``delta`` between communications and the error is kept in it afterwards).
The paper's accelerated-generalization variant (DEF-A) is not implemented: its rule is not in
the authors' code and could not be checked against the paper here (docs/communication.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..dist import DistEnv
from .base import option, register_combiner
from .compressed import CompressedCombiner, CompressorOptions, _compressor_names, no_loss_scaling
from .flat import allreduce_mean_, average_buffers_, flatten, restore_optimizer_state, unflatten_

__all__ = ["DEFCombiner", "DEFOptions"]


@dataclass(frozen=True)
class DEFOptions(CompressorOptions):
    compressor: str = option(
        "randblock", "the compressor (random-block: the paper's)", choices=_compressor_names
    )
    coeff: float = option(
        0.3, "local models y = x - coeff * e (0: error feedback on updates)", flag="--def-coeff"
    )
    period: int = option(1, "optimizer steps between communications", flag="--def-period")
    blocks: str = option(
        "flat",
        "what the compressor sees: flat (the whole update as one vector) or tensor (each "
        "parameter tensor on its own, the authors' reducer: one random block per tensor)",
        choices=("flat", "tensor"),
        flag="--def-blocks",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.coeff < 0:
            raise ValueError(f"coeff must be >= 0 (y = x - coeff * e), got {self.coeff}")
        if self.period < 1:
            raise ValueError(
                f"period must be >= 1 (steps between communications), got {self.period}"
            )
        if self.blocks not in ("flat", "tensor"):
            raise ValueError(f"blocks must be 'flat' or 'tensor', got {self.blocks!r}")


@register_combiner("def", DEFOptions)
class DEFCombiner(CompressedCombiner):
    """DEF: compressed all-reduce of the accumulated updates, local models detached from the
    shared one by ``coeff`` times the error (module docstring).

    Floating-point buffers (BatchNorm statistics) stay local and are averaged before each
    evaluation. fp16 loss scaling is refused (the error would carry the scale).
    """

    summary = "detached error feedback (a --compressor)"

    def __init__(self, options: DEFOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.coeff = float(self.options.coeff)
        self.period = int(self.options.period)
        self.per_tensor = self.options.blocks == "tensor"
        self.synced: Tensor | None = None  # x
        self.error: Tensor | None = None  # e_i
        self.delta: Tensor | None = None  # delta_i
        self._local: Tensor | None = None  # y_i while the module holds x - mean(e)
        self._keep = False  # the module keeps x - mean(e) after an evaluation (fit ended)

    # -- set-up --------------------------------------------------------------------------------
    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        model = super().prepare(model, optimizer, env)  # rank 0's weights everywhere
        params = self._params()
        self._dtype = torch.float64 if params[0].dtype == torch.float64 else torch.float32
        self.synced = flatten(params, self._dtype)
        self.error = torch.zeros_like(self.synced)
        self.delta = torch.zeros_like(self.synced)
        return model

    def _params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    # -- a step ----------------------------------------------------------------------------------
    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        no_loss_scaling(scaler, self.name)  # gradients stay local: the local optimizer steps y_i

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        assert self.synced is not None and self.error is not None and self.delta is not None
        params = self._params()
        self._restore_local()
        with torch.no_grad():
            before = flatten(params, self._dtype)
            super().step(optimizer, scaler)
            self.delta -= flatten(params, self._dtype) - before  # + lr m_i for SGD
        self.steps += 1
        if self.steps % self.period == 0:
            with torch.no_grad():
                if self.per_tensor:
                    mean, own = self._reduce_per_tensor(self.delta, self.compressor, params)
                else:
                    mean, own = self._reduce(self.delta, self.compressor, salt=0)
                self.error = self.delta - own
                self.synced -= mean
                unflatten_(params, self.synced - self.coeff * self.error)
                self.delta = self.error.clone()
        self.counter.step()

    def metrics(self) -> dict[str, float]:
        """The counter's bytes, and this rank's ``error_norm`` ||e_i|| next to ``shared_norm``
        ||x||: how far the local model y_i = x - coeff e_i is detached from the shared one."""
        out = super().metrics()
        if self.error is not None and self.synced is not None:
            out["error_norm"] = float(self.error.norm())
            out["shared_norm"] = float(self.synced.norm())
        return out

    # -- the averaged model ------------------------------------------------------------------------
    def _hold_average(self) -> None:
        """Put ``x - mean_j e_j`` in the module (a collective), keeping ``y_i`` aside."""
        assert self.model is not None and self.env is not None
        assert self.synced is not None and self.error is not None
        if self._local is not None:
            return
        with torch.no_grad():
            mean_error = self.error.clone()
            self.counter.add(allreduce_mean_([mean_error], self.env, dtype=self._dtype))
            self._local = flatten(self._params(), self._dtype)
            unflatten_(self._params(), self.synced - mean_error)
        self.counter.add(average_buffers_(self.model, self.env))

    def _restore_local(self) -> None:
        if self._local is not None:
            unflatten_(self._params(), self._local)
            self._local = None
        self._keep = False

    def synchronize(self) -> None:
        """Before evaluation (every rank): the module holds ``x - mean(e)``."""
        self._hold_average()

    def end_evaluation(self) -> None:
        """After evaluation: training continues from the local models ``y_i`` (unless ``fit``
        has ended: then the module keeps ``x - mean(e)``)."""
        if not self._keep:
            self._restore_local()

    def close(self) -> None:
        """End of ``fit`` (every rank): leave ``x - mean(e)`` in the module, the model to
        evaluate and export; a later step goes back to ``y_i`` first."""
        self._hold_average()
        self._keep = True

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint_model(self) -> dict[str, Any]:
        """The checkpoint's model: ``x - mean(e)`` and the averaged floating buffers (a
        collective); the module keeps training from ``y_i``."""
        assert self.model is not None and self.env is not None
        assert self.synced is not None and self.error is not None
        with torch.no_grad():
            mean_error = self.error.clone()
            allreduce_mean_([mean_error], self.env, dtype=self._dtype)
            average = self.synced - mean_error
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            offset = 0
            for name, p in self.model.named_parameters():
                if p.requires_grad:
                    state[name] = average[offset : offset + p.numel()].view_as(p).to(p.dtype)
                    offset += p.numel()
            buffers = [state[k] for k, b in self.model.named_buffers() if b.is_floating_point()]
            allreduce_mean_(buffers, self.env)
        return state

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        assert self.synced is not None and self.error is not None and self.delta is not None
        assert self.optimizer is not None
        local = self._local if self._local is not None else flatten(self._params(), self._dtype)
        state.update(
            synced=self.synced.clone(), error=self.error.clone(), delta=self.delta.clone(),
            local=local.clone(), optimizer=self.optimizer.state_dict()["state"],
        )  # fmt: skip
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        assert self.optimizer is not None
        self.synced = state_dict["synced"].clone()
        self.error = state_dict["error"].clone()
        self.delta = state_dict["delta"].clone()
        self._local, self._keep = None, False
        unflatten_(self._params(), state_dict["local"])
        restore_optimizer_state(self.optimizer, state_dict.get("optimizer"))

    def load_other_world(self, states: list[dict[str, Any]]) -> None:
        """After a world-size change: every worker restarts at the old world's ``x -
        mean(e)`` with no error (the momentum is rank 0's: the trainer loads its optimizer)."""
        start = states[0]["synced"] - torch.stack([s["error"] for s in states]).mean(0)
        self.synced = start.to(self._dtype).clone()
        self.error = torch.zeros_like(self.synced)
        self.delta = torch.zeros_like(self.synced)
        self._local, self._keep = None, False
        unflatten_(self._params(), self.synced)
