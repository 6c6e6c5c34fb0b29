"""A gloo all-reduce across lab nodes against the ring floor: how close the wire gets to physics.

Ours: ``dist.all_reduce(SUM)`` of one flat float32 tensor (default 25 MB at caps below 1 Gbit,
100 MB at 1 Gbit and above; ``--megabytes``) across N lab nodes (``trainers.netlab``: one
network namespace per node on a bridge, every link capped by ``tc tbf`` in both directions),
one process per node started by ``trainers.netlab.start_ranks`` (gloo over each node's eth0).
Peer: no program but the physics, the ring all-reduce's floor ``2(N-1)/N x bytes / bandwidth``
with bandwidth = the cap in bits/s / 8 (a reduce-scatter and an allgather, each moving
``(N-1)/N`` of the tensor through every node's link at the cap). TCP at MTU 1500 carries at
most ~95.6 % of the cap as payload (docs/netlab.md), so ``ratio`` stays below ~0.96.

For each setting (``--nodes`` x ``--caps``) a fresh lab is built, the ranks do one warm-up
all-reduce, then ``--rounds`` timed ones (a barrier, the all-reduce, its time; a round's time
is the slowest rank's). Each node's interface counters are read before and after the timed
rounds (measured on the cable: IP/TCP headers, ACKs and the rounds' barriers and timing
messages included) and divided by the rounds: the bytes each node sent per all-reduce,
printed against the ring's ``2(N-1)/N x bytes``. Every setting prints min / median / max of
the time, the floor, ``ratio = floor / median time`` and the bytes; the last lines are
``benchmarks/_report.py``'s for the last setting (4 nodes at 1 Gbit by default: the spec
measured 1.06x the floor there), the other settings under ``extra`` in ``--json``. Target:
within 1.15x of the floor (``ratio >= 1/1.15``) in every setting.

The lab is removed whatever happens (the processes inside first); each setting is bounded
(``60 s + 4 x the floor x (rounds + 1)``) and the whole run by ``--timeout``. Without root,
namespaces or iproute2 it prints one line saying what is missing and exits 2.

Usage: python benchmarks/bench_network.py [--nodes 2,4] [--caps 100mbit,1gbit] [--rounds 5]
       [--megabytes MB] [--timeout 900] [--json benchmarks/results/bench_network.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXIT_USAGE = 2
EXIT_TIMEOUT = 124
TARGET = 1 / 1.15  # the all-reduce within 1.15x of the ring floor (issue 38, item 6)
PORT = 29500  # node 0's store port: every lab is a fresh namespace, so it is always free
READY, DONE = "BENCH-READY", "BENCH-DONE"


# ---- one rank, inside a node ----
def worker(numel: int, rounds: int, timeout: float) -> None:
    """Warm up, wait for the parent's counters, time ``rounds`` all-reduces, report, wait for
    the parent's counters again. Rank 0 talks to the parent over stdout/stdin."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    flat = torch.empty(numel, dtype=torch.float32)
    expected = world * (world + 1) / 2  # rank r contributes r + 1 everywhere

    def handshake(line: str) -> None:
        dist.barrier()  # everything before is off the wire
        if rank == 0:
            print(line, flush=True)
            if sys.stdin.readline().strip() != "go":
                raise SystemExit("bench_network worker: the parent went away")
        dist.barrier()

    flat.fill_(rank + 1)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)  # warm-up: connections, buffers
    handshake(READY)
    times, wrong = [], 0
    for _ in range(rounds):
        flat.fill_(rank + 1)
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(float(elapsed))
        wrong += int((flat != expected).sum())
    bad = torch.tensor([wrong], dtype=torch.int64)
    dist.all_reduce(bad)
    handshake(f"{DONE} {json.dumps({'times': times, 'wrong_values': int(bad)})}")
    dist.destroy_process_group()


# ---- the parent, in the root namespace ----
class _Timeout(Exception):
    pass


def _read_line(procs: list[subprocess.Popen], prefix: str, deadline: float, seen: list[str]) -> str:
    """The first line of rank 0's output that starts with ``prefix`` (others go to ``seen``),
    waiting at most until ``deadline``; a rank that fails meanwhile raises at once."""
    proc = procs[0]
    fd = proc.stdout.fileno()
    buf = getattr(proc, "_bench_buf", b"")
    while True:
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode(errors="replace")
            if text.startswith(prefix):
                proc._bench_buf = buf
                return text[len(prefix) :].strip()
            seen.append(text)
        left = deadline - time.monotonic()
        if left <= 0:
            raise _Timeout(prefix)
        ready, _, _ = select.select([fd], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"rank 0 exited before {prefix} (exit {proc.wait()})")
            buf += chunk
        for n, p in enumerate(procs[1:], 1):
            if p.poll() not in (None, 0):
                out = p.stdout.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"node {n} exited with {p.returncode}:\n{out}")


def _go(proc: subprocess.Popen) -> None:
    proc.stdin.write(b"go\n")
    proc.stdin.flush()


