"""Train a linear model (logistic, multinomial, least squares, hinge) with distributed
L-BFGS, plain feature-partitioned SGD or CA-SGD. With no flags it fits L2-regularised
logistic regression on scikit-learn's breast-cancer data with L-BFGS and prints the held-out
accuracy:

    python scripts/train_linear.py

More recipes (docs/linear.md):

    python scripts/train_linear.py --dataset digits                      # multinomial, L-BFGS
    python scripts/train_linear.py --dataset wine --solver casgd --s-steps 4 --precision bf16
    python scripts/train_linear.py --dataset synthetic --synthetic-features 10000000 \\
        --nnz-per-row 20 --synthetic-samples 200000 --solver casgd --s-steps 8 --batch-size 256
    python scripts/train_linear.py --dataset svmlight --data-file train.svm --n-features 47236
    torchrun --nproc-per-node 2 scripts/train_linear.py --solver casgd --s-steps 4
    torchrun --nproc-per-node 4 scripts/train_linear.py --solver sgd --grad-combine symsgd

Under ``torchrun --nproc-per-node N``: L-BFGS is data parallel (each rank holds a contiguous
shard of the training rows; one all-reduce of [loss, gradient] per evaluation); SGD and CA-SGD
are feature partitioned (each rank holds a block of the columns, the intercept column on the
last rank). ``--solver sgd --grad-combine allreduce|average|symsgd`` partitions the rows
instead (:mod:`trainers.linear.rowparallel`): every rank holds the whole weight vector, a
round is ``N * --round-batches`` mini-batches, and the workers' contributions are combined by
a sparse all-reduce of the gradients, by model averaging, or by SymSGD's sound combiner.
``--arriving-batches K`` feeds L-BFGS the training rows in K batches and re-fits it on every
batch so far after each (:class:`trainers.linear.CumulativeBatchLBFGS`; the old spellings
``--sa-batches``/``--sa-decay`` still work). The run log
(``--run-log``) has a ``step`` record per iteration or mini-batch round, an ``epoch`` and an
``eval`` record per epoch (L-BFGS: per arriving batch) and an ``end`` record with the final
test metrics; ``scripts/reproduce.py`` reruns it.

Elastic (``--elastic-dir DIR``, docs/linear.md "Elastic"): the solver state is saved to
``DIR/state.pt`` every ``--elastic-checkpoint-steps`` steps and at the end of every epoch or
arriving batch; when ``torchrun --nnodes MIN:MAX`` / ``--max-restarts`` restarts the workers
with any world size, they continue from it and the run log carries on without duplicates:

    torchrun --nnodes 1:4 --nproc-per-node 2 --max-restarts 3 scripts/train_linear.py \
        --solver casgd --s-steps 4 --elastic-dir /shared/job --run-log /shared/job/run.jsonl
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

from modelzoo.linear import (
    LOSSES,
    add_intercept_column,
    build_linear_model,
    column_slice,
    load_bundled,
    load_svmlight,
    row_slice,
    synthetic_sparse,
)
from modelzoo.linear.svmlight import SvmlightFormatError
from trainers import DistEnv, RunLogger, make_header
from trainers.checkpoint import CheckpointError
from trainers.claims import majority_level
from trainers.cli import (
    ArgumentParser,
    Bound,
    add_elastic_args,
    add_tensorboard_args,
    brief,
    elastic_config,
    print_config,
    run_main,
)
from trainers.comm.sparse import ALGORITHMS as SPARSE_ALGORITHMS
from trainers.dist import UnsafeLaunchError, check_launch, peer_timeout, start_peer_watchdog
from trainers.linear import (
    COMBINERS,
    CURVATURES,
    CumulativeBatchLBFGS,
    ElasticStateMismatch,
    FeaturePartitionedSGD,
    LBFGSConfig,
    LinearElastic,
    Messenger,
    RowParallelSGD,
    column_blocks,
    epoch_batches,
    gather_rows,
)
from trainers.linear.rowparallel import DEFAULT_ROUND_BATCHES

DATASETS = ("breast_cancer", "digits", "wine", "diabetes", "synthetic", "svmlight")
SOLVERS = ("lbfgs", "sgd", "casgd")
DEFAULT_LOSS = {"binary": "logistic", "multiclass": "multinomial", "regression": "squared"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description="Train a linear model with distributed L-BFGS or CA-SGD.")
    d = p.add_argument_group("data")
    d.add_argument("--dataset", type=str.lower, default="breast_cancer", help=", ".join(DATASETS))
    d.add_argument("--data-file", type=str, default=None, help="--dataset svmlight: the file")
    d.add_argument("--n-features", type=int, default=None, help="svmlight: columns (default: file)")
    d.add_argument("--zero-based", type=str, default="auto", choices=("auto", "true", "false"),
                   help="svmlight: indices start at 0 (auto: if some index is 0)")  # fmt: skip
    d.add_argument("--test-fraction", type=float, default=0.25, help="held-out share of rows")
    d.add_argument("--synthetic-samples", type=int, default=20_000, help="synthetic: rows")
    d.add_argument("--synthetic-features", type=int, default=1_000_000, help="synthetic: columns")
    d.add_argument("--nnz-per-row", type=int, default=20, help="synthetic: non-zeros per row")
    d.add_argument("--synthetic-task", type=str, default="logistic", choices=("logistic", "linear"))
    d.add_argument("--synthetic-columns", type=str, default="zipf", choices=("zipf", "uniform"),
                   help="synthetic: feature popularity")  # fmt: skip
    d.add_argument("--data-seed", type=int, default=None,
                   help="split / synthetic data seed (default: --seed)")  # fmt: skip

    m = p.add_argument_group("model and solver")
    m.add_argument("--loss", type=str, default=None,
                   help=f"one of {sorted(LOSSES)}; default from the task")  # fmt: skip
    m.add_argument("--solver", type=str.lower, default="lbfgs", help=", ".join(SOLVERS))
    m.add_argument("--wd", type=float, default=1e-3, help="L2 weight λ: mean loss + λ/2 |w|²")
    m.add_argument("--lr", type=float, default=None, help="step (lbfgs default 1, sgd 0.1)")
    m.add_argument("--history-size", type=int, default=10, help="lbfgs: curvature pairs")
    m.add_argument("--iterations", type=int, default=100, help="lbfgs: iterations (per batch)")
    m.add_argument("--no-line-search", action="store_true", help="lbfgs: fixed step --lr")
    # dest sa_*: the key in published run-log headers and saved elastic identities; the
    # --sa-* spellings are deprecated (the method is not SA L-BFGS: trainers.linear.lbfgs)
    m.add_argument("--arriving-batches", "--sa-batches", dest="sa_batches", type=int, default=1,
                   metavar="K", help="lbfgs: the rows arrive in K batches; after each, re-fit "
                   "on all the rows so far (--sa-batches: deprecated)")  # fmt: skip
    m.add_argument("--arriving-decay", "--sa-decay", dest="sa_decay", type=float, default=1.0,
                   metavar="GAMMA", help="lbfgs: per-example weight of a batch per later batch, "
                   "in (0, 1] (--sa-decay: deprecated)")  # fmt: skip
    m.add_argument("--s-steps", "--s", dest="s", type=int, default=4,
                   help="casgd: mini-batches per all-reduce (under torchrun spell it --s-steps: "
                   "torchrun's own parser reads --s as an abbreviation of its options)")  # fmt: skip
    m.add_argument("--precision", type=str.lower, default="fp32",
                   choices=("fp64", "fp32", "bf16", "fp16"),
                   help="sgd/casgd: bf16/fp16 data and margins, fp32 Gram and updates")  # fmt: skip
    m.add_argument("--latency-ms", type=float, default=0.0, help="sleep before each all-reduce")
    m.add_argument("--grad-combine", type=str.lower, default=None, choices=COMBINERS,
                   help="sgd: partition the rows instead of the features and combine the "
                   "workers with a sparse all-reduce of the gradients (allreduce), model "
                   "averaging (average) or SymSGD's sound combiner (symsgd)")  # fmt: skip
    m.add_argument("--round-batches", type=int, default=None,
                   help="--grad-combine: mini-batches per worker per round (allreduce: 1; "
                   f"default average {DEFAULT_ROUND_BATCHES['average']}, symsgd "
                   f"{DEFAULT_ROUND_BATCHES['symsgd']})")  # fmt: skip
    m.add_argument("--sparse-allreduce", type=str.lower, default="auto",
                   choices=("auto", *SPARSE_ALGORITHMS),
                   help="--grad-combine allreduce: the sparse all-reduce algorithm")  # fmt: skip
    m.add_argument("--symsgd-rank", type=int, default=None,
                   help="--grad-combine symsgd: projection columns k (default 16)")  # fmt: skip
    m.add_argument("--symsgd-exact", action="store_true",
                   help="--grad-combine symsgd: exact d x d maps instead of the projection "
                   "(small d only; a test mode)")  # fmt: skip

    o = p.add_argument_group("training and logging")
    o.add_argument("--batch-size", type=int, default=32, help="sgd/casgd: rows per mini-batch")
    o.add_argument("--num-epochs", "--epochs", dest="num_epochs", type=int, default=20,
                   help="sgd/casgd: passes over the data")  # fmt: skip
    o.add_argument("--max-steps", type=int, default=None,
                   help="stop after N iterations (lbfgs) or mini-batches (sgd/casgd)")  # fmt: skip
    o.add_argument("--log-interval", type=int, default=1, help="iterations/rounds per step record")
    o.add_argument("--seed", type=int, default=0,
                   help="mini-batch order, and the split unless --data-seed is given")  # fmt: skip
    o.add_argument("--run-log", type=str, default=None, help="JSON Lines run log")
    o.add_argument("--no-progress", action="store_true", help="accepted; no progress bar here")
    add_elastic_args(p)
    add_tensorboard_args(p)
    brief(p, "--dataset", "--data-file", "--loss", "--solver", "--wd", "--lr", "--batch-size",
          "--num-epochs", "--max-steps", "--seed", "--run-log")  # fmt: skip
    args = p.parse_args(argv)
    if args.data_seed is None:  # a seed is a different split: what seeds vary for L-BFGS
        args.data_seed = args.seed

    if args.dataset not in DATASETS:
        p.error(f"--dataset {args.dataset!r}: choose one of {', '.join(DATASETS)}")
    if args.solver not in SOLVERS:
        p.error(f"--solver {args.solver!r}: choose one of {', '.join(SOLVERS)}")
    if args.dataset == "svmlight" and not args.data_file:
        p.error("--dataset svmlight needs --data-file PATH")
    if args.loss is not None and args.loss not in LOSSES:
        p.error(f"--loss {args.loss!r}: choose one of {', '.join(sorted(LOSSES))}")
    if args.s < 1:
        p.error(f"--s-steps must be at least 1, got {args.s}")
    for flag in ("batch_size", "num_epochs", "iterations", "sa_batches", "history_size"):
        if getattr(args, flag) < 1:
            p.error(f"{p.flag_of(flag)} must be at least 1, got {getattr(args, flag)}")
    if args.max_steps is not None and args.max_steps < 1:
        p.error(f"--max-steps must be positive, got {args.max_steps}")
    if not 0.0 < args.test_fraction < 1.0:
        p.error(f"--test-fraction must be in (0, 1), got {args.test_fraction}")
    if args.solver != "lbfgs" and args.sa_batches > 1:
        p.error("--arriving-batches/--sa-batches is an L-BFGS option; use --solver lbfgs")
    _check_row_parallel(p, args)
    if args.lr is None:
        args.lr = 1.0 if args.solver == "lbfgs" else 0.1
    if args.elastic_lr_scaling == "linear":
        p.error("--elastic-lr-scaling linear: train_linear's step never depends on the world "
                "size (L-BFGS uses every row, the SGD/CA-SGD mini-batch is global); use auto "
                "or none")  # fmt: skip
    if args.elastic_checkpoint_steps < 1:
        p.error(f"--elastic-checkpoint-steps must be at least 1, got "
                f"{args.elastic_checkpoint_steps}")  # fmt: skip
    p.check(args, bounds=BOUNDS)
    return p.finish(args)


# The script's own flags' ranges (the shared ones: trainers.cli.BOUNDS).
BOUNDS = {
    "n_features": Bound(1), "synthetic_samples": Bound(2), "synthetic_features": Bound(1),
    "nnz_per_row": Bound(1), "sa_decay": Bound(0, 1, low_open=True), "latency_ms": Bound(0),
}  # fmt: skip


def _check_row_parallel(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--grad-combine`` and its options: only with ``--solver sgd``, each with its combiner;
    fills in the defaults."""
    combine = args.grad_combine
    if combine is None:
        for flag, unset in (("round_batches", None), ("symsgd_rank", None),
                            ("symsgd_exact", False), ("sparse_allreduce", "auto")):  # fmt: skip
            if getattr(args, flag) != unset:
                p.error(f"--{flag.replace('_', '-')} is a --grad-combine option; add "
                        "--solver sgd --grad-combine allreduce|average|symsgd")  # fmt: skip
        return
    if args.solver != "sgd":
        p.error(f"--grad-combine {combine} is row-partitioned SGD: use --solver sgd "
                f"(--solver {args.solver} has its own communication)")  # fmt: skip
    if args.elastic_dir is not None:
        p.error("--elastic-dir is not supported with --grad-combine (the saved state is the "
                "feature-partitioned one); drop one of them")  # fmt: skip
    if args.round_batches is not None and args.round_batches < 1:
        p.error(f"--round-batches must be at least 1, got {args.round_batches}")
    if combine == "allreduce" and args.round_batches not in (None, 1):
        p.error(f"--grad-combine allreduce steps once per round with the global batch: "
                f"--round-batches must be 1 (got {args.round_batches}); use average or symsgd "
                "for several local mini-batches per round")  # fmt: skip
    if combine != "allreduce" and args.sparse_allreduce != "auto":
        p.error("--sparse-allreduce is a --grad-combine allreduce option")
    if combine != "symsgd" and (args.symsgd_rank is not None or args.symsgd_exact):
        p.error("--symsgd-rank and --symsgd-exact are --grad-combine symsgd options")
    if combine == "symsgd":
        if args.loss == "multinomial":
            p.error(_MULTINOMIAL_SYMSGD)
        if args.symsgd_rank is not None and args.symsgd_rank < 1:
            p.error(f"--symsgd-rank must be at least 1, got {args.symsgd_rank}")
        if args.symsgd_rank is None:
            args.symsgd_rank = 16
    if args.round_batches is None:
        args.round_batches = DEFAULT_ROUND_BATCHES[combine]


