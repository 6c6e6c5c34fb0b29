"""The linear models' answers to the model-family protocol (:mod:`modelzoo.family`).

A :class:`~modelzoo.linear.models.GLM` reads a ``(n, d)`` feature matrix and gives its
margins; export asks for example rows (dense, in the model's dtype) and keeps the number of
rows dynamic. Nothing else applies: a GLM has no stages to pipeline or layers to split (its
distributed solvers, :mod:`trainers.linear`, split the data's rows or columns instead).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..family import ModelFamily, register_family
from .models import GLM, LinearSVM, LogisticRegression, MultinomialLogisticRegression

__all__ = ["LinearFamily"]


class LinearFamily(ModelFamily):
    """Logistic, multinomial, least-squares and hinge GLMs."""

    name = "linear"
    model_classes = (GLM,)
    modality = "tabular"
    classifiers = (LogisticRegression, MultinomialLogisticRegression, LinearSVM)

    def example_inputs(
        self, model: nn.Module, *, batch_size: int, generator: torch.Generator, **sizes: Any
    ) -> tuple[Any, ...]:
        x = torch.randn(batch_size, model.in_features, generator=generator)
        return (x.to(model.weight.dtype),)

    def inputs_like(self, model: nn.Module, inputs: tuple[Any, ...]) -> dict[str, Any]:
        return {"batch_size": inputs[0].shape[0] + 1}


register_family(LinearFamily())
