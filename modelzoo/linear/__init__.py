"""Linear models at scale: GLMs on dense or sparse features, the svmlight reader, data.

* :mod:`.models`: logistic, multinomial logistic, linear (squared loss) and hinge /
  squared-hinge models with their margin losses;
* :mod:`.svmlight`: a streamed reader of the svmlight/libsvm text format into CSR tensors;
* :mod:`.datasets`: scikit-learn's bundled sets as standardised splits, and a synthetic
  sparse generator with a known generating ``w``.

The solvers (distributed L-BFGS, CA-SGD) are in :mod:`trainers.linear`.
"""

from . import family  # noqa: F401  (registers the linear models' family)
from .datasets import (
    BUNDLED,
    LinearData,
    SyntheticData,
    add_intercept_column,
    column_slice,
    load_bundled,
    row_slice,
    synthetic_sparse,
)
from .models import (
    DEFAULT_LOSS,
    GLM,
    LOSSES,
    LinearRegression,
    LinearSVM,
    LogisticRegression,
    MarginLoss,
    MultinomialLogisticRegression,
    build_linear_model,
    loss_fits,
)
from .svmlight import SvmlightBatch, SvmlightData, SvmlightFormatError, iter_svmlight, load_svmlight

__all__ = [
    "BUNDLED",
    "DEFAULT_LOSS",
    "GLM",
    "LOSSES",
    "LinearData",
    "LinearRegression",
    "LinearSVM",
    "LogisticRegression",
    "MarginLoss",
    "MultinomialLogisticRegression",
    "SvmlightBatch",
    "SvmlightData",
    "SvmlightFormatError",
    "SyntheticData",
    "add_intercept_column",
    "build_linear_model",
    "column_slice",
    "iter_svmlight",
    "load_bundled",
    "load_svmlight",
    "loss_fits",
    "row_slice",
    "synthetic_sparse",
]
