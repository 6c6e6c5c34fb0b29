"""How much of the communication the backward hides: Adasum gradient mode (or, ``--mode ef``,
bucketed top-k error feedback) with and without the overlap (``trainers.comm.overlap``), on
gloo processes, a slow link made by injected delay.

Every bucket reduction first sleeps what its messages would take on the link given by
``--gbps`` and ``--latency-ms`` (Adasum's tree sends a reduce-scatter and an allgather:
``2 log2(n)`` messages and ``2 (n-1)/n x`` the bucket's bytes per rank), then runs the real
reduction over loopback. The sleep stands for the network only, so it shows what the
overlap can hide on a slow link; the two CPU cores cannot show compute hiding compute.

The model: ``--layers`` Linear(width, width) + tanh layers (one bucket per layer at the
default cap), a batch of ``--batch``. Per round, on every rank, the same steps three ways:

* ``compute``: forward + backward only (no reduction), ``T_c``;
* ``plain``: then every bucket reduced after the backward (``--no-adasum-overlap``), ``T_p``;
* ``overlap``: each bucket reduced as soon as its gradients are in (the default), ``T_o``;

plain and overlap alternate which goes first; a step's time is the slowest rank's, a
round's the median of its steps. Printed: ``hidden = (T_p - T_o) / (T_p - T_c)``, the
fraction of the reduction's time taken off the step, per round and its median; then
``benchmarks/_report.py``'s lines with ``ratio = T_p / T_o`` (the speed-up of the step).
Both runs' gradients are checked equal bit for bit at every step.

Usage: python benchmarks/bench_overlap.py [--mode adasum|ef] [--world-size 2] [--rounds 7] [--gbps 1]
       [--latency-ms 0.5] [--json benchmarks/results/bench_overlap.json]
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, beside this file

import _report  # noqa: E402

from trainers import DistEnv  # noqa: E402
from trainers.comm.adasum import AdasumCombiner  # noqa: E402
from trainers.comm.ef import ErrorFeedbackCombiner  # noqa: E402

LINK = {"gbps": 1.0, "latency": 0.0005, "fraction": 1.0}  # set per process from the flags


def _wait_for_link(grads) -> None:
    n = dist.get_world_size()
    nbytes = sum(g.numel() * g.element_size() for g in grads) * LINK["fraction"]
    messages = 2 * math.ceil(math.log2(n))
    time.sleep(messages * LINK["latency"] + 2 * (n - 1) / n * nbytes * 8 / (LINK["gbps"] * 1e9))


class SlowAdasum(AdasumCombiner):
    """Adasum gradient mode whose every bucket first waits for the injected link."""

    def _reduce_bucket(self, b, grads):
        _wait_for_link(grads)
        super()._reduce_bucket(b, grads)


class SlowEF(ErrorFeedbackCombiner):
    """Bucketed top-k error feedback whose every bucket first waits for the injected link."""

    def _reduce_bucket(self, b, grads):
        _wait_for_link(grads)
        super()._reduce_bucket(b, grads)


def make_combiner(mode: str, overlap: bool, cap_mb: float, ratio: float):
    if mode == "adasum":
        return SlowAdasum(mode="gradient", overlap=overlap, bucket_cap_mb=cap_mb)
    return SlowEF(compressor="topk", ratio=ratio, bucket_mb=cap_mb, overlap=overlap)


NAMES = {"adasum": "Adasum gradient mode", "ef": "bucketed top-k error feedback"}


def make_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    env = DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)
    # top-k sends (value, index) pairs: 8 bytes per kept value against 4 per dense value
    LINK.update(gbps=args.gbps, latency=args.latency_ms / 1000,
                fraction=1.0 if args.mode == "adasum" else 2 * args.ratio)  # fmt: skip
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, args.width, generator=g)
    runs = {}
    for name, overlap in (("plain", False), ("overlap", True)):
        model = make_model(args.layers, args.width)
        combiner = make_combiner(args.mode, overlap, args.bucket_cap_mb, args.ratio)
        combiner.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), env)
        runs[name] = (model, combiner)

    def step(name: str, reduce: bool = True) -> float:
        model, combiner = runs[name]
        dist.barrier()
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if reduce:
            combiner.reduce_gradients(None)
        return slowest(time.perf_counter() - start)

    for name in ("plain", "overlap"):  # the first step records the order, then warm up
        for _ in range(2):
            step(name)
    grads = {}
    plain, overlapped, compute, hidden = [], [], [], []
    for r in range(args.rounds):
        times: dict[str, list[float]] = {"plain": [], "overlap": [], "compute": []}
        order = ["plain", "overlap"] if r % 2 == 0 else ["overlap", "plain"]
        for _ in range(args.steps):
            for name in order:
                times[name].append(step(name))
                grads[name] = [p.grad.clone() for p in runs[name][0].parameters()]
            if not all(
                torch.equal(a, b) for a, b in zip(grads["plain"], grads["overlap"], strict=True)
            ):
                raise SystemExit("the overlapped gradients differ from the plain ones")
            times["compute"].append(step("plain", reduce=False))
        t_p, t_o, t_c = (statistics.median(times[k]) for k in ("plain", "overlap", "compute"))
        plain.append(t_p)
        overlapped.append(t_o)
        compute.append(t_c)
        hidden.append((t_p - t_o) / (t_p - t_c) if t_p > t_c else float("nan"))
        if rank == 0:
            print(f"round {r}: compute {t_c * 1e3:.1f} ms  plain {t_p * 1e3:.1f} ms  "
                  f"overlap {t_o * 1e3:.1f} ms  hidden {hidden[-1]:.2f}", flush=True)  # fmt: skip
    if rank == 0:
        _, combiner = runs["overlap"]
        buckets = len((getattr(combiner, "_overlap", None) or combiner._buckets).buckets)
        print(f"{world} gloo processes, {args.layers} layers of {args.width}, batch "
              f"{args.batch}, {buckets} buckets, link {args.gbps} Gbit/s + "
              f"{args.latency_ms} ms per message (injected)")  # fmt: skip
        print(f"hidden fraction: {_report.spread(hidden, '')}")
        _report.finish(
            args.json,
            "bench_overlap" if args.mode == "adasum" else f"bench_overlap_{args.mode}",
            overlapped,
            plain,
            ours_label=f"{NAMES[args.mode]}, overlapped with the backward ({world} gloo "
            "processes, injected link delay)",
            peer_label=f"the same reduction after the backward (--no-{args.mode}-overlap)",
            extra={
                "hidden_fraction_median": statistics.median(hidden),
                "hidden_fraction_rounds": hidden,
                "compute_rounds": compute,
                "mode": args.mode,
                "world_size": world,
                "gbps": args.gbps,
                "latency_ms": args.latency_ms,
                "layers": args.layers,
                "width": args.width,
                "batch": args.batch,
                "buckets": buckets,
            },
        )
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mode", choices=("adasum", "ef"), default="adasum")
    parser.add_argument("--ratio", type=float, default=0.01, help="ef: top-k fraction sent")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="steps per side per round")
    parser.add_argument("--bucket-cap-mb", type=float, default=4.5)
    parser.add_argument("--gbps", type=float, default=1.0, help="injected link bandwidth")
    parser.add_argument("--latency-ms", type=float, default=0.5, help="injected per message")
    _report.add_args(parser)
    args = parser.parse_args()
    _report.check_rounds(args.rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world_size, port, args), nprocs=args.world_size)


if __name__ == "__main__":
    main()