def floor_seconds(nodes: int, nbytes: int, cap_bits: int) -> float:
    """The ring all-reduce's floor: ``2(N-1)/N x bytes`` through a link of ``cap / 8`` B/s."""
    return ring_bytes(nodes, nbytes) / (cap_bits / 8)


def ring_bytes(nodes: int, nbytes: int) -> float:
    """What each node sends in a ring all-reduce (reduce-scatter + allgather)."""
    return 2 * (nodes - 1) / nodes * nbytes


def run_setting(
    nodes: int, cap: int, nbytes: int, rounds: int, threads: int, name: str, deadline: float
) -> dict:
    """One lab, one job: the slowest rank's time per round and each node's bytes per round."""
    from trainers.netlab import Lab, start_ranks
    from trainers.netlab.lab import format_rate

    numel = nbytes // 4
    floor = floor_seconds(nodes, numel * 4, cap)
    deadline = min(deadline, time.monotonic() + 60 + 4 * floor * (rounds + 1))
    argv = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        str(numel),
        "--rounds",
        str(rounds),
        "--timeout",
        str(max(1, int(deadline - time.monotonic()))),
    ]
    seen: list[str] = []
    with Lab(nodes, bandwidth=cap, name=name) as lab:
        procs = start_ranks(lab, argv, port=PORT, threads=threads, cwd=Path.cwd(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip
        try:
            _read_line(procs, READY, deadline, seen)
            before = lab.all_counters()
            _go(procs[0])
            report = json.loads(_read_line(procs, DONE, deadline, seen))
            after = lab.all_counters()
            _go(procs[0])
            for n, p in enumerate(procs):
                code = p.wait(timeout=max(1.0, deadline - time.monotonic()))
                if code != 0:
                    tail = p.stdout.read().decode(errors="replace")[-2000:]
                    raise RuntimeError(f"node {n} exited with {code}:\n{tail}")
        except (_Timeout, subprocess.TimeoutExpired):
            raise _Timeout(f"{nodes} nodes at {format_rate(cap)} did not finish in time") from None
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nrank 0's output:\n" + "\n".join(seen[-30:])) from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
    delta = [a - b for a, b in zip(after, before, strict=True)]
    if report["wrong_values"]:
        raise RuntimeError(f"{report['wrong_values']} values of the all-reduce were wrong")
    return {
        "times": report["times"],
        "floor": floor,
        "sent": [d.tx_bytes / rounds for d in delta],
        "received": [d.rx_bytes / rounds for d in delta],
    }


def _rate(text: str) -> int:
    from trainers.netlab import parse_rate

    return parse_rate(text, "--caps")


def _list(text: str, kind, what: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{what} {text!r}: {e}") from None


def _parser() -> argparse.ArgumentParser:
    import _report

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", type=lambda t: _list(t, int, "--nodes"), default=[2, 4],
                   help="lab sizes, comma-separated (default 2,4)")  # fmt: skip
    p.add_argument("--caps", type=lambda t: _list(t, _rate, "--caps"), default=["100mbit", "1gbit"],
                   help="link caps, comma-separated (default 100mbit,1gbit)")  # fmt: skip
    p.add_argument("--megabytes", type=float, default=None,
                   help="tensor size in MB (1e6 bytes; default 25 below 1 Gbit, 100 at 1 Gbit and "
                        "above)")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument(
        "--timeout",
        type=float,
        default=900.0,
        help="seconds for the whole run; then the lab is removed (default 900)",
    )
    _report.add_args(p, rounds=5)
    p.add_argument("--worker", type=int, default=None, metavar="NUMEL", help=argparse.SUPPRESS)
    return p


def _on_signal(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # _report, beside this file
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # trainers
    args = _parser().parse_args(argv)
    if args.worker is not None:
        worker(args.worker, args.rounds, args.timeout)
        return 0
    from trainers.netlab import missing_requirements
    from trainers.netlab.lab import MAX_NODES, format_rate

    why = missing_requirements()
    if why:
        print(f"bench_network: {why}", file=sys.stderr)
        return EXIT_USAGE
    import _report
    import torch

    rounds = _report.check_rounds(args.rounds)
    caps = [_rate(c) if isinstance(c, str) else c for c in args.caps]
    bad = [n for n in args.nodes if not 2 <= n <= MAX_NODES]
    if bad or not args.nodes or not caps:
        print(f"bench_network: --nodes {bad or args.nodes}: give 2 to {MAX_NODES} nodes, and "
              "at least one --caps", file=sys.stderr)  # fmt: skip
        return EXIT_USAGE
    if args.megabytes is not None and args.megabytes <= 0:
        print(f"bench_network: --megabytes {args.megabytes}: must be > 0", file=sys.stderr)
        return EXIT_USAGE
    torch.set_num_threads(args.threads)  # the machine line shows the ranks' threads
    signal.signal(signal.SIGTERM, _on_signal)
    deadline = time.monotonic() + args.timeout
    settings = [(n, c) for n in args.nodes for c in caps]
    results: dict[str, dict] = {}
    try:
        for i, (nodes, cap) in enumerate(settings):
            mb = args.megabytes if args.megabytes is not None else (100 if cap >= 1e9 else 25)
            nbytes = int(mb * 1e6) // 4 * 4
            key = f"{nodes} nodes, {format_rate(cap)}, {nbytes / 1e6:g} MB"
            if nodes * cap > 4e9:
                print(f"note: {key}: {nodes * cap / 1e9:g} Gbit/s in all is past what 2 cores "
                      "carry (2-4 Gbit/s, docs/netlab.md); the CPU may be the limit")  # fmt: skip
            print(f"{key}: building the lab, {rounds} rounds after a warm-up ...", flush=True)
            got = run_setting(nodes, cap, nbytes, rounds, args.threads,
                              f"bn{os.getpid() % 1000000}s{i}", deadline)  # fmt: skip
            results[key] = {"nodes": nodes, "cap": format_rate(cap), "bytes": nbytes, **got}
            _print_setting(key, results[key], rounds)
    except _Timeout as e:
        print(f"bench_network: timed out: {e} (--timeout {args.timeout:g}); the lab was removed",
              file=sys.stderr)  # fmt: skip
        return EXIT_TIMEOUT
    except KeyboardInterrupt:
        print("bench_network: interrupted; the lab was removed", file=sys.stderr)
        return 130
    except RuntimeError as e:  # LabError included
        print(f"bench_network: error: {e}", file=sys.stderr)
        return 1
    _print_table(results)
    return _finish(args.json, results, rounds)


def _print_setting(key: str, r: dict, rounds: int) -> None:
    import _report

    formula = ring_bytes(r["nodes"], r["bytes"])
    med = statistics.median(r["times"])
    print(f"  all-reduce (slowest rank): {_report.spread(r['times'])}")
    print(f"  ring floor 2({r['nodes']}-1)/{r['nodes']} x {r['bytes'] / 1e6:g} MB / "
          f"({r['cap']} / 8) = {r['floor']:.4g} s; ratio floor/median = {r['floor'] / med:.3f} "
          f"({med / r['floor']:.3f}x the floor)")  # fmt: skip
    sent = ", ".join(f"{s / 1e6:.2f}" for s in r["sent"])
    print(
        f"  sent per node per all-reduce (interface counters, {rounds} rounds): [{sent}] MB; "
        f"ring 2(N-1)/N x bytes = {formula / 1e6:.2f} MB; sent / ring = "
        f"{min(r['sent']) / formula:.3f} to {max(r['sent']) / formula:.3f}",
        flush=True,
    )


def _print_table(results: dict[str, dict]) -> None:
    print(f"\n{'setting':<28} {'median s':>9} {'floor s':>8} {'ratio':>6} {'x floor':>7} "
          f"{'sent MB/node (min-max)':>23} {'ring MB':>8}")  # fmt: skip
    for key, r in results.items():
        med = statistics.median(r["times"])
        sent = f"{min(r['sent']) / 1e6:.2f}-{max(r['sent']) / 1e6:.2f}"
        print(
            f"{key:<28} {med:>9.4g} {r['floor']:>8.4g} {r['floor'] / med:>6.3f} "
            f"{med / r['floor']:>7.3f} {sent:>23} {ring_bytes(r['nodes'], r['bytes']) / 1e6:>8.2f}"
        )


def _finish(json_path: str | None, results: dict[str, dict], rounds: int) -> int:
    import _report

    def part(r: dict) -> dict:
        peer = [r["floor"]] * len(r["times"])
        ratio = statistics.median(peer) / statistics.median(r["times"])
        return {
            "ours_rounds": r["times"],
            "peer_rounds": peer,
            "ratio": ratio,
            "target": TARGET,
            "unit": "s",
            "nodes": r["nodes"],
            "cap": r["cap"],
            "bytes": r["bytes"],
            "floor_s": r["floor"],
            "ring_bytes_per_node": ring_bytes(r["nodes"], r["bytes"]),
            "sent_bytes_per_node": r["sent"],
            "received_bytes_per_node": r["received"],
        }

    *others, last = results
    head = results[last]
    extra = {"headline": {k: v for k, v in part(head).items() if k not in
                          ("ours_rounds", "peer_rounds", "ratio", "target", "unit")}}  # fmt: skip
    extra.update({key: part(results[key]) for key in others})
    ratios = {key: part(r)["ratio"] for key, r in results.items()}
    worst = min(ratios, key=ratios.get)
    print(f"worst setting: {worst}, ratio {ratios[worst]:.3f} (target "
          f">= {TARGET:.3f}, within 1.15x of the floor)")  # fmt: skip
    print(f"headline: {last}, seconds per all-reduce:")
    _report.finish(
        json_path,
        "bench_network",
        head["times"],
        [head["floor"]] * len(head["times"]),
        ours_label=f"gloo all_reduce(SUM), one flat float32 tensor, {last}, one process per "
        "lab node, slowest rank",
        peer_label="the ring floor 2(N-1)/N x bytes / (cap / 8): physics, not a program",
        target=TARGET,
        extra=extra,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
