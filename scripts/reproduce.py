"""Rerun the command recorded in a run log and check that it reproduces the logged numbers.

Usage::

    python scripts/reproduce.py logs/<run>.jsonl [--max-steps N] [--rtol R --atol A]
                                [--python EXE] [--rerun-log PATH]

Contract with the training scripts (every ``scripts/*.py`` that writes a run log):

* the header's ``command`` is ``sys.argv``: the script path relative to the repository
  root, then its arguments; the rerun runs from the repository root, with the root on
  ``PYTHONPATH``;
* the script accepts ``--run-log PATH`` (where to write the JSON Lines log) and
  ``--max-steps N`` (stop after N optimizer steps). The rerun gets ``--run-log`` pointed at a
  temporary file and, when ``--max-steps`` is given here, ``--max-steps N`` (both replace the
  recorded values);
* ``epoch`` records carry ``step`` (the global step at the end of the epoch), so that an
  epoch cut short by ``--max-steps`` is not compared with the full one. Without it, the
  last ``epoch`` record of a shortened rerun is skipped.

When the header's ``world_size`` W is above 1 the rerun is launched as
``EXE -m torch.distributed.run --standalone --nproc-per-node W script args`` (one node).
Elastic runs whose membership changed cannot be reproduced this way.

Comparison: records of kind ``step``, ``epoch`` and ``eval`` present in both logs, matched
by ``(kind, epoch, step)`` (and their order among equal keys), in the original's order.
Every numeric field both records share is compared, except the timing fields
``samples_per_sec``, ``time_cost``, ``total_time`` and ``time``: ``|new - orig| <= atol +
rtol * |orig|`` (NaN matches NaN; booleans must be equal). Default tolerances: rtol 1e-4,
atol 1e-6 when world_size is 1 (same code, same seed, same machine: only floating-point
noise from threading); rtol 1e-3, atol 1e-5 when it is above 1 (reduction order across
processes). Override them with ``--rtol``/``--atol``.

Exit status: 0 reproduced; 1 a divergence (the first one is printed with both records and
the field) or no comparable records; 2 bad arguments or an unreadable log; 3 the rerun
failed or wrote no log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from trainers.logs import RunLogError, read_run_log  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
COMPARED_KINDS = ("step", "epoch", "eval")
TIMING_FIELDS = frozenset({"samples_per_sec", "time_cost", "total_time", "time"})
SINGLE_PROCESS_TOLERANCES = (1e-4, 1e-6)  # (rtol, atol) when world_size is 1
MULTI_PROCESS_TOLERANCES = (1e-3, 1e-5)  # when world_size is above 1

Record = dict[str, Any]
Key = tuple[str, Any, Any, int]


LogError = RunLogError  # the name the rest of this script (and its tests) use
read_log = read_run_log


def default_tolerances(world_size: int) -> tuple[float, float]:
    """``(rtol, atol)`` used when none are given, by world size (see the module docstring)."""
    return SINGLE_PROCESS_TOLERANCES if world_size <= 1 else MULTI_PROCESS_TOLERANCES


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _close(new: float, orig: float, rtol: float, atol: float) -> bool:
    if math.isnan(orig) or math.isnan(new):
        return math.isnan(orig) and math.isnan(new)
    if math.isinf(orig) or math.isinf(new):
        return new == orig
    return abs(new - orig) <= atol + rtol * abs(orig)


def _keyed(records: Iterable[Record]) -> dict[Key, Record]:
    """Comparable records by ``(kind, epoch, step, occurrence)``, in log order."""
    seen: Counter[tuple[str, Any, Any]] = Counter()
    keyed = {}
    for record in records:
        if record.get("kind") not in COMPARED_KINDS:
            continue
        base = (record["kind"], record.get("epoch"), record.get("step"))
        keyed[(*base, seen[base])] = record
        seen[base] += 1
    return keyed


def _describe(key: Key) -> str:
    kind, epoch, step, occurrence = key
    text = f"{kind} epoch={epoch} step={step}"
    return text + (f" (#{occurrence + 1})" if occurrence else "")


def _truncated(original: Sequence[Record], new: Sequence[Record]) -> bool:
    """Whether the rerun stopped before the original did (by the last step reached)."""

    def last_step(records: Sequence[Record]) -> float:
        steps = [r["step"] for r in records if _is_number(r.get("step"))]
        steps += [
            r["steps"] for r in records if r.get("kind") == "end" and _is_number(r.get("steps"))
        ]
        return max(steps, default=0)

    return last_step(new) < last_step(original)


def compare_logs(
    original_records: Sequence[Record],
    new_records: Sequence[Record],
    rtol: float = 1e-4,
    atol: float = 1e-6,
    *,
    report: Callable[[str], None] | None = None,
) -> tuple[bool, str]:
    """Compare a rerun's records with the original's (rules in the module docstring).

    Args:
        original_records: the published log's records (header and end are ignored).
        new_records: the rerun's records.
        rtol: relative tolerance.
        atol: absolute tolerance.
        report: called with one line per compared record (e.g. ``print``).

    Returns:
        ``(ok, message)``: ``ok`` is False at the first field out of tolerance (the message
        names the record and field and shows both records) or when no record is in both logs.
    """
    original = _keyed(original_records)
    new = _keyed(new_records)
    if _truncated(original_records, new_records):
        # An epoch record without a step cannot be told apart from one for an epoch that
        # --max-steps cut short: drop the rerun's last one.
        epochless = [k for k in new if k[0] == "epoch" and k[2] is None]
        if epochless:
            del new[epochless[-1]]
    shared = [k for k in original if k in new]
    if not shared:
        return False, (
            f"no comparable records: the original has {len(original)} and the rerun "
            f"{len(new)} step/epoch/eval records, none with the same (kind, epoch, step)"
        )
    for key in shared:
        orig, rerun = original[key], new[key]
        fields = [
            f
            for f in orig
            if f not in TIMING_FIELDS
            and f in rerun
            and (_is_number(orig[f]) or isinstance(orig[f], bool))
        ]
        for f in fields:
            a, b = orig[f], rerun[f]
            if isinstance(a, bool) or isinstance(b, bool) or not _is_number(b):
                same = a == b
            else:
                same = _close(float(b), float(a), rtol, atol)
            if not same:
                return False, (
                    f"first divergence at {_describe(key)}, field {f!r}: original {a!r}, "
                    f"rerun {b!r} (rtol={rtol:g}, atol={atol:g})\n"
                    f"  original: {json.dumps(orig, sort_keys=True)}\n"
                    f"  rerun:    {json.dumps(rerun, sort_keys=True)}"
                )
        if report is not None:
            shown = " ".join(f"{f}={rerun[f]!r}" for f in fields if f not in ("epoch", "step"))
            report(f"ok  {_describe(key)}  {shown}")
    return True, f"reproduced: {len(shared)} records match (rtol={rtol:g}, atol={atol:g})"


def _set_flag(args: list[str], flag: str, value: str) -> list[str]:
    """``args`` with every ``flag V`` / ``flag=V`` removed and ``flag value`` appended."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return [*out, flag, value]


