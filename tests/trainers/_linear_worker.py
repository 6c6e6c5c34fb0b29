"""One rank of the multi-process tests in test_linear.py (torchrun's variables set).

Data-parallel L-BFGS on this rank's rows of the concatenated data (unequal shards), the
statistically adjusted variant on a stream of batches, and feature-partitioned SGD / CA-SGD
on this rank's column block. Each rank saves its results in ``OUTDIR/rank{r}.pt``; the test
compares them with one-process references.

Usage: python -m tests.trainers._linear_worker OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from modelzoo.linear import LOSSES, build_linear_model, load_bundled
from trainers import DistEnv
from trainers.linear import (
    CumulativeBatchLBFGS,
    DataParallelLBFGS,
    FeaturePartitionedSGD,
    LBFGSConfig,
    Messenger,
    column_blocks,
    epoch_batches,
)

LBFGS_ITERS = 12
S_VALUES = (1, 2, 4, 8)
CASGD_LR, CASGD_L2 = 0.5, 1e-2


def row_shards(n: int, world: int) -> list[tuple[int, int]]:
    """Contiguous, unequal row ranges (rank r gets about (r + 1) / sum parts)."""
    weights = torch.arange(1, world + 1, dtype=torch.float64)
    bounds = (torch.cumsum(weights, 0) / weights.sum() * n).round().long().tolist()
    starts = [0, *bounds[:-1]]
    return list(zip(starts, bounds, strict=True))


def lbfgs_problems() -> dict:
    """name -> (loss, X, y, classes, l2): real data, float64."""
    bc = load_bundled("breast_cancer", dtype=torch.float64)
    wine = load_bundled("wine", dtype=torch.float64)
    return {
        "logistic": ("logistic", bc.X_train, bc.y_train, 2, 1e-2),
        "multinomial": ("multinomial", wine.X_train, wine.y_train, 3, 1e-2),
    }


def stream_batches() -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Three batches of a regression problem (40, 55 and 30 rows), and the L2 weight."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(5, generator=g, dtype=torch.float64)
    X = [torch.randn(n, 5, generator=g, dtype=torch.float64) for n in (40, 55, 30)]
    y = [x @ w + 0.3 * torch.randn(x.shape[0], generator=g, dtype=torch.float64) + 1.0
         for x in X]  # fmt: skip
    return X, y, 0.1


def casgd_problem() -> dict:
    """name -> (loss, X, y, classes, batches): 16 mini-batches of 8 rows over two epochs."""
    g = torch.Generator().manual_seed(5)
    n = 64
    Xd = torch.randn(n, 24, generator=g, dtype=torch.float64)
    yd = torch.bernoulli(torch.sigmoid(Xd[:, :3].sum(1)), generator=g)
    dense = torch.zeros(n, 40, dtype=torch.float64)
    cols = torch.rand(n, 40, generator=g).argsort(dim=1)[:, :6]
    dense.scatter_(1, cols, torch.randn(n, 6, generator=g, dtype=torch.float64))
    dense[:, -1] = 1.0  # an intercept column: in every row (the dense-column Gram path)
    ys = torch.randint(0, 3, (n,), generator=g)
    batches = epoch_batches(n, 8, seed=3, epoch=0) + epoch_batches(n, 8, seed=3, epoch=1)
    return {
        "logistic_dense": ("logistic", Xd, yd, 1, batches),
        "multinomial_sparse": ("multinomial", dense.to_sparse_csr(), ys, 3, batches),
    }


def lbfgs_iterates(problem: tuple, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """Data-parallel L-BFGS on this rank's rows: the weights after every iteration, messages."""
    loss, X, y, classes, l2 = problem
    lo, hi = row_shards(len(y), world)[rank]
    model = build_linear_model(loss, X.shape[1], classes, dtype=torch.float64)
    solver = DataParallelLBFGS(
        model.parameters(), lambda: model.loss_sum(X[lo:hi], y[lo:hi]), hi - lo,
        penalty=lambda: model.penalty(l2), config=LBFGSConfig(),
    )  # fmt: skip
    iterates = []
    flat = lambda: torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # noqa: E731
    solver.run(LBFGS_ITERS, lambda it, f: iterates.append(flat()))
    return torch.stack(iterates), solver.messenger.messages


def sa_stages(rank: int, world: int, decay: float = 0.5) -> torch.Tensor:
    """Statistically adjusted L-BFGS on the stream: the weights after each batch."""
    X, y, l2 = stream_batches()
    model = build_linear_model("squared", X[0].shape[1], dtype=torch.float64)
    sa = CumulativeBatchLBFGS(
        model, penalty=lambda: model.penalty(l2), decay=decay,
        config=LBFGSConfig(tolerance_grad=1e-12, tolerance_change=1e-15),
    )  # fmt: skip
    stages = []
    for Xb, yb in zip(X, y, strict=True):
        lo, hi = row_shards(len(yb), world)[rank]
        sa.fit_batch(Xb[lo:hi], yb[lo:hi], 100)
        stages.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    return torch.stack(stages)


def casgd_weights(problem: tuple, s: int, rank: int, world: int) -> tuple[torch.Tensor, int]:
    """Feature-partitioned SGD (s = 0) or CA-SGD(s) on this rank's columns: w_p, messages."""
    loss, X, y, classes, batches = problem
    lo, hi = column_blocks(X.shape[1], world)[rank]
    sparse = X.layout == torch.sparse_csr
    Xp = X.to_dense()[:, lo:hi]
    Xp = Xp.to_sparse_csr() if sparse else Xp
    sgd = FeaturePartitionedSGD(
        Xp, y, LOSSES[loss].derivative, num_outputs=classes, lr=CASGD_LR, l2=CASGD_L2,
        precision="fp64", messenger=Messenger(),
    )  # fmt: skip
    sgd.run(batches, s=s)
    return sgd.w, sgd.messenger.messages


def main(outdir: str) -> None:
    env = DistEnv.from_env()
    rank, world = env.rank, env.world_size
    out: dict = {"world": world}
    for name, problem in lbfgs_problems().items():
        out[f"lbfgs_{name}"], out[f"lbfgs_{name}_messages"] = lbfgs_iterates(problem, rank, world)
    out["sa_stages"] = sa_stages(rank, world)
    for name, problem in casgd_problem().items():
        for s in (0, *S_VALUES):
            w, messages = casgd_weights(problem, s, rank, world)
            out[f"casgd_{name}_s{s}"], out[f"casgd_{name}_s{s}_messages"] = w, messages
    torch.save(out, Path(outdir) / f"rank{rank}.pt")
    env.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
