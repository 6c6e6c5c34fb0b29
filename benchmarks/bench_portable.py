"""The speed cost of the portable exact mode, per recipe family.

``scripts/publish.py --portable`` publishes under ``trainers.logs.PORTABLE_EXACT_PINS``
(oneDNN off, MKL's COMPATIBLE code branch, MKL_DYNAMIC off, correctly rounded sqrt) instead
of the usual ``PORTABLE_CPU_PINS``; ``--portable-onednn`` under ``PORTABLE_ONEDNN_PINS``
(the same with oneDNN on: ``--variant onednn`` here). Each round runs one short training
command per family twice, once in each mode, in an order that alternates with the round,
as subprocesses with the same thread count; the measure is the median ``samples_per_sec``
of the run log's step records (training steps only: start-up, data preparation and
evaluations are left out).

    python benchmarks/bench_portable.py [--rounds 5] [--threads 2] [--families resnest,bert]
        [--variant exact|onednn]

Prints, per family, min/median/max samples/s of each mode and ``ratio_<family>=<portable
median / pinned median>`` (below 1: the portable mode is slower), then ``ratio=`` the lowest
of them last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import check_rounds, machine, machine_line, spread, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from trainers.logs import (  # noqa: E402
    ISA_PIN_VARIABLES,
    PORTABLE_CPU_PINS,
    PORTABLE_EXACT_PINS,
    PORTABLE_ONEDNN_PINS,
)

VARIANTS = {"exact": PORTABLE_EXACT_PINS, "onednn": PORTABLE_ONEDNN_PINS}

FAMILIES = {
    "resnest": ["scripts/train_imagenet.py", "--no-progress", "--max-steps", "15",
                "--log-interval", "5"],
    "bert": ["scripts/finetune_squad.py", "--no-progress", "--max-steps", "12",
             "--log-interval", "2", "--output-dir", "{tmp}/squad"],
    "gnn": ["scripts/train_gnn.py", "--model", "gcn_sbm", "--dataset", "sbm", "--num-epochs",
            "10", "--eval-interval", "10", "--no-progress"],
    "linear": ["scripts/train_linear.py", "--dataset", "breast_cancer", "--solver", "sgd",
               "--batch-size", "16", "--num-epochs", "3", "--lr", "0.05", "--no-progress"],
}  # fmt: skip


def env_for(pins: dict[str, str], threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ISA_PIN_VARIABLES}
    env.update(pins)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def throughput(command: list[str], env: dict[str, str]) -> float:
    """Median samples/s of the step records of one run of ``command``."""
    with tempfile.TemporaryDirectory(prefix="bench-portable-") as tmp:
        log = Path(tmp) / "run.jsonl"
        argv = [a.replace("{tmp}", tmp) for a in command] + ["--seed", "0", "--run-log", str(log)]
        done = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                              text=True, check=False)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-1500:]}")
        records = [json.loads(line) for line in log.read_text().splitlines()]
    speeds = [r["samples_per_sec"] for r in records
              if r.get("kind") == "step" and r.get("samples_per_sec")]  # fmt: skip
    if not speeds:
        raise SystemExit(f"{' '.join(argv)}: no step record with samples_per_sec")
    return statistics.median(speeds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    p.add_argument("--variant", choices=sorted(VARIANTS), default="exact",
                   help="the portable mode's pins: exact (oneDNN off) or onednn")  # fmt: skip
    p.add_argument("--json", help="write the rounds and ratios here (benchmarks/make_doc.py)")
    args = p.parse_args(argv)
    check_rounds(args.rounds)
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        p.error(f"--families: unknown {unknown}; choose from {', '.join(FAMILIES)}")
    modes = {"pinned": env_for(PORTABLE_CPU_PINS, args.threads),
             "portable": env_for(VARIANTS[args.variant], args.threads)}  # fmt: skip
    print(machine_line())
    ratios: dict[str, float] = {}
    rounds: dict[str, dict[str, list[float]]] = {}
    for family in families:
        speeds: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            for mode in order:
                speeds[mode].append(throughput(FAMILIES[family], modes[mode]))
        for mode, values in speeds.items():
            print(f"{family:8s} {mode:9s} {spread(values, 'samples/s')}")
        ratios[family] = statistics.median(speeds["portable"]) / statistics.median(speeds["pinned"])
        rounds[family] = speeds
        print(f"ratio_{family}={ratios[family]:.3f}", flush=True)
    if args.json:
        write_json(args.json, {"benchmark": "bench_portable", "unit": "samples/s",
                               "variant": args.variant,
                               "pins": VARIANTS[args.variant], "rounds": rounds,
                               "ratios": ratios, "machine": machine()})  # fmt: skip
    print(f"ratio={min(ratios.values()):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
