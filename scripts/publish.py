"""Publish a recipe: run it for several seeds under the portable CPU pins, record its claim.

Usage::

    # run seeds 0-4 of a recipe into logs/<recipe>/seed<k>.jsonl, then update logs/claims.json
    python scripts/publish.py run digits_resnest14 --seeds 0-4 --metric top1 \
        --source last_eval --minimum 0.97 --description "the README's main job" \
        -- scripts/train_imagenet.py --no-progress
    # the same under torchrun, 2 processes on this machine
    python scripts/publish.py run digits_2proc --nproc-per-node 2 ... -- scripts/train_imagenet.py ...
    # the same seeds on this machine's own kernels (no pins), kept out of logs/ and claims
    python scripts/publish.py run digits_resnest14 --seeds 0-4 --native --out-dir runs/native ...
    # an elastic recipe: 3 nodes, one killed at step 30, one added at step 70 (trainers.elastic_drill)
    python scripts/publish.py run elastic_digits --elastic-drill 3:30:70 --threads 1 ... -- scripts/train_imagenet.py ...
    # a partition drill on the lab network (root): 3 nodes at 1 Gbit/s, node 2's cable pulled
    # at step 10 for 90 s (trainers.elastic_drill --netlab)
    python scripts/publish.py run elastic_cut --partition-drill 3:2:10:90 --threads 1 ... -- scripts/train_imagenet.py ...
    # list a recipe whose logs exist already (e.g. one written before fingerprints: "legacy")
    python scripts/publish.py add old_recipe --logs logs/old_recipe.jsonl \
        --metric f1 --source end --minimum 43 --min-seeds 3 --description "..."
    # a method that fails here: a negative result, with its diagnosis, beside its plain baseline
    python scripts/publish.py run digits_x --seeds 0-2 --metric top1 --minimum 0 \
        --baseline digits_resnest14 --negative "at chance: ..." -- scripts/train_imagenet.py ...
    python scripts/publish.py docs     # regenerate the claims tables and markers from claims.json
    python scripts/publish.py docs --check  # only list the out-of-date tables and markers
    python scripts/publish.py check    # claims.json, the docs tables and markers agree with the logs

Each recipe states its task's trivial level, computed from the data by the training
script's ``trivial_level(records)`` (majority class, best constant masked-LM prediction, the
untrained QA head's F1), and its plain ``--baseline`` recipe; a claim at or below the trivial
level is refused. A method that fails in a setting is published with ``--negative
"DIAGNOSIS"``: a negative result, listed apart in the docs.

Every run is made with ``trainers.logs.PORTABLE_CPU_PINS`` in its environment (ATen's and
oneDNN's ISA at AVX2, MKL's conditional numerical reproducibility at AVX2) and a fixed thread
count (``--threads``, default 2), which its header's fingerprint records; that is what
``scripts/reproduce.py`` re-applies. ``--portable`` runs it in the portable exact mode
(``PORTABLE_EXACT_PINS``), ``--portable-onednn`` in that mode's variant with oneDNN on
(``PORTABLE_ONEDNN_PINS``; docs/run_logs.md). A seed whose run fails leaves no log behind (a log it
was replacing is put back).

Docs tables: a block ``<!-- claims: name1 name2 -->`` ... ``<!-- /claims -->`` in any file
of ``docs/`` (or README.md) is replaced by a table of those recipes (mean +- std over n seeds,
min, claim). Inline markers: ``<!--claim RECIPE FIELD-->TEXT<!--/claim-->`` in their prose
has TEXT set to that field of the recipe, formatted as the tables format it (MARKER_FIELDS:
mean, std, mean±std, min, max, range, n, claim, minimum, trivial, values), so that no number quoted
from ``logs/claims.json`` is written by hand; ``docs --check`` and ``check`` name every
out-of-date marker by file, line, recipe and field.

The work is :mod:`trainers.publish`'s; this script wires it to the command line.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainers.claims import ClaimsError, load_claims
from trainers.cli import run_main, split_command
from trainers.publish import (
    BLOCK,
    MARKER,
    MARKER_FIELDS,
    MARKER_PART,
    SeedFailed,
    _fmt,
    _is_fraction,
    check,
    claim_text,
    doc_files,
    doc_problems,
    markers,
    parse_drill,
    parse_partition_drill,
    parse_seeds,
    recipe_entry,
    render_docs,
    render_markers,
    render_table,
    run_env,
    run_seeds,
    seed_command,
    trivial_of,
    update_claims,
    update_docs,
)

# The library's names that callers of this script (tests, scripts/comm_lab_study.py) import
# from it.
__all__ = [
    "BLOCK", "MARKER", "MARKER_FIELDS", "MARKER_PART", "_fmt", "_is_fraction", "check",
    "claim_text", "doc_files", "doc_problems", "main", "markers", "parse_drill",
    "parse_partition_drill", "parse_seeds", "render_docs", "render_markers", "render_table",
    "run_env", "seed_command", "trivial_of", "update_claims",
]  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parents[1]
CLAIMS = REPO_ROOT / "logs" / "claims.json"
DOCS = REPO_ROOT / "docs"


def _terminate_as_exit(signum: int, _frame: Any) -> None:
    """SIGTERM (a killed job, a scheduler's stop) unwinds like an error, so that a seed's
    partial log is removed and the log it was replacing comes back."""
    raise SystemExit(128 + signum)


def _recipe(logs: Sequence[Path], args: argparse.Namespace) -> dict[str, Any]:
    """The claims entry of ``logs`` declared by ``args`` (run/add)."""
    return recipe_entry(
        logs, claims=args.claims, metric=args.metric, source=args.source,
        documented_minimum=args.minimum, description=args.description,
        min_seeds=args.min_seeds, baseline=args.baseline, diagnosis=args.negative,
        root=REPO_ROOT,
    )  # fmt: skip


def cmd_run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminate_as_exit)
    portable = "onednn" if args.portable_onednn else args.portable
    out_dir = Path(args.out_dir) if args.out_dir else REPO_ROOT / "logs" / args.recipe
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.elastic_drill and args.partition_drill:
        raise SystemExit("--elastic-drill and --partition-drill: give one drill")
    partition = parse_partition_drill(args.partition_drill) if args.partition_drill else None
    drill = parse_drill(args.elastic_drill) if args.elastic_drill else None
    if args.drill_recovery != "restart" and drill is None:
        raise SystemExit("--drill-recovery: only with --elastic-drill")
    env = run_env(args.threads, native=args.native, portable=portable, root=REPO_ROOT)
    try:
        run_seeds(
            args.recipe, args.command, parse_seeds(args.seeds), out_dir, env=env,
            nproc=args.nproc_per_node, threads=args.threads, drill=drill,
            partition_drill=partition, bandwidth=args.drill_bandwidth, root=REPO_ROOT,
            drill_recovery=args.drill_recovery,
        )  # fmt: skip
    except SeedFailed as e:
        print(f"publish.py: {e}", file=sys.stderr)
        return 1
    if args.no_claims or args.native:
        return 0
    logs = sorted(out_dir.glob("seed*.jsonl"), key=lambda p: int(p.stem[4:]))
    entry = _recipe(logs, args)
    update_claims(Path(args.claims), args.recipe, entry)
    spread = "" if entry["std"] is None else f" +- {entry['std']:.4f}"
    bound = "<=" if entry["status"] == "negative" else ">="
    print(
        f"{args.recipe}: {entry['metric']} {entry['mean']:.4f}{spread} over {entry['n']} seeds, "
        f"min {entry['min']:.4f}, trivial level {entry['trivial']['value']:.4f}, "
        f"{entry['status']}, claim {bound} {entry['claim']:.4f} -> {args.claims}"
    )
    return 0


def cmd_add(args: argparse.Namespace) -> int:
    logs = [REPO_ROOT / p if not Path(p).is_absolute() else Path(p) for p in args.logs]
    entry = _recipe(logs, args)
    update_claims(Path(args.claims), args.recipe, entry)
    bound = "<=" if entry["status"] == "negative" else ">="
    print(f"{args.recipe}: {entry['status']}, n={entry['n']}, claim {bound} {entry['claim']:.4f}")
    return 0


def cmd_docs(args: argparse.Namespace) -> int:
    claims = load_claims(args.claims)
    if args.check:
        problems = doc_problems(claims, DOCS, root=REPO_ROOT)
        for line in problems:
            print(line, file=sys.stderr)
        print("docs: ok" if not problems else f"docs: {len(problems)} problem(s)")
        return 1 if problems else 0
    for shown in update_docs(claims, DOCS, root=REPO_ROOT):
        print(f"updated {shown}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    problems = check(Path(args.claims), DOCS, root=REPO_ROOT)
    for line in problems:
        print(line, file=sys.stderr)
    print("claims: ok" if not problems else f"claims: {len(problems)} problem(s)")
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    argv, command = split_command(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description="Publish recipes over seeds and their claims.")
    p.add_argument("--claims", default=str(CLAIMS), help="the claims file")
    sub = p.add_subparsers(dest="action", required=True)
    r = sub.add_parser("run", help="run seeds of a recipe; then update the claims file")
    r.add_argument("recipe", help="the recipe's name: logs/<recipe>/seed<k>.jsonl")
    r.add_argument("--seeds", default="0-4", help="e.g. 0-4 or 0,1,2")
    r.add_argument("--metric", required=True, help="e.g. top1, best_test_acc, f1")
    r.add_argument("--source", choices=("end", "last_eval"), default="last_eval")
    r.add_argument("--minimum", type=float, required=True, help="the documented minimum")
    r.add_argument("--description", required=True, help="a few words for the docs table")
    r.add_argument("--min-seeds", type=int, default=5, help="seeds the recipe must publish")
    r.add_argument("--nproc-per-node", type=int, default=1, help="processes (torchrun) per run")
    r.add_argument("--threads", type=int, default=2, help="torch CPU threads per process")
    r.add_argument("--elastic-drill", default=None, metavar="NODES:KILL:JOIN",
                   help="run each seed under trainers.elastic_drill: NODES agents, one killed at "
                   "step KILL, one added at step JOIN")  # fmt: skip
    r.add_argument("--partition-drill", default=None, metavar="NODES:NODE:STEP:SECONDS",
                   help="run each seed under trainers.elastic_drill --netlab (root): NODES lab "
                   "nodes, NODE's cable pulled at step STEP for SECONDS")  # fmt: skip
    r.add_argument("--drill-recovery", choices=("restart", "inproc"), default="restart",
                   help="--elastic-drill: torchrun restarts the workers (restart), or the "
                   "survivors recover in their processes (inproc: trainers.elastic inproc)")  # fmt: skip
    r.add_argument("--drill-bandwidth", default="1gbit",
                   help="--partition-drill: every lab node's link cap")  # fmt: skip
    # one environment: --native (no pins), --portable or --portable-onednn (argparse: exit 2)
    pins = r.add_mutually_exclusive_group()
    pins.add_argument("--native", action="store_true",
                      help="no ISA pins (a check, not a publication)")  # fmt: skip
    pins.add_argument(
        "--portable",
        action="store_true",
        help="the portable exact mode (trainers.logs.PORTABLE_EXACT_PINS: oneDNN off, MKL's "
        "COMPATIBLE branch, correctly rounded sqrt; docs/run_logs.md): a trace meant to "
        "re-create on other x86-64 processor models, once scripts/cross_processor.py has "
        "verified it",
    )
    pins.add_argument(
        "--portable-onednn",
        action="store_true",
        help="the portable exact mode with oneDNN kept on at AVX2 "
        "(trainers.logs.PORTABLE_ONEDNN_PINS), for convolution recipes: ATen's own "
        "convolutions cost 7x; holds where scripts/cross_processor.py verifies it",
    )
    r.add_argument("--out-dir", default=None, help="default logs/<recipe>")
    r.add_argument("--no-claims", action="store_true", help="do not update the claims file")
    a = sub.add_parser("add", help="list a recipe whose logs already exist")
    a.add_argument("recipe")
    a.add_argument("--logs", nargs="+", required=True, help="its run logs, one per seed")
    for parser in (a,):
        parser.add_argument("--metric", required=True)
        parser.add_argument("--source", choices=("end", "last_eval"), default="last_eval")
        parser.add_argument("--minimum", type=float, required=True)
        parser.add_argument("--description", required=True)
        parser.add_argument("--min-seeds", type=int, default=5)
    for parser in (r, a):
        parser.add_argument(
            "--baseline",
            default=None,
            metavar="RECIPE",
            help="the plain recipe of the same task (none: this one is plain)",
        )
        parser.add_argument(
            "--negative",
            default=None,
            metavar="DIAGNOSIS",
            help="publish a failure as a negative result, saying why it fails",
        )
    d = sub.add_parser(
        "docs", help="regenerate the claims tables and inline claim markers in docs/ and README.md"
    )
    d.add_argument("--check", action="store_true",
                   help="change nothing; list every out-of-date table or marker (exit 1)")  # fmt: skip
    sub.add_parser("check", help="claims file, docs tables and markers agree with the logs")
    args = p.parse_args(argv)
    args.command = command
    try:
        return {"run": cmd_run, "add": cmd_add, "docs": cmd_docs, "check": cmd_check}[args.action](
            args
        )
    except ClaimsError as e:
        print(f"publish.py: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(run_main(main))
