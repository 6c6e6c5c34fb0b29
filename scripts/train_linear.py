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
from typing import Any

import torch

from modelzoo.linear import (
    DEFAULT_LOSS,
    LOSSES,
    LinearData,
    add_intercept_column,
    build_linear_model,
    column_slice,
    loss_fits,
    row_slice,
)
from modelzoo.linear.data import DATASETS, TooFewExamples, load_linear_data
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
from trainers.dist import UnsafeLaunchError
from trainers.linear import COMBINERS, ElasticStateMismatch, LinearElastic
from trainers.linear.elastic import open_linear_elastic
from trainers.linear.recipes import (
    MULTINOMIAL_SYMSGD,
    LinearOptionError,
    MatrixOps,
    SolverConfig,
    SolverConfigError,
    describe_result,
    describe_run,
    elastic_identity,
    header_options,
    resolve_row_parallel,
    train_lbfgs,
    train_rowparallel,
    train_sgd,
)
from trainers.linear.rowparallel import DEFAULT_ROUND_BATCHES

SOLVERS = ("lbfgs", "sgd", "casgd")


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
    try:  # --grad-combine and its options, with their defaults
        args.round_batches, args.symsgd_rank = resolve_row_parallel(
            args.grad_combine, solver=args.solver, round_batches=args.round_batches,
            sparse_allreduce=args.sparse_allreduce, symsgd_rank=args.symsgd_rank,
            symsgd_exact=args.symsgd_exact, loss=args.loss, elastic=args.elastic_dir is not None,
        )  # fmt: skip
    except LinearOptionError as err:
        p.error(str(err))
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


# ------------------------------------------------------------------------------------- data
def load_data(args: argparse.Namespace, dtype: torch.dtype) -> LinearData:
    """The split for the flags (:func:`modelzoo.linear.data.load_linear_data`)."""
    zero_based = {"auto": "auto", "true": True, "false": False}[args.zero_based]
    try:
        return load_linear_data(args.dataset, dtype=dtype, test_fraction=args.test_fraction,
                                seed=args.data_seed, synthetic_samples=args.synthetic_samples,
                                synthetic_features=args.synthetic_features,
                                nnz_per_row=args.nnz_per_row, synthetic_task=args.synthetic_task,
                                synthetic_columns=args.synthetic_columns,
                                data_file=args.data_file, n_features=args.n_features,
                                zero_based=zero_based)  # fmt: skip
    except (SvmlightFormatError, FileNotFoundError) as e:
        raise SystemExit(f"--data-file: {e}") from None
    except TooFewExamples as e:
        raise SystemExit(f"{e.n} examples: too few to hold out --test-fraction") from None


def solver_config(args: argparse.Namespace) -> SolverConfig:
    """The recipes' settings from the flags."""
    return SolverConfig(solver=args.solver, lr=args.lr, wd=args.wd, latency_ms=args.latency_ms,
                        max_steps=args.max_steps, log_interval=args.log_interval, seed=args.seed,
                        history_size=args.history_size, iterations=args.iterations,
                        line_search=not args.no_line_search, arriving_batches=args.sa_batches,
                        arriving_decay=args.sa_decay, batch_size=args.batch_size,
                        num_epochs=args.num_epochs, s_steps=args.s, precision=args.precision,
                        grad_combine=args.grad_combine, round_batches=args.round_batches,
                        sparse_allreduce=args.sparse_allreduce, symsgd_rank=args.symsgd_rank,
                        symsgd_exact=args.symsgd_exact)  # fmt: skip


def train(args: argparse.Namespace, env: DistEnv, logger: RunLogger, data: LinearData,
          loss: str, dtype: torch.dtype, elastic: LinearElastic | None,
          resume: dict[str, Any] | None) -> dict[str, Any]:  # fmt: skip
    """The flags' recipe (:mod:`trainers.linear.recipes`); the ``end`` record's metrics."""
    config, margin_loss = solver_config(args), LOSSES[loss]
    ops = MatrixOps(row_slice, column_slice, add_intercept_column)
    if args.solver == "lbfgs":
        model = build_linear_model(loss, data.X_train.shape[1], max(data.num_classes, 2),
                                   dtype=dtype)  # fmt: skip
        return train_lbfgs(config, env, logger, data, margin_loss, model, ops, elastic, resume)
    if args.grad_combine is None:
        return train_sgd(config, env, logger, data, margin_loss, ops, elastic, resume)
    assert elastic is None and resume is None  # refused by parse_args
    try:
        return train_rowparallel(config, env, logger, data, margin_loss, ops)
    except SolverConfigError as e:
        raise SystemExit(f"--grad-combine {args.grad_combine}: {e}") from None


# ------------------------------------------------------------------------------------- main
def trivial_level(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The task's trivial level for a run log's claims (``logs/claims.json``): the accuracy of
    the best constant prediction (the majority class) on the run's held-out rows."""
    args = parse_args(list(records[0]["command"][1:]))
    data = load_data(args, torch.float64)
    if data.task == "regression":
        raise SystemExit("a regression has no majority class: its claims need another level")
    where = args.dataset if args.dataset != "svmlight" else args.data_file
    return majority_level(data.y_test.long().tolist(), what=f"held-out rows of {where}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)  # a --data-file that is not there: named by load_data
    if print_config(args):
        return 0
    env = DistEnv.from_env()
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    dtype = torch.float64 if args.precision == "fp64" else torch.float32
    data = load_data(args, dtype)
    loss = args.loss or DEFAULT_LOSS[data.task]
    if not loss_fits(loss, data.task):
        raise SystemExit(f"--loss {loss} does not fit the {data.task} labels of {args.dataset}")
    if args.grad_combine == "symsgd" and loss == "multinomial":
        raise SystemExit(MULTINOMIAL_SYMSGD)
    elastic, resume, appending = None, None, False
    config = elastic_config(args)
    if config is not None:  # every rank: the job's state, checked against these flags
        try:
            elastic, resume, appending = open_linear_elastic(
                config.dir, env, identity=elastic_identity(vars(args), data, loss),
                checkpoint_steps=config.checkpoint_steps, ledger=config.ledger,
                run_log=args.run_log,
            )  # fmt: skip
        except (ElasticStateMismatch, CheckpointError, UnsafeLaunchError) as e:
            raise SystemExit(f"--elastic-dir: {e}") from None
    logger = RunLogger(args.run_log, enabled=env.is_main, mode="a" if appending else "w",
                       tensorboard=args.tensorboard)  # fmt: skip
    if not appending:  # without --elastic-dir / --grad-combine: no elastic / row-parallel flags
        logger.write(make_header(command, args.seed, env.world_size, header_options(vars(args))))
    logger.info(describe_run(args.dataset, data, loss, args.solver, args.grad_combine,
                             env.world_size))  # fmt: skip
    if elastic is not None:
        elastic.start(logger, resume)  # the membership record, the ledger
    result = train(args, env, logger, data, loss, dtype, elastic, resume)
    logger.end(**result)
    if elastic is not None:
        elastic.finish()  # after the end record: a restart before it redoes the end
    logger.info(describe_result(data.task, result))
    logger.close()
    env.destroy()
    return 0 if all(math.isfinite(v) for v in result.values() if isinstance(v, float)) else 1


if __name__ == "__main__":
    sys.exit(run_main(main))
