"""Check the placement planner's predicted step times against measured gloo runs here.

For each world size (default 2 and 4 processes on 127.0.0.1, one thread each) and each
(tp, pp, dp) of it, in turn:

1. the loopback link is calibrated: all-reduces of 1 MiB and 16 MiB (median of 9 each)
   give the per-byte time and the fixed cost of ``T = 2 (N-1)/N S / B + 2 (N-1) a``, and so
   a one-level network ``"N:gbps:latency"`` for the planner;
2. every rank profiles the same small BERT (span QA, ``trainers.parallel.plan.profile_model``)
   at the same time, so the profile sees the same number of processes per core as the run
   (4 processes on this machine's 2 cores: each gets about half a core) and the same
   background load; the element-wise median over the ranks is the profile;
3. the planner picks the best micro-batches, schedule and boundaries for these degrees;
4. an optimizer step of the plan (forward, backward, gradient all-reduce, AdamW) is timed
   on the runtime (data parallel with one flat gradient all-reduce; tensor parallel with
   ``parallelize_bert`` on a (dp, tp) mesh; pipeline parallel with ``build_pipeline``, its
   dp replicas all-reducing each stage's gradients; both with ``build_pipeline(...,
   tensor_mesh=)`` on a (dp, pp, tp) mesh): ``--warmup`` rounds, then ``--rounds`` rounds,
   each the slowest rank's time after a barrier.

Prints one line per plan, predicted vs measured (min / median / max) and the relative error
of the prediction against the median (and against the fastest round), then ``max_rel_error=<...>`` last.

Usage: python benchmarks/plan_check.py [--worlds 2,4] [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import sys
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
from trainers.parallel.plan import (  # noqa: E402
    BlockProfile,
    Network,
    Plan,
    Profile,
    plan,
    profile_model,
)

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


def calibrate(world: int) -> tuple[float, float]:
    """``(gbps, latency_s)`` of this world's all-reduce, fitted to the ring formula."""
    small, large = 2**20, 16 * 2**20  # bytes
    times = {}
    for size in (small, large):
        x = torch.ones(size // 4)
        dist.all_reduce(x)  # warm up the connection
        runs = []
        for _ in range(9):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            runs.append(time.perf_counter() - start)
        t = torch.tensor([statistics.median(runs)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[size] = t.item()
    per_byte = (times[large] - times[small]) / (large - small)  # 2 (N-1)/N / B
    share = 2 * (world - 1) / world
    gbps = 8 * share / per_byte / 1e9
    latency = max(0.0, times[small] - per_byte * small) / (2 * (world - 1))
    return gbps, latency


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


def _flat_allreduce_(grads: list[torch.Tensor], group: Any, members: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
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
                _flat_allreduce_([local_tensor(q.grad) for q in params], dp_group, dp)
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
            _flat_allreduce_([local_tensor(q.grad) for q in params], dp_group, dp)
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


def worker(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for tp, pp, dp in CONFIGS[world]:
        # link and profile just before the run, so that both see the load the run sees
        gbps, latency = calibrate(world)
        network = Network.parse(f"{world}:{gbps:.6g}:{latency:.6g}")
        torch.manual_seed(0)
        model = BertForQuestionAnswering(bert_config(args))
        own = profile_model(model, seq_len=args.seq_len, batch=args.profile_batch, repeats=5,
                            warmup=2, name="bert_check")  # fmt: skip
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, own.to_dict())
        profile = median_profile([Profile.from_dict(d) for d in gathered])
        best = plan(
            profile, network, global_batch=args.global_batch, memory_bytes=math.inf,
            tensor_parallel=[tp], pipeline_parallel=[pp], max_tp=world, max_pp=world,
        )  # fmt: skip
        if best.data_parallel != dp:
            raise RuntimeError(f"planned dp {best.data_parallel}, expected {dp}")
        row: dict[str, Any] = {"world": world, "network": str(network), "gbps": gbps,
                               "latency_s": latency, "plan": best.to_dict(),
                               "profile": profile.to_dict()}  # fmt: skip
        step = build_step(best, args, rank)
        row["measured_s"] = time_rounds(step, args.rounds, args.warmup)
        rows.append(row)
    if rank == 0:
        out[world] = rows
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every number here")
    args = p.parse_args()
    if args.rounds < 5:
        p.error(f"--rounds must be >= 5 (min / median / max of the measured steps), got {args.rounds}")  # fmt: skip
    for world in args.worlds:
        if world not in CONFIGS:
            p.error(f"--worlds: {world} processes has no configurations; use 2 or 4")
    cores = os.cpu_count() or 1
    print(machine_line())
    print(f"model: BERT span QA, {args.layers} layers, hidden {args.hidden}, {args.heads} heads, "
          f"vocab {args.vocab}, seq {args.seq_len}, global batch {args.global_batch}, fp32, AdamW")  # fmt: skip
    out = mp.Manager().dict()
    worst, errors = 0.0, []
    start = time.perf_counter()
    for world in args.worlds:
        mp.spawn(worker, args=(world, _free_port(), args, out), nprocs=world, join=True)
        rows = out[world]
        print(f"\n{world} processes ({world / cores:.1f} per core; each plan profiled, and its "
              "link calibrated, just before its run, under the same contention)")  # fmt: skip
        print(f"{'tp':>3} {'pp':>3} {'dp':>3} {'M':>3} {'sched':>6} {'boundaries':>15} "
              f"{'link Gbps/us':>13} {'predicted':>9} {'min':>7} {'median':>7} {'max':>7} "
              f"{'error':>7} {'vs min':>7}")  # fmt: skip
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
            print(f"{head} {min(times):>7.3f} {med:>7.3f} {max(times):>7.3f} {rel:>+7.1%} "
                  f"{rel_min:>+7.1%}")  # fmt: skip
    if args.json:
        from trainers.checkpoint import atomic_write_text

        atomic_write_text(args.json, json.dumps({str(k): v for k, v in out.items()}, indent=1))
    print(f"\n{len(errors)} plans measured in {time.perf_counter() - start:.0f} s; median "
          f"|error| {statistics.median(errors):.1%}")  # fmt: skip
    print(f"max_rel_error={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
