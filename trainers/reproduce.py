"""Re-creating a run log: rerun the command its header records and compare the new log with it.

``scripts/reproduce.py`` is the command line (flags, exit codes); this module is what it
does, with the repository root, the claims file and the cross-processor results as
parameters (defaults: this checkout's). Two checks (docs/run_logs.md, "Reproducing a log"):

* **exact** (default): where this machine can re-create the log's recorded setting (its
  header's ``fingerprint``: architecture, processor, device, ISA pins, threads), the rerun
  gets the recorded thread count and ISA pins (``ATEN_CPU_CAPABILITY``, ``ONEDNN_MAX_CPU_ISA``,
  ``MKL_CBWR``; on CUDA deterministic algorithms) and its trace must match the log's. Where
  it cannot, :func:`reproduce_log` prints ``not comparable: <reason>`` and returns 4 without
  rerunning. Runs whose combiner is nondeterministic by design (asynchronous AD-PSGD,
  recorded in the header's ``configs``) are never comparable exactly.
* **statistical** (``full``): reruns the whole recipe on any machine and checks the final
  metric against the recipe's claim in ``logs/claims.json`` (not below max(documented
  minimum, mean - 3 std) of its published seeds, and above the task's trivial level whatever
  the band; a negative result's rerun must stay at or below its bound: the failure
  reproduces). On a comparable machine the whole trace is
  compared exactly as well.

Contract with the training scripts (every ``scripts/*.py`` that writes a run log):

* the header's ``command`` is ``sys.argv``: the script path relative to the repository
  root, then its arguments; the rerun runs from the repository root, with the root on
  ``PYTHONPATH``;
* the script accepts ``--run-log PATH`` (where to write the JSON Lines log) and
  ``--max-steps N`` (stop after N optimizer steps). The rerun gets ``--run-log`` pointed at a
  temporary file and, when ``max_steps`` is given, ``--max-steps N`` (both replace the
  recorded values);
* ``epoch`` records carry ``step`` (the global step at the end of the epoch), so that an
  epoch cut short by ``--max-steps`` is not compared with the full one. Without it, the
  last ``epoch`` record of a shortened rerun is skipped.

When the header's ``world_size`` W is above 1 the rerun is launched as
``EXE -m torch.distributed.run --standalone --nproc-per-node W script args`` (one node;
an elastic log's through ``-m trainers.elastic torchrun``, which its workers require).
An elastic run whose worker group changed (a ``membership`` record) is compared up to that
change: its first S steps (S the record's ``step``, where the new group resumed), rerun at
the starting world size; ``max_steps`` beyond S is cut to S.

Comparison: every ``step``, ``epoch`` and ``eval`` record of the original up to the step the
rerun reached (all of them, and the ``end`` record, for a full rerun) must be in the rerun,
matched by ``(kind, epoch, step)`` (and their order among equal keys), with every numeric or
boolean field the original has, except the timing fields ``samples_per_sec``, ``time_cost``,
``total_time`` and ``time``: ``|new - orig| <= atol + rtol * |orig|`` (NaN matches NaN;
booleans must be equal). A missing record or field is a divergence. Default tolerances: rtol
1e-4, atol 1e-6 when world_size is 1; rtol 1e-3, atol 1e-5 when it is above 1 (reduction
order across processes).

When the script or the packages changed since the log's git commit, the rerun says so (a
divergence may then be a change of code, not of machine).

Outcome (:func:`reproduce_log`'s status, the script's exit status): 0 reproduced (and, with
``full``, the claim met); 1 a divergence (the first one is printed with both records and the
field), no comparable records, or a missed claim; 2 bad arguments or an unreadable log; 3 the
rerun failed or wrote no log; 4 not comparable (with ``full``: the claim was met, but the
trace could not be compared on this machine). Statuses 1-3 that come with a message of their
own are raised as :class:`ReproduceError`.
"""

from __future__ import annotations

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

from trainers.claims import (
    ClaimsError,
    at_trivial_level,
    claim_met,
    find_recipe,
    load_claims,
    metric_of,
)
from trainers.comm import combiner_class
from trainers.logs import (
    ISA_PIN_VARIABLES,
    PORTABLE_MODE_VERSIONS,
    RunLogError,
    machine_fingerprint,
    not_comparable_reason,
    read_run_log,
)