_MULTINOMIAL_SYMSGD = (
    "--grad-combine symsgd needs a loss with one margin per example (squared, logistic, hinge, "
    "squared_hinge): the multinomial loss has one per class; use --grad-combine allreduce or "
    "average, or --solver sgd without --grad-combine"
)
_ROW_PARALLEL_FLAGS = ("grad_combine", "round_batches", "sparse_allreduce", "symsgd_rank",
                       "symsgd_exact")  # fmt: skip


# Flags that fix the trajectory: a saved elastic state with other values is refused.
_IDENTITY_FLAGS = ("solver", "dataset", "data_file", "n_features", "zero_based", "test_fraction",
                   "synthetic_samples", "synthetic_features", "nnz_per_row", "synthetic_task",
                   "synthetic_columns", "data_seed", "wd", "lr", "precision")  # fmt: skip
_SOLVER_FLAGS = {
    "lbfgs": ("history_size", "iterations", "no_line_search", "sa_batches", "sa_decay"),
    "sgd": ("batch_size", "seed"),
    "casgd": ("batch_size", "seed", "s"),
}


def elastic_identity(args: argparse.Namespace, data: dict[str, Any], loss: str) -> dict[str, Any]:
    """What a resumed job must share with the saved one: the flags that fix the trajectory
    (not ``--num-epochs``/``--max-steps``, which only say where it ends) and the data's shape."""
    flags = _IDENTITY_FLAGS + _SOLVER_FLAGS[args.solver]
    n, d = data["X_train"].shape
    return {**{f: getattr(args, f) for f in flags}, "loss": loss, "train_rows": int(n),
            "features": int(d), "num_classes": int(data["num_classes"])}  # fmt: skip


