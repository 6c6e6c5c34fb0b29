"""Non-finite losses and weights, found without a host synchronisation per step.

A NaN or infinite training loss on any rank stops :meth:`trainers.Trainer.fit` with
:class:`~trainers.errors.NonFiniteError`, naming the step and the likely cause. Each rank
keeps its first bad step on the device (:meth:`NonFiniteWatch.watch`: a few tiny kernels, no
sync), and the ranks agree (one all-reduce of 3 numbers per rank, :meth:`NonFiniteWatch.agree`)
where the loop waits anyway: the log interval's reduction, the end of an epoch, before every
evaluation and checkpoint, and the end of ``fit`` (which also checks the weights).
``TrainerConfig.skip_nonfinite = N`` instead agrees every step and skips the update of up to N
such steps (:meth:`NonFiniteWatch.skip_step`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ._dtensor import local_tensor
from .errors import NonFiniteError

__all__ = ["NonFiniteWatch"]


class NonFiniteWatch:
    """One rank's watch over the losses and weights of a run.

    Args:
        env: the (data-parallel) :class:`~trainers.dist.DistEnv` the ranks agree over.
        logger: the run's logger (a skipped step is reported).
        config: the :class:`~trainers.config.TrainerConfig` (``skip_nonfinite``,
            ``clip_grad_norm`` and ``precision`` for the advice).
        lr_at: the trainer's learning rate of a step (for the advice).
    """

    def __init__(self, env: Any, logger: Any, config: Any, lr_at: Callable[[int], float]) -> None:
        self.env = env
        self.logger = logger
        self.config = config
        self.lr_at = lr_at
        # This rank's first non-finite loss since the last check: its (1-based) step and
        # value, 0-d tensors on the loss's device (no host sync).
        self.bad_step: torch.Tensor | None = None
        self.bad_loss: torch.Tensor | None = None
        self.skipped: list[int] = []  # steps whose update skip_nonfinite skipped

    def watch(self, loss: torch.Tensor, global_step: int) -> None:
        """Remember this rank's first non-finite loss and its step, on the device (no sync);
        ``global_step``: the optimizer steps done before this one."""
        value = loss.detach()
        if self.bad_step is None or self.bad_loss is None:
            self.bad_step = torch.zeros((), dtype=torch.float64, device=value.device)
            self.bad_loss = torch.zeros((), dtype=torch.float64, device=value.device)
        keep = torch.isfinite(value) | (self.bad_step > 0)  # a few tiny kernels, no sync
        self.bad_step = torch.where(keep, self.bad_step, float(global_step + 1))
        self.bad_loss = torch.where(keep, self.bad_loss, value)

    def agree(
        self, model: nn.Module, global_step: int, *, weights: bool = False
    ) -> tuple[int, float, int, str] | None:
        """A collective: the earliest non-finite loss of any rank since the last check, as
        ``(step, loss, rank, "")``; with ``weights``, else the first non-finite parameter of
        ``model`` as ``(step, nan, rank, name)``; ``None`` when all is finite. One all-reduce
        of 3 numbers per rank: every rank gets the same answer, so all of them raise (or go
        on) together."""
        env = self.env
        row = torch.zeros(3, dtype=torch.float64, device=env.device)
        if self.bad_step is not None and self.bad_loss is not None:
            row[0] = self.bad_step.to(env.device)
            row[1] = self.bad_loss.to(env.device)
        names: list[str] = []
        if weights:
            named = [(n, local_tensor(p.detach())) for n, p in model.named_parameters()]
            if named:
                names = [n for n, _ in named]
                with torch.no_grad():
                    bad = ~torch.stack([torch.isfinite(p).all().to(env.device) for _, p in named])
                    first = bad.to(torch.float64).argmax() + 1
                    row[2] = torch.where(bad.any(), first, 0.0)
        vector = torch.zeros(3 * env.world_size, dtype=torch.float64, device=env.device)
        vector[3 * env.rank : 3 * env.rank + 3] = row
        rows = env.all_reduce_sum(vector).view(-1, 3).tolist()  # the one host sync
        losses = [(int(step), loss, rank) for rank, (step, loss, _) in enumerate(rows) if step]
        if losses:
            step, loss, rank = min(losses)
            return step, loss, rank, ""
        params = [(rank, int(index)) for rank, (_, _, index) in enumerate(rows) if index]
        if params:
            rank, index = params[0]
            name = names[index - 1] if index <= len(names) else f"#{index - 1}"
            return global_step, math.nan, rank, name
        return None

    def check(self, model: nn.Module, global_step: int, *, weights: bool = False) -> None:
        """A collective: raise :class:`NonFiniteError` if some rank saw a non-finite loss
        (or, with ``weights``, holds a non-finite parameter)."""
        found = self.agree(model, global_step, weights=weights)
        if found is not None:
            raise NonFiniteError(self.message(*found))

    def skip_step(self, model: nn.Module, global_step: int) -> bool:
        """``skip_nonfinite``: whether this step's loss was non-finite on some rank (a
        collective, every step); such a step is skipped, the (N+1)-th one raises."""
        found = self.agree(model, global_step)
        if found is None:
            return False
        self.bad_step = self.bad_loss = None  # handled: the next bad step is a new one
        step, loss, rank, _ = found
        if len(self.skipped) >= self.config.skip_nonfinite:
            raise NonFiniteError(self.message(*found))
        self.skipped.append(step)
        where = f" on rank {rank}" if self.env.world_size > 1 else ""
        self.logger.info(
            f"step {step}: non-finite loss ({loss}){where}, its update skipped "
            f"({len(self.skipped)} of --skip-nonfinite {self.config.skip_nonfinite})"
        )
        return True

    def message(self, step: int, loss: float, rank: int, parameter: str) -> str:
        """What went wrong where, and the flags most likely at fault."""
        where = f" on rank {rank}" if self.env.world_size > 1 else ""
        if parameter:
            what = f"non-finite weights after step {step}{where} (parameter {parameter!r})"
        else:
            what = f"non-finite loss ({loss}) at step {step}{where}"
        skipped = self.config.skip_nonfinite
        if skipped and len(self.skipped) >= skipped:
            steps = ", ".join(str(s) for s in self.skipped)
            what += f", one more than --skip-nonfinite {skipped} tolerates (skipped: {steps})"
        if step <= 1 and not parameter:
            return (
                f"{what}, before any update: check the data (a NaN or inf input) and the loss "
                "function; --skip-nonfinite N skips up to N such steps"
            )
        fixes = [f"lower --lr (now {self.lr_at(max(step - 2, 0)):g})"]
        if self.config.clip_grad_norm is None:
            fixes.append("clip the gradients (--clip-grad-norm, where the script has it)")
        if self.config.precision == "fp16":
            fixes.append("train in --dtype bfloat16 or float32")
        advice = fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + " or " + fixes[-1]
        return (
            f"{what}: the training diverged; {advice}; --skip-nonfinite N skips up to N steps "
            "with a non-finite loss"
        )
