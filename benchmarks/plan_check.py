"""Check the placement planner's predicted step times against measured gloo runs here.

For each world size (default 2 and 4 processes on 127.0.0.1, one thread each) and each
(tp, pp, dp) of it, in turn:

1. the loopback link is calibrated: an all-reduce of one float gives the per-message cost
   ``a`` of ``T = 2 (N-1)/N S / B + 2 (N-1) a`` (median of 25) and one of 16 MiB the
   bandwidth ``B`` (median of 9), and (``--link curve``, the default) all-reduces of 64 KiB
   to 4 MiB a ring step's time at each chunk size between them, and so a one-level network
   ``"N:gbps:latency[:CHUNK@SECONDS/...]"`` for the planner;
2. every rank profiles the same small BERT (span QA, ``trainers.parallel.plan.profile_model``)
   at the same time, so the profile sees the same number of processes per core as the run
   (4 processes on this machine's 2 cores: each gets about half a core) and the same
   background load, in step (``sync=dist.barrier``: a barrier before each block and around
   each tensor-parallel probe process, so that no rank times while another starts one); the
   element-wise median over the ranks is the profile;
3. the planner picks the best micro-batches, schedule and boundaries for these degrees,
   told how many ranks share a core (``ranks_per_core`` = ranks / cores: a pipeline's
   bubble then runs faster than the profile, taken with every rank busy);
4. an optimizer step of the plan (forward, backward, gradient all-reduce, AdamW) is timed
   on the runtime (data parallel with one flat gradient all-reduce; tensor parallel with
   ``parallelize_bert`` on a (dp, tp) mesh; pipeline parallel with ``build_pipeline``, its
   dp replicas all-reducing each stage's gradients; both with ``build_pipeline(...,
   tensor_mesh=)`` on a (dp, pp, tp) mesh): ``--warmup`` rounds, then ``--rounds`` rounds,
   each the slowest rank's time after a barrier.

Prints one line per plan, predicted vs measured (min / median / max) and the relative error
of the prediction against the median (and against the fastest round), then ``max_rel_error=<...>`` last.

``--netlab CAP`` runs the ranks on a lab network instead (:mod:`trainers.netlab`: one rank per
node namespace, ``--worlds`` nodes, every node's link capped at ``CAP`` both ways): step 1 is
then skipped and the planner's network is one level described by the cap alone -- ``CAP x
1448 / 1514`` (the TCP payload of a 1514-byte frame at MTU 1500) and ``--latency-us`` per
message (default :data:`LAB_LATENCY_US`, this machine's per-message cost on loopback: the lab
adds no propagation delay) -- nothing measured on the lab. Each plan's line also gives the
network's part of the prediction (the prediction minus the same plan's on an infinitely fast
network) and the bytes every node's interface sent per step. The ranks are started by
:func:`trainers.netlab.start_ranks` as ``python benchmarks/plan_check.py --worker FILE``, which
reads torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``).

``--only TP,PP,DP [...]`` checks only those degrees and ``--micro-batches M[,M...]`` plans each
of them at each of those micro-batch counts instead of the planner's own choice (the planner
still picks the schedule and the stages): how the prediction and the measured step move with
the micro-batches, e.g. ``--worlds 4 --only 1,4,1 --micro-batches 4,8,16,32``.

Usage: python benchmarks/plan_check.py [--worlds 2,4] [--rounds 5] [--json out.json]
           [--only TP,PP,DP ...] [--micro-batches M[,M...]]
       python benchmarks/plan_check.py --netlab 100mbit [--worlds 2,4] [--latency-us U]
           [--timeout 3600] [--json benchmarks/results/netlab/plan_check_netlab_100mbit.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _report import machine_line

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from modelzoo.nlp.bert import BertConfig, BertForQuestionAnswering  # noqa: E402
from trainers._dtensor import local_tensor  # noqa: E402
from trainers.netlab import interface_tx_bytes  # noqa: E402
from trainers.parallel.plan import (  # noqa: E402
    BlockProfile,
    Network,
    Plan,
    Profile,
    plan,
    predict_step_time,
    profile_model,
)

TCP_PAYLOAD = 1448 / 1514  # TCP payload of a 1514-byte Ethernet frame at MTU 1500 (timestamps on)
#: the lab's per-message latency (us): the median of the per-message costs calibrated on
#: loopback on this machine by :func:`calibrate` (one-float all-reduces; two runs of 9 plans on
#: 2026-12-07: 117-880 us, median 147); the lab adds no propagation delay, so a message costs
#: the same software time there. (919 us before, the median of the old fit's residuals.)
LAB_LATENCY_US = 147.0
CONFIGS = {  # (tp, pp, dp) per world size
    2: [(1, 1, 2), (2, 1, 1), (1, 2, 1)],
    4: [(1, 1, 4), (2, 1, 2), (4, 1, 1), (1, 2, 2), (1, 4, 1), (2, 2, 1)],
}


def bert_config(args: argparse.Namespace) -> BertConfig:
    return BertConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=max(128, args.seq_len),
    )


def span_loss(logits: torch.Tensor, spans: torch.Tensor) -> torch.Tensor:
    start, end = logits.unbind(-1)
    return F.cross_entropy(start, spans[:, 0]) + F.cross_entropy(end, spans[:, 1])


def batch(args: argparse.Namespace, n: int, seed: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab, (n, args.seq_len), generator=gen)
    types = torch.randint(0, 2, (n, args.seq_len), generator=gen)
    mask = torch.ones(n, args.seq_len, dtype=torch.long)
    spans = torch.randint(0, args.seq_len, (n, 2), generator=gen)
    return (ids, types, mask), spans


#: all-reduce sizes (bytes) of the measured link curve (``--link curve``): around the plans'
#: messages (tensor parallelism's 0.5-2 MiB hidden states, 2-21 MB of gradients)
CURVE_BYTES = (4, 64 * 2**10, 256 * 2**10, 2**20, 2 * 2**20, 4 * 2**20, 16 * 2**20)


def calibrate(world: int, curve: bool = False) -> tuple[float, float, str]:
    """``(gbps, latency_s, hops)`` of this world's all-reduce under the ring formula ``T =
    2 (N-1)/N S / B + 2 (N-1) a``: ``a`` from an all-reduce of one float (the formula's bytes
    term is nothing there), ``B`` from 16 MiB less that latency. Medians of 25 and 9 calls,
    slowest rank. (The latency was the residual of a 1 MiB and a 16 MiB fit before, which
    swung from 0 to 4.6 ms per message between runs of one hour.) With ``curve``, ``hops``
    is a ring step's measured time per chunk size (``CHUNK@SECONDS/...``, the network
    string's fourth field: each all-reduce of :data:`CURVE_BYTES`, ``T / (2 (N-1))`` at
    ``S / N``); else ``""``."""

    def timed(x: torch.Tensor, calls: int) -> float:
        dist.all_reduce(x)  # warm up the connection
        runs = []
        for _ in range(calls):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            runs.append(time.perf_counter() - start)
        t = torch.tensor([statistics.median(runs)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    large = 16 * 2**20  # bytes
    hops = 2 * (world - 1)
    one = timed(torch.ones(1), 25)
    latency = one / hops
    big = timed(torch.ones(large // 4), 9)
    per_byte = max(big - hops * latency, 1e-12) / large
    gbps = 8 * (hops / world) / per_byte / 1e9  # per_byte = 2 (N-1)/N / B
    if not curve:
        return gbps, latency, ""
    points = []
    for nbytes in CURVE_BYTES:
        t = {4: one, large: big}.get(nbytes) or timed(torch.ones(nbytes // 4), 15)
        points.append(f"{nbytes / world:g}@{t / hops:.6g}")
    return gbps, latency, "/".join(points)


def median_profile(profiles: list[Profile]) -> Profile:
    """The element-wise median of the ranks' profiles (same blocks, same bytes)."""
    first = profiles[0]
    blocks = []
    for k, block in enumerate(first.blocks):
        values = {}
        for f in dataclasses.fields(BlockProfile):
            v = getattr(block, f.name)
            if isinstance(v, float) and f.name.endswith("_s"):
                v = statistics.median(getattr(p.blocks[k], f.name) for p in profiles)
            elif f.name == "batch_times":  # per micro-batch and time, over the ranks
                v = {m: {key: statistics.median(p.blocks[k].batch_times[m][key] for p in profiles)
                         for key in times}
                     for m, times in block.batch_times.items()}  # fmt: skip
            elif f.name == "tp_time_ratio":  # per degree, over the ranks that measured it
                v = {d: statistics.median(p.blocks[k].tp_time_ratio[d] for p in profiles
                                          if d in p.blocks[k].tp_time_ratio)
                     for d in {d for p in profiles for d in p.blocks[k].tp_time_ratio}}  # fmt: skip
            values[f.name] = v
        for part, whole in (("forward_fixed_s", "forward_s"), ("backward_fixed_s", "backward_s")):
            values[part] = min(values[part], values[whole])
        blocks.append(BlockProfile(**values))
    source = {**first.source, "ranks": len(profiles), "statistic": "median over repeats and ranks"}
    return dataclasses.replace(first, blocks=tuple(blocks), source=source)


