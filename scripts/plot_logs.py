"""Plot the curves of one or more run logs against the global optimizer step.

Usage::

    python scripts/plot_logs.py logs/a.jsonl [logs/b.jsonl ...] -o curves.png

One subplot per quantity, one line per log (labelled with the file's stem). Quantities are
every numeric field of the ``step`` records (``train loss``, ``train accuracy``,
``train lr``, ``train samples_per_sec``, ...) and of the ``eval`` records (``eval top1``,
``eval loss``, ...), except the bookkeeping fields ``epoch``, ``batch`` and ``step``.
``epoch`` records are not drawn: their numbers are the averages of the step records
already shown. Needs matplotlib (``pip install matplotlib``; part of the test/dev extras).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainers.logs import RunLogError, read_run_log

PLOTTED_KINDS = {"step": "train", "eval": "eval"}
SKIPPED_FIELDS = frozenset({"epoch", "batch", "step"})

Series = dict[str, tuple[list[float], list[float]]]


class LogError(Exception):
    """A run log that cannot be read or has nothing to plot."""


def read_log(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON Lines run log whose first record is the header (see trainers.logs)."""
    try:
        return read_run_log(path)
    except RunLogError as e:
        raise LogError(str(e)) from e


def collect_series(records: Sequence[dict[str, Any]]) -> Series:
    """``{"<train|eval> <field>": (steps, values)}`` from a log's step and eval records."""
    series: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for record in records:
        prefix = PLOTTED_KINDS.get(record.get("kind", ""))
        step = record.get("step")
        if prefix is None or not isinstance(step, (int, float)):
            continue
        for name, value in record.items():
            if name in SKIPPED_FIELDS or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                xs, ys = series[f"{prefix} {name}"]
                xs.append(float(step))
                ys.append(float(value))
    return dict(series)


def plot_logs(paths: Sequence[str | Path], output: str | Path) -> list[str]:
    """Draw the curves of ``paths`` into the image file ``output``.

    Returns:
        The plotted quantities, in subplot order.

    Raises:
        LogError: a log is unreadable, or no log has a step/eval record with a number.
    """
    try:
        import matplotlib
    except ImportError as e:
        raise LogError("plot_logs.py needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logs = {Path(p).stem: collect_series(read_log(p)) for p in paths}
    quantities: list[str] = []
    for series in logs.values():
        quantities += [q for q in series if q not in quantities]
    # Training curves first, then evaluation, each in first-seen field order.
    quantities.sort(key=lambda q: not q.startswith("train "))
    if not quantities:
        raise LogError(f"nothing to plot: no step or eval record with numbers in {list(paths)}")

    ncols = min(3, len(quantities))
    nrows = math.ceil(len(quantities) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.5 * nrows), squeeze=False)
    for ax, quantity in zip(axes.flat, quantities, strict=False):
        for label, series in logs.items():
            if quantity in series:
                xs, ys = series[quantity]
                ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=label)
        ax.set_title(quantity)
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    for ax in axes.flat[len(quantities) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return quantities


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Plot run-log curves against the step.")
    parser.add_argument("logs", nargs="+", help="run logs (JSON Lines)")
    parser.add_argument(
        "-o", "--output", default="curves.png", help="image file (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        quantities = plot_logs(args.logs, args.output)
    except LogError as e:
        print(f"plot_logs.py: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {', '.join(quantities)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
