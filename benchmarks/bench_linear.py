"""Linear solvers side by side: our L-BFGS vs scikit-learn's, and CA-SGD vs plain SGD.

**L-BFGS** (one process): L2-regularised logistic regression on a synthetic sparse problem
(``--rows`` x ``--features``, ``--nnz`` per row, Zipf columns, float64). scikit-learn's
``LogisticRegression(solver="lbfgs", C=1/(n λ))`` runs first each round; its final
objective ``F_sk`` (mean log loss + λ/2 |w|², computed here) is the target, and ours
(:class:`trainers.linear.DataParallelLBFGS`, one process) is timed until its objective is at
most ``F_sk``. Both run on one thread (``torch.set_num_threads(1)``; scikit-learn's BLAS and
OpenMP pools limited through ``threadpoolctl``). Rounds alternate the two; a line ``lbfgs ...
ratio=<sklearn/ours>`` (median times).

**CA-SGD** (``--world`` gloo processes on 127.0.0.1, features partitioned): plain
feature-partitioned SGD (one all-reduce per mini-batch) against CA-SGD with s = 1, 2, 4, 8, 16
(one all-reduce of the Gram matrix and margins per s mini-batches), ``--latency-ms`` slept
before every all-reduce to model a network whose per-message cost dominates. Each round runs
``--steps`` mini-batches of every variant in turn (paired); per variant the messages counted
by :class:`trainers.linear.Messenger` and the per-mini-batch time (min/median/max over
rounds). Last line ``ratio=<plain SGD time / CA-SGD(--ratio-s) time>``.

Usage: python benchmarks/bench_linear.py [--rounds 5] [--world 4] [--latency-ms 2] [--steps 64]
    [--skip-lbfgs | --skip-casgd] [--json FILE]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

import torch
from _report import add_args, check_rounds, finish

from modelzoo.linear import LOSSES, LogisticRegression, column_slice, synthetic_sparse
from trainers.linear import DataParallelLBFGS, FeaturePartitionedSGD, LBFGSConfig, Messenger

warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
S_VALUES = (1, 2, 4, 8, 16)


def _spread(times: list[float]) -> str:
    return (f"min={min(times) * 1e3:.2f}ms median={statistics.median(times) * 1e3:.2f}ms "
            f"max={max(times) * 1e3:.2f}ms")  # fmt: skip


# ---------------------------------------------------------------------------------- L-BFGS
def _objective(X, y, w: torch.Tensor, b: float, l2: float) -> float:
    m = X @ w.reshape(-1, 1)
    loss = LOSSES["logistic"].value(m[:, 0] + b, y).mean()
    return float(loss) + 0.5 * l2 * float((w**2).sum())


def bench_lbfgs(args: argparse.Namespace) -> dict:
    from sklearn.linear_model import LogisticRegression as SkLogistic
    from threadpoolctl import threadpool_limits  # scikit-learn's own dependency

    data = synthetic_sparse(args.rows, args.features, args.nnz, seed=0, dtype=torch.float64)
    X, y = data.X, data.y
    n, l2 = X.shape[0], args.l2
    import scipy.sparse

    X_sp = scipy.sparse.csr_matrix(
        (X.values().numpy(), X.col_indices().numpy(), X.crow_indices().numpy()), shape=X.shape
    )
    ours_t, sk_t, iters, sk_iters = [], [], [], []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        sk = SkLogistic(C=1.0 / (n * l2), solver="lbfgs", tol=1e-6, max_iter=1000)
        with threadpool_limits(limits=1):  # one thread each, as torch here
            sk.fit(X_sp, y.numpy())
        sk_t.append(time.perf_counter() - t0)
        sk_iters.append(int(sk.n_iter_[0]))
        target = _objective(X, y, torch.from_numpy(sk.coef_[0]), float(sk.intercept_[0]), l2)

        model = LogisticRegression(args.features, dtype=torch.float64)
        t0 = time.perf_counter()
        solver = DataParallelLBFGS(
            model.parameters(), lambda m=model: m.loss_sum(X, y), n,
            penalty=lambda m=model: m.penalty(l2),
            config=LBFGSConfig(tolerance_grad=0, tolerance_change=0),
        )  # fmt: skip
        loss = solver.evaluate()
        while loss > target and solver.iterations < 1000:
            loss = solver.step()
        ours_t.append(time.perf_counter() - t0)
        iters.append(solver.iterations)
    ratio = statistics.median(sk_t) / statistics.median(ours_t)
    print(f"lbfgs data: {n} x {args.features}, {args.nnz} nnz/row, λ={l2}; target F_sk="
          f"{target:.8f}")  # fmt: skip
    print(f"lbfgs sklearn {_spread(sk_t)} iterations={statistics.median(sk_iters):g}")
    print(f"lbfgs ours    {_spread(ours_t)} iterations={statistics.median(iters):g} "
          f"ratio={ratio:.3f}")  # fmt: skip
    return {"lbfgs_ratio": ratio, "lbfgs_ours_rounds": ours_t, "lbfgs_sklearn_rounds": sk_t}


# ---------------------------------------------------------------------------------- CA-SGD
def _casgd_worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world
    )
    data = synthetic_sparse(args.casgd_rows, args.casgd_features, args.nnz, seed=1)
    base, extra = divmod(args.casgd_features, args.world)
    lo = rank * base + min(rank, extra)
    hi = lo + base + (1 if rank < extra else 0)
    Xp = column_slice(data.X, lo, hi)
    g = torch.Generator().manual_seed(2)
    batches = list(torch.randperm(args.casgd_rows, generator=g).split(args.batch_size))
    variants = [("sgd", 0)] + [(f"casgd_s{s}", s) for s in S_VALUES]
    times: dict[str, list[float]] = {name: [] for name, _ in variants}
    messages: dict[str, int] = {}
    solvers = {
        name: FeaturePartitionedSGD(
            Xp,
            data.y,
            LOSSES["logistic"].derivative,
            lr=0.5,
            messenger=Messenger(latency=args.latency_ms / 1000),
        )  # fmt: skip
        for name, _ in variants
    }
    position = 0
    for _ in range(args.rounds):
        chunk = [batches[(position + i) % len(batches)] for i in range(args.steps)]
        position += args.steps
        for name, s in variants:
            solver = solvers[name]
            before = solver.messenger.messages
            dist.barrier()
            t0 = time.perf_counter()
            solver.run(chunk, s=s)
            dist.barrier()
            times[name].append((time.perf_counter() - t0) / args.steps)
            messages[name] = solver.messenger.messages - before
    if rank == 0:
        torch.save({"times": times, "messages": messages}, out)
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_casgd(args: argparse.Namespace) -> dict[str, list[float]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "casgd.pt")
        mp.spawn(_casgd_worker, args=(args, free_port(), out), nprocs=args.world, join=True)
        result = torch.load(out, weights_only=True)
    times, messages = result["times"], result["messages"]
    print(f"casgd data: {args.casgd_rows} x {args.casgd_features}, {args.nnz} nnz/row, "
          f"batch {args.batch_size}, {args.world} gloo processes, latency {args.latency_ms} ms "
          f"per message, {args.steps} mini-batches a round")  # fmt: skip
    plain = statistics.median(times["sgd"])
    for name, t in times.items():
        speedup = plain / statistics.median(t)
        print(f"casgd {name:<10} messages/round={messages[name]:>3} per-step {_spread(t)} "
              f"vs_sgd={speedup:.2f}")  # fmt: skip
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=20_000, help="L-BFGS rows")
    p.add_argument("--features", type=int, default=200_000, help="L-BFGS features")
    p.add_argument("--nnz", type=int, default=20, help="non-zeros per row")
    p.add_argument("--l2", type=float, default=1e-4)
    p.add_argument("--world", type=int, default=4, help="CA-SGD gloo processes")
    p.add_argument("--casgd-rows", type=int, default=8192)
    p.add_argument("--casgd-features", type=int, default=1_000_000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=64, help="mini-batches per variant per round")
    p.add_argument("--latency-ms", type=float, default=2.0)
    p.add_argument("--ratio-s", type=int, default=8, choices=S_VALUES)
    p.add_argument("--skip-lbfgs", action="store_true")
    p.add_argument("--skip-casgd", action="store_true",
                   help="L-BFGS only: its ratio (scikit-learn time / ours) is the last line")  # fmt: skip
    add_args(p, rounds=5)
    args = p.parse_args(argv)
    check_rounds(args.rounds)
    if args.steps % max(S_VALUES) != 0:
        p.error(f"--steps must be a multiple of {max(S_VALUES)}")
    if args.skip_lbfgs and args.skip_casgd:
        p.error("--skip-lbfgs and --skip-casgd together leave nothing to run")
    torch.set_num_threads(1)
    extra = {} if args.skip_lbfgs else bench_lbfgs(args)
    if args.skip_casgd:
        finish(args.json, "bench_linear_lbfgs", extra["lbfgs_ours_rounds"],
               extra["lbfgs_sklearn_rounds"], unit="s",
               ours_label="our L-BFGS (DataParallelLBFGS, 1 process) to scikit-learn's objective",
               peer_label="scikit-learn LogisticRegression(solver='lbfgs', tol=1e-6)",
               target=1.0)  # fmt: skip
        return 0
    times = bench_casgd(args)
    extra.update(latency_ms=args.latency_ms, world=args.world,
                 **{f"{name}_rounds": t for name, t in times.items()})  # fmt: skip
    finish(args.json, "bench_linear", times[f"casgd_s{args.ratio_s}"], times["sgd"],
           ours_label=f"CA-SGD(s={args.ratio_s}) per mini-batch, {args.world} processes, "
           f"{args.latency_ms:g} ms per message",
           peer_label="plain feature-partitioned SGD per mini-batch", unit="s/mini-batch",
           extra=extra)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
