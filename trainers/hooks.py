"""Reusable Trainer hooks (see :mod:`trainers.trainer` for the hook protocol)."""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["EarlyStopping", "StopAtTarget"]


class EarlyStopping:
    """Keeps the weights of the best evaluation; with ``patience``, stops when none is better.

    Args:
        model: the bare module whose ``state_dict`` is kept.
        score: evaluation metrics -> a comparable score (higher is better), e.g.
            ``lambda m: (m["val_acc"], -m["val_loss"])`` (ties in accuracy: lower loss).
        patience: stop (:meth:`Trainer.request_stop`) after this many evaluations without a
            better score (0: never stop early).
        report: ``{name in the end record: metric}`` of the best evaluation, e.g.
            ``{"best_val_acc": "val_acc"}``; ``best_epoch`` is always reported.
        name: what the score measures, for the console line when stopping.

    The kept weights are ``best_state`` (load them after ``fit``); :meth:`final_metrics`
    joins the ``end`` record, so it states the kept model's numbers. Checkpointed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        score: Callable[[Mapping[str, float]], Any],
        patience: int = 0,
        report: Mapping[str, str] | None = None,
        name: str = "score",
    ) -> None:
        if patience < 0:
            raise ValueError(f"patience must be >= 0 (0: never stop early), got {patience}")
        self.model, self.score, self.patience = model, score, int(patience)
        self.report = dict(report or {})
        self.name = name
        self.best: Any = None
        self.best_metrics: dict[str, float] = {}
        self.best_state: dict[str, torch.Tensor] | None = None
        self.bad = 0

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        score = self.score(metrics)
        if self.best is None or score > self.best:
            self.best, self.bad = score, 0
            self.best_state = copy.deepcopy(self.model.state_dict())
            self.best_metrics = {"best_epoch": trainer.epoch}
            self.best_metrics.update({k: metrics[m] for k, m in self.report.items()})
        else:
            self.bad += 1
            if self.patience and self.bad >= self.patience:
                trainer.logger.info(
                    f"Early stopping: no better {self.name} in {self.bad} evaluations"
                )
                trainer.request_stop()

    def final_metrics(self) -> dict[str, float]:
        """The best evaluation's numbers, for the end record."""
        return dict(self.best_metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_metrics": self.best_metrics, "bad": self.bad,
                "best_state": self.best_state}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        best = state["best"]
        self.best = tuple(best) if isinstance(best, list) else best
        self.best_metrics, self.bad = dict(state["best_metrics"]), int(state["bad"])
        self.best_state = state["best_state"]


class StopAtTarget:
    """Time to accuracy (MLPerf's rule): stop at the first evaluation whose ``metric``
    reaches ``target``, and report when that happened.

    Args:
        metric: the evaluation metric, e.g. ``"top1"`` (higher is better).
        target: stop once ``metrics[metric] >= target``.

    The end record gets ``target`` and ``target_reached`` (bool); when reached, also
    ``time_to_target`` (wall-clock seconds from the start of ``fit`` to the end of that
    evaluation, evaluations included) and ``target_step``/``target_epoch``. A run that never
    reaches it trains to its end and says ``target_reached: false``.
    """

    def __init__(self, metric: str, target: float) -> None:
        if not math.isfinite(target):
            raise ValueError(f"target must be a finite number, got {target}")
        self.metric, self.target = metric, float(target)
        self.start: float | None = None
        self.reached: dict[str, float] = {}

    def on_train_start(self, trainer: Any) -> None:
        if self.start is None:
            self.start = time.perf_counter()

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        value = metrics.get(self.metric)
        if value is None:
            raise KeyError(f"StopAtTarget: the evaluation has no {self.metric!r} (it has "
                           f"{', '.join(sorted(metrics))})")  # fmt: skip
        if self.reached or not value >= self.target:
            return
        start = self.start if self.start is not None else time.perf_counter()
        self.reached = {
            "time_to_target": time.perf_counter() - start,
            "target_step": trainer.global_step,
            "target_epoch": trainer.epoch,
        }
        trainer.logger.info(
            f"Target {self.metric} {self.target} reached at step {trainer.global_step} "
            f"({value:.4f}, {self.reached['time_to_target']:.1f} s): stopping"
        )
        trainer.request_stop()

    def final_metrics(self) -> dict[str, Any]:
        return {"target": self.target, "target_reached": bool(self.reached), **self.reached}
