"""The linear solvers' training loops with run-log records (``scripts/train_linear.py``).

Each recipe runs one of this package's solvers over a train/test split, writes the run log's
``step`` records (per iteration or mini-batch round, every ``log_interval``), an ``epoch``
and an ``eval`` record per epoch (L-BFGS: per arriving batch), saves and resumes an elastic
state when given one, and returns the ``end`` record's metrics:

* :func:`train_lbfgs`: data-parallel L-BFGS, re-fit on all the rows so far as each of
  ``arriving_batches`` arrives (:class:`~trainers.linear.CumulativeBatchLBFGS`);
* :func:`train_sgd`: feature-partitioned SGD, or CA-SGD (``solver="casgd"``: ``s_steps``
  mini-batches per all-reduce);
* :func:`train_rowparallel`: row-partitioned SGD with a ``grad_combine`` combiner.

The options of these recipes, as ``train_linear.py``'s flags: the row-parallel ones resolved
and checked together (:func:`resolve_row_parallel`), the ones that fix a run's trajectory (an
elastic state's identity, :func:`elastic_identity`), those a run-log header records
(:func:`header_options`), and the lines that describe a run and its result
(:func:`describe_run`, :func:`describe_result`).

As the solvers, the recipes import no model family: ``data`` is a split with the attributes
of :class:`modelzoo.linear.LinearData` (``X_train, y_train, X_test, y_test, task,
num_classes``), ``loss`` a margin loss with ``name``, ``value`` and ``derivative`` (one of
``modelzoo.linear.LOSSES``), and ``ops`` the row / column slicing of dense or CSR matrices
(``modelzoo.linear``'s ``row_slice``, ``column_slice`` and ``add_intercept_column``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..dist import DistEnv
from ..logs import RunLogger
from .casgd import FeaturePartitionedSGD, column_blocks, epoch_batches
from .elastic import LinearElastic, gather_rows
from .lbfgs import CumulativeBatchLBFGS, LBFGSConfig
from .messages import Messenger
from .rowparallel import CURVATURES, DEFAULT_ROUND_BATCHES, RowParallelSGD

__all__ = [
    "IDENTITY_OPTIONS",
    "MULTINOMIAL_SYMSGD",
    "ROW_PARALLEL_OPTIONS",
    "SOLVER_OPTIONS",
    "LinearOptionError",
    "MatrixOps",
    "SolverConfig",
    "SolverConfigError",
    "describe_result",
    "describe_run",
    "elastic_identity",
    "header_options",
    "metrics",
    "resolve_row_parallel",
    "train_lbfgs",
    "train_rowparallel",
    "train_sgd",
]


@dataclass(frozen=True)
class MatrixOps:
    """Slicing of dense or ``torch.sparse_csr`` matrices (``modelzoo.linear``'s functions)."""

    row_slice: Callable[[torch.Tensor, int, int], torch.Tensor]
    column_slice: Callable[[torch.Tensor, int, int], torch.Tensor]
    add_intercept_column: Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SolverConfig:
    """A recipe's settings (the defaults: ``train_linear.py``'s, but ``lr``, which the script
    sets by solver: 1 for L-BFGS, 0.1 for SGD/CA-SGD)."""

    solver: str = "lbfgs"  # lbfgs, sgd or casgd
    lr: float = 1.0
    wd: float = 1e-3  # L2 weight λ: mean loss + λ/2 |w|²
    latency_ms: float = 0.0  # sleep before each all-reduce
    max_steps: int | None = None  # iterations (lbfgs) or mini-batches (sgd/casgd)
    log_interval: int = 1
    seed: int = 0  # the mini-batch order
    # lbfgs
    history_size: int = 10
    iterations: int = 100  # per arriving batch
    line_search: bool = True  # strong Wolfe; else a fixed step lr
    arriving_batches: int = 1
    arriving_decay: float = 1.0
    # sgd / casgd
    batch_size: int = 32
    num_epochs: int = 20
    s_steps: int = 4  # casgd: mini-batches per all-reduce
    precision: str = "fp32"
    # row-partitioned sgd
    grad_combine: str | None = None
    round_batches: int | None = None
    sparse_allreduce: str = "auto"
    symsgd_rank: int | None = None
    symsgd_exact: bool = False

    @property
    def budget(self) -> float:
        return self.max_steps if self.max_steps is not None else math.inf


class SolverConfigError(ValueError):
    """The row-parallel solver refused its settings (the solver's message)."""


class LinearOptionError(ValueError):
    """A recipe's options do not go together: the message names the flag
    (``train_linear.py``'s spelling) and what to do instead."""


MULTINOMIAL_SYMSGD = (
    "--grad-combine symsgd needs a loss with one margin per example (squared, logistic, hinge, "
    "squared_hinge): the multinomial loss has one per class; use --grad-combine allreduce or "
    "average, or --solver sgd without --grad-combine"
)
#: The options of row-partitioned SGD (``--grad-combine`` and those that go with it).
ROW_PARALLEL_OPTIONS = ("grad_combine", "round_batches", "sparse_allreduce", "symsgd_rank",
                        "symsgd_exact")  # fmt: skip
#: Options that fix the trajectory: a saved elastic state with other values is refused.
IDENTITY_OPTIONS = ("solver", "dataset", "data_file", "n_features", "zero_based", "test_fraction",
                    "synthetic_samples", "synthetic_features", "nnz_per_row", "synthetic_task",
                    "synthetic_columns", "data_seed", "wd", "lr", "precision")  # fmt: skip
#: ... and those of each solver.
SOLVER_OPTIONS = {
    "lbfgs": ("history_size", "iterations", "no_line_search", "sa_batches", "sa_decay"),
    "sgd": ("batch_size", "seed"),
    "casgd": ("batch_size", "seed", "s"),
}


def resolve_row_parallel(
    grad_combine: str | None,
    *,
    solver: str,
    round_batches: int | None = None,
    sparse_allreduce: str = "auto",
    symsgd_rank: int | None = None,
    symsgd_exact: bool = False,
    loss: str | None = None,
    elastic: bool = False,
) -> tuple[int | None, int | None]:
    """``grad_combine`` and its options: only with ``solver="sgd"``, each with its combiner.

    Returns:
        ``(round_batches, symsgd_rank)`` with the defaults filled in (unchanged without
        ``grad_combine``).

    Raises:
        LinearOptionError: an option without its combiner or solver, out of range, or with
            an elastic state (``elastic``) or a loss (``loss``) the combiner cannot take.
    """
    combine = grad_combine
    if combine is None:
        for flag, value, unset in (("round_batches", round_batches, None),
                                   ("symsgd_rank", symsgd_rank, None),
                                   ("symsgd_exact", symsgd_exact, False),
                                   ("sparse_allreduce", sparse_allreduce, "auto")):  # fmt: skip
            if value != unset:
                raise LinearOptionError(
                    f"--{flag.replace('_', '-')} is a --grad-combine option; add --solver sgd "
                    "--grad-combine allreduce|average|symsgd"
                )
        return round_batches, symsgd_rank
    if solver != "sgd":
        raise LinearOptionError(
            f"--grad-combine {combine} is row-partitioned SGD: use --solver sgd (--solver "
            f"{solver} has its own communication)"
        )
    if elastic:
        raise LinearOptionError(
            "--elastic-dir is not supported with --grad-combine (the saved state is the "
            "feature-partitioned one); drop one of them"
        )
    if round_batches is not None and round_batches < 1:
        raise LinearOptionError(f"--round-batches must be at least 1, got {round_batches}")
    if combine == "allreduce" and round_batches not in (None, 1):
        raise LinearOptionError(
            f"--grad-combine allreduce steps once per round with the global batch: "
            f"--round-batches must be 1 (got {round_batches}); use average or symsgd "
            "for several local mini-batches per round"
        )
    if combine != "allreduce" and sparse_allreduce != "auto":
        raise LinearOptionError("--sparse-allreduce is a --grad-combine allreduce option")
    if combine != "symsgd" and (symsgd_rank is not None or symsgd_exact):
        raise LinearOptionError(
            "--symsgd-rank and --symsgd-exact are --grad-combine symsgd options"
        )
    if combine == "symsgd":
        if loss == "multinomial":
            raise LinearOptionError(MULTINOMIAL_SYMSGD)
        if symsgd_rank is not None and symsgd_rank < 1:
            raise LinearOptionError(f"--symsgd-rank must be at least 1, got {symsgd_rank}")
        if symsgd_rank is None:
            symsgd_rank = 16
    if round_batches is None:
        round_batches = DEFAULT_ROUND_BATCHES[combine]
    return round_batches, symsgd_rank


def elastic_identity(options: Mapping[str, Any], data: Any, loss: str) -> dict[str, Any]:
    """What a resumed job must share with the saved one: the options (flag values by name)
    that fix the trajectory (:data:`IDENTITY_OPTIONS` and the solver's
    :data:`SOLVER_OPTIONS`; not ``num_epochs``/``max_steps``, which only say where it ends),
    the loss and the shape of the split ``data``."""
    names = IDENTITY_OPTIONS + SOLVER_OPTIONS[options["solver"]]
    n, d = data.X_train.shape
    return {**{name: options[name] for name in names}, "loss": loss, "train_rows": int(n),
            "features": int(d), "num_classes": int(data.num_classes)}  # fmt: skip


def header_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options a run-log header records: without an ``elastic_dir`` the elastic ones are
    left out, and without a ``grad_combine`` the row-parallel ones, so a run's header is what
    it was before they existed."""

    def kept(name: str) -> bool:
        if "elastic" in name and options.get("elastic_dir") is None:
            return False
        return options.get("grad_combine") is not None or name not in ROW_PARALLEL_OPTIONS

    return {name: value for name, value in options.items() if kept(name)}


def describe_run(
    dataset: str, data: Any, loss: str, solver: str, grad_combine: str | None, world_size: int
) -> str:
    """The line that says what a run trains: the split's sizes and task, the loss, the solver
    (row-partitioned SGD with ``grad_combine``) and the processes."""
    n, d = data.X_train.shape
    solver = solver if grad_combine is None else f"sgd/{grad_combine} (rows)"
    return (f"{dataset}: {n} training / {data.X_test.shape[0]} test examples, {d} features, "
            f"{data.task}; {loss} loss, {solver} on {world_size} process(es)")  # fmt: skip


def describe_result(task: str, result: Mapping[str, Any]) -> str:
    """The line that says what a run reached: the held-out accuracy (regression: mean squared
    error) of the ``end`` record's metrics ``result``, and what it cost."""
    main_metric = "test_mse" if task == "regression" else "test_accuracy"
    return (f"held-out {main_metric.split('_')[1]}: {result[main_metric]:.4f} "
            f"(test loss {result['test_loss']:.4f}, {result['steps']} steps, "
            f"{result['messages']} messages, {result['total_time']:.2f} s)")  # fmt: skip


def metrics(
    task: str,
    margins: torch.Tensor,
    y: torch.Tensor,
    loss_value: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    prefix: str,
) -> dict[str, float]:
    """Mean loss, and accuracy (classification) or mean squared error (regression)."""
    value = loss_value(margins, y).double().mean()
    out = {f"{prefix}_loss": float(value)}
    if task == "regression":
        out[f"{prefix}_mse"] = float(((margins - y) ** 2).double().mean())
    else:
        pred = margins.argmax(1) if margins.dim() == 2 else (margins > 0).long()
        out[f"{prefix}_accuracy"] = float((pred == y.long()).double().mean())
    return out


def train_lbfgs(
    config: SolverConfig,
    env: DistEnv,
    logger: RunLogger,
    data: Any,
    loss: Any,
    model: torch.nn.Module,
    ops: MatrixOps,
    elastic: LinearElastic | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Data-parallel L-BFGS of ``model`` (``loss_sum(X, y)``, ``penalty(wd)``, called on the
    margins as ``model(X)``), re-fit on all the rows so far as each of ``arriving_batches``
    arrives (one batch: plain L-BFGS); the ``end`` record's metrics.

    With ``elastic``: saves every ``checkpoint_steps`` iterations and after each arriving
    batch; ``resume`` (a saved state, any world size) continues where it was saved.
    """
    X, y = data.X_train, data.y_train
    n = X.shape[0]
    messenger = Messenger(latency=config.latency_ms / 1000)
    lbfgs = LBFGSConfig(lr=config.lr, history_size=config.history_size,
                        line_search="strong_wolfe" if config.line_search else None)  # fmt: skip
    cumulative = CumulativeBatchLBFGS(model, penalty=lambda: model.penalty(config.wd),
                                      decay=config.arriving_decay, config=lbfgs,
                                      messenger=messenger)  # fmt: skip
    budget = config.budget
    step, start = 0, time.perf_counter()
    arrivals = torch.linspace(0, n, config.arriving_batches + 1).round().long().tolist()

    def shard(k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the k-th arriving batch."""
        lo, hi = arrivals[k], arrivals[k + 1]
        bounds = torch.linspace(lo, hi, env.world_size + 1).round().long().tolist()
        a, b = bounds[env.rank], bounds[env.rank + 1]
        return ops.row_slice(X, a, b), y[a:b]

    def save(batch: int, iteration: int, in_batch: bool) -> None:
        assert elastic is not None
        elastic.save({"solver": cumulative.state_dict(), "batch": batch, "iteration": iteration,
                      "in_batch": in_batch, "epochs": epochs, "loss_value": loss_value,
                      "messages": messenger.messages, "bytes": messenger.bytes}, step=step)  # fmt: skip

    def test_metrics() -> dict[str, float]:
        with torch.no_grad():
            return metrics(data.task, model(data.X_test), data.y_test, loss.value, "test")

    epochs, first_batch, first_iteration, in_batch = 0, 0, 0, False
    loss_value = math.nan
    if resume is not None:  # the arrived batches, re-sharded over this world
        arrived = int(resume["solver"]["arrived"])
        cumulative.load_state_dict(resume["solver"], [shard(j) for j in range(arrived)])
        messenger.messages, messenger.bytes = int(resume["messages"]), int(resume["bytes"])
        step, epochs, loss_value = int(resume["step"]), int(resume["epochs"]), resume["loss_value"]
        first_batch, first_iteration = int(resume["batch"]), int(resume["iteration"])
        in_batch = bool(resume["in_batch"])
    for k in range(first_batch, config.arriving_batches):
        resumed = in_batch and k == first_batch  # this batch arrived before the restart
        if step >= budget and not resumed:
            break
        hi = arrivals[k + 1]  # the k-th arriving batch, sharded over ranks
        t0, it0 = time.perf_counter(), 0
        if resumed:
            solver = cumulative.solver
            assert solver is not None
            it0 = config.iterations if solver.converged else first_iteration
        else:
            cumulative.add_batch(*shard(k))
            solver = cumulative.solver
            assert solver is not None
            loss_value = solver.evaluate()
        for it in range(it0, config.iterations):
            if step >= budget:
                break
            loss_value = solver.step()
            step += 1
            if step % config.log_interval == 0:
                speed = (hi * (it + 1 - it0)) / max(time.perf_counter() - t0, 1e-9)
                logger.step(epoch=k, batch=it, step=step, loss=loss_value, lr=config.lr,
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
        logger.eval(epoch=k, step=step, **test_metrics())
        epochs += 1
        if elastic is not None:
            save(k + 1, 0, False)
    return {"steps": step, "epochs": epochs, "total_time": time.perf_counter() - start,
            "train_objective": loss_value, "messages": messenger.messages, **test_metrics()}  # fmt: skip


def _margin_metrics(data: Any, loss: Any, m: torch.Tensor, C: int) -> dict[str, float]:
    """The test metrics of ``(n, C)`` margins (one output: its column)."""
    return metrics(data.task, m[:, 0] if C == 1 else m, data.y_test, loss.value, "test")


def train_sgd(
    config: SolverConfig,
    env: DistEnv,
    logger: RunLogger,
    data: Any,
    loss: Any,
    ops: MatrixOps,
    elastic: LinearElastic | None = None,
    resume: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Feature-partitioned SGD or CA-SGD (``solver="casgd"``); the ``end`` record's metrics.

    Each rank holds a block of the columns (:func:`~trainers.linear.column_blocks`; the
    intercept column on the last rank). With ``elastic``: saves the full ``w`` (gathered)
    and the (epoch, next mini-batch) position every ``checkpoint_steps`` mini-batches (at the
    end of the round that reaches them) and after each epoch; ``resume`` continues with this
    world's column blocks.
    """
    X, y = ops.add_intercept_column(data.X_train), data.y_train
    X_test = ops.add_intercept_column(data.X_test)
    lo, hi = column_blocks(X.shape[1], env.world_size)[env.rank]
    C = data.num_classes if loss.name == "multinomial" else 1
    messenger = Messenger(latency=config.latency_ms / 1000)
    sgd = FeaturePartitionedSGD(ops.column_slice(X, lo, hi), y, loss.derivative,
                                loss_value=loss.value, num_outputs=C, lr=config.lr, l2=config.wd,
                                precision=config.precision, messenger=messenger)  # fmt: skip
    X_test_p = ops.column_slice(X_test, lo, hi)
    s = config.s_steps if config.solver == "casgd" else 1
    budget = config.budget
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
    for epoch in range(first_epoch, config.num_epochs):
        done = first_batch if epoch == first_epoch else 0  # mini-batches of it already applied
        if sgd.steps >= budget and done == 0:
            break
        t0 = time.perf_counter()
        batches = epoch_batches(X.shape[0], config.batch_size, seed=config.seed, epoch=epoch)
        if budget < math.inf:
            batches = batches[: int(budget - (sgd.steps - done))]
        for first in range(done, len(batches), s):
            r = first // s
            group = batches[first : first + s]
            before = sgd.steps
            if config.solver == "casgd":
                sgd.unrolled_step(group)
            else:
                sgd.step(group[0])
            if (r + 1) % config.log_interval == 0:
                rows = sum(int(b.numel()) for b in group) * (r + 1 - done // s) / len(group)
                logger.step(epoch=epoch, batch=r, step=sgd.steps, loss=sgd.last_loss,
                            lr=config.lr,
                            samples_per_sec=rows / max(time.perf_counter() - t0, 1e-9),
                            messages=messenger.messages)  # fmt: skip
            if elastic is not None:
                elastic.ledger_step(epoch=epoch, step=sgd.steps, ids=torch.cat(group))
                if elastic.due(before, sgd.steps):
                    save(epoch, first + len(group))
        elapsed = time.perf_counter() - t0
        train_obj = sgd.objective(loss.value)  # evaluation: not counted in messages
        logger.epoch(epoch=epoch, step=sgd.steps, loss=train_obj, time_cost=elapsed,
                     samples_per_sec=X.shape[0] / max(elapsed, 1e-9),
                     messages=messenger.messages)  # fmt: skip
        logger.eval(epoch=epoch, step=sgd.steps,
                    **_margin_metrics(data, loss, sgd.margins(X_test_p), C))  # fmt: skip
        epochs += 1
        if elastic is not None:
            save(epoch + 1, 0)
    test = _margin_metrics(data, loss, sgd.margins(X_test_p), C)
    return {"steps": sgd.steps, "epochs": epochs, "total_time": time.perf_counter() - start,
            "train_objective": sgd.objective(loss.value),
            "messages": messenger.messages, **test}  # fmt: skip


def train_rowparallel(
    config: SolverConfig,
    env: DistEnv,
    logger: RunLogger,
    data: Any,
    loss: Any,
    ops: MatrixOps,
) -> dict[str, Any]:
    """Row-partitioned SGD (``grad_combine``); the ``end`` record's metrics.

    Every rank holds all the data and the whole ``w``; a step record per round (or every
    ``log_interval`` rounds) with the combiner, the bytes this rank sent in the round and in
    all (``round_bytes``, ``bytes_sent``) and, for ``allreduce``, the sparse algorithm. No
    elastic state (the saved one is the feature-partitioned one).

    Raises:
        SolverConfigError: :class:`~trainers.linear.RowParallelSGD` refused the settings.
    """
    X, y = ops.add_intercept_column(data.X_train), data.y_train
    X_test = ops.add_intercept_column(data.X_test)
    C = data.num_classes if loss.name == "multinomial" else 1
    messenger = Messenger(latency=config.latency_ms / 1000)
    try:
        sgd = RowParallelSGD(X, y, loss.derivative, combine=config.grad_combine,
                             lr=config.lr, l2=config.wd, num_outputs=C, loss_value=loss.value,
                             curvature=CURVATURES.get(loss.name),
                             round_batches=config.round_batches,
                             sparse_algorithm=config.sparse_allreduce,
                             symsgd_rank=config.symsgd_rank or 16, exact=config.symsgd_exact,
                             seed=config.seed, precision=config.precision,
                             messenger=messenger)  # fmt: skip
    except ValueError as e:
        raise SolverConfigError(str(e)) from None
    budget = config.budget
    start, epochs, round_index = time.perf_counter(), 0, 0
    for epoch in range(config.num_epochs):
        if sgd.steps >= budget:
            break
        t0 = time.perf_counter()
        batches = epoch_batches(X.shape[0], config.batch_size, seed=config.seed, epoch=epoch)
        if budget < math.inf:
            batches = batches[: int(budget - sgd.steps)]
        size = sgd.batches_per_round
        for r, first in enumerate(range(0, len(batches), size)):
            group = batches[first : first + size]
            sgd.round(group, round_index)
            round_index += 1
            if (r + 1) % config.log_interval == 0:
                rows = sum(int(b.numel()) for b in batches[: first + len(group)])
                extra = {}
                if sgd.combine == "allreduce":
                    extra["sparse_algorithm"] = sgd.last_algorithm
                logger.step(epoch=epoch, batch=r, step=sgd.steps, loss=sgd.mean_round_loss(),
                            lr=config.lr,
                            samples_per_sec=rows / max(time.perf_counter() - t0, 1e-9),
                            messages=messenger.messages, combiner=sgd.combine,
                            round_bytes=sgd.round_bytes, bytes_sent=sgd.bytes_sent, **extra)  # fmt: skip
        elapsed = time.perf_counter() - t0
        logger.epoch(epoch=epoch, step=sgd.steps, loss=sgd.objective(loss.value),
                     time_cost=elapsed, samples_per_sec=X.shape[0] / max(elapsed, 1e-9),
                     messages=messenger.messages, bytes_sent=sgd.bytes_sent)  # fmt: skip
        logger.eval(epoch=epoch, step=sgd.steps,
                    **_margin_metrics(data, loss, sgd.margins(X_test), C))  # fmt: skip
        epochs += 1
    test = _margin_metrics(data, loss, sgd.margins(X_test), C)
    return {"steps": sgd.steps, "epochs": epochs, "total_time": time.perf_counter() - start,
            "train_objective": sgd.objective(loss.value),
            "messages": messenger.messages, "bytes_sent": sgd.bytes_sent,
            "combiner": sgd.combine, **test}  # fmt: skip