def _flat_allreduce_(grads: list[torch.Tensor], group: Any, members: int,
                     bucket: list[torch.Tensor]) -> None:  # fmt: skip
    """The mean of ``grads`` over the group through one flat bucket, kept between steps
    (``bucket``: empty, or the bucket) as DDP keeps its buckets."""
    if not bucket:
        bucket.append(torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype))
    flat = torch.cat([g.reshape(-1) for g in grads], out=bucket[0])
    dist.all_reduce(flat, group=group)
    flat /= members
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def build_step(p: Plan, args: argparse.Namespace, rank: int):
    """This rank's part of plan ``p``: a function running one optimizer step."""
    from torch.distributed.device_mesh import init_device_mesh

    from trainers.parallel import build_pipeline, parallelize_bert

    tp, pp, dp, micro = p.tensor_parallel, p.pipeline_parallel, p.data_parallel, p.micro_batches
    replica, stage = rank // (tp * pp), (rank // tp) % pp
    per_replica = p.global_batch // dp
    size = per_replica // micro
    torch.manual_seed(0)
    model = BertForQuestionAnswering(bert_config(args))
    model.train()
    inputs, spans = batch(args, per_replica, seed=replica)
    dp_group: Any = None
    bucket: list[torch.Tensor] = []
    if pp == 1:
        if tp > 1:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            parallelize_bert(model, mesh["tp"])
            dp_group = mesh["dp"].get_group() if dp > 1 else None
        params = [q for q in model.parameters() if q.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-5)

        def step() -> None:
            for k in range(micro):
                part = slice(k * size, (k + 1) * size)
                out = model(*(x[part] for x in inputs))
                loss = span_loss(torch.stack([out.start, out.end], -1), spans[part]) / micro
                loss.backward()
            if dp > 1:
                _flat_allreduce_([local_tensor(q.grad) for q in params], dp_group, dp, bucket)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return step
    # Megatron's rank order: rank = replica * (pp * tp) + stage * tp + tp index
    tp_mesh = None
    if tp == 1:
        mesh = init_device_mesh("cpu", (dp, pp), mesh_dim_names=("dp", "pp"))
    else:
        mesh = init_device_mesh("cpu", (dp, pp, tp), mesh_dim_names=("dp", "pp", "tp"))
        tp_mesh = mesh["tp"]
    if dp > 1:
        dp_group = mesh["dp"].get_group()
    example = tuple(x[:size] for x in inputs)
    pipe = build_pipeline(
        model, rank=stage, num_stages=pp, micro_batches=micro, loss_fn=span_loss,
        example_inputs=example, schedule=p.schedule, boundaries=list(p.boundaries),
        group=mesh["pp"].get_group(), tensor_mesh=tp_mesh,
    )  # fmt: skip
    params = [q for q in pipe.module.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    def step() -> None:
        pipe.step(inputs if pipe.is_first else (), spans if pipe.is_last else None)
        if dp > 1:
            _flat_allreduce_([local_tensor(q.grad) for q in params], dp_group, dp, bucket)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def time_rounds(step, rounds: int, warmup: int) -> list[float]:
    times = []
    for r in range(warmup + rounds):
        dist.barrier()
        start = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends with the slowest rank
        if r >= warmup:
            times.append(t.item())
    return times


def measure(rank: int, world: int, args: argparse.Namespace, network: Network | None) -> list:
    """Every configuration of ``world`` on the initialized default group: profile, plan, run;
    rank 0's rows (the others' are ``[]``). ``network``: the planner's network (``None``:
    calibrate the loopback link before each plan)."""
    rows = []
    configs = [c for c in (args.only or CONFIGS[world]) if c[0] * c[1] * c[2] == world]
    for tp, pp, dp in configs:
        # link and profile just before the run, so that both see the load the run sees
        if network is None:
            gbps, latency, hops = calibrate(world, curve=args.link == "curve")
            net = Network.parse(f"{world}:{gbps:.6g}:{latency:.6g}" + (f":{hops}" if hops else ""))
        else:
            net = network
        torch.manual_seed(0)
        model = BertForQuestionAnswering(bert_config(args))
        own = profile_model(model, seq_len=args.seq_len, batch=args.profile_batch, repeats=5,
                            warmup=2, name="bert_check",
                            larger_batches=args.profile_larger_batches,
                            sync=dist.barrier)  # fmt: skip
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, own.to_dict())
        profile = median_profile([Profile.from_dict(d) for d in gathered])
        share = max(1.0, world / (os.cpu_count() or 1))  # ranks per core, as profiled
        for micro in args.micro_batches or [None]:
            rows.append(_run_plan(rank, world, args, net, profile, share, (tp, pp, dp), micro))
    return rows


