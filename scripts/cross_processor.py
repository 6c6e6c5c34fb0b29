"""Evidence across processors: rerun a prefix of published logs made on another processor model.

``scripts/reproduce.py`` re-creates a log exactly only on the processor model that made it
(``trainers.fingerprint.not_comparable_reason``). This script measures how far that rule is
needed: for each log whose processor (vendor, family, model) differs from this machine's, it
reruns the first ``--steps`` optimizer steps with the log's recorded threads and ISA pins
(and its portable mode, where the log was made in it: ``scripts/publish.py --portable``) and
compares every logged number of every step/epoch/eval record with the original, bit for bit.
Each (log, publisher processor, rerun processor) pair goes into ``logs/cross_processor.json``
(one entry per pair, replaced when measured again), and the table between
``<!-- cross-processor -->`` and ``<!-- /cross-processor -->`` in ``docs/run_logs.md`` is
regenerated from that file::

    python scripts/cross_processor.py                      # one log of each family
    python scripts/cross_processor.py logs/karate_gcn/seed0.jsonl --steps 20
    python scripts/cross_processor.py --portable-logs --steps 100000  # the portable mode's logs
    python scripts/cross_processor.py --table              # only regenerate the docs table
    python scripts/cross_processor.py --optrace --steps 1  # operator traces, logs/optrace/
    python -m trainers.optrace compare logs/optrace/A.json.gz logs/optrace/B.json.gz
    python scripts/cross_processor.py --optrace --steps 1 --at COMMIT LOG  # that commit's code
    python scripts/cross_processor.py --add-trace logs/digits_resnest14/seed0.jsonl

A log made on this processor model is skipped (say so): there is nothing to learn from it
here. Timing fields are not compared. The work is :mod:`trainers.cross_processor`'s; this
script wires it to the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainers.cli import run_main
from trainers.cross_processor import (
    END,
    FAMILIES,
    START,
    add_trace,
    difference,
    load_results,
    measure,
    merge,
    pair_entry,
    parse_pins,
    portable_logs,
    portable_tag,
    processor,
    record_trace,
    same_processor,
    save_pair,
    table,
    trace_path,
    write_table,
)
from trainers.errors import UsageError
from trainers.reproduce import read_log

# The library's names that callers of this script (its tests) import from it.
__all__ = [
    "END", "FAMILIES", "START", "add_trace", "difference", "load_results", "main", "measure",
    "merge", "pair_entry", "parse_pins", "portable_logs", "portable_tag", "processor",
    "record_trace", "same_processor", "save_pair", "table", "trace_path", "write_table",
]  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "logs" / "cross_processor.json"
DOC = REPO_ROOT / "docs" / "run_logs.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="*", help="run logs (default: one of each family)")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps to rerun (default 10)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the reruns")
    p.add_argument("--table", action="store_true", help="only regenerate the docs table")
    p.add_argument("--portable-logs", action="store_true",
                   help="add seed 0 of every recipe published in the portable exact mode "
                   "(logs/claims.json) to the logs; with --steps 100000, the reruns that "
                   "verify or refute the mode on this processor")  # fmt: skip
    p.add_argument("--optrace", action="store_true",
                   help="instead record each log's operator trace (trainers.optrace) of "
                   "--steps steps into logs/optrace/; compare two machines' traces with "
                   "python -m trainers.optrace compare A B")  # fmt: skip
    p.add_argument("--portable", action="store_true",
                   help="with --optrace: record in the portable exact mode "
                   "(trainers.logs.PORTABLE_EXACT_PINS) instead of the log's pins")  # fmt: skip
    p.add_argument("--pins", default=None, metavar="NAME=VALUE,...",
                   help="with --optrace: override these ISA pins (an empty value unsets one), "
                   "e.g. MODELZOO_PORTABLE= to trace the portable mode with oneDNN on; the "
                   "trace's file name carries them")  # fmt: skip
    p.add_argument("--at", default=None, metavar="COMMIT",
                   help="with --optrace: run the code of this commit (git archive into a "
                   "temporary directory), e.g. the commit in the header of another machine's "
                   "trace, so that the two traces compare; the file name ends in "
                   ".at-<commit>")  # fmt: skip
    p.add_argument("--add-trace", action="store_true",
                   help="instead rerun each whole log here and publish it as this processor "
                   "model's trace of the run (scripts/reproduce.py compares with it here)")  # fmt: skip
    args = p.parse_args(argv)
    if args.table and (args.logs or args.portable_logs):
        p.error("--table only regenerates the docs table: it reruns no log")
    logs = [Path(x) for x in args.logs]
    if args.portable_logs:
        logs += portable_logs(root=REPO_ROOT)
    once: dict[Path, Path] = {}
    for log in logs:  # each log once, where it first appears
        once.setdefault(log.resolve(), log)
    logs = list(once.values())
    if args.add_trace:
        if not logs:
            p.error("--add-trace: name the logs")
        for log in logs:
            if not log.is_file():
                raise UsageError(f"{log}: no such run log")
            add_trace(log, args.python, root=REPO_ROOT, results=RESULTS, doc=DOC)
        return 0
    if (args.portable or args.pins is not None or args.at) and not args.optrace:
        p.error("--portable, --pins and --at go with --optrace (a log's own pins decide a "
                "rerun's mode)")  # fmt: skip
    pins = parse_pins(args.pins, p.error) if args.pins is not None else None
    if args.steps < 1:
        p.error(f"--steps {args.steps}: must be >= 1")
    if args.optrace:
        for log in logs or [Path(x) for x in FAMILIES.values()]:
            if not log.is_file():
                raise UsageError(f"{log}: no such run log")
            world_size = read_log(str(log))[0].get("world_size", 1)
            if world_size > 1:
                print(f"{log}: {world_size} processes; "
                      "an operator trace records one: skipped")  # fmt: skip
                continue
            record_trace(log, args.steps, args.python, portable=args.portable, pins=pins,
                         root=REPO_ROOT, at=args.at)  # fmt: skip
        return 0
    pairs = load_results(RESULTS)
    if not args.table:
        logs = logs or [Path(x) for x in FAMILIES.values()]
        for log in logs:
            if not log.is_file():
                raise UsageError(f"{log}: no such run log")
        for log in logs:
            entry = measure(log, args.steps, args.python, root=REPO_ROOT)
            if entry is None:
                continue
            print(f"  {entry['records_identical']}/{entry['records_compared']} records identical;"
                  f" first difference: {entry['first_difference'] or 'none'}; max rel diff "
                  f"{entry['max_rel_diff']:.3g}", flush=True)  # fmt: skip
            pairs = save_pair(entry, RESULTS)
    write_table(pairs, DOC)
    print(table(pairs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
