"""Held-out pretraining curves of several recipes over their seeds, against samples seen.

Usage::

    python scripts/plot_pretraining.py bert_pretrain_small_adamw_b32 \
        bert_pretrain_small_lans_b256 ... -o docs/pretraining_large_batch.png \
        --reach bert_pretrain_small_lamb_b256

Reads every ``logs/<recipe>/seed*.jsonl`` of ``scripts/pretrain_bert.py`` (phase 1's ``eval``
records; samples = optimizer step x the phase's global batch) and draws the held-out masked-LM
and next-sentence accuracy and loss: one line per recipe (the mean over its seeds) and a band
from the lowest to the highest seed. It prints a markdown table of each recipe's final numbers
over its seeds, and with ``--reach R`` the first evaluated step at which each seed of every
recipe reaches the mean final masked-LM accuracy of recipe ``R``. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
METRICS = ("mlm_accuracy", "mlm_loss", "nsp_accuracy", "nsp_loss")


def read_seed(path: Path) -> dict[str, Any]:
    """One seed's phase-1 evaluations: ``{"batch", "steps": [...], metric: [...]}``."""
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    config = records[0]["config"]
    batch = config["phase1_batch_size"] * config["phase1_accumulate"] * records[0]["world_size"]
    evals = [r for r in records if r["kind"] == "eval" and r.get("phase", 1) == 1]
    out: dict[str, Any] = {"batch": batch, "steps": [r["step"] for r in evals]}
    for metric in METRICS:
        out[metric] = [r[metric] for r in evals]
    return out


def read_recipe(name: str, logs: Path) -> list[dict[str, Any]]:
    paths = sorted((logs / name).glob("seed*.jsonl"), key=lambda p: int(p.stem[4:]))
    if not paths:
        raise SystemExit(f"plot_pretraining.py: no {logs / name}/seed*.jsonl")
    seeds = [read_seed(p) for p in paths]
    if len({tuple(s["steps"]) for s in seeds}) != 1:
        raise SystemExit(f"plot_pretraining.py: the seeds of {name} evaluated at different steps")
    return seeds


def first_step_reaching(seed: dict[str, Any], target: float) -> int | None:
    return next(
        (s for s, a in zip(seed["steps"], seed["mlm_accuracy"], strict=True) if a >= target), None
    )


def summary(recipes: dict[str, list[dict[str, Any]]], reach: str | None) -> str:
    lines = [
        "| recipe | global batch | steps | seeds | final MLM accuracy mean ± std | min | max "
        "| final MLM loss mean | final NSP accuracy mean |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, seeds in recipes.items():
        acc = [s["mlm_accuracy"][-1] for s in seeds]
        std = statistics.stdev(acc) if len(acc) > 1 else float("nan")
        lines.append(
            f"| `{name}` | {seeds[0]['batch']} | {seeds[0]['steps'][-1]} | {len(seeds)} "
            f"| {statistics.mean(acc):.4f} ± {std:.4f} | {min(acc):.4f} | {max(acc):.4f} "
            f"| {statistics.mean(s['mlm_loss'][-1] for s in seeds):.3f} "
            f"| {statistics.mean(s['nsp_accuracy'][-1] for s in seeds):.3f} |"
        )
    if reach is not None:
        target = statistics.mean(s["mlm_accuracy"][-1] for s in recipes[reach])
        lines += [
            "",
            f"First evaluated step at which each seed reaches {target:.4f} (the mean final "
            f"MLM accuracy of `{reach}`; - = never):",
            "",
            "| recipe | per seed |",
            "|---|---|",
        ]
        for name, seeds in recipes.items():
            steps = [first_step_reaching(s, target) for s in seeds]
            shown = ", ".join(
                "-" if s is None else f"{s} ({s * seeds[0]['batch']:,} samples)" for s in steps
            )
            lines.append(f"| `{name}` | {shown} |")
    return "\n".join(lines)


def plot(recipes: dict[str, list[dict[str, Any]]], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, metric in zip(axes.flat, METRICS, strict=True):
        for name, seeds in recipes.items():
            samples = [step * seeds[0]["batch"] for step in seeds[0]["steps"]]
            columns = list(zip(*(s[metric] for s in seeds), strict=True))  # (evals, seeds)
            mean = [statistics.mean(c) for c in columns]
            label = f"{name.removeprefix('bert_pretrain_')} ({len(seeds)} seeds)"
            (line,) = ax.plot(samples, mean, label=label)
            ax.fill_between(
                samples, [min(c) for c in columns], [max(c) for c in columns],
                color=line.get_color(), alpha=0.2, linewidth=0,
            )  # fmt: skip
        ax.set_title(f"held-out {metric.replace('_', ' ')}")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("training samples (sequences)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Phase-1 pretraining: mean over seeds, band = lowest to highest seed")
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("recipes", nargs="+", help="names: logs/<name>/seed*.jsonl")
    p.add_argument("-o", "--output", type=Path, default=None, help="the figure (.png)")
    p.add_argument("--logs", type=Path, default=ROOT / "logs")
    p.add_argument("--reach", default=None, help="a recipe whose final accuracy is the target")
    args = p.parse_args(argv)
    if args.reach is not None and args.reach not in args.recipes:
        p.error(f"--reach {args.reach}: not among the recipes")
    recipes = {name: read_recipe(name, args.logs) for name in args.recipes}
    print(summary(recipes, args.reach))
    if args.output is not None:
        plot(recipes, args.output)
        print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