# ------------------------------------------------------------------------------------- data
def load_data(args: argparse.Namespace, dtype: torch.dtype) -> dict[str, Any]:
    """``X_train, y_train, X_test, y_test, task, num_classes`` for the flags."""
    if args.dataset in ("breast_cancer", "digits", "wine", "diabetes"):
        d = load_bundled(args.dataset, test_size=args.test_fraction, seed=args.data_seed,
                         dtype=dtype)  # fmt: skip
        return {"X_train": d.X_train, "y_train": d.y_train, "X_test": d.X_test,
                "y_test": d.y_test, "task": d.task, "num_classes": d.num_classes}  # fmt: skip
    if args.dataset == "synthetic":
        s = synthetic_sparse(args.synthetic_samples, args.synthetic_features, args.nnz_per_row,
                             task=args.synthetic_task, columns=args.synthetic_columns,
                             seed=args.data_seed, dtype=dtype)  # fmt: skip
        X, y = s.X, s.y
        task = "binary" if args.synthetic_task == "logistic" else "regression"
    else:
        zero_based = {"auto": "auto", "true": True, "false": False}[args.zero_based]
        try:
            data = load_svmlight(args.data_file, args.n_features, zero_based=zero_based,
                                 dtype=dtype)  # fmt: skip
        except (SvmlightFormatError, FileNotFoundError) as e:
            raise SystemExit(f"--data-file: {e}") from None
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
    n_test = max(1, int(round(args.test_fraction * X.shape[0])))
    if X.shape[0] - n_test < 1:
        raise SystemExit(f"{X.shape[0]} examples: too few to hold out --test-fraction")
    cut = X.shape[0] - n_test  # the last rows are held out
    num_classes = int(y.max()) + 1 if task == "multiclass" else (2 if task == "binary" else 0)
    return {"X_train": row_slice(X, 0, cut), "y_train": y[:cut],
            "X_test": row_slice(X, cut, X.shape[0]), "y_test": y[cut:],
            "task": task, "num_classes": num_classes}  # fmt: skip


