"""One rank of the multi-process tests in test_symsgd.py (torchrun's variables set).

Row-partitioned SGD (:class:`trainers.linear.RowParallelSGD`) with each combiner on the
problems of :func:`cases`; every rank holds all rows and runs its mini-batches of each round.
Each rank saves, per case, its final weights, the counters and the last round's mean loss in
``OUTDIR/rank{r}.pt``; the test compares them with one-process references written out there.

Usage: python -m tests.trainers._rowparallel_worker OUTDIR
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from modelzoo.linear import LOSSES
from trainers import DistEnv
from trainers.comm.sparse import ALGORITHMS
from trainers.linear import CURVATURES, Messenger, RowParallelSGD, epoch_batches

LR, L2 = 0.1, 0.01
ROWS, FEATURES, BATCH = 40, 6, 4


def problem() -> dict:
    """Dense and CSR features (an intercept column in every row), real and {0, 1} and 3-class
    labels, and 20 mini-batches of 4 rows over two epochs; float64. At 2 ranks the rounds
    of 2 R mini-batches leave a short last round for R = 3 (rank 1 idle) and R = 6 (rank 1
    with 2 of its 6)."""
    g = torch.Generator().manual_seed(7)
    n, d = ROWS, FEATURES
    dense = torch.randn(n, d, generator=g, dtype=torch.float64)
    dense[:, -1] = 1.0
    keep = torch.rand(n, d, generator=g) < 0.5
    keep[:, -1] = True
    sparse = (dense * keep).to_sparse_csr()
    w = torch.randn(d, generator=g, dtype=torch.float64)
    return {
        "dense": dense,
        "sparse": sparse,
        "squared": dense @ w + 0.1 * torch.randn(n, generator=g, dtype=torch.float64),
        "logistic": torch.bernoulli(torch.sigmoid(dense @ w), generator=g),
        "multinomial": torch.randint(0, 3, (n,), generator=g),
        "batches": [
            *epoch_batches(n, BATCH, seed=3, epoch=0),
            *epoch_batches(n, BATCH, seed=3, epoch=1),
        ],
    }


def cases() -> dict[str, dict]:
    """name -> the solver's options (``features``, ``loss`` pick the problem's parts)."""
    out: dict[str, dict] = {
        "allreduce_dense_logistic": dict(combine="allreduce", features="dense", loss="logistic"),
        "allreduce_sparse_multinomial": dict(combine="allreduce", features="sparse",
                                             loss="multinomial"),
        "average_dense_squared": dict(combine="average", features="dense", loss="squared",
                                      round_batches=3),
        "average_sparse_logistic": dict(combine="average", features="sparse", loss="logistic",
                                        round_batches=2),
        "symsgd_exact_dense_squared": dict(combine="symsgd", features="dense", loss="squared",
                                           round_batches=3, exact=True),
        "symsgd_exact_sparse_squared": dict(combine="symsgd", features="sparse", loss="squared",
                                            round_batches=6, exact=True),
        "symsgd_projection_sparse_logistic": dict(combine="symsgd", features="sparse",
                                                  loss="logistic", round_batches=3,
                                                  symsgd_rank=4),
    }  # fmt: skip
    for algorithm in ALGORITHMS:
        out[f"allreduce_sparse_squared_{algorithm}"] = dict(
            combine="allreduce", features="sparse", loss="squared", sparse_algorithm=algorithm
        )
    return out


def run_case(options: dict, data: dict) -> dict:
    options = dict(options)
    features, loss = options.pop("features"), options.pop("loss")
    C = 3 if loss == "multinomial" else 1
    sgd = RowParallelSGD(
        data[features], data[loss], LOSSES[loss].derivative, lr=LR, l2=L2, num_outputs=C,
        loss_value=LOSSES[loss].value, curvature=CURVATURES.get(loss), precision="fp64",
        messenger=Messenger(), seed=5, **options,
    )  # fmt: skip
    sgd.run(data["batches"])
    return {"w": sgd.w, "messages": sgd.messenger.messages, "bytes_sent": sgd.bytes_sent,
            "round_bytes": sgd.round_bytes, "algorithm": sgd.last_algorithm,
            "loss": sgd.mean_round_loss(), "rounds": sgd.rounds, "steps": sgd.steps}  # fmt: skip


def main(outdir: str) -> None:
    warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta")
    torch.set_num_threads(1)
    env = DistEnv.from_env()
    data = problem()
    out = {name: run_case(options, data) for name, options in cases().items()}
    out["world"] = env.world_size
    torch.save(out, Path(outdir) / f"rank{env.rank}.pt")
    env.destroy()


if __name__ == "__main__":
    main(sys.argv[1])
