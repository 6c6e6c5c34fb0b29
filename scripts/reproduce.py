"""Rerun the command recorded in a run log and check that it reproduces the logged numbers.

Usage::

    python scripts/reproduce.py logs/<run>.jsonl [--max-steps N] [--full] [--rtol R --atol A]
                                [--python EXE] [--rerun-log PATH] [--claims logs/claims.json]

Two checks (docs/run_logs.md, "Reproducing a log"): **exact** (default), where this machine
can re-create the log's recorded setting (its header's ``fingerprint``), the rerun's trace
must match the log's; **statistical** (``--full``), the whole recipe is rerun on any machine
and its final metric checked against the recipe's claim in ``logs/claims.json``. The rules
(the contract with the training scripts, what is compared, the default tolerances: rtol 1e-4,
atol 1e-6 at world size 1, rtol 1e-3, atol 1e-5 above; ``--rtol``/``--atol`` override them)
are :mod:`trainers.reproduce`'s, which this script wires to the command line.

Exit status: 0 reproduced (and, with ``--full``, the claim met); 1 a divergence (the first one
is printed with both records and the field), no comparable records, or a missed claim; 2 bad
arguments or an unreadable log; 3 the rerun failed or wrote no log; 4 not comparable (with
``--full``: the claim was met, but the trace could not be compared on this machine).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from trainers.cli import run_main
from trainers.reproduce import (
    COMPARED_CONFIGS,
    COMPARED_KINDS,
    EXIT_NOT_COMPARABLE,
    TIMING_FIELDS,
    LogError,
    ReproduceError,
    _describe,
    _expected,
    _is_number,
    _keyed,
    _last_step,
    build_command,
    check_claim,
    claim_for,
    code_changes,
    compare_logs,
    config_changes,
    default_tolerances,
    native_fingerprint,
    nondeterministic_reason,
    pair_evidence,
    portable_evidence,
    portable_refutation,
    processor_key,
    processor_name,
    processor_trace,
    read_log,
    reproduce_log,
    rerun_env,
    same_processor,
)

# The library's names that callers of this script import from it (its tests; the private
# helpers are those scripts/cross_processor.py used before trainers.cross_processor).
__all__ = [
    "COMPARED_CONFIGS", "COMPARED_KINDS", "EXIT_NOT_COMPARABLE", "TIMING_FIELDS", "LogError",
    "_describe", "_expected", "_is_number", "_keyed", "_last_step", "build_command",
    "check_claim", "claim_for", "code_changes", "compare_logs", "config_changes",
    "default_tolerances", "main", "native_fingerprint", "nondeterministic_reason",
    "pair_evidence", "portable_evidence", "portable_refutation", "processor_key",
    "processor_name", "processor_trace", "read_log", "rerun_env", "same_processor",
]  # fmt: skip

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CLAIMS = REPO_ROOT / "logs" / "claims.json"
CROSS_PROCESSOR = REPO_ROOT / "logs" / "cross_processor.json"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Rerun a run log's command and compare the new log with it.",
        epilog=(
            "Exit status: 0 reproduced, 1 divergence or missed claim, 2 bad input, 3 rerun "
            "failed, 4 not comparable on this machine."
        ),
    )
    parser.add_argument("log", help="the run log (JSON Lines) to reproduce")
    parser.add_argument("--max-steps", type=int, help="stop the rerun after N optimizer steps")
    parser.add_argument(
        "--full",
        action="store_true",
        help="rerun the whole recipe and check its final metric against logs/claims.json",
    )
    parser.add_argument("--claims", default=str(DEFAULT_CLAIMS), help="the claims file (--full)")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: by world size)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default: by world size)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the rerun")
    parser.add_argument("--rerun-log", help="keep the rerun's log here (default: a temp file)")
    args = parser.parse_args(argv)
    if args.max_steps is not None and args.max_steps <= 0:
        parser.error("--max-steps must be positive")
    if args.full and args.max_steps is not None:
        parser.error("--full reruns the whole recipe; leave out --max-steps")
    try:
        return reproduce_log(
            args.log, max_steps=args.max_steps, full=args.full, claims=Path(args.claims),
            rtol=args.rtol, atol=args.atol, python=args.python, rerun_log=args.rerun_log,
            root=REPO_ROOT, cross_processor=CROSS_PROCESSOR,
        )  # fmt: skip
    except ReproduceError as e:
        print(f"reproduce.py: {e}", file=sys.stderr)
        return e.status


if __name__ == "__main__":
    sys.exit(run_main(main))
