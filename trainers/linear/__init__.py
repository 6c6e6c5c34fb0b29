"""Solvers for linear models at scale (they take tensors and loss callables; no modelzoo).

* :mod:`.lbfgs`: data-parallel L-BFGS (one all-reduce of ``[loss, gradient]`` per
  evaluation) and the statistically adjusted variant for data arriving in batches;
* :mod:`.casgd`: feature-partitioned SGD and communication-avoiding s-step SGD (CA-SGD), in
  fp64/fp32 and mixed precision;
* :mod:`.rowparallel`: row-partitioned (data-parallel) SGD with three combiners: sparse
  all-reduce of the gradients, model averaging, and SymSGD's sound combiner;
* :mod:`.messages`: the counted all-reduce the solvers use;
* :mod:`.elastic`: their durable state for elastic restarts (``train_linear.py --elastic-dir``).
"""

from .casgd import PRECISIONS, FeaturePartitionedSGD, column_blocks, epoch_batches
from .elastic import ElasticStateMismatch, LinearElastic, gather_rows
from .lbfgs import DataParallelLBFGS, LBFGSConfig, StatisticallyAdjustedLBFGS
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
    "DataParallelLBFGS",
    "ElasticStateMismatch",
    "FeaturePartitionedSGD",
    "LBFGSConfig",
    "LinearElastic",
    "Messenger",
    "RowParallelSGD",
    "StatisticallyAdjustedLBFGS",
    "column_blocks",
    "epoch_batches",
    "gather_rows",
    "rademacher",
    "round_partition",
    "sound_combine",
]
