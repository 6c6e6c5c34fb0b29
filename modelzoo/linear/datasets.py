"""Data for the linear models: scikit-learn's bundled sets and a synthetic sparse generator.

:func:`load_bundled` returns one of scikit-learn's offline sets (``breast_cancer``,
``digits``, ``wine``, ``diabetes``) as a seeded, stratified (classification) train/test split
with the features standardised by the *training* mean and standard deviation (a constant
column is left at 0). :func:`synthetic_sparse` draws a CSR matrix with a fixed number of
non-zeros per row at 10^6-10^7 features, a known generating weight vector ``w`` and labels
from a logistic or linear model, deterministically from its seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .svmlight import _csr

__all__ = [
    "BUNDLED",
    "LinearData",
    "SyntheticData",
    "add_intercept_column",
    "column_slice",
    "load_bundled",
    "row_slice",
    "synthetic_sparse",
]

# name -> (scikit-learn loader, task)
BUNDLED: dict[str, tuple[str, str]] = {
    "breast_cancer": ("load_breast_cancer", "binary"),
    "digits": ("load_digits", "multiclass"),
    "wine": ("load_wine", "multiclass"),
    "diabetes": ("load_diabetes", "regression"),
}


@dataclass
class LinearData:
    """A train/test split. ``task`` is ``binary``, ``multiclass`` or ``regression``;
    ``num_classes`` is 0 for regression. Labels are float for binary/regression, int64 else."""

    X_train: torch.Tensor
    y_train: torch.Tensor
    X_test: torch.Tensor
    y_test: torch.Tensor
    task: str
    num_classes: int
    name: str


def load_bundled(
    name: str, *, test_size: float = 0.25, seed: int = 0, dtype: torch.dtype = torch.float32
) -> LinearData:
    """One of :data:`BUNDLED`, split with ``seed`` and standardised on the training part.

    Needs scikit-learn (``pip install scikit-learn``; its data ship inside the package).
    """
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled data set {name!r}: choose one of {sorted(BUNDLED)}")
    if not 0.0 < test_size < 1.0:
        raise ValueError(f"test_size={test_size} must be in (0, 1)")
    try:
        import sklearn.datasets
        from sklearn.model_selection import train_test_split
    except ImportError as e:  # an optional dependency (the 'examples' extra)
        raise ImportError(
            f"the {name} data set comes with scikit-learn: pip install scikit-learn ({e})"
        ) from e
    loader, task = BUNDLED[name]
    X, y = getattr(sklearn.datasets, loader)(return_X_y=True)
    stratify = y if task != "regression" else None
    X_tr, X_te, y_tr, y_te = train_test_split(
        X, y, test_size=test_size, random_state=seed, stratify=stratify
    )
    X_tr = torch.as_tensor(X_tr, dtype=torch.float64)
    X_te = torch.as_tensor(X_te, dtype=torch.float64)
    mean = X_tr.mean(dim=0)
    std = X_tr.std(dim=0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))  # constant columns stay at 0
    X_tr, X_te = (X_tr - mean) / std, (X_te - mean) / std
    label_dtype = torch.int64 if task == "multiclass" else dtype
    num_classes = {"binary": 2, "multiclass": int(y.max()) + 1, "regression": 0}[task]
    return LinearData(
        X_tr.to(dtype),
        torch.as_tensor(y_tr).to(label_dtype),
        X_te.to(dtype),
        torch.as_tensor(y_te).to(label_dtype),
        task,
        num_classes,
        name,
    )


@dataclass
class SyntheticData:
    """``X`` (CSR, ``(n, d)``), labels ``y``, the generating ``w`` (``(d,)``) and ``b``."""

    X: torch.Tensor
    y: torch.Tensor
    w: torch.Tensor
    b: float
    task: str


def synthetic_sparse(
    n_samples: int,
    n_features: int,
    nnz_per_row: int,
    *,
    task: str = "logistic",
    columns: str = "zipf",
    seed: int = 0,
    signal: float = 3.0,
    noise: float = 0.1,
    dtype: torch.dtype = torch.float32,
) -> SyntheticData:
    r"""Sparse examples with a known generating model.

    Row :math:`i` has ``nnz_per_row`` (``k``) distinct, sorted columns with standard-normal
    values. ``columns="zipf"`` (default) draws them log-uniformly, :math:`P(j) \propto 1 / (j +
    1)`, as feature popularity falls off in click and text data (so that a model can learn
    the frequent features from few rows while the tail keeps 10^7 columns in play); a column
    drawn twice in a row is drawn again. ``columns="uniform"``: ``k`` uniform draws
    :math:`u_1 \le \dots \le u_k` from :math:`[0, d - k]`, shifted by :math:`0, 1, \dots,
    k-1`. The generating weights are :math:`w_j \sim N(0,
    \text{signal}^2 / k)`, so a margin :math:`x_i^\top w` has standard deviation about
    ``signal``. Labels: ``task="logistic"``: :math:`y_i \sim \text{Bernoulli}(\sigma(x_i^\top
    w))`; ``task="linear"``: :math:`y_i = x_i^\top w + \text{noise}\cdot\epsilon_i`. ``b = 0``.

    Memory: ``n_samples * nnz_per_row`` values and indices, plus ``w`` (``n_features``).
    """
    if task not in ("logistic", "linear"):
        raise ValueError(f"task={task!r}: choose 'logistic' or 'linear'")
    if columns not in ("zipf", "uniform"):
        raise ValueError(f"columns={columns!r}: choose 'zipf' or 'uniform'")
    if not 0 < nnz_per_row <= n_features or n_samples < 1:
        raise ValueError(
            f"need n_samples >= 1 and 0 < nnz_per_row <= n_features, got n_samples="
            f"{n_samples}, n_features={n_features}, nnz_per_row={nnz_per_row}"
        )
    g = torch.Generator().manual_seed(seed)
    k = nnz_per_row
    if columns == "uniform":
        draws = torch.randint(0, n_features - k + 1, (n_samples, k), generator=g)
        cols = draws.sort(dim=1).values + torch.arange(k)  # (n, k): distinct and increasing
    else:
        if k > n_features // 4:
            raise ValueError(f"columns='zipf' needs nnz_per_row <= n_features / 4, got {k}")
        cols = _zipf_columns(n_samples, n_features, k, g)
    values = torch.randn(n_samples, k, generator=g, dtype=torch.float64)
    w = torch.randn(n_features, generator=g, dtype=torch.float64) * (signal / k**0.5)
    margins = (values * w[cols]).sum(dim=1)  # (n,)
    if task == "logistic":
        y = torch.bernoulli(torch.sigmoid(margins), generator=g)
    else:
        y = margins + noise * torch.randn(n_samples, generator=g, dtype=torch.float64)
    X = _csr(
        torch.arange(0, n_samples * k + 1, k, dtype=torch.int64),
        cols.reshape(-1),
        values.reshape(-1).to(dtype),
        (n_samples, n_features),
    )
    return SyntheticData(X, y.to(dtype), w.to(dtype), 0.0, task)


def _zipf_columns(n: int, d: int, k: int, g: torch.Generator) -> torch.Tensor:
    """``(n, k)`` sorted distinct columns per row, ``P(j) ∝ 1 / (j + 1)``."""
    log_d = torch.log(torch.tensor(d + 1.0, dtype=torch.float64))

    def draw(size: int) -> torch.Tensor:
        u = torch.rand(size, generator=g, dtype=torch.float64)
        return (torch.exp(u * log_d).floor().long() - 1).clamp(0, d - 1)

    cols = draw(n * k).view(n, k).sort(dim=1).values
    for _ in range(1000):
        dup = torch.zeros_like(cols, dtype=torch.bool)
        dup[:, 1:] = cols[:, 1:] == cols[:, :-1]
        count = int(dup.sum())
        if count == 0:
            return cols
        cols[dup] = draw(count)
        cols = cols.sort(dim=1).values
    raise RuntimeError(f"could not draw {k} distinct columns of {d} per row")  # d >= 4k: never


def row_slice(X: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of a dense or CSR matrix (CSR stays CSR)."""
    if X.layout != torch.sparse_csr:
        return X[start:stop]
    crow = X.crow_indices()
    lo, hi = int(crow[start]), int(crow[stop])
    return _csr(
        crow[start : stop + 1] - lo, X.col_indices()[lo:hi], X.values()[lo:hi],
        (stop - start, X.shape[1]),
    )  # fmt: skip