#: The checkout holding this package: the default root of every function taking ``root``.
REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CLAIMS = REPO_ROOT / "logs" / "claims.json"
COMPARED_KINDS = ("step", "epoch", "eval")
TIMING_FIELDS = frozenset({"samples_per_sec", "time_cost", "total_time", "time"})
SINGLE_PROCESS_TOLERANCES = (1e-4, 1e-6)  # (rtol, atol) when world_size is 1
MULTI_PROCESS_TOLERANCES = (1e-3, 1e-5)  # when world_size is above 1
EXIT_NOT_COMPARABLE = 4
# What a rerun's code depends on besides its script: a change here since the log's commit is
# reported (a divergence may then be the code's, not the machine's).
CODE_PATHS = ("modelzoo", "trainers", "setup.py")

Record = dict[str, Any]
Key = tuple[str, Any, Any, int]


LogError = RunLogError  # the name the rest of this module (and its tests) use
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


def _keyed(records: Iterable[Record], kinds: Sequence[str] = COMPARED_KINDS) -> dict[Key, Record]:
    """Comparable records by ``(kind, epoch, step, occurrence)``, in log order."""
    seen: Counter[tuple[str, Any, Any]] = Counter()
    keyed = {}
    for record in records:
        if record.get("kind") not in kinds:
            continue
        base = (record["kind"], record.get("epoch"), record.get("step"))
        keyed[(*base, seen[base])] = record
        seen[base] += 1
    return keyed


def _describe(key: Key) -> str:
    kind, epoch, step, occurrence = key
    text = f"{kind} epoch={epoch} step={step}"
    return text + (f" (#{occurrence + 1})" if occurrence else "")


def _last_step(records: Sequence[Record]) -> float:
    steps = [r["step"] for r in records if _is_number(r.get("step"))]
    steps += [r["steps"] for r in records if r.get("kind") == "end" and _is_number(r.get("steps"))]
    return max(steps, default=0)


def _expected(key: Key, record: Record, last: float, truncated: bool) -> bool:
    """Whether a rerun that reached step ``last`` must have the original's ``record``."""
    if not truncated:
        return True
    step = record.get("step")
    if not _is_number(step):
        return False  # an epoch record without a step: cannot tell whether it was cut short
    # at the step where the rerun stopped, its epoch/eval records describe a cut-short epoch
    return step < last or (step == last and key[0] == "step")


