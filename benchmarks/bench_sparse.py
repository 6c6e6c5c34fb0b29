"""Sparse allreduce vs the all-gather of pairs vs the dense all-reduce: gloo processes, time and bytes.

Ours: :func:`trainers.comm.sparse.sparse_allreduce` with each algorithm (``recursive_doubling``,
``split_allgather``, ``dense``, ``allgather``) and ``auto`` (its cost model's choice), with
``dense_output=True`` and ``counts`` (every worker holds k pairs, which the peers assume too):
the dense sum, as ``topk`` uses it and as the peers produce it.
Peers: what a framework without a sparse allreduce does --

* ``peer_allgather``: ``dist.all_gather`` of every worker's k fp32 values and int32 indices,
  then the decoded dense vectors summed (the collective ``topk`` used before this module);
* ``peer_dense``: scatter into a dense fp32 buffer and ``dist.all_reduce`` it.

Every worker holds ``k = density * numel`` pairs. ``--overlap`` is the fraction of each
worker's support drawn from a set all workers share (top-k gradients of one model overlap);
the rest is the worker's own random draw. Each round runs every method once, in an order that
rotates with the round, on the same inputs; a method's time is the slowest rank's. For each
setting the script prints min/median/max per method, the bytes one worker sent, the sum's
non-zeros, ``auto``'s choice, and ``ratio=<peer_allgather median / auto median>``.

``--link-gbps G`` injects a link: every message of ours (counted where it is sent) and of the
peers then also waits ``bytes / (G / 8)`` seconds, and ``auto`` gets a :class:`CostModel` with
that bandwidth -- the regime SparCML is for, which loopback on one machine is not.

Usage: python benchmarks/bench_sparse.py [--worlds 2,4,8] [--densities 0.001,0.01,0.1]
           [--numel 4194304] [--overlap 0.5] [--rounds 5] [--json out.json] [--link-gbps G]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _report import check_rounds, machine_line

from trainers.comm.sparse import (
    ALGORITHMS,
    CostModel,
    estimate_costs,
    estimate_features,
    sparse_allreduce,
)

OURS = ("auto", "recursive_doubling", "split_allgather", "allgather", "dense")
PEERS = ("peer_allgather", "peer_dense")


LINK = {"bytes_per_sec": None}  # --link-gbps: the injected link, for ours and the peers alike


def link_delay(nbytes: float) -> None:
    """Sleep as long as ``nbytes`` take on the injected link (nothing without one)."""
    if LINK["bytes_per_sec"]:
        time.sleep(nbytes / LINK["bytes_per_sec"])


def inject_link(gbps: float) -> None:
    """Every message ours sends (``trainers.comm.sparse._Comm._sent``, which counts them)
    also waits for its bytes on a ``gbps`` link."""
    import trainers.comm.sparse as sparse  # noqa: PLC0415

    LINK["bytes_per_sec"] = gbps * 1e9 / 8
    counted = sparse._Comm._sent

    def sent(self, nbytes: int, messages: int) -> None:
        counted(self, nbytes, messages)
        link_delay(nbytes)

    sparse._Comm._sent = sent


def peer_allgather(idx: torch.Tensor, val: torch.Tensor, numel: int) -> tuple[torch.Tensor, int]:
    world = dist.get_world_size()
    vals = [torch.empty_like(val) for _ in range(world)]
    inds = [torch.empty_like(idx) for _ in range(world)]
    dist.all_gather(vals, val)
    dist.all_gather(inds, idx)
    sent = (world - 1) * (val.numel() * 4 + idx.numel() * 4)
    link_delay(sent)
    total = torch.zeros(numel)
    for v, i in zip(vals, inds, strict=True):
        total.index_add_(0, i.long(), v)
    return total, sent


def peer_dense(idx: torch.Tensor, val: torch.Tensor, numel: int) -> tuple[torch.Tensor, int]:
    world = dist.get_world_size()
    buf = torch.zeros(numel)
    buf[idx.long()] = val
    dist.all_reduce(buf)
    sent = round(2 * (world - 1) / world * numel * 4)
    link_delay(sent)
    return buf, sent


def supports(numel: int, k: int, overlap: float, rank: int, setting: int) -> torch.Tensor:
    shared = torch.Generator().manual_seed(10_000 + setting)
    own = torch.Generator().manual_seed(20_000 + 100 * setting + rank)
    n_shared = round(overlap * k)
    common = torch.randperm(numel, generator=shared)[:n_shared]
    mine = torch.randperm(numel, generator=own)[: 2 * k]
    idx = torch.unique(torch.cat([common, mine]))[:k] if n_shared < k else torch.unique(common)
    while idx.numel() < k:  # the own draw collided with the shared set: top up
        idx = torch.unique(torch.cat([idx, torch.randperm(numel, generator=own)[:k]]))[:k]
    return torch.sort(idx).values


def timed(fn) -> tuple[float, object]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), out


def run_world(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cost = None
    if args.link_gbps:
        inject_link(args.link_gbps)
        cost = CostModel(bandwidth=args.link_gbps * 1e9 / 8)  # auto is told the link
    rows = []
    for s, density in enumerate(args.densities):
        k = max(1, round(density * args.numel))
        idx = supports(args.numel, k, args.overlap, rank, s)
        val = torch.randn(k, generator=torch.Generator().manual_seed(rank))
        union = None
        methods = {
            name: (
                lambda a=name, i=idx, v=val, c=[k] * world: sparse_allreduce(
                    i, v, args.numel, algorithm=a, dense_output=True, counts=c, cost=cost
                )
            )
            for name in OURS
        }
        i32 = idx.to(torch.int32)
        methods["peer_allgather"] = lambda i=i32, v=val: peer_allgather(i, v, args.numel)
        methods["peer_dense"] = lambda i=idx, v=val: peer_dense(i, v, args.numel)
        names = list(methods)
        times: dict[str, list[float]] = {n: [] for n in names}
        info: dict[str, dict] = {}
        for name in names:  # warm-up, and the check that every method gives the same sum
            _, out = timed(methods[name])
            dense = out.to_dense() if hasattr(out, "to_dense") else out[0]
            info[name] = {
                "bytes": out.bytes_sent if hasattr(out, "bytes_sent") else out[1],
                "messages": getattr(out, "messages", None),
                "algorithm": getattr(out, "algorithm", name),
                "max_abs_diff": 0.0,
            }
            if name == names[0]:
                reference = dense
                union = int(torch.count_nonzero(dense))
            else:
                info[name]["max_abs_diff"] = float((dense - reference).abs().max())
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                times[name].append(timed(methods[name])[0])
        if rank == 0:
            rows.append({"world": world, "numel": args.numel, "density": density, "k": k,
                         "overlap": args.overlap, "union": union, "info": info,
                         "times": times, "link_gbps": args.link_gbps})  # fmt: skip
    if rank == 0:
        queue.put(rows)
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4,8")
    parser.add_argument("--densities", default="0.001,0.01,0.1")
    parser.add_argument("--numel", type=int, default=1 << 22)
    parser.add_argument("--overlap", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="inject a link: every message also waits bytes / (Gbps/8), for "
                        "ours and the peers alike; auto is given a CostModel with it")  # fmt: skip
    args = parser.parse_args()
    check_rounds(args.rounds)
    args.densities = [float(x) for x in args.densities.split(",")]
    print(machine_line())
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, one thread per process, "
          f"gloo on 127.0.0.1")  # fmt: skip
    ctx = mp.get_context("spawn")
    all_rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        queue = ctx.Queue()
        mp.spawn(run_world, args=(world, port, args, queue), nprocs=world)
        rows = queue.get()
        all_rows += rows
        for row in rows:
            link = f", injected link {args.link_gbps} Gbps" if args.link_gbps else ""
            print(f"\n{world} gloo processes{link}, numel {row['numel']}, density {row['density']:.3%}"
                  f" (k={row['k']}, overlap {row['overlap']}), sum non-zeros {row['union']}")  # fmt: skip
            for name, ts in row["times"].items():
                i = row["info"][name]
                chosen = f" -> {i['algorithm']}" if name == "auto" else ""
                print(f"  {name:19s} min {min(ts) * 1e3:8.2f}  median {statistics.median(ts) * 1e3:8.2f}"
                      f"  max {max(ts) * 1e3:8.2f} ms  {i['bytes'] / 1e6:8.3f} MB sent"
                      f"  |diff| {i['max_abs_diff']:.1e}{chosen}")  # fmt: skip
            med = {n: statistics.median(t) for n, t in row["times"].items()}
            print(f"  ratio={med['peer_allgather'] / med['auto']:.3f} (all-gather peer / auto)")
    calibrate(all_rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(all_rows, f, indent=1)


def calibrate(rows: list[dict]) -> None:
    """Fit :class:`CostModel`'s four constants to the algorithms' medians (least squares on
    relative error, constants kept >= 0) over :func:`estimate_features` of each setting (true
    stream lengths, the measured sum size), then compare, per setting, the winner the
    formulas predict -- with the fitted constants and with the defaults -- with the measured
    one."""
    feats, times = [], []
    for row in rows:
        f = estimate_features([row["k"]] * row["world"], row["numel"], 4, union=row["union"])
        for name in ALGORITHMS:
            feats.append(f[name])
            times.append(statistics.median(row["times"][name]))
    a = torch.tensor(feats, dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64)
    w = 1 / b
    active = list(range(4))
    while True:  # non-negative least squares by dropping negative terms
        sol = torch.linalg.lstsq((a[:, active] * w[:, None]), (b * w)[:, None]).solution[:, 0]
        if (sol >= 0).all() or len(active) == 1:
            break
        active.pop(int(torch.argmin(sol)))
    full = [0.0] * 4
    for j, v in zip(active, sol.tolist(), strict=True):
        full[j] = max(v, 0.0)
    fitted = CostModel(latency=full[0], bandwidth=1 / max(full[1], 1e-15), merge=full[2],
                       scan=full[3])  # fmt: skip
    print(f"\nfitted: CostModel(latency={fitted.latency:.3g}, bandwidth={fitted.bandwidth:.3g}, "
          f"merge={fitted.merge:.3g}, scan={fitted.scan:.3g})")  # fmt: skip
    link = rows[0].get("link_gbps") if rows else None
    default = CostModel(bandwidth=link * 1e9 / 8) if link else CostModel()
    for label, cost in (("fitted", fitted), ("default", default)):
        agree, regret = 0, []
        for row in rows:
            counts = [row["k"]] * row["world"]
            est = estimate_costs(counts, row["numel"], 4, cost=cost, union=row["union"])
            med = {n: statistics.median(row["times"][n]) for n in ALGORITHMS}
            predicted = min(ALGORITHMS, key=lambda n: est[n])
            measured = min(ALGORITHMS, key=lambda n: med[n])
            agree += predicted == measured
            regret.append(med[predicted] / med[measured])
            if label == "default":
                print(f"  {row['world']} procs, density {row['density']:.3%}: formula -> "
                      f"{predicted} ({med[predicted] * 1e3:.1f} ms), measured fastest {measured} "
                      f"({med[measured] * 1e3:.1f} ms), auto ran {row['info']['auto']['algorithm']}")  # fmt: skip
        print(f"{label}: formula_agrees={agree}/{len(rows)}, time of the formula's pick over the "
              f"fastest: median {statistics.median(regret):.2f}, max {max(regret):.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
