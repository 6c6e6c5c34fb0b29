"""Image classification as a training task: label smoothing, mixup, distillation, metrics.

The per-batch work of ``scripts/train_imagenet.py`` (GluonCV's recipe), usable from any
training loop: :class:`ImageClassificationTask` gives ``train_step(model, batch)`` and
``eval_step(model, batch)`` in the shape :class:`trainers.Trainer` calls them, and is a hook
(``on_epoch_start``) so that mixup can stop for the last epochs. :class:`DropBlockRamp` ramps
ResNeSt's DropBlock over the epochs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .splat import set_dropblock_prob

__all__ = ["DropBlockRamp", "ImageClassificationTask", "distillation_loss", "smooth_one_hot"]


def smooth_one_hot(labels: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """One-hot targets with ``smoothing`` spread evenly over all classes (GluonCV's rule)."""
    off = smoothing / num_classes
    return torch.full((labels.shape[0], num_classes), off, device=labels.device).scatter_(
        1, labels[:, None], 1.0 - smoothing + off
    )


def distillation_loss(
    logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``T^2 KL(softmax(teacher / T) || softmax(student / T))``, batch mean (Hinton et al.)."""
    t = temperature
    soft = F.softmax(teacher_logits.float() / t, dim=1)
    return F.kl_div(F.log_softmax(logits.float() / t, dim=1), soft, reduction="batchmean") * t * t


class ImageClassificationTask:
    """Soft-target cross-entropy with label smoothing, optional mixup and distillation.

    Args:
        num_classes: classes of the head.
        label_smoothing: GluonCV's ``eta`` (0: plain one-hot targets).
        mixup_alpha: mixup's Beta(alpha, alpha) (``None``: no mixup). Like GluonCV, a batch
            is mixed with itself reversed; the accuracy counts the dominant label.
        mixup_epochs: epochs with mixup (GluonCV's ``num_epochs - mixup_off_epoch``);
            ``None``: all.
        teacher: a frozen model to distil from (its logits on the same, mixed, images).
        temperature: distillation temperature.
        hard_weight: weight of the hard-target loss (``1 - hard_weight``: distillation).
    """

    def __init__(
        self,
        num_classes: int,
        *,
        label_smoothing: float = 0.0,
        mixup_alpha: float | None = None,
        mixup_epochs: int | None = None,
        teacher: torch.nn.Module | None = None,
        temperature: float = 20.0,
        hard_weight: float = 0.5,
    ) -> None:
        self.num_classes = num_classes
        self.label_smoothing = label_smoothing
        self.mixup_alpha = mixup_alpha
        self.mixup_epochs = mixup_epochs
        self.teacher = teacher
        self.temperature = temperature
        self.hard_weight = hard_weight
        self.epoch = 0  # the epoch being trained (a hook: on_epoch_start)

    def on_epoch_start(self, trainer: Any, epoch: int) -> None:
        self.epoch = epoch

    def mixup_active(self) -> bool:
        if self.mixup_alpha is None:
            return False
        return self.mixup_epochs is None or self.epoch < self.mixup_epochs

    def train_step(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        images, labels = batch
        targets = smooth_one_hot(labels, self.num_classes, self.label_smoothing)
        dominant = labels
        if self.mixup_active():
            alpha = self.mixup_alpha
            lam = float(torch.distributions.Beta(alpha, alpha).sample())
            perm = torch.arange(
                images.shape[0] - 1, -1, -1, device=images.device
            )  # GluonCV: reversed batch
            images = lam * images + (1 - lam) * images[perm]
            targets = lam * targets + (1 - lam) * targets[perm]
            dominant = labels if lam >= 0.5 else labels[perm]
        logits = model(images)
        loss = torch.sum(-targets * F.log_softmax(logits.float(), dim=1), dim=1).mean()
        if self.teacher is not None:
            with torch.no_grad():
                teacher_logits = self.teacher(images)
            distill = distillation_loss(logits, teacher_logits, self.temperature)
            loss = self.hard_weight * loss + (1 - self.hard_weight) * distill
        correct = (logits.argmax(dim=1) == dominant).sum()
        return loss, {"accuracy": correct, "count": labels.shape[0]}

    def eval_step(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        images, labels = batch
        logits = model(images).float()
        top5 = logits.topk(min(5, self.num_classes), dim=1).indices
        hits = top5 == labels[:, None]
        return {
            "top1": hits[:, 0].sum(),
            "top5": hits.any(dim=1).sum(),
            "loss": F.cross_entropy(logits, labels, reduction="sum"),
            "count": labels.shape[0],
        }


class DropBlockRamp:
    """Ramps DropBlock linearly from 0 at the first epoch to its maximum at the last (GluonCV)."""

    def __init__(self, model: torch.nn.Module, epochs: int) -> None:
        self.model, self.epochs = model, epochs

    def on_epoch_start(self, trainer: Any, epoch: int) -> None:
        set_dropblock_prob(self.model, min(1.0, epoch / max(1, self.epochs - 1)))