def _divergence(key: Key, what: str, orig: Record, rerun: Record | None = None) -> str:
    """The message for the first divergence: where, what, and both records."""
    text = f"first divergence at {_describe(key)}{what}\n  original: {json.dumps(orig, sort_keys=True)}"
    if rerun is not None:
        text += f"\n  rerun:    {json.dumps(rerun, sort_keys=True)}"
    return text


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
        original_records: the published log's records (the header is ignored).
        new_records: the rerun's records.
        rtol: relative tolerance.
        atol: absolute tolerance.
        report: called with one line per compared record (e.g. ``print``).

    Returns:
        ``(ok, message)``: ``ok`` is False at the first field out of tolerance, at the first
        record or field of the original that the rerun lacks (the message names the record
        and field and shows both records), or when no record is in both logs.
    """
    last = _last_step(new_records)
    truncated = last < _last_step(original_records)
    kinds = COMPARED_KINDS if truncated else (*COMPARED_KINDS, "end")
    original = _keyed(original_records, kinds)
    new = _keyed(new_records, kinds)
    if truncated:
        # An epoch record without a step cannot be told apart from one for an epoch that
        # --max-steps cut short: drop the rerun's last one.
        epochless = [k for k in new if k[0] == "epoch" and k[2] is None]
        if epochless:
            del new[epochless[-1]]
    expected = [k for k, r in original.items() if _expected(k, r, last, truncated)]
    if not any(k in new for k in expected):
        return False, (
            f"no comparable records: the original has {len(original)} and the rerun "
            f"{len(new)} step/epoch/eval records, none with the same (kind, epoch, step)"
        )
    compared = 0
    for key in expected:
        orig = original[key]
        if key not in new:
            return False, _divergence(
                key, f": the rerun has no such record (it reached step {last:g})", orig
            )
        rerun = new[key]
        fields = [
            f
            for f in orig
            if f not in TIMING_FIELDS
            and f != "kind"
            and (_is_number(orig[f]) or isinstance(orig[f], bool))
        ]
        for f in fields:
            a = orig[f]
            if f not in rerun:
                return False, _divergence(
                    key, f", field {f!r}: the rerun's record lacks it", orig, rerun
                )
            b = rerun[f]
            if isinstance(a, bool) or isinstance(b, bool) or not _is_number(b):
                same = a == b
            else:
                same = _close(float(b), float(a), rtol, atol)
            if not same:
                what = f", field {f!r}: original {a!r}, rerun {b!r} (rtol={rtol:g}, atol={atol:g})"
                return False, _divergence(key, what, orig, rerun)
        compared += 1
        if report is not None:
            shown = " ".join(f"{f}={rerun[f]!r}" for f in fields if f not in ("epoch", "step"))
            report(f"ok  {_describe(key)}  {shown}")
    return True, f"reproduced: {compared} records match (rtol={rtol:g}, atol={atol:g})"


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


def nondeterministic_reason(header: dict[str, Any]) -> str | None:
    """Why the run cannot be rerun exactly on any machine (an asynchronous combiner), or None.

    Reads the header's ``configs.combiner`` (mode and options); logs without it (written
    before the typed configs) are taken as deterministic.
    """
    combiner = (header.get("configs") or {}).get("combiner")
    if not combiner:
        return None
    try:
        cls = combiner_class(str(combiner["mode"]))
        options = cls.Options(**combiner.get("options", {}))
    except (KeyError, TypeError, ValueError) as e:
        return f"the header's combiner {combiner!r} is not one this checkout knows ({e})"
    if cls.is_deterministic(options):
        return None
    return (
        f"--grad-combine {cls.name} with {options} is nondeterministic (its communication "
        "races the computation); only --full's statistical check applies"
    )


def build_command(
    header: Record,
    run_log: str,
    *,
    max_steps: int | None = None,
    python: str = sys.executable,
    root: Path = REPO_ROOT,
) -> list[str]:
    """The rerun's argv for a log header (see the module docstring); the script lies under
    ``root``."""
    command = header.get("command")
    if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
        raise LogError(
            f"the header's 'command' must be a non-empty list of strings, got {command!r}"
        )
    script = str(root / command[0])
    args = _set_flag(list(command[1:]), "--run-log", run_log)
    elastic = any(a == "--elastic-dir" or a.startswith("--elastic-dir=") for a in args)
    if elastic:  # an elastic run's state directory must start empty
        args = _set_flag(args, "--elastic-dir", str(Path(run_log).parent / "elastic"))
    if max_steps is not None:
        args = _set_flag(args, "--max-steps", str(max_steps))
    world_size = int(header.get("world_size") or 1)
    if world_size > 1:
        # an elastic run's workers refuse torchrun's shared store (trainers.dist.check_launch):
        # launch it as the project's torchrun, which gives each rendezvous round a fresh one
        runner = ["trainers.elastic", "torchrun"] if elastic else ["torch.distributed.run"]
        launcher = ["-m", *runner, "--standalone", "--nproc-per-node", str(world_size)]
        return [python, *launcher, script, *args]
    return [python, script, *args]


def rerun_env(
    header: Record, base: dict[str, str] | None = None, *, pins: bool = True, root: Path = REPO_ROOT
) -> dict[str, str]:
    """The rerun's environment: the repository at ``root`` importable; the original's CPU
    thread count (so reductions sum in the same order); and, with ``pins``, the original's ISA
    pins exactly (set where it had them, removed where it had none) and, for a CUDA log made
    with deterministic algorithms, deterministic algorithms again."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    fingerprint = header.get("fingerprint") or {}
    threads = fingerprint.get("threads", header.get("threads"))  # older logs: top level
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(int(threads))
    if pins and fingerprint:
        recorded = fingerprint.get("isa_pins") or {}
        for name in ISA_PIN_VARIABLES:
            if recorded.get(name):
                env[name] = str(recorded[name])
            else:
                env.pop(name, None)
        device = fingerprint.get("device") or {}
        if device.get("type") == "cuda" and fingerprint.get("deterministic"):
            env["MODELZOO_DETERMINISTIC"] = "1"
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return env