def metrics(task: str, margins: torch.Tensor, y: torch.Tensor, loss: str, prefix: str) -> dict:
    """Mean loss, and accuracy (classification) or mean squared error (regression)."""
    value = LOSSES[loss].value(margins, y).double().mean()
    out = {f"{prefix}_loss": float(value)}
    if task == "regression":
        out[f"{prefix}_mse"] = float(((margins - y) ** 2).double().mean())
    else:
        pred = margins.argmax(1) if margins.dim() == 2 else (margins > 0).long()
        out[f"{prefix}_accuracy"] = float((pred == y.long()).double().mean())
    return out


# ------------------------------------------------------------------------------------- solvers
def train_lbfgs(
    args: argparse.Namespace,
    env: DistEnv,
    logger: RunLogger,
    data: dict[str, Any],
    loss: str,
    dtype: torch.dtype,
    elastic: LinearElastic | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Data-parallel L-BFGS, re-fit on all the rows so far as each of ``--arriving-batches``
    arrives (one batch: plain L-BFGS); the ``end`` record's metrics.

    With ``elastic``: saves every ``checkpoint_steps`` iterations and after each arriving
    batch; ``resume`` (a saved state, any world size) continues where it was saved.
    """
    X, y = data["X_train"], data["y_train"]
    n = X.shape[0]
    model = build_linear_model(loss, X.shape[1], max(data["num_classes"], 2), dtype=dtype)
    messenger = Messenger(latency=args.latency_ms / 1000)
    config = LBFGSConfig(lr=args.lr, history_size=args.history_size,
                         line_search=None if args.no_line_search else "strong_wolfe")  # fmt: skip
    cumulative = CumulativeBatchLBFGS(model, penalty=lambda: model.penalty(args.wd),
                              decay=args.sa_decay, config=config, messenger=messenger)  # fmt: skip
    budget = args.max_steps if args.max_steps is not None else math.inf
    step, start = 0, time.perf_counter()
    arrivals = torch.linspace(0, n, args.sa_batches + 1).round().long().tolist()

    def shard(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the k-th arriving batch."""
        lo, hi = arrivals[k], arrivals[k + 1]
        bounds = torch.linspace(lo, hi, env.world_size + 1).round().long().tolist()
        a, b = bounds[env.rank], bounds[env.rank + 1]
        return row_slice(X, a, b), y[a:b]

    def save(batch: int, iteration: int, in_batch: bool) -> None:
        assert elastic is not None
        elastic.save({"solver": cumulative.state_dict(), "batch": batch, "iteration": iteration,
                      "in_batch": in_batch, "epochs": epochs, "loss_value": loss_value,
                      "messages": messenger.messages, "bytes": messenger.bytes}, step=step)  # fmt: skip

    epochs, first_batch, first_iteration, in_batch = 0, 0, 0, False
    loss_value = math.nan
    if resume is not None:  # the arrived batches, re-sharded over this world
        arrived = int(resume["solver"]["arrived"])
        cumulative.load_state_dict(resume["solver"], [shard(j) for j in range(arrived)])
        messenger.messages, messenger.bytes = int(resume["messages"]), int(resume["bytes"])
        step, epochs, loss_value = int(resume["step"]), int(resume["epochs"]), resume["loss_value"]
        first_batch, first_iteration = int(resume["batch"]), int(resume["iteration"])
        in_batch = bool(resume["in_batch"])
    for k in range(first_batch, args.sa_batches):
        resumed = in_batch and k == first_batch  # this batch arrived before the restart
        if step >= budget and not resumed:
            break
        hi = arrivals[k + 1]  # the k-th arriving batch, sharded over ranks
        t0, it0 = time.perf_counter(), 0
        if resumed:
            solver = cumulative.solver
            assert solver is not None
            it0 = args.iterations if solver.converged else first_iteration
        else:
            cumulative.add_batch(*shard(k))
            solver = cumulative.solver
            assert solver is not None
            loss_value = solver.evaluate()
        for it in range(it0, args.iterations):
            if step >= budget:
                break
            loss_value = solver.step()
            step += 1
            if step % args.log_interval == 0:
                speed = (hi * (it + 1 - it0)) / max(time.perf_counter() - t0, 1e-9)
                logger.step(epoch=k, batch=it, step=step, loss=loss_value, lr=args.lr,
                            samples_per_sec=speed, messages=messenger.messages)  # fmt: skip
            if elastic is not None:
                elastic.ledger_step(epoch=k, step=step, ids=[])  # every row, every iteration
                if elastic.due(step - 1, step):
                    save(k, it + 1, True)
            if solver.converged:
                break
        elapsed = time.perf_counter() - t0
        logger.epoch(epoch=k, step=step, loss=loss_value, samples_per_sec=hi / max(elapsed, 1e-9),
                     time_cost=elapsed, examples=hi)  # fmt: skip
        with torch.no_grad():
            test = metrics(data["task"], model(data["X_test"]), data["y_test"], loss, "test")
        logger.eval(epoch=k, step=step, **test)
        epochs += 1
        if elastic is not None:
            save(k + 1, 0, False)
    with torch.no_grad():
        test = metrics(data["task"], model(data["X_test"]), data["y_test"], loss, "test")
    return {"steps": step, "epochs": epochs, "total_time": time.perf_counter() - start,
            "train_objective": loss_value, "messages": messenger.messages, **test}  # fmt: skip


def train_sgd(
    args: argparse.Namespace,
    env: DistEnv,
    logger: RunLogger,
    data: dict[str, Any],
    loss: str,
    dtype: torch.dtype,
    elastic: LinearElastic | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Feature-partitioned SGD or CA-SGD; the ``end`` record's metrics.

    With ``elastic``: saves the full ``w`` (gathered) and the (epoch, next mini-batch)
    position every ``checkpoint_steps`` mini-batches (at the end of the round that reaches
    them) and after each epoch; ``resume`` continues with this world's column blocks.
    """
    X, y = add_intercept_column(data["X_train"]), data["y_train"]
    X_test = add_intercept_column(data["X_test"])
    lo, hi = column_blocks(X.shape[1], env.world_size)[env.rank]
    C = data["num_classes"] if loss == "multinomial" else 1
    messenger = Messenger(latency=args.latency_ms / 1000)
    sgd = FeaturePartitionedSGD(column_slice(X, lo, hi), y, LOSSES[loss].derivative,
                                loss_value=LOSSES[loss].value, num_outputs=C, lr=args.lr, l2=args.wd, precision=args.precision,
                                messenger=messenger)  # fmt: skip
    X_test_p = column_slice(X_test, lo, hi)
    s = args.s if args.solver == "casgd" else 1
    budget = args.max_steps if args.max_steps is not None else math.inf
    start, epochs = time.perf_counter(), 0

    def save(epoch: int, batch: int) -> None:
        assert elastic is not None
        block = sgd.state_dict()
        w = gather_rows(block["w"], env.world_size)  # (d, C) on rank 0: every rank's block
        elastic.save({"w": w, "steps": sgd.steps, "last_loss": sgd.last_loss, "epoch": epoch,
                      "batch": batch, "epochs": epochs, "messages": messenger.messages,
                      "bytes": messenger.bytes}, step=sgd.steps)  # fmt: skip

    first_epoch, first_batch = 0, 0
    if resume is not None:  # this world's column block of the saved w
        sgd.load_state_dict({"w": resume["w"][lo:hi], "steps": resume["steps"],
                             "last_loss": resume["last_loss"]})  # fmt: skip
        messenger.messages, messenger.bytes = int(resume["messages"]), int(resume["bytes"])
        first_epoch, first_batch = int(resume["epoch"]), int(resume["batch"])
        epochs = int(resume["epochs"])
    for epoch in range(first_epoch, args.num_epochs):
        done = first_batch if epoch == first_epoch else 0  # mini-batches of it already applied
        if sgd.steps >= budget and done == 0:
            break
        t0 = time.perf_counter()
        batches = epoch_batches(X.shape[0], args.batch_size, seed=args.seed, epoch=epoch)
        if budget < math.inf:
            batches = batches[: int(budget - (sgd.steps - done))]
        for first in range(done, len(batches), s):
            r = first // s
            group = batches[first : first + s]
            before = sgd.steps
            if args.solver == "casgd":
                sgd.unrolled_step(group)
            else:
                sgd.step(group[0])
            if (r + 1) % args.log_interval == 0:
                rows = sum(int(b.numel()) for b in group) * (r + 1 - done // s) / len(group)
                logger.step(epoch=epoch, batch=r, step=sgd.steps, loss=sgd.last_loss, lr=args.lr,
                            samples_per_sec=rows / max(time.perf_counter() - t0, 1e-9),
                            messages=messenger.messages)  # fmt: skip
            if elastic is not None:
                elastic.ledger_step(epoch=epoch, step=sgd.steps, ids=torch.cat(group))
                if elastic.due(before, sgd.steps):
                    save(epoch, first + len(group))
        elapsed = time.perf_counter() - t0
        train_obj = sgd.objective(LOSSES[loss].value)  # evaluation: not counted in messages
        logger.epoch(epoch=epoch, step=sgd.steps, loss=train_obj, time_cost=elapsed,
                     samples_per_sec=X.shape[0] / max(elapsed, 1e-9), messages=messenger.messages)  # fmt: skip
        m = sgd.margins(X_test_p)
        logger.eval(epoch=epoch, step=sgd.steps,
                    **metrics(data["task"], m[:, 0] if C == 1 else m, data["y_test"], loss, "test"))  # fmt: skip
        epochs += 1
        if elastic is not None:
            save(epoch + 1, 0)
    m = sgd.margins(X_test_p)
    test = metrics(data["task"], m[:, 0] if C == 1 else m, data["y_test"], loss, "test")
    return {"steps": sgd.steps, "epochs": epochs, "total_time": time.perf_counter() - start,
            "train_objective": sgd.objective(LOSSES[loss].value),
            "messages": messenger.messages, **test}  # fmt: skip


def train_rowparallel(
    args: argparse.Namespace,
    env: DistEnv,
    logger: RunLogger,
    data: dict[str, Any],
    loss: str,
    dtype: torch.dtype,
    elastic: LinearElastic | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Row-partitioned SGD (``--grad-combine``); the ``end`` record's metrics.

    Every rank loads all the data and the whole ``w``; a step record per round (or every
    ``--log-interval`` rounds) with the combiner, the bytes this rank sent in the round and
    in all (``round_bytes``, ``bytes_sent``) and, for ``allreduce``, the sparse algorithm.
    """
    assert elastic is None and resume is None  # refused by parse_args
    X, y = add_intercept_column(data["X_train"]), data["y_train"]
    X_test = add_intercept_column(data["X_test"])
    C = data["num_classes"] if loss == "multinomial" else 1
    messenger = Messenger(latency=args.latency_ms / 1000)
    try:
        sgd = RowParallelSGD(X, y, LOSSES[loss].derivative, combine=args.grad_combine,
                             lr=args.lr, l2=args.wd, num_outputs=C, loss_value=LOSSES[loss].value,
                             curvature=CURVATURES.get(loss), round_batches=args.round_batches,
                             sparse_algorithm=args.sparse_allreduce,
                             symsgd_rank=args.symsgd_rank or 16, exact=args.symsgd_exact,
                             seed=args.seed, precision=args.precision,
                             messenger=messenger)  # fmt: skip
    except ValueError as e:
        raise SystemExit(f"--grad-combine {args.grad_combine}: {e}") from None
    budget = args.max_steps if args.max_steps is not None else math.inf
    start, epochs, round_index = time.perf_counter(), 0, 0
    for epoch in range(args.num_epochs):
        if sgd.steps >= budget:
            break
        t0 = time.perf_counter()
        batches = epoch_batches(X.shape[0], args.batch_size, seed=args.seed, epoch=epoch)
        if budget < math.inf:
            batches = batches[: int(budget - sgd.steps)]
        size = sgd.batches_per_round
        for r, first in enumerate(range(0, len(batches), size)):
            group = batches[first : first + size]
            sgd.round(group, round_index)
            round_index += 1
            if (r + 1) % args.log_interval == 0:
                rows = sum(int(b.numel()) for b in batches[: first + len(group)])
                extra = {}
                if sgd.combine == "allreduce":
                    extra["sparse_algorithm"] = sgd.last_algorithm
                logger.step(epoch=epoch, batch=r, step=sgd.steps, loss=sgd.mean_round_loss(),
                            lr=args.lr, samples_per_sec=rows / max(time.perf_counter() - t0, 1e-9),
                            messages=messenger.messages, combiner=sgd.combine,
                            round_bytes=sgd.round_bytes, bytes_sent=sgd.bytes_sent, **extra)  # fmt: skip
        elapsed = time.perf_counter() - t0
        logger.epoch(epoch=epoch, step=sgd.steps, loss=sgd.objective(LOSSES[loss].value),
                     time_cost=elapsed, samples_per_sec=X.shape[0] / max(elapsed, 1e-9),
                     messages=messenger.messages, bytes_sent=sgd.bytes_sent)  # fmt: skip
        m = sgd.margins(X_test)
        logger.eval(epoch=epoch, step=sgd.steps,
                    **metrics(data["task"], m[:, 0] if C == 1 else m, data["y_test"], loss, "test"))  # fmt: skip
        epochs += 1
    m = sgd.margins(X_test)
    test = metrics(data["task"], m[:, 0] if C == 1 else m, data["y_test"], loss, "test")
    return {"steps": sgd.steps, "epochs": epochs, "total_time": time.perf_counter() - start,
            "train_objective": sgd.objective(LOSSES[loss].value),
            "messages": messenger.messages, "bytes_sent": sgd.bytes_sent,
            "combiner": sgd.combine, **test}  # fmt: skip


# ------------------------------------------------------------------------------------- main
def trivial_level(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The task's trivial level for a run log's claims (``logs/claims.json``): the accuracy of
    the best constant prediction (the majority class) on the run's held-out rows."""
    args = parse_args(list(records[0]["command"][1:]))
    data = load_data(args, torch.float64)
    if data["task"] == "regression":
        raise SystemExit("a regression has no majority class: its claims need another level")
    where = args.dataset if args.dataset != "svmlight" else args.data_file
    return majority_level(data["y_test"].long().tolist(), what=f"held-out rows of {where}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # a --data-file that is not there: named by load_data
    if print_config(args):
        return 0
    env = DistEnv.from_env()
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    dtype = torch.float64 if args.precision == "fp64" else torch.float32
    data = load_data(args, dtype)
    loss = args.loss or DEFAULT_LOSS[data["task"]]
    if (loss == "multinomial") != (data["task"] == "multiclass") or (
        (loss == "squared") != (data["task"] == "regression")
    ):
        raise SystemExit(f"--loss {loss} does not fit the {data['task']} labels of {args.dataset}")
    if args.grad_combine == "symsgd" and loss == "multinomial":
        raise SystemExit(_MULTINOMIAL_SYMSGD)
    elastic, resume, appending = None, None, False
    config = elastic_config(args)
    if config is not None:
        elastic = LinearElastic(config.dir, rank=env.rank, world_size=env.world_size,
                                identity=elastic_identity(args, data, loss),
                                checkpoint_steps=config.checkpoint_steps, ledger=config.ledger,
                                run_log=args.run_log)  # fmt: skip
        try:
            resume = elastic.read()  # every rank: the job's state, checked against these flags
            appending = elastic.resume_run_log(resume)  # rank 0: cut the log back to the save
        except (ElasticStateMismatch, CheckpointError) as e:
            raise SystemExit(f"--elastic-dir: {e}") from None
        # As the Trainer's ElasticState: refuse torchrun's shared store (a restart would read
        # the dead group's addresses), and give up on a silent peer (a partition) in seconds
        # instead of at the 30-minute collective timeout, so that torchrun re-forms the group.
        try:
            check_launch(elastic=True)
        except UnsafeLaunchError as e:
            raise SystemExit(f"--elastic-dir: {e}") from None
        start_peer_watchdog(env, peer_timeout(elastic=True))
    logger = RunLogger(args.run_log, enabled=env.is_main, mode="a" if appending else "w",
                       tensorboard=args.tensorboard)  # fmt: skip
    if not appending:
        logger.write(make_header(command, args.seed, env.world_size, _header_config(args)))
    n, d = data["X_train"].shape
    solver = args.solver if args.grad_combine is None else f"sgd/{args.grad_combine} (rows)"
    logger.info(f"{args.dataset}: {n} training / {data['X_test'].shape[0]} test examples, "
                f"{d} features, {data['task']}; {loss} loss, {solver} on "
                f"{env.world_size} process(es)")  # fmt: skip
    if elastic is not None:
        elastic.start(logger, resume)  # the membership record, the ledger
    if args.solver == "lbfgs":
        train = train_lbfgs
    else:
        train = train_sgd if args.grad_combine is None else train_rowparallel
    result = train(args, env, logger, data, loss, dtype, elastic, resume)
    logger.end(**result)
    if elastic is not None:
        elastic.finish()  # after the end record: a restart before it redoes the end
    main_metric = "test_mse" if data["task"] == "regression" else "test_accuracy"
    logger.info(f"held-out {main_metric.split('_')[1]}: {result[main_metric]:.4f} "
                f"(test loss {result['test_loss']:.4f}, {result['steps']} steps, "
                f"{result['messages']} messages, {result['total_time']:.2f} s)")  # fmt: skip
    logger.close()
    env.destroy()
    return 0 if all(math.isfinite(v) for v in result.values() if isinstance(v, float)) else 1


def _header_config(args: argparse.Namespace) -> argparse.Namespace:
    """The flags for the header; without ``--elastic-dir`` the elastic ones are left out, and
    without ``--grad-combine`` the row-parallel ones, so a run's header is what it was before
    they existed."""

    def kept(flag: str) -> bool:
        if "elastic" in flag and args.elastic_dir is None:
            return False
        return args.grad_combine is not None or flag not in _ROW_PARALLEL_FLAGS

    return argparse.Namespace(**{k: v for k, v in vars(args).items() if kept(k)})


if __name__ == "__main__":
    sys.exit(run_main(main))
