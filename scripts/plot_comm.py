"""Accuracy against bytes sent: compare communication-efficient runs (docs/communication.md).

Usage::

    python scripts/plot_comm.py logs/digits_resnest14_2proc/seed0.jsonl logs/digits_comm_*_2proc.jsonl \
        -o docs/communication_digits.png

Left: held-out top-1 of every ``eval`` record against the bytes one worker had sent by then;
right: the final top-1 against the total, one point per run (log scale). Bytes come from the
step records' ``bytes_sent`` (bytes per step, averaged over each log interval). Logs written
before the communication modes existed (plain averaging, Adasum) have no ``bytes_sent``;
their runs sent the dense gradient every step, so ``--dense-bytes`` (or ``grad_bytes`` of
another log given here, same model) supplies the per-step size. Also prints a table.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trainers.logs import RunLogError, read_run_log  # noqa: E402


def label(path: Path, header: dict[str, Any]) -> str:
    config = header.get("config") or {}
    mode = str(config.get("grad_combine", "average"))
    if mode in ("ef", "cser-update"):
        mode += "-" + str(config.get("compressor") or "topk")
    return mode


def curve(records: list[dict[str, Any]], dense: float | None) -> list[tuple[float, float]]:
    """``(bytes sent so far, top1)`` at every eval record."""
    sent, last_step, points = 0.0, 0, []
    per_step = dense
    for r in records:
        if r.get("kind") == "step":
            steps = int(r["step"]) - last_step
            last_step = int(r["step"])
            per_step = float(r.get("bytes_sent", dense if dense is not None else float("nan")))
            sent += per_step * steps
        elif r.get("kind") == "eval" and "top1" in r:
            steps = int(r["step"]) - last_step
            last_step = int(r["step"])
            sent += (per_step if per_step is not None else float("nan")) * steps
            points.append((sent, float(r["top1"])))
    return points


def collect(paths: Sequence[str | Path], dense: float | None) -> dict[str, list[tuple[float, float]]]:  # fmt: skip
    logs = {}
    for p in paths:
        try:
            logs[Path(p)] = read_run_log(p)
        except RunLogError as e:
            raise SystemExit(f"plot_comm.py: {e}") from None
    if dense is None:  # the dense size from any log that recorded it
        dense = next(
            (float(r["grad_bytes"]) for rs in logs.values() for r in rs if "grad_bytes" in r),
            None,
        )
    out = {}
    for path, records in logs.items():
        points = curve(records, dense)
        if not points:
            raise SystemExit(f"plot_comm.py: {path} has no eval record with top1")
        out[label(path, records[0])] = points
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Held-out accuracy against bytes sent per worker.")
    p.add_argument("logs", nargs="+")
    p.add_argument("-o", "--output", default="communication.png")
    p.add_argument("--dense-bytes", type=float, default=None, help="per-step bytes of old logs")
    args = p.parse_args(argv)
    runs = collect(args.logs, args.dense_bytes)

    print(f"{'mode':<18}{'top1':>8}{'MiB sent/worker':>18}")
    for name, points in sorted(runs.items(), key=lambda kv: kv[1][-1][0]):
        print(f"{name:<18}{points[-1][1]:>8.4f}{points[-1][0] / 2**20:>18.1f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in runs.items():
        xs = [b / 2**30 for b, _ in points]
        left.plot(xs, [t for _, t in points], marker=".", label=name)
        right.scatter([xs[-1]], [points[-1][1]])
        right.annotate(name, (xs[-1], points[-1][1]), fontsize="small")
    left.set_xscale("log")
    left.set_xlabel("GiB sent per worker")
    left.set_ylabel("held-out top-1")
    left.set_title("top-1 at each epoch")
    left.grid(True, alpha=0.3)
    left.legend(fontsize="small")
    right.set_xscale("log")
    right.set_xlabel("GiB sent per worker (whole run)")
    right.set_title("final top-1")
    right.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.output, dpi=100)
    plt.close(fig)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
