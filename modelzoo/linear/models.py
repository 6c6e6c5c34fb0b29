"""Generalized linear models on dense or sparse (CSR) features, and their losses.

One affine map :math:`m = x W^\\top + b` and a loss on the margin :math:`m`:

* :class:`LogisticRegression`, labels ``{0, 1}``: :math:`\\log(1 + e^{m}) - y m`;
* :class:`MultinomialLogisticRegression`, labels ``0 .. C-1``:
  :math:`\\log \\sum_c e^{m_c} - m_y`;
* :class:`LinearRegression`, real labels: :math:`\\tfrac12 (m - y)^2` (ridge with L2);
* :class:`LinearSVM`, labels ``{0, 1}``: hinge :math:`\\max(0, 1 - t m)` or squared hinge
  :math:`\\max(0, 1 - t m)^2`, :math:`t = 2y - 1`.

The objective of every model is the mean loss plus an optional L2 penalty on the weights
(never on the intercept, as in scikit-learn's lbfgs solver):

.. math::
    F(W, b) = \\frac{1}{n} \\sum_{i=1}^{n} \\ell(x_i W^\\top + b, y_i) + \\frac{\\lambda}{2}
    \\lVert W \\rVert_F^2

so scikit-learn's ``LogisticRegression(C=...)`` is ``l2 = 1 / (n C)``. Each loss is a
:class:`MarginLoss`: the per-example value and its derivative :math:`\\partial \\ell /
\\partial m`, which is all a margin-based solver (CA-SGD in :mod:`trainers.linear.casgd`)
needs; :meth:`GLM.loss` is the autograd objective the L-BFGS solver minimises.

Example:
    >>> import torch
    >>> model = LogisticRegression(in_features=3)
    >>> x, y = torch.randn(8, 3), torch.randint(0, 2, (8,)).float()
    >>> model.loss(x, y, l2=1e-2).shape
    torch.Size([])
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import _native

__all__ = [
    "DEFAULT_LOSS",
    "GLM",
    "LOSSES",
    "LinearRegression",
    "LinearSVM",
    "LogisticRegression",
    "MarginLoss",
    "MultinomialLogisticRegression",
    "build_linear_model",
    "loss_fits",
]


# ---------------------------------------------------------------------------------- losses
@dataclass(frozen=True)
class MarginLoss:
    """A loss of the margin: per-example ``value(m, y)`` and ``derivative(m, y)`` = dl/dm.

    ``m`` is ``(n,)`` for the single-output models and ``(n, C)`` for the multinomial one.
    """

    name: str
    value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    derivative: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _logistic_value(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(m, y.to(m.dtype), reduction="none")


def _logistic_derivative(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(m) - y.to(m.dtype)


def _softmax_value(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(m, y.long(), reduction="none")


def _softmax_derivative(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.softmax(m, dim=1) - F.one_hot(y.long(), m.shape[1]).to(m.dtype)


def _squared_value(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return 0.5 * (m - y.to(m.dtype)) ** 2


def _squared_derivative(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return m - y.to(m.dtype)


def _signs(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return 2.0 * y.to(dtype) - 1.0  # {0, 1} -> {-1, +1}


def _hinge_value(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.clamp(1.0 - _signs(y, m.dtype) * m, min=0.0)


def _hinge_derivative(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = _signs(y, m.dtype)
    return torch.where(t * m < 1.0, -t, torch.zeros_like(m))  # a subgradient (0 at the kink)


def _squared_hinge_value(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.clamp(1.0 - _signs(y, m.dtype) * m, min=0.0) ** 2


def _squared_hinge_derivative(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = _signs(y, m.dtype)
    return -2.0 * t * torch.clamp(1.0 - t * m, min=0.0)


LOSSES: dict[str, MarginLoss] = {
    loss.name: loss
    for loss in (
        MarginLoss("logistic", _logistic_value, _logistic_derivative),
        MarginLoss("multinomial", _softmax_value, _softmax_derivative),
        MarginLoss("squared", _squared_value, _squared_derivative),
        MarginLoss("hinge", _hinge_value, _hinge_derivative),
        MarginLoss("squared_hinge", _squared_hinge_value, _squared_hinge_derivative),
    )
}

#: The loss of each task (``LinearData.task``) when none is chosen.
DEFAULT_LOSS = {"binary": "logistic", "multiclass": "multinomial", "regression": "squared"}


def loss_fits(loss: str, task: str) -> bool:
    """Whether the labels of ``task`` (``binary``, ``multiclass``, ``regression``) fit margin
    loss ``loss``: the multinomial loss takes exactly the multiclass labels, the squared loss
    exactly the real ones (the others take binary labels)."""
    return (loss == "multinomial") == (task == "multiclass") and (
        (loss == "squared") == (task == "regression")
    )


# ---------------------------------------------------------------------------------- models
class _SparseMargins(torch.autograd.Function):
    """``X W^T`` for CSR ``X`` as a gather and scatter-add over the non-zeros, and the
    backward ``G^T X`` the same way (torch's own CSR product and its backward, through a
    transpose, are several times slower at 10^7 columns). On CPU the C kernels of
    :mod:`._native` compute the same sums in the same order in one pass (bit for bit)."""

    @staticmethod
    def forward(ctx, X: torch.Tensor, W: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.out_features = W.shape[0]
        if _native.available(X, W):
            ctx.save_for_backward(X)
            return _native.csr_margins(X, W)
        rows = torch.repeat_interleave(torch.arange(X.shape[0]), X.crow_indices().diff())
        ctx.save_for_backward(X, rows)
        contrib = X.values()[:, None].to(W.dtype) * W.t()[X.col_indices()]  # (nnz, C)
        out = torch.zeros(X.shape[0], W.shape[0], dtype=W.dtype, device=W.device)
        return out.index_add_(0, rows, contrib)  # (n, C)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        X = ctx.saved_tensors[0]
        if len(ctx.saved_tensors) == 1 and _native.available(X, grad):
            return None, _native.csr_margins_backward(X, grad).t()
        rows = (
            ctx.saved_tensors[1]
            if len(ctx.saved_tensors) == 2
            else torch.repeat_interleave(torch.arange(X.shape[0]), X.crow_indices().diff())
        )
        contrib = X.values()[:, None].to(grad.dtype) * grad[rows]  # (nnz, C)
        out = torch.zeros(X.shape[1], ctx.out_features, dtype=grad.dtype, device=grad.device)
        out.index_add_(0, X.col_indices(), contrib)
        return None, out.t()


class GLM(nn.Module):
    """An affine map ``m = x W^T + b`` with a margin loss.

    Args:
        in_features: number of features ``d``.
        out_features: margins per example (1, or the number of classes ``C``).
        loss: a name of :data:`LOSSES`.
        bias: learn an intercept.
        dtype: parameter dtype (float64 for solver tests, float32 otherwise).

    Shapes: ``x`` is ``(n, d)``, dense or ``torch.sparse_csr``; the margins are ``(n,)`` when
    ``out_features == 1``, else ``(n, C)``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int = 1,
        *,
        loss: str,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if loss not in LOSSES:
            raise ValueError(f"loss {loss!r} is not one of {sorted(LOSSES)}")
        if in_features < 1 or out_features < 1:
            raise ValueError(
                f"in_features={in_features} and out_features={out_features} must be positive"
            )
        self.in_features, self.out_features = in_features, out_features
        self.margin_loss = LOSSES[loss]
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zeros: the objectives are convex, and zero is where scikit-learn's solvers start."""
        nn.init.zeros_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"the features have {x.shape[-1]} columns, the model expects {self.in_features}"
            )
        if x.layout == torch.sparse_csr:
            m = _SparseMargins.apply(x, self.weight)  # (n, C)
        else:
            m = x @ self.weight.t()  # (n, C)
        if self.bias is not None:
            m = m + self.bias
        return m.squeeze(1) if self.out_features == 1 else m

    def penalty(self, l2: float) -> torch.Tensor:
        """``(l2 / 2) ||W||^2``: the intercept is not penalised."""
        return 0.5 * l2 * (self.weight**2).sum()

    def loss_sum(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Sum of the per-example losses (no penalty): what a data-parallel rank reduces."""
        return self.margin_loss.value(self(x), y).sum()

    def loss(self, x: torch.Tensor, y: torch.Tensor, l2: float = 0.0) -> torch.Tensor:
        """The objective ``F``: mean loss plus ``(l2 / 2) ||W||^2``."""
        return self.loss_sum(x, y) / y.shape[0] + self.penalty(l2)

    @torch.no_grad()
    def predict(self, x: torch.Tensor) -> torch.Tensor:
        """Class labels (classifiers) or the fitted values (regression)."""
        m = self(x)
        name = self.margin_loss.name
        if name == "multinomial":
            return m.argmax(dim=1)
        if name == "squared":
            return m
        return (m > 0).long()


class LogisticRegression(GLM):
    """Binary logistic regression, labels in ``{0, 1}``."""

    def __init__(
        self, in_features: int, *, bias: bool = True, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(in_features, 1, loss="logistic", bias=bias, dtype=dtype)


class MultinomialLogisticRegression(GLM):
    """Softmax regression over ``num_classes`` classes, labels ``0 .. C-1``."""

    def __init__(
        self,
        in_features: int,
        num_classes: int,
        *,
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if num_classes < 2:
            raise ValueError(f"num_classes={num_classes}: a multinomial model needs at least 2")
        super().__init__(in_features, num_classes, loss="multinomial", bias=bias, dtype=dtype)


class LinearRegression(GLM):
    """Least squares; with ``l2 > 0`` ridge regression."""

    def __init__(
        self, in_features: int, *, bias: bool = True, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__(in_features, 1, loss="squared", bias=bias, dtype=dtype)


class LinearSVM(GLM):
    """A linear SVM, labels in ``{0, 1}``; ``loss`` is ``"hinge"`` or ``"squared_hinge"``."""

    def __init__(
        self,
        in_features: int,
        *,
        loss: str = "squared_hinge",
        bias: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if loss not in ("hinge", "squared_hinge"):
            raise ValueError(f"LinearSVM loss {loss!r}: choose 'hinge' or 'squared_hinge'")
        super().__init__(in_features, 1, loss=loss, bias=bias, dtype=dtype)


def build_linear_model(
    loss: str,
    in_features: int,
    num_classes: int = 2,
    *,
    bias: bool = True,
    dtype: torch.dtype = torch.float32,
) -> GLM:
    """The model for a loss name of :data:`LOSSES` (``multinomial`` takes ``num_classes``)."""
    if loss == "multinomial":
        return MultinomialLogisticRegression(in_features, num_classes, bias=bias, dtype=dtype)
    if loss not in LOSSES:
        raise ValueError(f"loss {loss!r} is not one of {sorted(LOSSES)}")
    return GLM(in_features, 1, loss=loss, bias=bias, dtype=dtype)
