"""One rank of test_sparse_allreduce.py (torchrun's variables set).

Every rank builds every rank's sparse vector from the same seeds, so it can compute the
oracle itself: the dense vectors summed in rank order (fp32) and in float64. It runs each
case with each algorithm and saves, per case and algorithm, its result (densified), the
algorithm that ran and the bytes it sent, in ``OUTDIR/rank{r}.pt``.

Usage: python -m tests.trainers._sparse_worker OUTDIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainers.comm.sparse import ALGORITHMS, sparse_allreduce

NUMEL = 97  # not a multiple of any world size
# "wide": few non-zeros in a long vector, so that the sums take the sorted-merge path (the
# others fill a sixteenth of the vector and take the dense scratch buffer)
WIDE = 5003


def numel_of(case: str) -> int:
    return WIDE if case == "wide" else NUMEL


def supports(case: str, world: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * world + rank)
    if case == "overlapping":  # a shared core plus each rank's own picks
        own = torch.randperm(NUMEL, generator=g)[:12]
        return torch.unique(torch.cat([torch.arange(0, 40, 5), own]))
    if case == "disjoint":  # rank r holds every world-th index from r
        return torch.arange(rank, NUMEL, world)[:7]
    if case == "some_empty":  # odd ranks send nothing
        return torch.tensor([], dtype=torch.long) if rank % 2 else torch.tensor([3, 50, 96])
    if case == "all_empty":
        return torch.tensor([], dtype=torch.long)
    if case == "dense":  # every index on every rank
        return torch.arange(NUMEL)
    if case == "wide":  # overlapping picks among the first 60, and each rank's own
        return torch.unique(
            torch.cat([torch.arange(0, 60, 7), torch.randint(WIDE, (9,), generator=g)])
        )
    if case == "near_dense":  # ~60 % each: the sum passes the dense threshold
        return torch.sort(torch.randperm(NUMEL, generator=g)[:58]).values
    raise ValueError(case)


CASES = ("overlapping", "disjoint", "some_empty", "all_empty", "dense", "near_dense", "wide")


def values_for(case: str, world: int, rank: int, idx: torch.Tensor, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(7 + 1000 * world + rank)
    if kind == "dyadic":  # small multiples of 1/8: every summation order is exact
        return torch.randint(-64, 65, (idx.numel(),), generator=g).float() / 8
    if kind == "rows":  # a row-sparse (numel, 3) matrix
        return torch.randn(idx.numel(), 3, generator=g)
    return torch.randn(idx.numel(), generator=g) * 10 ** torch.randint(
        -3, 4, (idx.numel(),), generator=g
    )


def main() -> None:
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for case in CASES:
        for kind in ("dyadic", "random", "rows"):
            dense = []
            for r in range(world):
                idx = supports(case, world, r)
                val = values_for(case, world, r, idx, kind)
                d = torch.zeros((numel_of(case), *val.shape[1:]))
                d[idx] = val
                dense.append(d)
            ordered = torch.zeros_like(dense[0])
            for d in dense:
                ordered += d
            exact = torch.stack([d.double() for d in dense]).sum(0)
            idx = supports(case, world, rank)
            val = values_for(case, world, rank, idx, kind)
            for algorithm in ("auto", *ALGORITHMS):
                res = sparse_allreduce(idx, val, numel_of(case), algorithm=algorithm)
                results[case, kind, algorithm] = {
                    "sum": res.to_dense(), "algorithm": res.algorithm, "dense": res.dense,
                    "bytes": res.bytes_sent, "nnz": -1 if res.dense else res.indices.numel(),
                }  # fmt: skip
                res = sparse_allreduce(idx, val, numel_of(case), algorithm=algorithm,
                                       dense_output=True)  # fmt: skip
                results[case, kind, algorithm, "dense_output"] = {
                    "sum": res.values,
                    "dense": res.dense,
                    "bytes": res.bytes_sent,
                }
            # recursive doubling with the lengths known: framed swaps, the same merges
            lengths = [supports(case, world, q).numel() for q in range(world)]
            res = sparse_allreduce(idx, val, numel_of(case), algorithm="recursive_doubling",
                                   counts=lengths)  # fmt: skip
            results[case, kind, "rd_framed"] = {"sum": res.to_dense(), "bytes": res.bytes_sent,
                                                "messages": res.messages}  # fmt: skip
            results[case, kind, "ordered"] = ordered
            results[case, kind, "exact"] = exact
            results[case, kind, "abs"] = torch.stack([d.double().abs() for d in dense]).sum(0)
    # known lengths (every rank holds 7 pairs): no exchange of lengths, the same sum
    idx = supports("disjoint", world, rank)
    val = values_for("disjoint", world, rank, idx, "random")
    for algorithm in ("auto", "allgather"):
        res = sparse_allreduce(idx, val, NUMEL, algorithm=algorithm, counts=[7] * world)
        results["counts", algorithm] = {"sum": res.to_dense(), "bytes": res.bytes_sent}
    try:
        sparse_allreduce(idx, val, NUMEL, counts=[6] * world)
    except ValueError as e:
        results["counts", "error"] = str(e)
    # the dense switch of recursive doubling at the formula's count (numel 1000, fp32, int32
    # indices: 500); rank r holds a contiguous block, so the first merge has 2 * nnz entries
    for nnz in (249, 250, 499, 500):
        idx = torch.arange(rank * nnz, (rank + 1) * nnz) % 1000
        idx = torch.unique(idx)
        res = sparse_allreduce(idx, torch.ones(idx.numel()), 1000, algorithm="recursive_doubling")
        results["switch", nnz] = {"dense": res.dense, "bytes": res.bytes_sent,
                                  "sum": res.to_dense()}  # fmt: skip
    # split-allgather's exchanges: each point-to-point batch it posts (receives' and sends'
    # peers), to check that a worker receives from one peer at a time (no incast)
    posted = []
    real = dist.batch_isend_irecv

    def recording(ops):
        posted.append(sorted((op.op.__name__, op.peer) for op in ops))
        return real(ops)

    dist.batch_isend_irecv = recording
    try:
        idx = supports("overlapping", world, rank)
        res = sparse_allreduce(idx, values_for("overlapping", world, rank, idx, "random"),
                               NUMEL, algorithm="split_allgather")  # fmt: skip
    finally:
        dist.batch_isend_irecv = real
    results["split_posted"] = {"batches": posted, "sum": res.to_dense()}
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