def column_slice(X: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Columns ``start:stop`` of a dense or CSR matrix (CSR stays CSR, renumbered from 0)."""
    if X.layout != torch.sparse_csr:
        return X[:, start:stop]
    cols = X.col_indices()
    keep = (cols >= start) & (cols < stop)
    rows = torch.repeat_interleave(torch.arange(X.shape[0]), X.crow_indices().diff())
    counts = torch.bincount(rows[keep], minlength=X.shape[0])
    crow = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    return _csr(crow, cols[keep] - start, X.values()[keep], (X.shape[0], stop - start))


def add_intercept_column(X: torch.Tensor) -> torch.Tensor:
    """``[X, 1]``: a column of ones appended (the intercept of a solver that has no bias)."""
    n, d = X.shape
    ones = torch.ones(n, 1, dtype=X.dtype)
    if X.layout != torch.sparse_csr:
        return torch.cat([X, ones], dim=1)
    crow, cols, vals = X.crow_indices(), X.col_indices(), X.values()
    lengths = crow.diff()
    # row i's entries, then its new last column d: positions shift by i within the values
    new_crow = crow + torch.arange(n + 1)
    new_cols = torch.empty(cols.numel() + n, dtype=cols.dtype)
    new_vals = torch.empty(vals.numel() + n, dtype=vals.dtype)
    rows = torch.repeat_interleave(torch.arange(n), lengths)
    old_pos = torch.arange(cols.numel()) + rows
    new_cols[old_pos], new_vals[old_pos] = cols, vals
    last = new_crow[1:] - 1
    new_cols[last], new_vals[last] = d, 1.0
    return _csr(new_crow, new_cols, new_vals, (n, d + 1))