def _run_plan(rank: int, world: int, args: argparse.Namespace, net: Network, profile: Profile,
              share: float, degrees: tuple[int, int, int], micro: int | None) -> dict:  # fmt: skip
    """Plan ``degrees`` (the planner's micro-batches, or ``micro``), time it, one row."""
    tp, pp, dp = degrees
    gbps, latency = net.levels[0].gbps, net.levels[0].latency_s  # as calibrated or given
    best = plan(
        profile, net, global_batch=args.global_batch, memory_bytes=math.inf,
        tensor_parallel=[tp], pipeline_parallel=[pp], max_tp=world, max_pp=world,
        ranks_per_core=share, **({} if micro is None else {"micro_batches": [micro]}),
    )  # fmt: skip
    if best.data_parallel != dp:
        raise RuntimeError(f"planned dp {best.data_parallel}, expected {dp}")
    # the same plan on an infinitely fast network: the prediction's compute part
    fast = Network.parse(f"{world}:1e12:0")
    compute = predict_step_time(profile, fast, best.config, global_batch=args.global_batch,
                                ranks_per_core=share)  # fmt: skip
    row: dict[str, Any] = {"world": world, "network": str(net), "gbps": gbps,
                           "latency_s": latency, "plan": best.to_dict(),
                           "predicted_compute_s": compute.step_s,
                           "profile": profile.to_dict()}  # fmt: skip
    step = build_step(best, args, rank)
    tx = interface_tx_bytes()
    row["measured_s"] = time_rounds(step, args.rounds, args.warmup)
    after = interface_tx_bytes()
    sent: list[Any] = [None] * world
    per_step = None if tx is None or after is None else (after - tx) / (args.rounds + args.warmup)
    dist.all_gather_object(sent, per_step)
    row["wire_bytes_per_step"] = sent
    return row


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = measure(rank, world, args, None)
    if rank == 0:
        out[world] = rows
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def lab_worker(config: Path) -> None:
    """One rank on a lab node (``--worker FILE``), started by :func:`trainers.netlab.start_ranks`
    or torchrun: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` from the
    environment; settings and the network from ``FILE``; rank 0 writes the rows to its ``"out"``."""
    conf = json.loads(config.read_text())
    args = argparse.Namespace(**conf["args"])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=conf["gloo_timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = measure(rank, world, args, Network.parse(conf["network"], devices=world))
    if rank == 0:
        Path(conf["out"]).write_text(json.dumps(rows))
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def lab_network(world: int, cap_bits: int, latency_us: float) -> Network:
    """The planner's one-level network for ``world`` lab nodes capped at ``cap_bits``: the
    cap's TCP payload rate and ``latency_us`` per message."""
    return Network.parse(f"{world}:{cap_bits * TCP_PAYLOAD / 1e9:.6g}:{latency_us * 1e-6:.6g}")


def run_on_lab(world: int, args: argparse.Namespace) -> list:
    """``world`` ranks of :func:`lab_worker`, one per node of a fresh lab capped at
    ``args.netlab``; the lab is removed however the run ends, and the run is stopped after
    ``args.timeout`` s."""
    from trainers.netlab import Lab, parse_rate, start_ranks, wait_ranks  # noqa: PLC0415

    network = lab_network(world, parse_rate(args.netlab), args.latency_us)
    with tempfile.TemporaryDirectory(prefix="plan_check_lab_") as tmp:
        config, out, log = Path(tmp, "config.json"), Path(tmp, "rows.json"), Path(tmp, "ranks.log")
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
        config.write_text(json.dumps({"args": settings, "out": str(out), "network": str(network),
                                      "gloo_timeout": max(60, args.timeout // 2)}))  # fmt: skip
        name = f"pc{os.getpid() % 10**6}n{world}"
        with Lab(world, bandwidth=args.netlab, name=name) as lab, open(log, "w") as logf:
            procs = start_ranks(lab, [sys.executable, str(Path(__file__).resolve()), "--worker",
                                      str(config)], port=29500, cwd=ROOT, stdout=logf,
                                stderr=subprocess.STDOUT)  # fmt: skip
            if not wait_ranks(procs, args.timeout):
                raise SystemExit(f"plan_check: the {world}-node lab run passed --timeout "
                                 f"{args.timeout} s; ranks' output:\n{log.read_text()[-3000:]}")  # fmt: skip
        if any(p.returncode for p in procs):
            raise SystemExit(f"plan_check: lab ranks exited with {[p.returncode for p in procs]}"
                             f":\n{log.read_text()[-5000:]}")  # fmt: skip
        return json.loads(out.read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _degrees(text: str) -> tuple[int, int, int]:
    parts = text.split(",")
    if len(parts) != 3 or not all(v.isdigit() and int(v) >= 1 for v in parts):
        raise argparse.ArgumentTypeError(f"{text!r} is not TP,PP,DP (three integers >= 1)")
    tp, pp, dp = (int(v) for v in parts)
    return tp, pp, dp


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=lambda t: [int(v) for v in t.split(",")], default=[2, 4])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--profile-batch", type=int, default=8)
    p.add_argument("--profile-larger-batches", default=[16, 32],
                   type=lambda t: [int(v) for v in t.split(",") if v],
                   help="micro-batches above --profile-batch the profile also times (the "
                        "plans' micro-batches go up to the global batch); '' for none")  # fmt: skip
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every number here")
    p.add_argument("--netlab", default=None, metavar="CAP",
                   help="run the ranks on a lab network, one per node, links capped at CAP "
                   "(e.g. 100mbit, 1gbit) both ways; needs root (docs/netlab.md)")  # fmt: skip
    p.add_argument("--latency-us", type=float, default=LAB_LATENCY_US,
                   help="--netlab: the planner's per-message latency (microseconds)")  # fmt: skip
    p.add_argument("--timeout", type=int, default=3600,
                   help="--netlab: seconds one lab run may take before it is stopped")  # fmt: skip
    p.add_argument("--only", type=_degrees, nargs="+", default=None, metavar="TP,PP,DP",
                   help="check only these (tensor, pipeline, data) degrees, e.g. 1,4,1")  # fmt: skip
    p.add_argument("--micro-batches", type=lambda t: [int(v) for v in t.split(",")],
                   default=None, metavar="M[,M...]",
                   help="plan each configuration at each of these micro-batch counts instead "
                   "of the planner's choice (the planner still picks schedule and stages)")  # fmt: skip
    p.add_argument("--link", choices=("curve", "line"), default="curve",
                   help="loopback: give the planner the all-reduce's measured time per ring "
                   "step at several sizes (curve, the default), or only the line through "
                   "one float and 16 MiB (line, before 2026-12-07)")  # fmt: skip
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        lab_worker(args.worker)
        return 0
    if args.rounds < 5:
        p.error(f"--rounds must be >= 5 (min / median / max of the measured steps), got {args.rounds}")  # fmt: skip
    for world in args.worlds:
        if world not in CONFIGS and not args.only:
            p.error(f"--worlds: {world} processes has no configurations; use 2 or 4, or --only")
    if args.only:
        worlds = {tp * pp * dp for tp, pp, dp in args.only}
        if not worlds <= set(args.worlds):
            p.error(f"--only: degrees for {sorted(worlds)} processes; --worlds has "
                    f"{args.worlds} (give --worlds {','.join(map(str, sorted(worlds)))})")  # fmt: skip
        args.worlds = [w for w in args.worlds if w in worlds]
    for micro in args.micro_batches or []:
        for _tp, _pp, dp in args.only or [c for w in args.worlds for c in CONFIGS[w]]:
            if micro < 1 or args.global_batch % (dp * micro):
                p.error(f"--micro-batches {micro}: the global batch {args.global_batch} does "
                        f"not divide into data_parallel {dp} x {micro} micro-batches")  # fmt: skip
    if args.netlab:
        from trainers.netlab import missing_requirements  # noqa: PLC0415

        why = missing_requirements()
        if why:
            print(f"plan_check --netlab: {why}", file=sys.stderr)
            return 2
    cores = os.cpu_count() or 1
    print(machine_line())
    print(f"model: BERT span QA, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"vocab {args.vocab}, seq {args.seq_len}, global batch {args.global_batch}, fp32, AdamW")  # fmt: skip
    if args.netlab:
        print(f"lab network: one rank per node, {args.netlab} each way per node; the planner's "
              f"network: {args.netlab} x 1448/1514, {args.latency_us:g} us per message")  # fmt: skip
    out: Any = {} if args.netlab else mp.Manager().dict()
    worst, errors = 0.0, []
    start = time.perf_counter()
    for world in args.worlds:
        if args.netlab:
            out[world] = run_on_lab(world, args)
            print(f"\n{world} lab nodes at {args.netlab} ({world / cores:.1f} ranks per core; each "
                  "plan profiled just before its run; 'net' = the prediction's network part, "
                  "'wire MB' = bytes each node sent per step)")  # fmt: skip
        else:
            mp.spawn(worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
            print(f"\n{world} processes ({world / cores:.1f} per core; each plan profiled, and its "
                  "link calibrated, just before its run, under the same contention)")  # fmt: skip
        rows = out[world]
        print(f"{'tp':>3} {'pp':>3} {'dp':>3} {'M':>3} {'sched':>6} {'boundaries':>15} "
              f"{'link Gbps/us':>13} {'predicted':>9} {'min':>7} {'median':>7} {'max':>7} "
              f"{'error':>7} {'vs min':>7}" + (f" {'net':>6} {'wire MB':>13}" if args.netlab else ""))  # fmt: skip
        for row in rows:
            q = row["plan"]
            head = (
                f"{q['tensor_parallel']:>3} {q['pipeline_parallel']:>3} {q['data_parallel']:>3} "
                f"{q['micro_batches']:>3} {q['schedule']:>6} {str(q['boundaries']):>15} "
                f"{row['gbps']:>6.2f}/{row['latency_s'] * 1e6:<6.0f} {q['predicted_step_s']:>9.3f}"
            )
            times = row["measured_s"]
            med = statistics.median(times)
            rel = (q["predicted_step_s"] - med) / med
            rel_min = (q["predicted_step_s"] - min(times)) / min(times)
            row["rel_error"], row["rel_error_vs_min"] = rel, rel_min
            errors.append(abs(rel))
            worst = max(worst, abs(rel))
            tail = ""
            if args.netlab:
                net = q["predicted_step_s"] - row["predicted_compute_s"]
                wire = [w for w in row["wire_bytes_per_step"] if w is not None]
                span = f"{min(wire) / 1e6:.2f}-{max(wire) / 1e6:.2f}" if wire else "n/a"
                tail = f" {net:>6.3f} {span:>13}"
            print(f"{head} {min(times):>7.3f} {med:>7.3f} {max(times):>7.3f} {rel:>+7.1%} "
                  f"{rel_min:>+7.1%}{tail}")  # fmt: skip
    if args.json:
        from trainers.checkpoint import atomic_write_text

        data: dict[str, Any] = {str(k): v for k, v in out.items()}
        if args.netlab:
            from _report import machine  # noqa: PLC0415

            data = {"benchmark": "plan_check", "netlab": args.netlab,
                    "command": [Path(sys.argv[0]).as_posix(), *sys.argv[1:]],
                    "latency_us": args.latency_us, "machine": machine(),
                    "date": time.strftime("%Y-%m-%d"), "max_rel_error": worst,
                    "median_abs_error": statistics.median(errors), "worlds": data}  # fmt: skip
        atomic_write_text(args.json, json.dumps(data, indent=1))
    print(f"\n{len(errors)} plans measured in {time.perf_counter() - start:.0f} s; median "
          f"|error| {statistics.median(errors):.1%}")  # fmt: skip
    print(f"max_rel_error={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