#: ``scripts/cross_processor.py``'s pairs: the default ``results`` of the evidence below.
CROSS_PROCESSOR = REPO_ROOT / "logs" / "cross_processor.json"


def processor_key(cpu: dict[str, Any]) -> str:
    """``"AuthenticAMD-25-17"``: vendor, family and model, the processor rule's key."""
    return f"{cpu.get('vendor')}-{cpu.get('family')}-{cpu.get('model')}"


def processor_trace(log: Path, here: dict[str, Any]) -> Path | None:
    """The trace of ``log``'s run made on this machine's processor model, if one was
    published beside it (``<recipe>/processors/<vendor>-<family>-<model>/<log name>``, made
    by ``scripts/cross_processor.py --add-trace``), else None."""
    path = log.parent / "processors" / processor_key(here.get("cpu") or {}) / log.name
    return path if path.is_file() else None


def portable_evidence(log: Path, header: Record, results: Path | None = None) -> str | None:
    """The pairs of ``scripts/cross_processor.py`` (``results``, default
    ``logs/cross_processor.json``) that verify the portable exact mode for ``log``'s recipe
    (the name of its folder): a log of that recipe made in the mode, with the same pins as
    ``log`` (the mode's switches changed once already), whose whole rerun on a processor of
    the other vendor was identical in every record. Two models of one vendor are not enough:
    the mode exists because Intel's and AMD's kernels part (docs/run_logs.md), and two Intel
    models computed the same bits even under the usual pins. ``"made on A, rerun on B (N
    records)"``, or None."""
    found = [
        _evidence(p)
        for p in _portable_pairs(log, header, results)
        if _identical_and_complete(p) and _vendor(p["publisher"]) != _vendor(p["rerun"])
    ]
    return "; ".join(found) or None


def _vendor(name: str) -> str:
    """``"GenuineIntel"`` of :func:`processor_name`'s ``"GenuineIntel 6/207 (...)"``."""
    return str(name).split(" ", 1)[0]


def portable_refutation(log: Path, header: Record, results: Path | None = None) -> str | None:
    """The pairs that refute the portable exact mode for ``log``'s recipe with ``log``'s pins:
    a rerun on another processor model that differed. None without such a pair."""
    found = [
        f"{p['log']} made on {p['publisher']}, rerun on {p['rerun']}: first difference at "
        f"{p.get('first_difference')}"
        for p in _portable_pairs(log, header, results)
        if p.get("records_identical") != p.get("records_compared")
    ]
    return "; ".join(found) or None


def _portable_pairs(log: Path, header: Record, results: Path | None) -> list[dict[str, Any]]:
    pins = {k: v for k, v in ((header.get("fingerprint") or {}).get("isa_pins") or {}).items() if v}
    if pins.get("MODELZOO_PORTABLE") not in PORTABLE_MODE_VERSIONS:
        return []
    recipe = log.resolve().parent.name
    return [
        p
        for p in _pairs(results)
        if Path(p.get("log", "")).parent.name == recipe
        and (p.get("pins") or {}) == pins
        and p.get("publisher") != p.get("rerun")
    ]


