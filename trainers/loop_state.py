"""The trainer's per-rank bookkeeping: metric sums, the training clock, RNG states."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .dist import DistEnv

__all__ = ["Meter", "elapsed", "rng_state", "set_rng_state"]


class Meter:
    """Sums of the loss and of the metrics over micro-batches, reduced across ranks on demand."""

    def __init__(self) -> None:
        self.loss: torch.Tensor | float = 0.0
        self.batches = 0
        self.sums: dict[str, torch.Tensor | float] = {}

    def update(self, metrics: Mapping[str, Any], loss: torch.Tensor | None = None) -> None:
        if loss is not None:
            self.loss = self.loss + loss.detach().float()
        self.batches += 1
        for name, value in metrics.items():
            value = value.detach().double() if isinstance(value, torch.Tensor) else float(value)
            self.sums[name] = self.sums.get(name, 0.0) + value

    def touch(self, names: Sequence[str]) -> None:
        """Make sure ``names`` are summed (as 0) without counting a micro-batch: a rank that
        skipped a step still offers the same vector to :meth:`reduce`."""
        for name in names:
            self.sums.setdefault(name, 0.0)

    def reduce(
        self, env: DistEnv, keys: Sequence[str] | None = None
    ) -> tuple[float, dict[str, float]]:
        """Global means: the loss per micro-batch, metrics per ``count`` (or micro-batch)."""
        names = sorted(self.sums) if keys is None else list(keys)
        values = [self.loss, float(self.batches)] + [self.sums.get(n, 0.0) for n in names]
        vector = torch.stack(
            [torch.as_tensor(v, dtype=torch.float64, device=env.device).reshape(()) for v in values]
        )
        totals = env.all_reduce_sum(vector).tolist()
        loss_sum, batches, reduced = totals[0], totals[1], dict(zip(names, totals[2:], strict=True))
        # Report in the order train_step/eval_step returned them (ranks agree on the set).
        order = [n for n in self.sums if n in reduced] + [n for n in names if n not in self.sums]
        sums = {n: reduced[n] for n in order}
        denominator = sums.pop("count", batches)
        loss = loss_sum / batches if batches else math.nan
        means = {
            name: total / denominator if denominator else math.nan for name, total in sums.items()
        }
        return loss, means

    def state_dict(self) -> dict[str, Any]:
        return {
            "loss": float(self.loss),
            "batches": self.batches,
            "sums": {k: float(v) for k, v in self.sums.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.loss = float(state["loss"])
        self.batches = int(state["batches"])
        self.sums = {k: float(v) for k, v in state["sums"].items()}

    @staticmethod
    def merged(states: Sequence[Mapping[str, Any]], keep: bool) -> dict[str, Any]:
        """All ranks' sums on one rank (``keep``), zeros with the same keys on the others."""
        keys = sorted({k for s in states for k in s["sums"]})
        if not keep:
            return {"loss": 0.0, "batches": 0, "sums": dict.fromkeys(keys, 0.0)}
        return {
            "loss": sum(s["loss"] for s in states),
            "batches": sum(s["batches"] for s in states),
            "sums": {k: sum(s["sums"].get(k, 0.0) for s in states) for k in keys},
        }


def elapsed(start: float, paused_at_start: float, paused_now: float) -> float:
    """Wall time since ``start`` minus the evaluation/saving time spent meanwhile."""
    return time.perf_counter() - start - (paused_now - paused_at_start)


def rng_state() -> dict[str, Any]:
    """This process's RNG states in types ``torch.load(weights_only=True)`` accepts."""
    _, keys, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "numpy": {
            "keys": keys.tolist(),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": list(mt), "gauss": gauss},
    }


def set_rng_state(state: Mapping[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and device.type == "cuda":
        torch.cuda.set_rng_state_all(state["cuda"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            np.asarray(np_state["keys"], dtype=np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
