"""One rank of test_netlab.py's all-reduce: the same seeded tensors summed across the lab
or on loopback; saves the result (OUTDIR/rank{r}.pt).

Usage: python -m tests.trainers._netlab_allreduce_worker OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

SIZES = (3, 1000, 250_000, 1_000_003)  # small and large messages, odd lengths


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(1234 + rank)
    results = {}
    for n in SIZES:
        t = torch.randn(n, generator=g)
        dist.all_reduce(t)
        results[n] = t
    stack = torch.randn(64, generator=g)
    gathered = [torch.empty(64) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, stack)
    results["gather"] = torch.stack(gathered)
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
