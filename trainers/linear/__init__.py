"""Solvers for linear models at scale (they take tensors and loss callables; no modelzoo).

* :mod:`.lbfgs`: data-parallel L-BFGS (one all-reduce of ``[loss, gradient]`` per
  evaluation) and, for data arriving in batches, L-BFGS re-fit on every batch so far
  (``CumulativeBatchLBFGS``; ``StatisticallyAdjustedLBFGS`` is its deprecated old name);
* :mod:`.casgd`: feature-partitioned SGD and communication-avoiding s-step SGD (CA-SGD), in
  fp64/fp32 and mixed precision;
* :mod:`.rowparallel`: row-partitioned (data-parallel) SGD with three combiners: sparse
  all-reduce of the gradients, model averaging, and SymSGD's sound combiner;
* :mod:`.messages`: the counted all-reduce the solvers use;
* :mod:`.elastic`: their durable state for elastic restarts (``train_linear.py --elastic-dir``).
"""

import warnings
from typing import Any

from .casgd import PRECISIONS, FeaturePartitionedSGD, column_blocks, epoch_batches
from .elastic import ElasticStateMismatch, LinearElastic, gather_rows
from .lbfgs import _RENAMED, CumulativeBatchLBFGS, DataParallelLBFGS, LBFGSConfig
from .messages import Messenger
from .rowparallel import (
    COMBINERS,
    CURVATURES,
    RowParallelSGD,
    rademacher,
    round_partition,
    sound_combine,
)

__all__ = [
    "COMBINERS",
    "CURVATURES",
    "PRECISIONS",
    "CumulativeBatchLBFGS",
    "DataParallelLBFGS",
    "ElasticStateMismatch",
    "FeaturePartitionedSGD",
    "LBFGSConfig",
    "LinearElastic",
    "Messenger",
    "RowParallelSGD",
    "column_blocks",
    "epoch_batches",
    "gather_rows",
    "rademacher",
    "round_partition",
    "sound_combine",
]


def __getattr__(name: str) -> Any:
    if name == "StatisticallyAdjustedLBFGS":  # the deprecated old name
        warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
        return CumulativeBatchLBFGS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
