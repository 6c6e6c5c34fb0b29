"""Adasum allreduce vs a fused summing allreduce: 4 gloo processes, ResNet-50 gradients.

Ours: :func:`trainers.comm.adasum.adasum_allreduce_` on the 161 tensors of ResNet-50's parameter
shapes (25.6 M float32 values): buckets (large tensors in place, small ones packed),
vector-halving distance-doubling exchange, per-tensor dot/norm sums, the pairwise rule,
allgather, copy back of the packed ones. The warm-up call also compiles the fused dot kernel.
Peer: what a data-parallel framework does to sum the same tensors fast — concatenate them into
one flat (persistent) buffer, ``all_reduce(SUM)`` it (gloo's ring), copy the slices back. Both move the
same bytes per rank (a reduce-scatter plus an allgather); ours also computes the rule.

Each round runs ours and the peer back to back (alternating which goes first) on fresh
copies of the same per-rank random gradients; a round's time is the slowest rank's. Rank 0
prints every round, then ``benchmarks/_report.py``'s lines: the machine, min / median / max
of both sides and, last, ``ratio=<peer median / our median>`` (1.0: as fast as summing; the
target is 1/1.2, Adasum at most 1.2x the fused sum). ``--json FILE`` also writes the rounds,
the ratio and the machine.

Usage: python benchmarks/bench_adasum.py [--world-size 4] [--rounds 7] [--threads 1]
       [--json benchmarks/results/bench_adasum.json]
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, beside this file

import _report  # noqa: E402

from trainers.comm.adasum import adasum_allreduce_  # noqa: E402

TARGET = 1 / 1.2  # Adasum at most 1.2x the fused sum's time (issue 21, item 1)


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's ResNet-50 (161 tensors, 25,557,032 values)."""
    shapes: list[tuple[int, ...]] = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, inplanes, 1, 1), (width,), (width,)]
            shapes += [(width, width, 3, 3), (width,), (width,)]
            shapes += [(width * 4, width, 1, 1), (width * 4,), (width * 4,)]
            if b == 0:
                shapes += [(width * 4, inplanes, 1, 1), (width * 4,), (width * 4,)]
            inplanes = width * 4
    shapes += [(1000, 2048), (1000,)]
    return shapes


_FLAT: dict[str, torch.Tensor] = {}


def peer_allreduce_(tensors: list[torch.Tensor]) -> None:
    numel = sum(t.numel() for t in tensors)
    if "flat" not in _FLAT or _FLAT["flat"].numel() != numel:
        _FLAT["flat"] = torch.empty(numel)  # a persistent fusion buffer, as ours keeps
    flat = _FLAT["flat"]
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def timed(fn, tensors: list[torch.Tensor]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn(tensors)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
    return float(elapsed)


def worker(
    rank: int, world: int, port: int, rounds: int, threads: int, json_path: str | None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(s, generator=g) * 1e-2 for s in resnet50_shapes()]
    numel = sum(t.numel() for t in grads)
    ours_fn = adasum_allreduce_
    ours_fn([t.clone() for t in grads])  # warm-up: process groups, allocator
    peer_allreduce_([t.clone() for t in grads])
    ours, peer = [], []
    for r in range(rounds):
        pair = [(ours, ours_fn), (peer, peer_allreduce_)]
        for times, fn in pair if r % 2 == 0 else pair[::-1]:
            times.append(timed(fn, [t.clone() for t in grads]))
        if rank == 0:
            print(f"round {r}: adasum {ours[-1]:.3f} s  sum-allreduce {peer[-1]:.3f} s", flush=True)
    if rank == 0:
        print(f"{world} gloo processes, {len(grads)} tensors, {numel / 1e6:.1f} M float32")
        _report.finish(
            json_path,
            "bench_adasum",
            ours,
            peer,
            ours_label=f"adasum_allreduce_, {world} gloo processes, {threads} thread(s) each",
            peer_label="fused flat all_reduce(SUM) (concatenate, gloo ring, copy back)",
            target=TARGET,
            extra={"world_size": world, "tensors": len(grads), "numel": numel},
        )
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    _report.add_args(parser)
    args = parser.parse_args()
    rounds = _report.check_rounds(args.rounds)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(
        worker,
        args=(args.world_size, port, rounds, args.threads, args.json),
        nprocs=args.world_size,
    )


if __name__ == "__main__":
    main()
