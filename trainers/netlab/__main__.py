"""``python -m trainers.netlab {up,down,status,run}``: a lab network on this machine.

Examples::

    python -m trainers.netlab run --nodes 4 --bandwidth 1gbit -- \\
        scripts/train_imagenet.py -j 0 --no-progress --run-log runs/lab4.jsonl
    python -m trainers.netlab run --nodes 3 --min-nodes 2 --bandwidth 1gbit \\
        --partition-node 2 --partition-at-step 40 --partition-for 20 -- scripts/train_imagenet.py ...
    python -m trainers.netlab up --nodes 4 --bandwidth 1gbit --slow-node 2:100mbit
    python -m trainers.netlab status
    python -m trainers.netlab down
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from ..cli import split_command
from .job import Partition, flag_value, run_job
from .lab import (
    MAX_NODES,
    Lab,
    LabError,
    LabExists,
    describe,
    list_labs,
    missing_requirements,
    parse_rate,
)
from .lab import remove_labs as _remove_labs

EXIT_USAGE = 2
EXIT_TIMEOUT = 124


class _Usage(Exception):
    """A user's mistake: one line, exit 2."""


def _nodes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 2 <= value <= MAX_NODES:
        raise argparse.ArgumentTypeError(f"{value}: a lab has 2 to {MAX_NODES} nodes")
    return value


def _rate(text: str) -> int:
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _slow(text: str) -> tuple[int, int]:
    node, sep, rate = text.partition(":")
    if not sep or not node.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give NODE:RATE, e.g. 2:100mbit")
    return int(node), _rate(rate)


def _seconds(text: str) -> float:
    try:
        value = float(text[:-1] if text.endswith("s") else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give seconds, e.g. 20 or 20s") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must not be negative")
    return value


def _add_shape(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nodes", type=_nodes, default=2, help="node namespaces (2-99; default 2)")
    p.add_argument("--bandwidth", type=_rate, default=None, metavar="RATE",
                   help="every node's cap in each direction, e.g. 1gbit, 100mbit "
                        "(default: uncapped; the 2 cores limit a lab to ~2-4 gbit in all)")  # fmt: skip
    p.add_argument("--slow-node", type=_slow, action="append", default=[], metavar="NODE:RATE",
                   help="one node's own cap, e.g. 2:100mbit (repeatable)")  # fmt: skip


def _lab_from(args: argparse.Namespace, name: str) -> Lab:
    slow = dict(args.slow_node)
    for node in slow:
        if node >= args.nodes:
            raise _Usage(f"--slow-node {node}:...: the lab has nodes 0 to {args.nodes - 1}")
    return Lab(args.nodes, bandwidth=args.bandwidth, slow=slow, name=name)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainers.netlab",
        description="Rehearse a multi-node job on one Linux machine: nodes as network "
        "namespaces on a bridge, bandwidth caps, partitions, bytes counted on the wire.",
    )
    sub = p.add_subparsers(dest="verb", required=True, metavar="{run,up,down,status}")
    run = sub.add_parser("run", help="build a lab, run a torchrun job on every node, remove the lab",
                         description="Build a lab, start one torchrun agent per node running "
                         "the command after --, report each node's bytes, remove the lab.",
                         epilog="the training command follows --, e.g. -- scripts/train_imagenet.py "
                         "--run-log runs/x.jsonl")  # fmt: skip
    _add_shape(run)
    run.add_argument("--nproc-per-node", type=int, default=1, help="workers per node (default 1)")
    run.add_argument("--min-nodes", type=int, default=None,
                     help="elastic job: --nnodes=MIN:NODES (rendezvous on the lab's control host)")  # fmt: skip
    run.add_argument("--max-restarts", type=int, default=3, help="torchrun --max-restarts")
    run.add_argument("--threads", type=int, default=1, help="torch CPU threads per worker")
    run.add_argument("--timeout", type=_seconds, default=3600.0,
                     help="seconds for the whole job; then every node is stopped (default 3600)")  # fmt: skip
    run.add_argument("--partition-node", type=int, default=None, help="node whose link goes down")
    when = run.add_mutually_exclusive_group()
    when.add_argument("--partition-at-step", type=int, default=None,
                      help="take the link down when the job records this training step")  # fmt: skip
    when.add_argument("--partition-at-time", type=_seconds, default=None,
                      help="take the link down this many seconds after the job starts")  # fmt: skip
    run.add_argument("--partition-for", type=_seconds, default=None,
                     help="seconds until the link comes back (default: down until the end)")  # fmt: skip
    run.add_argument("--report", type=Path, default=None,
                     help="write the per-node bytes and times as JSON here (default: beside "
                          "the command's --run-log, as <name>.netlab.json)")  # fmt: skip
    run.add_argument(
        "--log-dir", type=Path, default=None, help="agents' output (default: a temp dir)"
    )
    run.add_argument("--name", default=None, help="lab name (default: r<pid>)")

    up = sub.add_parser("up", help="build a lab and leave it up")
    _add_shape(up)
    up.add_argument("--name", default="lab", help="lab name (default 'lab')")
    down = sub.add_parser("down", help="stop the processes in a lab and remove it")
    which = down.add_mutually_exclusive_group(required=True)
    which.add_argument("--name", default=None, help="the lab to remove")
    which.add_argument("--all", action="store_true", help="every lab on this machine (mzlab-*)")
    status = sub.add_parser("status", help="nodes, addresses, caps, links, bytes of the labs here")
    status.add_argument("--name", default=None, help="one lab (default: every lab)")
    status.add_argument("--json", action="store_true", help="print JSON")
    return p


