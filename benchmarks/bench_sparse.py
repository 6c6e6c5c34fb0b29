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

``--netlab CAP`` runs the ranks on a lab network instead (:mod:`trainers.netlab`: one rank per
node namespace, ``--worlds`` nodes, every node's link capped at ``CAP`` both ways, real TCP
through the caps, no injected delay) and gives ``auto`` a :class:`CostModel` whose bandwidth is
the cap's TCP payload rate (``CAP x 1448 / 1514``: a 1514-byte frame at MTU 1500 carries 1448
bytes of payload); its latency and swap are measured on each lab before its rounds, on other
operations than the ones predicted (:func:`calibrate_network`: an 8-byte all-gather and an
8-byte swap), and its computation constants in this process, one thread
(:func:`trainers.comm.sparse.measure_compute`), multiplied by ``nodes / cores``
(``cpu_share``: every node runs on this machine's cores). ``--latency-us U`` fixes the latency
at ``U`` and the swap at the default instead. For each setting it then prints, per
algorithm, the measured median, the cost model's prediction (:func:`estimate_costs` on the
setting's true lengths and sum size) and the relative error; the formula's and ``auto``'s pick
against the measured fastest; whether each sparse algorithm beats the all-gather where the
formula says it does; the bytes each node's interface sent in each method's first call against
what the algorithm reports; and ``max_rel_error=<...>`` last. The ranks are started by
:func:`trainers.netlab.start_ranks` as ``python benchmarks/bench_sparse.py --worker FILE``,
which reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

Usage: python benchmarks/bench_sparse.py [--worlds 2,4,8] [--densities 0.001,0.01,0.1]
           [--numel 4194304] [--overlap 0.5] [--rounds 5] [--json out.json] [--link-gbps G]
       python benchmarks/bench_sparse.py --netlab 100mbit --worlds 4,8 [--latency-us U]
           [--timeout 1200] [--json benchmarks/results/netlab/bench_sparse_netlab_100mbit.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _report import check_rounds, machine, machine_line

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainers.comm.sparse import (  # noqa: E402
    ALGORITHMS,
    CostModel,
    estimate_costs,
    estimate_features,
    fit_nonnegative,
    measure_compute,
    sparse_allreduce,
)
from trainers.netlab import interface_tx_bytes  # noqa: E402

OURS = ("auto", "recursive_doubling", "split_allgather", "allgather", "dense")
PEERS = ("peer_allgather", "peer_dense")
TCP_PAYLOAD = 1448 / 1514  # TCP payload of a 1514-byte Ethernet frame at MTU 1500 (timestamps on)
SPARSE = ("recursive_doubling", "split_allgather")


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
    """``k`` sorted indices, uniform over ``[0, numel)``: ``round(overlap k)`` from a set every
    rank shares, the rest this rank's own draw outside that set."""
    shared = torch.Generator().manual_seed(10_000 + setting)
    own = torch.Generator().manual_seed(20_000 + 100 * setting + rank)
    n_shared = min(k, round(overlap * k))
    common = torch.randperm(numel, generator=shared)[:n_shared]
    taken = torch.zeros(numel, dtype=torch.bool)
    taken[common] = True
    draw = torch.randperm(numel, generator=own)
    mine = draw[~taken[draw]][: k - n_shared]  # a random subset, not the smallest indices
    return torch.sort(torch.cat([common, mine])).values


def timed(fn) -> tuple[float, object]:
    dist.barrier()
    start = time.perf_counter()
    out = fn()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed), out


def tcp_retransmits() -> int | None:
    """TCP segments this process's network namespace retransmitted (``/proc/net/snmp``)."""
    try:
        with open("/proc/net/snmp", encoding="ascii") as f:
            tcp = [line.split() for line in f if line.startswith("Tcp:")]
        return int(dict(zip(tcp[0][1:], tcp[1][1:], strict=True))["RetransSegs"])
    except (OSError, IndexError, KeyError, ValueError):
        return None


def bench(rank: int, world: int, args: argparse.Namespace, cost: CostModel | None) -> list[dict]:
    """Every setting of ``args.densities`` on the initialized default group; rank 0's rows
    (the others' are ``[]``). ``wire_bytes``: per method, the bytes each rank's interface sent
    in the method's first call (one barrier after it, so everything sent has left), where the
    rank runs on a lab node."""
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
        wire: dict[str, int | None] = {}
        for name in names:  # warm-up, and the check that every method gives the same sum
            dist.barrier()
            tx = interface_tx_bytes()
            _, out = timed(methods[name])
            dist.barrier()  # every byte of the call has crossed the wire
            after = interface_tx_bytes()
            wire[name] = None if tx is None or after is None else after - tx
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
        retrans: dict[str, int] = dict.fromkeys(names, 0)
        for r in range(args.rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                before = tcp_retransmits()
                times[name].append(timed(methods[name])[0])
                after = tcp_retransmits()
                if before is not None and after is not None:
                    retrans[name] += after - before
        gathered: list = [None] * world
        dist.all_gather_object(gathered, {"wire": wire, "retrans": retrans,
                                          "bytes": {n: info[n]["bytes"] for n in names}})  # fmt: skip
        if rank == 0:
            rows.append({"world": world, "numel": args.numel, "density": density, "k": k,
                         "overlap": args.overlap, "union": union, "info": info,
                         "times": times, "link_gbps": args.link_gbps,
                         "netlab": getattr(args, "netlab", None),
                         "wire_bytes": [g["wire"] for g in gathered],
                         "tcp_retransmits": [g["retrans"] for g in gathered],
                         "reported_bytes": [g["bytes"] for g in gathered]})  # fmt: skip
    return rows


def run_world(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cost = None
    if args.link_gbps:
        inject_link(args.link_gbps)
        cost = CostModel(bandwidth=args.link_gbps * 1e9 / 8)  # auto is told the link
    rows = bench(rank, world, args, cost)
    if rank == 0:
        queue.put(rows)
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


# ------------------------------------------------------------------------------ the lab network
def lab_cost(cap_bits: int, latency_us: float | None = None, **fields) -> CostModel:
    """``auto``'s cost model on a lab link capped at ``cap_bits``: the bandwidth is the cap's
    TCP payload rate; latency ``latency_us`` (else :class:`CostModel`'s default); ``fields``:
    the others (the measured computation constants, the swap factor, ``cpu_share``)."""
    base = CostModel()
    latency = base.latency if latency_us is None else latency_us * 1e-6
    return CostModel(latency=latency, bandwidth=cap_bits * TCP_PAYLOAD / 8, **fields)


def cores() -> int:
    """The cores this process may run on (the lab's nodes all share them)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def calibrate_network(repeats: int = 31) -> dict:
    """The lab's per-message latency and a swap's cost, measured on the initialized default
    group before the benchmark (the same network, 8-byte messages, not the algorithms): the
    median slowest-rank time of an all-gather of one int64 (the length messages the
    algorithms all-gather) over its ``N - 1`` ring steps, and of an 8-byte swap between ranks
    ``r`` and ``r xor 1`` over that latency. A one-float all-reduce is timed too, for the
    record: gloo's all-reduce of one element costs a fraction of what a ring step of a
    larger message does, so it is not the latency."""
    rank, world = dist.get_rank(), dist.get_world_size()
    one = torch.zeros(1)
    head, theirs = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    heads = [torch.empty_like(head) for _ in range(world)]
    peer = rank ^ 1

    def swap() -> None:
        if peer < world:
            ops = [dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, head, peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    calls = {"allgather_s": lambda: dist.all_gather(heads, head), "swap_s": swap,
             "allreduce_s": lambda: dist.all_reduce(one)}  # fmt: skip
    for fn in calls.values():  # warm-up: connections, first-call costs
        for _ in range(3):
            timed(fn)
    out = {name: statistics.median(timed(fn)[0] for _ in range(repeats))
           for name, fn in calls.items()}  # fmt: skip
    out["latency"] = out["allgather_s"] / (world - 1)
    out["swap"] = max(out["swap_s"] / out["latency"], 1e-3)
    return out


def worker(config: Path) -> None:
    """One rank on a lab node (``--worker FILE``), started by :func:`trainers.netlab.start_ranks`
    or torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the
    environment; the run's settings from ``FILE``; rank 0 writes the rows to its ``"out"``."""
    conf = json.loads(config.read_text())
    args = argparse.Namespace(**conf["args"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=conf["gloo_timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    cost, calibration = None, None
    if conf.get("cost"):
        fields = dict(conf["cost"])
        if conf.get("calibrate"):  # this lab's latency and swap, measured before the rounds
            calibration = calibrate_network()
            fields.update(latency=calibration["latency"], swap=calibration["swap"])
        cost = CostModel(**fields)
    rows = bench(rank, world, args, cost)
    if rank == 0:
        for row in rows:
            row["cost_model"] = dataclasses.asdict(cost) if cost else None
            row["calibration"] = calibration
        Path(conf["out"]).write_text(json.dumps(rows))
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def run_on_lab(world: int, cap: str, args: argparse.Namespace, cost: CostModel) -> list[dict]:
    """``world`` ranks of :func:`worker`, one per node of a fresh lab capped at ``cap``; the
    lab is removed however the run ends, and the run is stopped after ``args.timeout`` s."""
    from trainers.netlab import Lab, start_ranks, wait_ranks  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix="bench_sparse_lab_") as tmp:
        config, out, log = Path(tmp, "config.json"), Path(tmp, "rows.json"), Path(tmp, "ranks.log")
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        fields = dataclasses.asdict(cost)
        fields["cpu_share"] = world / cores()  # the nodes share this machine's cores
        config.write_text(json.dumps({"args": settings, "out": str(out), "cost": fields,
                                      "calibrate": args.latency_us is None,
                                      "gloo_timeout": max(60, args.timeout // 2)}))  # fmt: skip
        name = f"sp{os.getpid() % 10**6}n{world}"
        with Lab(world, bandwidth=cap, name=name) as lab, open(log, "w") as logf:
            before = lab.all_counters()
            procs = start_ranks(lab, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                      str(config)], port=29500, cwd=ROOT, stdout=logf,
                                stderr=subprocess.STDOUT)  # fmt: skip
            if not wait_ranks(procs, args.timeout):
                raise SystemExit(f"bench_sparse: the {world}-node lab run passed --timeout "
                                 f"{args.timeout} s; ranks' output:\n{log.read_text()[-3000:]}")  # fmt: skip
            total = [(a - b).tx_bytes for a, b in zip(lab.all_counters(), before, strict=True)]
        if any(p.returncode for p in procs):
            raise SystemExit(f"bench_sparse: lab ranks exited with {[p.returncode for p in procs]}"
                             f":\n{log.read_text()[-5000:]}")  # fmt: skip
        rows = json.loads(out.read_text())
    for row in rows:
        row["job_tx_bytes"] = total  # the whole job: bootstrap, warm-up, rounds, barriers
    return rows


def lab_report(rows: list[dict], cost: CostModel | None = None) -> dict:
    """Per setting: measured median and predicted time of each algorithm (by ``cost``, else
    by the row's own ``cost_model``: the one its run calibrated), relative errors, the
    formula's, ``auto``'s and the measured pick, and where each sparse algorithm beats the
    all-gather (measured, and by the formula); returns the summary (``max_rel_error``)."""
    worst, agree, where = 0.0, 0, []
    for row in rows:
        counts = [row["k"]] * row["world"]
        model = cost if cost is not None else CostModel(**row["cost_model"])
        est = estimate_costs(counts, row["numel"], 4, cost=model, union=row["union"],
                             dense_output=True)  # fmt: skip
        med = {n: statistics.median(row["times"][n]) for n in row["times"]}
        rel = {n: (est[n] - med[n]) / med[n] for n in ALGORITHMS}
        predicted = min(ALGORITHMS, key=lambda n: est[n])
        fastest = min(ALGORITHMS, key=lambda n: med[n])
        beats = {a: {"measured": med[a] < med["allgather"], "formula": est[a] < est["allgather"],
                     "measured_vs_peer": med[a] < med["peer_allgather"]} for a in SPARSE}  # fmt: skip
        row.update(predicted_s=est, median_s=med, rel_error=rel, formula_pick=predicted,
                   measured_fastest=fastest, beats_allgather=beats)  # fmt: skip
        worst = max(worst, *(abs(e) for e in rel.values()))
        agree += predicted == fastest
        where += [b["measured"] == b["formula"] for b in beats.values()]
        print(f"\n{row['world']} lab nodes at {row['netlab']}, density {row['density']:.3%} "
              f"(k={row['k']}), sum non-zeros {row['union']}")  # fmt: skip
        print(f"  {'algorithm':19s} {'measured':>9s} {'predicted':>9s} {'error':>7s}  "
              f"{'reported MB':>11s} {'wire MB (per node)':>18s} {'wire/reported':>13s} {'retx':>6s}")  # fmt: skip
        for name in (*OURS, *PEERS):
            reported = [b[name] for b in row["reported_bytes"]]
            wire = [w[name] for w in row["wire_bytes"]]
            ratio = (sum(wire) / sum(reported)) if None not in wire and sum(reported) else None
            p = f"{est[name] * 1e3:9.1f}" if name in est else f"{'':9s}"
            e = f"{rel[name]:+7.1%}" if name in rel else f"{'':7s}"
            w = "n/a" if None in wire else f"{min(wire) / 1e6:.3f}-{max(wire) / 1e6:.3f}"
            r = f"{ratio:13.3f}" if ratio else f"{'':13s}"
            retx = sum(t[name] for t in row.get("tcp_retransmits", []))
            chosen = f" -> {row['info']['auto']['algorithm']}" if name == "auto" else ""
            print(f"  {name:19s} {med[name] * 1e3:9.1f} {p} {e}  "
                  f"{statistics.median(reported) / 1e6:11.3f} {w:>18s} {r} {retx:6d}{chosen}")  # fmt: skip
        print(f"  formula picks {predicted}, auto ran {row['info']['auto']['algorithm']}, "
              f"measured fastest {fastest}")  # fmt: skip
        for a, b in beats.items():
            print(f"  {a} beats the all-gather: measured {b['measured']}, formula {b['formula']}"
                  f" ({'agree' if b['measured'] == b['formula'] else 'DISAGREE'}); beats the "
                  f"peer all-gather: {b['measured_vs_peer']}")  # fmt: skip
    summary = {"max_rel_error": worst, "formula_agrees": agree, "settings": len(rows),
               "beats_where_formula_says": sum(where), "beats_checks": len(where)}  # fmt: skip
    print(f"\nformula's pick = measured fastest in {agree}/{len(rows)} settings; sparse beats "
          f"the all-gather exactly where the formula says in {sum(where)}/{len(where)} checks")  # fmt: skip
    return summary


def main_netlab(args: argparse.Namespace) -> None:
    from trainers.netlab import missing_requirements, parse_rate  # noqa: PLC0415

    why = missing_requirements()
    if why:
        print(f"bench_sparse --netlab: {why}", file=sys.stderr)
        raise SystemExit(2)
    torch.set_num_threads(1)  # as each rank runs
    compute = measure_compute(args.numel)  # one process: the model when nothing is calibrated
    cost = lab_cost(parse_rate(args.netlab), args.latency_us, **compute)
    print(machine_line())
    how = (
        f"latency={cost.latency:g} s, swap={cost.swap:g}"
        if args.latency_us is not None
        else "latency and swap measured on each lab before its rounds"
    )
    how += (f"; computation measured here in one process (merge={cost.merge:.3g}, "
            f"scan={cost.scan:.3g}, fill={cost.fill:.3g}, scatter={cost.scatter:.3g}) x "
            f"cpu_share = nodes / {cores()} cores")  # fmt: skip
    print(f"lab network: one rank per node, {args.netlab} each way per node, gloo over TCP; "
          f"auto's CostModel(bandwidth={cost.bandwidth:.4g} B/s = {args.netlab} x 1448/1514 / 8;"
          f" {how})")  # fmt: skip
    rows = []
    for world in [int(w) for w in args.worlds.split(",")]:
        rows += run_on_lab(world, args.netlab, args, cost)
        cal = rows[-1].get("calibration")
        if cal:
            print(f"{world} nodes: 8-byte all-gather {cal['allgather_s'] * 1e6:.0f} us -> latency "
                  f"{cal['latency'] * 1e6:.0f} us per message; 8-byte swap "
                  f"{cal['swap_s'] * 1e6:.0f} us = {cal['swap']:.2f} messages (one-float "
                  f"all-reduce {cal['allreduce_s'] * 1e6:.0f} us)")  # fmt: skip
    summary = lab_report(rows)
    if args.json:
        from _report import write_json  # noqa: PLC0415

        write_json(args.json, {"benchmark": "bench_sparse", "netlab": args.netlab,
                               "command": [Path(sys.argv[0]).as_posix(), *sys.argv[1:]],
                               "cost_model": dataclasses.asdict(cost), "compute": compute,
                               "machine": machine(), "date": time.strftime("%Y-%m-%d"),
                               **summary, "rows": rows})  # fmt: skip
        print(f"wrote {args.json}")
    print(f"max_rel_error={summary['max_rel_error']:.3f}")


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
    parser.add_argument("--netlab", default=None, metavar="CAP",
                        help="run the ranks on a lab network, one per node, links capped at "
                        "CAP (e.g. 100mbit, 1gbit) both ways; needs root (docs/netlab.md)")  # fmt: skip
    parser.add_argument(
        "--latency-us",
        type=float,
        default=None,
        help="--netlab: auto's per-message latency (default: CostModel's)",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=1800,
        help="--netlab: seconds one lab run may take before it is stopped",
    )
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    check_rounds(args.rounds)
    args.densities = [float(x) for x in args.densities.split(",")]
    if args.netlab:
        if args.link_gbps:
            parser.error("--netlab runs on a real link: leave out --link-gbps")
        main_netlab(args)
        return
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
    """Fit :class:`CostModel`'s six constants to the algorithms' medians (least squares on
    relative error, constants kept >= 0) over :func:`estimate_features` of each setting (true
    stream lengths, the measured sum size), then compare, per setting, the winner the
    formulas predict -- with the fitted constants and with the defaults -- with the measured
    one."""
    feats, times = [], []
    for row in rows:
        f = estimate_features([row["k"]] * row["world"], row["numel"], 4, union=row["union"],
                              dense_output=True)  # fmt: skip
        for name in ALGORITHMS:
            feats.append(f[name])
            times.append(statistics.median(row["times"][name]))
    full = fit_nonnegative(feats, times)
    fitted = CostModel(latency=full[0], bandwidth=1 / max(full[1], 1e-15), merge=full[2],
                       scan=full[3], fill=full[4], scatter=full[5])  # fmt: skip
    print(f"\nfitted: CostModel(latency={fitted.latency:.3g}, bandwidth={fitted.bandwidth:.3g}, "
          f"merge={fitted.merge:.3g}, scan={fitted.scan:.3g}, fill={fitted.fill:.3g}, "
          f"scatter={fitted.scatter:.3g})")  # fmt: skip
    link = rows[0].get("link_gbps") if rows else None
    default = CostModel(bandwidth=link * 1e9 / 8) if link else CostModel()
    for label, cost in (("fitted", fitted), ("default", default)):
        agree, regret = 0, []
        for row in rows:
            counts = [row["k"]] * row["world"]
            est = estimate_costs(counts, row["numel"], 4, cost=cost, union=row["union"],
                                 dense_output=True)  # fmt: skip
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