def build_command(
    header: Record, run_log: str, *, max_steps: int | None = None, python: str = sys.executable
) -> list[str]:
    """The rerun's argv for a log header (see the module docstring)."""
    command = header.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise LogError(
            f"the header's 'command' must be a non-empty list of strings, got {command!r}"
        )
    script = str(REPO_ROOT / command[0])
    args = _set_flag(list(command[1:]), "--run-log", run_log)
    if any(a == "--elastic-dir" or a.startswith("--elastic-dir=") for a in args):
        # an elastic run's state directory must start empty
        args = _set_flag(args, "--elastic-dir", str(Path(run_log).parent / "elastic"))
    if max_steps is not None:
        args = _set_flag(args, "--max-steps", str(max_steps))
    world_size = int(header.get("world_size") or 1)
    if world_size > 1:
        launcher = [
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world_size),
        ]
        return [python, *launcher, script, *args]
    return [python, script, *args]


def rerun_env(header: Record, base: dict[str, str] | None = None) -> dict[str, str]:
    """The rerun's environment: this repository importable, and the original's CPU thread
    count (``header["threads"]``, when the log has it), so reductions sum in the same order."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    if header.get("threads"):
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(int(header["threads"]))
    return env


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Rerun a run log's command and compare the new log with it.",
        epilog="Exit status: 0 reproduced, 1 divergence, 2 bad input, 3 rerun failed.",
    )
    parser.add_argument("log", help="the run log (JSON Lines) to reproduce")
    parser.add_argument("--max-steps", type=int, help="stop the rerun after N optimizer steps")
    parser.add_argument("--rtol", type=float, help="relative tolerance (default: by world size)")
    parser.add_argument("--atol", type=float, help="absolute tolerance (default: by world size)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for the rerun")
    parser.add_argument("--rerun-log", help="keep the rerun's log here (default: a temp file)")
    args = parser.parse_args(argv)
    if args.max_steps is not None and args.max_steps <= 0:
        parser.error("--max-steps must be positive")

    try:
        original = read_log(args.log)
    except LogError as e:
        print(f"reproduce.py: error: {e}", file=sys.stderr)
        return 2
    header = original[0]
    world_size = int(header.get("world_size") or 1)
    rtol, atol = default_tolerances(world_size)
    rtol = rtol if args.rtol is None else args.rtol
    atol = atol if args.atol is None else args.atol

    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        run_log = args.rerun_log or os.path.join(tmp, "rerun.jsonl")
        if os.path.exists(run_log):
            os.remove(run_log)  # a stale log must not pass for the rerun's
        try:
            command = build_command(header, run_log, max_steps=args.max_steps, python=args.python)
        except LogError as e:
            print(f"reproduce.py: error: {args.log}: {e}", file=sys.stderr)
            return 2
        print("rerunning:", " ".join(command), flush=True)
        result = subprocess.run(command, cwd=REPO_ROOT, env=rerun_env(header), check=False)
        if result.returncode != 0:
            print(
                f"reproduce.py: the rerun failed with exit status {result.returncode}",
                file=sys.stderr,
            )
            return 3
        try:
            new = read_log(run_log)
        except LogError as e:
            print(f"reproduce.py: the rerun wrote no usable log: {e}", file=sys.stderr)
            return 3

    ok, message = compare_logs(original, new, rtol, atol, report=print)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
