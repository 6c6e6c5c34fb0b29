"""The linear models' CSR product in C (modelzoo.linear._native) against the torch form.

Oracles: the gather/``index_add_`` form the models used before (and still use where the C
kernels do not apply), scipy's CSR product, and autograd's numerical gradient check.
"""

from __future__ import annotations

import warnings

import pytest
import scipy.sparse
import torch

from modelzoo.linear import (
    LogisticRegression,
    MultinomialLogisticRegression,
    _native,
    synthetic_sparse,
)
from modelzoo.linear.models import _SparseMargins

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
pytestmark = pytest.mark.skipif(_native._lib() is None, reason="no C compiler")


def _torch_form(X, W, G):
    rows = torch.repeat_interleave(torch.arange(X.shape[0]), X.crow_indices().diff())
    contrib = X.values()[:, None].to(W.dtype) * W.t()[X.col_indices()]
    out = torch.zeros(X.shape[0], W.shape[0], dtype=W.dtype).index_add_(0, rows, contrib)
    back = torch.zeros(X.shape[1], W.shape[0], dtype=W.dtype)
    back.index_add_(0, X.col_indices(), X.values()[:, None].to(W.dtype) * G[rows])
    return out, back


def _with_empty_rows(X):
    """The same matrix with every fifth row emptied."""
    sp = scipy.sparse.csr_matrix(
        (X.values().numpy(), X.col_indices().numpy(), X.crow_indices().numpy()), shape=X.shape
    )
    keep = scipy.sparse.diags([1.0 if r % 5 else 0.0 for r in range(X.shape[0])])
    sp = scipy.sparse.csr_matrix(keep @ sp)
    sp.eliminate_zeros()
    emptied = torch.sparse_csr_tensor(
        torch.from_numpy(sp.indptr).long(), torch.from_numpy(sp.indices).long(),
        torch.from_numpy(sp.data).to(X.dtype), size=X.shape,
    )  # fmt: skip
    assert (emptied.crow_indices().diff() == 0).sum() >= X.shape[0] // 5  # rows 0, 5, 10, ...
    return emptied


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("classes", [1, 3])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("empty_rows", [False, True])
def test_product_and_backward_equal_the_torch_form(dtype, classes, threads, empty_rows):
    # 53 287 non-zeros: up to 3 threads; 4099 rows split at 1366 and 2732 (not multiples of 4)
    X = synthetic_sparse(4099, 20_000, 13, seed=1, dtype=dtype).X
    if empty_rows:
        X = _with_empty_rows(X)
    g = torch.Generator().manual_seed(0)
    W = torch.randn(classes, X.shape[1], generator=g, dtype=dtype)
    G = torch.randn(X.shape[0], classes, generator=g, dtype=dtype)
    out, back = _torch_form(X, W, G)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert _native.available(X, W)
        assert torch.equal(_native.csr_margins(X, W), out)
        assert torch.equal(_native.csr_margins_backward(X, G), back)
    finally:
        torch.set_num_threads(old)
    sp = scipy.sparse.csr_matrix(
        (X.values().double().numpy(), X.col_indices().numpy(), X.crow_indices().numpy()),
        shape=X.shape,
    )
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    assert torch.allclose(out.double(), torch.from_numpy(sp @ W.double().numpy().T), atol=tol)


def test_gradcheck():
    X = synthetic_sparse(40, 60, 5, seed=2, dtype=torch.float64).X
    W = torch.randn(2, 60, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: _SparseMargins.apply(X, w), (W,))


@pytest.mark.parametrize(
    "model", [LogisticRegression(5000, dtype=torch.float64),
              MultinomialLogisticRegression(5000, 4, dtype=torch.float64)],
    ids=["logistic", "multinomial"],
)  # fmt: skip
def test_models_loss_and_gradient_are_the_torch_forms(model, monkeypatch):
    data = synthetic_sparse(2000, 5000, 10, seed=3, dtype=torch.float64)
    y = data.y if model.out_features == 1 else (data.y * 3).long() % 4
    torch.nn.init.normal_(model.weight, std=0.1)

    def loss_and_grad():
        model.zero_grad()
        loss = model.loss(data.X, y, l2=1e-3)
        loss.backward()
        return loss.detach(), model.weight.grad.clone(), model.bias.grad.clone()

    calls = []
    real = _native.csr_margins
    monkeypatch.setattr(_native, "csr_margins", lambda *a: calls.append(1) or real(*a))
    ours = loss_and_grad()
    assert calls, "the C kernels were not taken"
    monkeypatch.setattr(_native, "_lib", lambda: None)
    ref = loss_and_grad()
    assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True))


def test_layouts_that_take_the_torch_form(monkeypatch):
    X = synthetic_sparse(10, 20, 3, seed=4, dtype=torch.float32).X
    assert _native.available(X, torch.zeros(1, 20))
    assert not _native.available(X, torch.zeros(1, 20, dtype=torch.float64))  # mixed dtypes
    assert not _native.available(X.to_dense(), torch.zeros(1, 20))
    monkeypatch.setattr(_native, "_lib", lambda: None)
    assert not _native.available(X, torch.zeros(1, 20))
