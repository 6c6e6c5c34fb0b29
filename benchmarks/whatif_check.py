"""Check scripts/scaling_whatif.py's communication model against measured gloo runs here.

Two processes on 127.0.0.1 (gloo). First the link is calibrated: all-reduces of 2 MiB and
32 MiB (the fastest of 15 each) give the per-byte time and the fixed cost of ``T = 2 (N-1)/N S / B + 2 (N-1) a``.
Then a "training step" is measured for several gradient sizes — ``--compute`` seconds of
compute (a sleep, so the two processes do not fight over this machine's cores) followed by
an all-reduce of the gradient, as the error-feedback and CSER combiners do (no overlap) —
(the fastest of ``--steps``) and compared with the what-if prediction ``T_c + T_comm``. Prints one line per size and
``max_rel_error=<...>`` last.

Usage: python benchmarks/whatif_check.py [--compute 0.05] [--sizes-mib 4,16,64]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _report import check_rounds, machine_line, spread

ROOT = Path(__file__).resolve().parents[1]


def _whatif():
    spec = importlib.util.spec_from_file_location("whatif", ROOT / "scripts" / "scaling_whatif.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["whatif"] = module
    spec.loader.exec_module(module)
    return module


def _time_allreduce(numel: int, repeats: int) -> float:
    x = torch.ones(numel)
    dist.all_reduce(x)  # warm up the connection
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(x)
        times.append(time.perf_counter() - start)
    return min(times)  # the least disturbed by other work on this machine


def _worker(rank: int, port: int, args: argparse.Namespace, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    small, large = 2 * 2**20, 32 * 2**20  # bytes
    t_small = _time_allreduce(small // 4, 15)
    t_large = _time_allreduce(large // 4, 15)
    per_byte = (t_large - t_small) / (large - small)  # = 2 (N-1)/N / B = 1 / B for N = 2
    fixed = max(0.0, t_small - per_byte * small)  # = 2 (N-1) a = 2 a
    rows = []
    for mib in args.sizes_mib:
        grad = torch.ones(mib * 2**20 // 4)
        steps = []
        for _ in range(args.steps):
            dist.barrier()
            start = time.perf_counter()
            time.sleep(args.compute)  # the forward and backward
            dist.all_reduce(grad)
            steps.append(time.perf_counter() - start)
        rows.append((mib, steps))
    if rank == 0:
        out.update(per_byte=per_byte, fixed=fixed, rows=rows)
    dist.barrier()  # no rank leaves while a peer still talks to it
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--compute", type=float, default=0.05, help="seconds of compute per step")
    p.add_argument("--sizes-mib", type=lambda t: [int(v) for v in t.split(",")], default=[4, 16, 64])  # fmt: skip
    p.add_argument("--steps", type=int, default=7, help="measured steps per size (>= 5)")
    args = p.parse_args()
    check_rounds(args.steps)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(port, args, out), nprocs=2, join=True)
    whatif = _whatif()
    gbps = 8 / out["per_byte"] / 1e9  # N = 2: T = S / B + 2 a
    latency = out["fixed"] / 2
    print(machine_line())
    print(f"calibrated loopback link: {gbps:.2f} Gbps, latency {latency * 1e6:.0f} us per hop")
    worst = 0.0
    for mib, steps in out["rows"]:
        print(f"gradient {mib:>4d} MiB: measured steps {spread(steps, 'ms', 1e3)}")
        measured = min(steps)  # the model's compute + communication, without other load
        w = whatif.Workload(compute_time=args.compute, grad_bytes=mib * 2**20)
        predicted = args.compute + whatif.comm_time(w, 2, gbps, latency)
        rel = abs(predicted - measured) / measured
        worst = max(worst, rel)
        print(
            f"gradient {mib:>4d} MiB: step measured {measured * 1e3:7.1f} ms, predicted "
            f"{predicted * 1e3:7.1f} ms (scaling factor {args.compute / measured:.3f} measured, "
            f"{whatif.scaling_factor(w, 2, gbps, latency):.3f} predicted)"
        )
    print(f"max_rel_error={worst:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