def _partition(args: argparse.Namespace) -> Partition | None:
    at_given = args.partition_at_step is not None or args.partition_at_time is not None
    if args.partition_node is None:
        if at_given or args.partition_for is not None:
            raise _Usage("--partition-at-step/--partition-at-time/--partition-for need "
                         "--partition-node")  # fmt: skip
        return None
    if not 0 <= args.partition_node < args.nodes:
        raise _Usage(
            f"--partition-node {args.partition_node}: the lab has nodes 0 to {args.nodes - 1}"
        )
    if not at_given:
        raise _Usage("--partition-node needs --partition-at-step or --partition-at-time")
    return Partition(args.partition_node, at_step=args.partition_at_step,
                     at_time=args.partition_at_time, duration=args.partition_for)  # fmt: skip


def _run(args: argparse.Namespace, command: list[str]) -> int:
    if not command:
        raise _Usage("give the training command after --, e.g. -- scripts/train_imagenet.py ...")
    if command[0].endswith(".py") and not Path(command[0]).is_file():
        raise _Usage(f"{command[0]}: no such script")
    if args.nproc_per_node < 1:
        raise _Usage(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
    if args.min_nodes is not None and not 1 <= args.min_nodes <= args.nodes:
        raise _Usage(f"--min-nodes {args.min_nodes}: must be between 1 and --nodes {args.nodes}")
    partition = _partition(args)
    if (
        partition is not None
        and partition.at_step is not None
        and not (flag_value(command, "--run-log") or flag_value(command, "--elastic-dir"))
    ):
        raise _Usage("--partition-at-step reads the job's steps from its --run-log or "
                     "--elastic-dir: give the command one")  # fmt: skip
    report = args.report
    run_log = flag_value(command, "--run-log")
    if report is None and run_log is not None:
        report = Path(run_log).with_suffix(".netlab.json")
    with _lab_from(args, args.name or f"r{os.getpid()}") as lab:
        caps = ", ".join(
            f"node {r['node']} {r.get('cap') or 'uncapped'}" for r in describe(lab.name)
        )
        print(f"[netlab] lab {lab.name}: {lab.nodes} nodes ({caps})", flush=True)
        result = run_job(
            lab, command, nproc_per_node=args.nproc_per_node, min_nodes=args.min_nodes,
            threads=args.threads, timeout=args.timeout, partition=partition,
            max_restarts=args.max_restarts, log_dir=args.log_dir,
            log=lambda line: print(line, flush=True),
        )  # fmt: skip
    print(result.table())
    print(f"[netlab] wall {result.wall_seconds:.1f} s; bytes are each node's interface "
          "counters over the job (sent = tx, received = rx)")  # fmt: skip
    if report is not None:
        from ..checkpoint import atomic_write_text

        report.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(report, json.dumps(result.to_json(), indent=1) + "\n")
        print(f"[netlab] report: {report}")
    if result.timed_out:
        return EXIT_TIMEOUT
    if not result.ok:
        failed = [n for n, c in enumerate(result.exit_codes) if c != 0]
        print(f"[netlab] nodes {failed} failed; their output: "
              f"{', '.join(result.logs[n] for n in failed)}", file=sys.stderr)  # fmt: skip
        return 1
    return 0


def _status(args: argparse.Namespace) -> int:
    labs = list_labs()
    names = [args.name] if args.name else sorted(labs)
    if args.name and args.name not in labs:
        raise _Usage(f"no lab named {args.name!r} (labs here: {', '.join(labs) or 'none'})")
    table = {name: describe(name) for name in names}
    if args.json:
        print(json.dumps(table, indent=1))
        return 0
    if not names:
        print("no labs")
    for name, rows in table.items():
        print(f"lab {name}:")
        for r in rows:
            print(f"  node {r['node']}  {r.get('address', '?'):<14} cap {r.get('cap') or 'none':<8} "
                  f"link {r['link']:<4} sent {r.get('tx_bytes', 0) / 1e6:.2f} MB  received "
                  f"{r.get('rx_bytes', 0) / 1e6:.2f} MB  processes {r['processes']}")  # fmt: skip
    return 0


def _on_signal(signum, frame):  # noqa: ARG001
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    argv, command = split_command(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    why = missing_requirements()
    if why:
        print(f"netlab: {why}", file=sys.stderr)
        return EXIT_USAGE
    signal.signal(signal.SIGTERM, _on_signal)
    try:
        if args.verb == "run":
            return _run(args, command)
        if command:
            raise _Usage(f"'{args.verb}' takes no command after --")
        if args.verb == "up":
            lab = _lab_from(args, args.name).up()
            for r in describe(lab.name):
                print(f"node {r['node']}: {r['namespace']} {r['address']} cap {r['cap'] or 'none'}")
            print(f"lab {lab.name} is up; run a command in node 0 with: "
                  f"ip netns exec {lab.namespace(0)} COMMAND; remove it with: "
                  f"python -m trainers.netlab down --name {lab.name}")  # fmt: skip
            return 0
        if args.verb == "down":
            removed = _remove_labs(None if args.all else args.name)
            print(
                f"removed {len(removed)} namespaces" + (f": {' '.join(removed)}" if removed else "")
            )
            return 0
        return _status(args)
    except (_Usage, ValueError, LabExists) as e:
        print(f"netlab: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except LabError as e:
        print(f"netlab: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("netlab: interrupted; the lab was removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
