"""One entry point to the linear models' data sets, as ``scripts/train_linear.py --dataset``.

:func:`load_linear_data` returns a :class:`~modelzoo.linear.datasets.LinearData` split of one
of :data:`DATASETS`: scikit-learn's bundled sets (:func:`~modelzoo.linear.load_bundled`:
stratified, standardised), the synthetic sparse generator
(:func:`~modelzoo.linear.synthetic_sparse`) or an svmlight file
(:func:`~modelzoo.linear.load_svmlight`, its task read off the labels). The last
``test_fraction`` of the rows of a synthetic or svmlight set are held out.
"""

from __future__ import annotations

import os

import torch

from .datasets import BUNDLED, LinearData, load_bundled, row_slice, synthetic_sparse
from .svmlight import load_svmlight

__all__ = ["DATASETS", "TooFewExamples", "load_linear_data"]

DATASETS = ("breast_cancer", "digits", "wine", "diabetes", "synthetic", "svmlight")


class TooFewExamples(ValueError):
    """The rows do not leave one for training after the held-out share."""

    def __init__(self, n: int, test_fraction: float) -> None:
        super().__init__(f"{n} examples: too few to hold out a test fraction of {test_fraction}")
        self.n = n


def load_linear_data(
    dataset: str,
    *,
    dtype: torch.dtype = torch.float32,
    test_fraction: float = 0.25,
    seed: int = 0,
    synthetic_samples: int = 20_000,
    synthetic_features: int = 1_000_000,
    nnz_per_row: int = 20,
    synthetic_task: str = "logistic",
    synthetic_columns: str = "zipf",
    data_file: str | os.PathLike[str] | None = None,
    n_features: int | None = None,
    zero_based: bool | str = "auto",
) -> LinearData:
    """A train/test split of ``dataset`` (one of :data:`DATASETS`).

    Args:
        dataset: a bundled set's name, ``synthetic`` or ``svmlight``.
        dtype: the features' dtype (and the float labels').
        test_fraction: the held-out share of the rows, in (0, 1).
        seed: the split's seed (bundled sets) or the generator's (synthetic).
        synthetic_samples, synthetic_features, nnz_per_row, synthetic_task,
            synthetic_columns: :func:`~modelzoo.linear.synthetic_sparse`'s arguments;
            ``synthetic_task`` ``logistic`` gives a binary task, ``linear`` a regression.
        data_file, n_features, zero_based: ``svmlight``: the file and
            :func:`~modelzoo.linear.load_svmlight`'s arguments. Labels in {-1, 1} or {0, 1}
            are a binary task (mapped to {0, 1}), non-negative integers (at most 1000
            distinct) a multiclass one, anything else a regression.

    Raises:
        SvmlightFormatError, FileNotFoundError: a bad or missing ``data_file``.
        TooFewExamples: no training row would be left after the held-out share.
    """
    if dataset not in DATASETS:
        raise ValueError(f"dataset {dataset!r}: choose one of {', '.join(DATASETS)}")
    if dataset in BUNDLED:
        return load_bundled(dataset, test_size=test_fraction, seed=seed, dtype=dtype)
    if dataset == "synthetic":
        s = synthetic_sparse(synthetic_samples, synthetic_features, nnz_per_row,
                             task=synthetic_task, columns=synthetic_columns, seed=seed,
                             dtype=dtype)  # fmt: skip
        X, y = s.X, s.y
        task = "binary" if synthetic_task == "logistic" else "regression"
    else:
        if data_file is None:
            raise ValueError("dataset 'svmlight' needs data_file")
        data = load_svmlight(data_file, n_features, zero_based=zero_based, dtype=dtype)
        X, y = data.X, data.y
        labels = torch.unique(y)
        if labels.numel() <= 2 and bool(((labels == 0) | (labels == 1) | (labels == -1)).all()):
            y = (y > 0).to(dtype)  # {-1, +1} or {0, 1} -> {0, 1}
            task = "binary"
        elif (
            bool((labels == labels.round()).all()) and labels.min() >= 0 and labels.numel() <= 1000
        ):
            y, task = y.long(), "multiclass"
        else:
            task = "regression"
    n_test = max(1, int(round(test_fraction * X.shape[0])))
    if X.shape[0] - n_test < 1:
        raise TooFewExamples(X.shape[0], test_fraction)
    cut = X.shape[0] - n_test  # the last rows are held out
    num_classes = int(y.max()) + 1 if task == "multiclass" else (2 if task == "binary" else 0)
    return LinearData(X_train=row_slice(X, 0, cut), y_train=y[:cut],
                      X_test=row_slice(X, cut, X.shape[0]), y_test=y[cut:], task=task,
                      num_classes=num_classes, name=dataset)  # fmt: skip
