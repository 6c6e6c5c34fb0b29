"""Reusable Trainer hooks (see :mod:`trainers.trainer` for the hook protocol)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["EarlyStopping"]


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
