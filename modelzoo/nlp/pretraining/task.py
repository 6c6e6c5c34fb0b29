"""BERT pretraining as a task: the masked-LM and next-sentence sums a step returns, the
ratios the run log shows, the loss, the model's inputs under pipeline parallelism, and a
phase's fit with the held-out evaluations of its curves (:func:`fit_phase`).

What ``scripts/pretrain_bert.py`` trains with; the trainer is duck-typed (nothing here
imports ``trainers``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "EMA_RATIOS",
    "RATIOS",
    "EvalTracker",
    "eval_step",
    "fit_phase",
    "pipeline_inputs",
    "pretraining_sums",
    "train_step",
]

# Sums that train_step/eval_step return -> the ratios the log shows.
RATIOS = {
    "mlm_loss": ("mlm_loss_sum", "mlm_count"),
    "mlm_accuracy": ("mlm_correct", "mlm_count"),
    "nsp_loss": ("nsp_loss_sum", "nsp_count"),
    "nsp_accuracy": ("nsp_correct", "nsp_count"),
}
# The EMA's evaluations (--model-ema) carry the same sums, prefixed.
EMA_RATIOS = {f"ema_{k}": (f"ema_{n}", f"ema_{d}") for k, (n, d) in RATIOS.items()}


def pretraining_sums(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = model(
        batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
        batch["masked_positions"],
    )  # fmt: skip
    logits = out.mlm_logits.float()  # (B, P, vocab)
    labels = batch["masked_labels"]  # (B, P), -100 where no mask
    valid = labels != -100
    mlm_loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    nsp_logits = out.nsp_logits.float()  # (B, 2)
    nsp_labels = batch["next_sentence_labels"]
    return {
        "mlm_loss_sum": mlm_loss,
        "mlm_correct": ((logits.argmax(-1) == labels) & valid).sum(),
        "mlm_count": valid.sum(),
        "nsp_loss_sum": F.cross_entropy(nsp_logits, nsp_labels, reduction="sum"),
        "nsp_correct": (nsp_logits.argmax(-1) == nsp_labels).sum(),
        "nsp_count": torch.tensor(nsp_labels.shape[0]),
    }


def pipeline_inputs(batch: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """The model's inputs for ``--pipeline-parallel``: the attention mask as integers (all
    ones where no sequence of the batch is padded: the stages pass a tensor on)."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    mask = torch.ones_like(ids) if mask is None else mask.long()
    return ids, batch["token_type_ids"], mask, batch["masked_positions"]


def train_step(model: torch.nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    sums = pretraining_sums(model, batch)
    loss = sums["mlm_loss_sum"] / sums["mlm_count"].clamp(min=1)
    loss = loss + sums["nsp_loss_sum"] / sums["nsp_count"]
    return loss, {k: v.detach() for k, v in sums.items()}


@torch.no_grad()
def eval_step(model: torch.nn.Module, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    return pretraining_sums(model, batch)


class EvalTracker:
    """Hook: the global step of the latest evaluation."""

    step = -1

    def on_eval_end(self, trainer: Any, metrics: dict[str, float]) -> None:
        self.step = trainer.global_step


def fit_phase(
    trainer: Any,
    train: Any,
    dev: Any | None,
    collate: Callable[[list[Any]], Any],
    *,
    tracker: EvalTracker,
    log_eval: Callable[..., None],
    first: bool,
    ema: Any | None = None,
) -> None:
    """One phase's ``trainer.fit(train)`` with the held-out (``dev``) evaluations its curves
    need, each written with ``log_eval(epoch=, step=, **metrics)``: the model it starts from
    (``first``: the run's first phase, when it starts at step 0), and the model it ends with
    when ``fit`` did not evaluate that step (``tracker``: the hook that saw the latest
    evaluation), then ``ema``'s weights (``ema.evaluate_and_log(trainer)``)."""
    if dev is not None and first and trainer.global_step == 0:
        metrics = trainer.evaluate(dev, collate)  # the starting point of the curves
        tracker.step = 0
        log_eval(epoch=0, step=0, **metrics)
    trainer.fit(train, eval_dataset=dev, collate_fn=collate)
    if dev is not None and tracker.step != trainer.global_step:
        metrics = trainer.evaluate(dev, collate, remember=True)
        log_eval(epoch=trainer.epoch, step=trainer.global_step, **metrics)
        if ema is not None:
            ema.evaluate_and_log(trainer)  # the phase's EMA weights, ema_ metrics