def _pairs(results: Path | None) -> list[dict[str, Any]]:
    """The pairs of ``results`` (default ``logs/cross_processor.json``); none if unreadable."""
    try:
        pairs = json.loads((results or CROSS_PROCESSOR).read_text(encoding="utf-8"))["pairs"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    return pairs if isinstance(pairs, list) else []


def _identical_and_complete(pair: dict[str, Any]) -> bool:
    return (
        bool(pair.get("complete"))
        and pair.get("records_compared", 0) > 0
        and pair.get("records_identical") == pair.get("records_compared")
        and not pair.get("missing")
    )


def _evidence(pair: dict[str, Any]) -> str:
    return (
        f"{pair['log']} made on {pair['publisher']}, rerun whole on {pair['rerun']}: "
        f"{pair['records_identical']} records identical"
    )


def processor_name(cpu: dict[str, Any]) -> str:
    """``"GenuineIntel 6/143 (Intel(R) Xeon(R) Platinum 8488C)"`` (scripts/cross_processor.py)."""
    return f"{cpu.get('vendor')} {cpu.get('family')}/{cpu.get('model')} ({cpu.get('model_name')})"


def pair_evidence(
    log: Path, header: Record, here: dict[str, Any], results: Path | None = None
) -> str | None:
    """The pairs of ``scripts/cross_processor.py`` showing that ``log``'s recipe, with the
    log's pins, computes the same bits on the log's processor model and on this one: a log
    of the recipe made on that model and rerun whole on this one, identical in every record.
    A log then is re-created here although its processor differs. None without such a pair."""
    pairs = _pairs(results)
    fingerprint = header.get("fingerprint") or {}
    pins = {k: v for k, v in (fingerprint.get("isa_pins") or {}).items() if v}
    made_on = processor_name(fingerprint.get("cpu") or {})
    rerun_on = processor_name(here.get("cpu") or {})
    recipe = log.resolve().parent.name
    found = [
        _evidence(p)
        for p in pairs
        if Path(p.get("log", "")).parent.name == recipe
        and p.get("publisher") == made_on
        and p.get("rerun") == rerun_on
        and (p.get("pins") or {}) == pins
        and _identical_and_complete(p)
    ]
    return "; ".join(found) or None


def same_processor(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two fingerprints' ``cpu`` are the same processor model (the processor rule)."""
    return all(a.get(k) == b.get(k) for k in ("vendor", "family", "model"))


def _other_processor(header: Record, here: dict[str, Any]) -> bool:
    recorded = (header.get("fingerprint") or {}).get("cpu") or {}
    return not same_processor(recorded, here.get("cpu") or {})


def native_fingerprint(python: str = sys.executable, root: Path = REPO_ROOT) -> dict[str, Any]:
    """This machine's fingerprint as an unpinned process sees it (the CPU capability torch
    picks with no ISA pin in the environment; ``root``: the repository it imports)."""
    env = {k: v for k, v in os.environ.items() if k not in ISA_PIN_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    code = "import json; from trainers.logs import machine_fingerprint as m; print(json.dumps(m()))"
    try:
        out = subprocess.run(
            [python, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return machine_fingerprint()


def code_changes(header: Record, root: Path = REPO_ROOT) -> str | None:
    """A note when the script or the packages differ between the log's commit and HEAD (or
    the working tree), None when they do not or when git cannot tell."""
    fingerprint = header.get("fingerprint") or {}
    commit = (fingerprint.get("git") or {}).get("commit") or header.get("git")
    command = header.get("command") or []
    if not commit or not command or not (root / ".git").exists():
        return None
    paths = [command[0], *CODE_PATHS]
    try:
        out = subprocess.run(
            ["git", "diff", "--name-only", commit, "--", *paths],
            cwd=root, capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return f"note: the log's commit {commit[:12]} is not in this checkout; cannot tell whether the code changed since"
    changed = out.stdout.split()
    if not changed:
        return None
    shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return (
        f"note: since the log's commit {commit[:12]} these files changed: {shown} "
        f"(git diff {commit[:12]} -- {' '.join(paths)})"
    )


def claim_for(
    log_path: str, claims_path: Path, root: Path = REPO_ROOT
) -> tuple[str, dict[str, Any]]:
    """The ``(name, entry)`` of the published recipe ``log_path`` is a seed of (the claims'
    log paths are relative to ``root``)."""
    return find_recipe(load_claims(claims_path), log_path, root=root)


def check_claim(name: str, recipe: dict[str, Any], records: Sequence[Record]) -> tuple[bool, str]:
    """Whether a full rerun's final metric meets the recipe's claim (above the task's trivial
    level whatever the band; for a negative result: the failure reproduces, at or below its
    bound), and a line saying so."""
    value = metric_of(records, recipe["metric"], recipe["source"])
    claim = recipe["claim"]
    negative = recipe["status"] == "negative"
    spread = "" if recipe["std"] is None else f" +- {recipe['std']:.3g}"
    trivial = recipe.get("trivial")
    level = "" if trivial is None else f", trivial level {trivial['value']:.6g}"
    band = (
        f"recipe {name}: {recipe['metric']}={value:.6g}, claim {'<=' if negative else '>='} "
        f"{claim:.6g} (mean {recipe['mean']:.6g}{spread} over {recipe['n']} seeds, min "
        f"{recipe['min']:.6g}, documented {'level' if negative else 'minimum'} "
        f"{recipe['documented_minimum']:.6g}{level})"
    )
    met = claim_met(value, recipe)
    if negative:
        verdict = "negative result reproduced: " if met else "negative result NOT reproduced: "
        return met, verdict + band + f"; diagnosis: {recipe['diagnosis']}"
    if at_trivial_level(value, recipe):
        return False, f"claim missed: at the task's trivial level ({trivial['how']}): " + band
    return met, ("claim met: " if met else "claim missed: ") + band


# The typed configs a rerun must resolve to exactly as the log did (``run`` differs by design:
# a prefix rerun sets max_steps).
COMPARED_CONFIGS = ("optimizer", "schedule", "combiner")


def config_changes(header: Record, rerun_header: Record) -> list[str]:
    """``"combiner.options.asynchronous: False (the log) -> True (the rerun)"`` for every
    setting of the header's typed ``configs`` that the rerun resolved otherwise: the same
    command means something else when a default changed since the log was made. Settings
    only one side has (an option added since, whose default keeps the old behaviour) and logs
    without typed configs compare nothing."""
    before = header.get("configs") or {}
    after = rerun_header.get("configs") or {}
    changes: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict):
            for key in sorted(set(a) & set(b)):  # an option added later is not compared
                walk(a[key], b[key], f"{where}.{key}")
        elif a != b:
            changes.append(f"{where}: {a!r} (the log) -> {b!r} (the rerun)")

    for name in COMPARED_CONFIGS:
        if name in before and name in after:
            walk(before[name], after[name], name)
    return changes


class ReproduceError(Exception):
    """An outcome with a message of its own: ``scripts/reproduce.py`` prints
    ``reproduce.py: <message>`` on stderr and exits ``status`` (2 bad input, 3 the rerun
    failed, 1 a rerun under another configuration or a claim it cannot check)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def reproduce_log(
    log: str,
    *,
    max_steps: int | None = None,
    full: bool = False,
    claims: Path = DEFAULT_CLAIMS,
    rtol: float | None = None,
    atol: float | None = None,
    python: str = sys.executable,
    rerun_log: str | None = None,
    root: Path = REPO_ROOT,
    cross_processor: Path = CROSS_PROCESSOR,
) -> int:
    """Rerun ``log``'s command (from ``root``) and compare; with ``full`` the whole recipe,
    its final metric checked against its claim in ``claims`` as well. Prints what it does and
    finds on stdout (a divergence or a missed claim on stderr).

    Args:
        log: the run log (JSON Lines) to reproduce.
        max_steps: stop the rerun after this many optimizer steps (not with ``full``).
        full: the statistical check (see the module docstring).
        claims: the claims file (``full``).
        rtol: relative tolerance (None: by world size, :func:`default_tolerances`).
        atol: absolute tolerance (None: by world size).
        python: the rerun's interpreter.
        rerun_log: keep the rerun's log here (None: a temporary file).
        root: the repository the log's command runs in.
        cross_processor: ``scripts/cross_processor.py``'s pairs (the evidence across
            processor models).

    Returns:
        0 reproduced, 1 a divergence or a missed claim, 4 not comparable (module docstring).

    Raises:
        ReproduceError: bad input (2), a failed rerun (3), a rerun under another
            configuration or a claim that cannot be checked (1), with its message.
    """
    try:
        original = read_log(log)
    except LogError as e:
        raise ReproduceError(2, f"error: {e}") from None
    if not any(r.get("kind") == "end" for r in original):
        steps = [r["step"] for r in original if _is_number(r.get("step"))]
        where = f"its last record is at step {max(steps)}" if steps else "it has no step record"
        raise ReproduceError(
            2,
            f"error: {log} has no end record: that run never finished ({where}); "
            "there is nothing to reproduce. Pass the log of a finished run",
        )
    recipe_name, recipe = "", {}
    if full:
        try:  # a missing or unlisted claim fails before the rerun is spent
            recipe_name, recipe = claim_for(log, claims, root)
        except ClaimsError as e:
            raise ReproduceError(2, f"error: {e}") from None
    header = original[0]
    world_size = int(header.get("world_size") or 1)
    default_rtol, default_atol = default_tolerances(world_size)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol

    verified = portable_evidence(Path(log), header, cross_processor)
    here = native_fingerprint(python, root)
    refuted = None if verified else portable_refutation(Path(log), header, cross_processor)
    reason = not_comparable_reason(
        header.get("fingerprint"), here, portable_verified=verified, portable_refuted=refuted
    )
    if reason is None and verified and _other_processor(header, here):
        print(f"portable exact mode, verified across processors: {verified}", flush=True)
    if reason is not None and _other_processor(header, here):
        evidence = pair_evidence(Path(log), header, here, cross_processor)
        same_cpu = {**(header.get("fingerprint") or {}), "cpu": here.get("cpu")}
        if evidence and not_comparable_reason(same_cpu, here) is None:
            print(f"another processor model, shown to compute the same bits: {evidence}")
            reason = None
    if reason is not None and _other_processor(header, here):
        trace = processor_trace(Path(log), here)
        if trace is not None:  # this processor model's own trace of the same run
            own = read_log(str(trace))
            if not_comparable_reason(own[0].get("fingerprint"), here) is None:
                print(f"comparing with this processor model's trace of the run: {trace}")
                original, reason = own, None
    pins = reason is None
    reason = nondeterministic_reason(header) or reason
    change = next((i for i, r in enumerate(original) if r.get("kind") == "membership"), None)
    if change is not None and not full:
        # the records after a worker-group change come from a world this rerun does not have
        m = original[change]
        limit = int(m.get("step") or 0)
        if limit < 1:
            print(f"not comparable: the worker group changed before the first step "
                  f"({m.get('old_world_size')} -> {m.get('new_world_size')} workers)")  # fmt: skip
            return EXIT_NOT_COMPARABLE
        if max_steps is None or max_steps > limit:
            print(f"an elastic run: its worker group changed at step {limit} "
                  f"({m.get('old_world_size')} -> {m.get('new_world_size')} workers); "
                  f"rerunning its first {limit} steps and comparing the records before that "
                  "change", flush=True)  # fmt: skip
            max_steps = limit
        original = original[:change]
    if reason is not None:
        print(f"not comparable: {reason}", flush=True)
        if not full:
            return EXIT_NOT_COMPARABLE
        print("running the full recipe for the statistical check")
    note = code_changes(header, root)
    if note:
        print(note, flush=True)

    with tempfile.TemporaryDirectory(prefix="reproduce-") as tmp:
        run_log = rerun_log or os.path.join(tmp, "rerun.jsonl")
        if os.path.exists(run_log):
            os.remove(run_log)  # a stale log must not pass for the rerun's
        try:
            command = build_command(header, run_log, max_steps=max_steps, python=python, root=root)
        except LogError as e:
            raise ReproduceError(2, f"error: {log}: {e}") from None
        print("rerunning:", " ".join(command), flush=True)
        env = rerun_env(header, pins=pins, root=root)
        result = subprocess.run(command, cwd=root, env=env, check=False)
        if result.returncode != 0:
            raise ReproduceError(3, f"the rerun failed with exit status {result.returncode}")
        try:
            new = read_log(run_log)
        except LogError as e:
            raise ReproduceError(3, f"the rerun wrote no usable log: {e}") from None

    changed = config_changes(header, new[0])
    if changed:
        raise ReproduceError(
            1,
            "the rerun ran with another configuration than the log's (a default "
            f"changed since the log was made?): {'; '.join(changed)}; rerun the log's command "
            "with the flags that set these back",
        )
    status = 0
    if reason is None:
        ok, message = compare_logs(original, new, rtol, atol, report=print)
        print(message, file=sys.stdout if ok else sys.stderr)
        status = 0 if ok else 1
    if full:
        try:
            met, message = check_claim(recipe_name, recipe, new)
        except KeyError as e:
            raise ReproduceError(1, f"cannot check the claim: {e}") from None
        print(message, file=sys.stdout if met else sys.stderr)
        if not met:
            return 1
    if status == 0 and reason is not None:
        return EXIT_NOT_COMPARABLE
    return status
