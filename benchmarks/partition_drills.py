"""A series of partition drills on the lab network: how often a cut node costs the job
nothing but seconds, and how many.

Runs ``--drills`` times ``trainers.elastic_drill --netlab`` (3 lab nodes at ``--bandwidth``,
node 2's cable pulled at ``--cut-step`` for ``--cut-seconds``) on the digits recipe for
``--epochs`` epochs, with ``--recovery inproc`` (the members re-form the group in their
processes) or ``restart`` (torchrun), one seed per drill. A drill is clean when every member
exits 0, the run log ends with its ``end`` record and every sample of every epoch is
committed exactly once (the ledger). Prints each drill and min / median / max of: detection
(the cut to the last survivor's failed collective, or watchdog), the first step without the
node, and the rejoin (the link's return to the first step at full size); ``--json`` keeps
them. Needs root (network namespaces). No peer: the numbers are the lab's, not a model's.

    python benchmarks/partition_drills.py --drills 10 --recovery inproc \\
        --json benchmarks/results/netlab/partition_drills_inproc.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import machine_line

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainers.elastic_drill import DrillError, DrillUsage, run_netlab_drill  # noqa: E402

KEYS = ("survivors_detection_seconds", "outage_seconds", "rejoin_seconds")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drills", type=int, default=10, help="drills (one seed each)")
    p.add_argument("--recovery", choices=("inproc", "restart"), default="inproc")
    p.add_argument("--bandwidth", default="1gbit", help="every node's link cap")
    p.add_argument("--cut-step", type=int, default=10, help="pull the cable at this step")
    p.add_argument("--cut-seconds", type=float, default=20.0, help="plug it back after")
    p.add_argument("--epochs", type=int, default=4, help="epochs of the digits recipe")
    p.add_argument("--json", type=Path, default=None, help="write the drills here")
    args = p.parse_args()
    print(f"{args.drills} drills, recovery {args.recovery}, 3 nodes at {args.bandwidth}, node 2 "
          f"cut at step {args.cut_step} for {args.cut_seconds:g} s, {args.epochs} epochs")  # fmt: skip
    print(machine_line())
    drills = []
    with tempfile.TemporaryDirectory(prefix="partition_drills_") as tmp:
        for seed in range(args.drills):
            command = [
                "scripts/train_imagenet.py", "-j", "0", "--no-progress", "--batch-size", "32",
                "--log-interval", "5", "--elastic-checkpoint-steps", "4", "--elastic-ramp-steps",
                "5", "--epochs", str(args.epochs), "--seed", str(seed),
                "--run-log", str(Path(tmp) / f"seed{seed}.jsonl"),
            ]  # fmt: skip
            start = time.monotonic()
            try:
                result = run_netlab_drill(
                    command, nodes=3, bandwidth=args.bandwidth,
                    partition=(2, args.cut_step, args.cut_seconds), threads=1,
                    recovery=args.recovery, log=lambda _: None,
                )  # fmt: skip
                row = {"seed": seed, "clean": True, **{k: result.get(k) for k in KEYS}}
                row["membership"] = [
                    (m.get("step"), m.get("old_world_size"), m.get("new_world_size"))
                    for m in result.get("membership", [])
                ]
            except DrillUsage as e:  # no root, no ip/tc: nothing to measure here
                print(f"partition_drills.py: error: {e}", file=sys.stderr)
                return 2
            except DrillError as e:
                row = {"seed": seed, "clean": False, "error": str(e)}
            row["wall_seconds"] = time.monotonic() - start
            drills.append(row)
            shown = ", ".join(
                f"{k.replace('_seconds', '')} {row[k]:.1f} s"
                for k in KEYS
                if row.get(k) is not None
            )
            print(f"seed {seed}: {'clean' if row['clean'] else 'FAILED: ' + row['error']}; {shown}",
                  flush=True)  # fmt: skip
    clean = sum(d["clean"] for d in drills)
    print(f"clean: {clean} of {len(drills)}")
    for key in KEYS:
        values = [d[key] for d in drills if d.get(key) is not None]
        if values:
            print(f"{key}: min {min(values):.2f} median {statistics.median(values):.2f} "
                  f"max {max(values):.2f} ({len(values)} drills)")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "machine": machine_line(), "drills": drills}, indent=1))  # fmt: skip
    return 0 if clean == len(drills) else 1


if __name__ == "__main__":
    raise SystemExit(main())
