"""Evidence across processors: rerun published logs made on another processor model, bit for bit.

``scripts/reproduce.py`` re-creates a log exactly only on the processor model that made it
(``trainers.fingerprint.not_comparable_reason``). ``scripts/cross_processor.py`` (the command
line) measures how far that rule is needed with this module: for a log whose processor
(vendor, family, model) differs from this machine's, :func:`measure` reruns its first steps
with the log's recorded threads and ISA pins (and its portable mode, where the log was made
in it: ``scripts/publish.py --portable``) and :func:`difference` compares every logged number
of every step/epoch/eval record with the original, bit for bit. Each (log, publisher
processor, rerun processor) pair goes into ``logs/cross_processor.json`` (:func:`save_pair`:
one entry per pair, replaced when measured again), and the table between
``<!-- cross-processor -->`` and ``<!-- /cross-processor -->`` in ``docs/run_logs.md`` is
regenerated from that file (:func:`write_table`). :func:`record_trace` records a rerun's
operator trace (:mod:`trainers.optrace`) into ``logs/optrace/``; :func:`add_trace` publishes
a whole rerun as this processor model's trace of the run.

The repository root, the results file and the document are parameters (defaults: this
checkout's). Timing fields are not compared.
"""

from __future__ import annotations

import datetime
import io
import json
import math
import subprocess
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainers import reproduce
from trainers.checkpoint import atomic_write_text
from trainers.errors import UsageError
from trainers.logs import ISA_PIN_VARIABLES, PORTABLE_EXACT_PINS, PORTABLE_MODE_VERSIONS

#: The checkout holding this package: the default root of every function taking ``root``.
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "logs" / "cross_processor.json"
CLAIMS = REPO_ROOT / "logs" / "claims.json"
DOC = REPO_ROOT / "docs" / "run_logs.md"
START, END = "<!-- cross-processor -->\n", "<!-- /cross-processor -->"

#: One published log per recipe family (and the distributed path): the default set.
FAMILIES = {
    "ResNeSt (conv)": "logs/digits_resnest14/seed0.jsonl",
    "ResNeSt, 2 processes, ef top-k": "logs/digits_comm_ef_topk_2proc/seed0.jsonl",
    "GNN": "logs/karate_gcn/seed0.jsonl",
    "BERT fine-tuning": "logs/squad_minilm/seed0.jsonl",
    "BERT pretraining": "logs/bert_pretrain_adam_b16/seed0.jsonl",
    "linear": "logs/linear_breast_cancer_lbfgs/seed0.jsonl",
}


processor = reproduce.processor_name


same_processor = reproduce.same_processor


def difference(original: Sequence[dict], rerun: Sequence[dict], steps: int) -> dict[str, Any]:
    """Bit-for-bit comparison of the records of the first ``steps`` steps: how many records
    were compared, how many are identical, the first record that differs, the largest
    absolute and relative differences of any compared number."""
    kinds = reproduce.COMPARED_KINDS
    last = reproduce._last_step(rerun)
    truncated = last < reproduce._last_step(original)
    kinds = kinds if truncated else (*kinds, "end")
    orig = reproduce._keyed(original, kinds)
    new = reproduce._keyed(rerun, kinds)
    keys = [k for k, r in orig.items() if reproduce._expected(k, r, last, truncated)]
    compared = identical = 0
    first: str | None = None
    max_abs = max_rel = 0.0
    missing: list[str] = []
    for key in keys:
        if key not in new:
            missing.append(reproduce._describe(key))
            continue
        a_rec, b_rec = orig[key], new[key]
        same = True
        for field, a in a_rec.items():
            if field in reproduce.TIMING_FIELDS or field == "kind" or isinstance(a, bool):
                continue
            if not reproduce._is_number(a) or not reproduce._is_number(b_rec.get(field)):
                continue
            a, b = float(a), float(b_rec[field])
            if a == b or (math.isnan(a) and math.isnan(b)):
                continue
            same = False
            diff = abs(a - b)
            max_abs = max(max_abs, diff)
            max_rel = max(max_rel, diff / abs(a)) if a else max_rel
        compared += 1
        identical += same
        if not same and first is None:
            first = reproduce._describe(key)
    return {
        "complete": not truncated,  # the whole log was rerun (its end record compared too)
        "records_compared": compared,
        "records_identical": identical,
        "first_difference": first,
        "max_abs_diff": max_abs,
        "max_rel_diff": max_rel,
        "missing": missing[:3],
        "steps": int(last),
    }


def portable_logs(claims: Path = CLAIMS, root: Path = REPO_ROOT) -> list[Path]:
    """The first log of every recipe in ``claims`` (its ``"logs"``, relative to ``root``)
    that was published in the portable exact mode, any version: the set a session on a
    processor of the other vendor reruns whole to verify or refute the mode
    (``scripts/cross_processor.py --portable-logs``), in the claims file's order."""
    try:
        recipes = json.loads(claims.read_text(encoding="utf-8"))["recipes"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UsageError(f"{claims}: cannot read the recipes ({e})") from None
    found = []
    for name, recipe in recipes.items():
        logs = recipe.get("logs") or []
        if not logs:
            continue
        log = root / logs[0]
        try:
            header = reproduce.read_log(str(log))[0]
        except reproduce.LogError as e:
            raise UsageError(f"{claims}: recipe {name}: {e}") from None
        pins = (header.get("fingerprint") or {}).get("isa_pins") or {}
        if pins.get("MODELZOO_PORTABLE") in PORTABLE_MODE_VERSIONS:
            found.append(log)
    if not found:
        raise UsageError(f"{claims}: no recipe is published in the portable exact mode")
    return found


def measure(log: Path, steps: int, python: str, *, root: Path = REPO_ROOT) -> dict[str, Any] | None:
    """Rerun ``steps`` steps of ``log`` here (from the repository at ``root``) and compare;
    None when made on this processor."""
    try:
        original = reproduce.read_log(str(log))
    except reproduce.LogError as e:
        raise UsageError(f"{log}: {e}") from None
    header = original[0]
    fingerprint = header.get("fingerprint") or {}
    here = reproduce.native_fingerprint(python, root)
    if not fingerprint:
        raise UsageError(f"{log}: no machine fingerprint in its header; republish it first")
    reason = reproduce.nondeterministic_reason(header)
    if reason:
        raise UsageError(f"{log}: {reason}")
    if same_processor(fingerprint.get("cpu") or {}, here.get("cpu") or {}):
        print(f"{log}: made on this processor model ({processor(here['cpu'])}); skipped")
        return None
    with tempfile.TemporaryDirectory(prefix="cross-processor-") as tmp:
        run_log = str(Path(tmp) / "rerun.jsonl")
        command = reproduce.build_command(header, run_log, max_steps=steps, python=python,
                                          root=root)  # fmt: skip
        env = reproduce.rerun_env(header, pins=True, root=root)
        print(f"{log}: rerunning {steps} steps: {' '.join(command)}", flush=True)
        result = subprocess.run(command, cwd=root, env=env, check=False,
                                capture_output=True, text=True)  # fmt: skip
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{log}: the rerun failed (exit {result.returncode}):\n{tail}")
        rerun = reproduce.read_log(run_log)
    return pair_entry(log, header, here, original, rerun, steps, root=root)


def pair_entry(
    log: Path,
    header: dict[str, Any],
    here: dict[str, Any],
    original: Sequence[dict],
    rerun: Sequence[dict],
    steps: int,
    *,
    root: Path = REPO_ROOT,
) -> dict[str, Any]:
    """The pair (``logs/cross_processor.json``) of ``log`` (``original``, its records with the
    header) and its rerun here (``rerun``) over ``steps`` steps; the log is named relative to
    ``root`` where it lies inside it."""
    fingerprint = header.get("fingerprint") or {}
    pins = fingerprint.get("isa_pins") or {}
    return {
        "log": _shown(log.resolve(), root),
        "publisher": processor(fingerprint.get("cpu") or {}),
        "rerun": processor(here.get("cpu") or {}),
        "pins": {k: v for k, v in pins.items() if v},
        "threads": fingerprint.get("threads"),
        "world_size": header.get("world_size", 1),
        "torch": (fingerprint.get("versions") or {}).get("torch"),
        "torch_here": (here.get("versions") or {}).get("torch"),
        "date": datetime.date.today().isoformat(),
        **difference(original[1:], rerun[1:], steps),
    }


def portable_tag(pins: dict[str, str] = PORTABLE_EXACT_PINS) -> str:
    """The portable exact mode's name in trace file names, by its MKL branch and, from
    version 2 on, its version: ``portable-compatible-v2``; version 1's traces are
    ``portable-compatible``, the first mode's ``portable-avx2-strict``."""
    version = pins.get("MODELZOO_PORTABLE", "1")
    tag = "portable-" + pins["MKL_CBWR"].lower().replace(",", "-")
    return tag if version == "1" else f"{tag}-v{version}"


def trace_path(
    log: Path,
    cpu: dict[str, Any],
    *,
    portable: bool = False,
    pins: dict[str, str] | None = None,
    root: Path = REPO_ROOT,
) -> Path:
    """``<root>/logs/optrace/<recipe>-<seed>.<vendor>-<family>-<model>[.<mode>].json.gz``: the
    mode is ``portable-<mkl branch>`` and/or the ``--pins`` overrides
    (``pins-mkl_cbwr=compatible``)."""
    stem = f"{log.resolve().parent.name}-{log.stem}"
    machine = f"{cpu.get('vendor')}-{cpu.get('family')}-{cpu.get('model')}"
    parts = [portable_tag()] if portable else []
    if pins:
        parts.append("pins-" + "-".join(f"{k.lower()}={v.lower().replace(',', '-')}"
                                        for k, v in sorted(pins.items())))  # fmt: skip
    mode = "".join(f".{part}" for part in parts)
    return root / "logs" / "optrace" / f"{stem}.{machine}{mode}.json.gz"


def record_trace(
    log: Path,
    steps: int,
    python: str,
    *,
    portable: bool = False,
    pins: dict[str, str] | None = None,
    root: Path = REPO_ROOT,
    at: str | None = None,
    out: Path | None = None,
) -> Path:
    """Record the operator trace (:mod:`trainers.optrace`) of the first ``steps`` steps of
    ``log``'s command, under its recorded threads and pins (with ``portable``: the portable
    exact mode's pins instead; ``pins`` then overrides single variables, an empty value unsets
    one: a candidate mode two machines can compare), into :func:`trace_path`; the command runs
    in the repository at ``root``, or with ``at`` in that commit of it (exported into a
    temporary directory: traces compare only between runs of the same code; the file name
    then ends in ``.at-<commit>``). ``out``: write there instead."""
    if at is not None:
        with tempfile.TemporaryDirectory(prefix="optrace-code-") as code:
            commit = export_commit(at, Path(code), root)
            here = reproduce.native_fingerprint(python, Path(code))
            final = out or trace_path(log, here.get("cpu") or {}, portable=portable, pins=pins,
                                      root=root)  # fmt: skip
            if out is None:
                final = final.with_name(
                    final.name.replace(".json.gz", f".at-{commit[:12]}.json.gz")
                )
            print(f"{log}: running the code of commit {commit[:12]}", flush=True)
            return record_trace(log, steps, python, portable=portable, pins=pins, root=Path(code),
                                out=final)  # fmt: skip
    original = reproduce.read_log(str(log))
    header = original[0]
    if out is None:
        here = reproduce.native_fingerprint(python, root)
        out = trace_path(log, here.get("cpu") or {}, portable=portable, pins=pins, root=root)
    env = reproduce.rerun_env(header, pins=True, root=root)
    if portable:
        env = {k: v for k, v in env.items() if k not in ISA_PIN_VARIABLES}
        env.update(PORTABLE_EXACT_PINS)
    for name, value in (pins or {}).items():
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="optrace-") as tmp:
        command = reproduce.build_command(header, str(Path(tmp) / "r.jsonl"), max_steps=steps,
                                          python=python, root=root)  # fmt: skip
        if "torch.distributed.run" in command:
            raise UsageError(f"{log}: an operator trace records one process; this log ran "
                             f"{header.get('world_size')}")  # fmt: skip
        script_at = next(i for i, a in enumerate(command) if a.endswith(".py"))
        traced = [python, "-m", "trainers.optrace", "record", str(out), "--",
                  *command[script_at:]]  # fmt: skip
        print(f"{log}: recording the operator trace of {steps} step(s) -> "
              f"{_shown(out, root)}", flush=True)  # fmt: skip
        result = subprocess.run(traced, cwd=root, env=env, check=False,
                                capture_output=True, text=True)  # fmt: skip
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise RuntimeError(f"{log}: the traced run failed (exit {result.returncode}):\n{tail}")
    return out


def export_commit(commit: str, into: Path, root: Path = REPO_ROOT) -> str:
    """Write the files of ``commit`` of the repository at ``root`` into the directory ``into``
    (``git archive``); its full hash. An unknown commit is a :class:`UsageError`."""
    found = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    if found.returncode != 0:
        raise UsageError(f"--at {commit}: no such commit in {root} (git rev-parse: "
                         f"{found.stderr.strip().splitlines()[-1] if found.stderr else '?'})")  # fmt: skip
    full = found.stdout.strip()
    archive = subprocess.run(["git", "-C", str(root), "archive", "--format=tar", full],
                             capture_output=True, check=True)  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(into, filter="data")
    return full


def _shown(path: Path, root: Path = REPO_ROOT) -> str:
    """``path`` relative to the repository (``root``) where it lies inside it."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def add_trace(
    log: Path, python: str, *, root: Path = REPO_ROOT, results: Path = RESULTS, doc: Path = DOC
) -> Path | None:
    """Rerun all of ``log``'s command here (in the repository at ``root``), under its recorded
    threads and pins, and publish the result beside it as this processor model's trace of the
    run (``<recipe>/processors/<vendor>-<family>-<model>/<log name>``: what
    ``scripts/reproduce.py`` compares with on this processor model); the comparison is a pair
    too, saved into ``results`` and ``doc``'s table. None when the log was made on this
    processor model."""
    original = reproduce.read_log(str(log))
    header = original[0]
    here = reproduce.native_fingerprint(python, root)
    reason = reproduce.nondeterministic_reason(header)
    if reason:
        raise UsageError(f"{log}: {reason}")
    if same_processor((header.get("fingerprint") or {}).get("cpu") or {}, here.get("cpu") or {}):
        print(f"{log}: made on this processor model; no second trace needed")
        return None
    out = log.parent / "processors" / reproduce.processor_key(here.get("cpu") or {}) / log.name
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="add-trace-", dir=out.parent) as tmp:
        run_log = Path(tmp) / log.name
        command = reproduce.build_command(header, str(run_log), python=python, root=root)
        print(f"{log}: rerunning all of it here -> {out}", flush=True)
        env = reproduce.rerun_env(header, pins=True, root=root)
        result = subprocess.run(command, cwd=root, env=env, check=False, capture_output=True,
                                text=True)  # fmt: skip
        records = reproduce.read_log(str(run_log)) if run_log.is_file() else []
        if result.returncode != 0 or not any(r.get("kind") == "end" for r in records):
            tail = "\n".join(result.stderr.strip().splitlines()[-5:])
            raise RuntimeError(
                f"{log}: the rerun did not finish (exit {result.returncode}):\n{tail}"
            )
        run_log.replace(out)  # the folder's own rename: a trace is whole or absent
    last = int(reproduce._last_step(records))
    entry = pair_entry(log, header, here, original, records, last, root=root)
    print(f"  {entry['records_identical']}/{entry['records_compared']} records identical to the "
          f"published log; first difference: {entry['first_difference'] or 'none'}")  # fmt: skip
    write_table(save_pair(entry, results), doc)  # the whole log rerun here: a pair, too
    ends = [[r for r in recs if r.get("kind") == "end"][-1] for recs in (original, records)]
    shown = [k for k, v in ends[0].items() if reproduce._is_number(v)
             and k not in reproduce.TIMING_FIELDS]  # fmt: skip
    print("  end, published: " + ", ".join(f"{k}={ends[0][k]:.6g}" for k in shown))
    print(
        "  end, this trace: " + ", ".join(f"{k}={ends[1].get(k, float('nan')):.6g}" for k in shown)
    )
    return out


def save_pair(entry: dict[str, Any], results: Path = RESULTS) -> list[dict[str, Any]]:
    """Merge ``entry`` into the results file (default :data:`RESULTS`); the pairs now there."""
    pairs = merge(load_results(results), entry)
    atomic_write_text(results, json.dumps({"pairs": pairs}, indent=1) + "\n")
    return pairs


def load_results(path: Path = RESULTS) -> list[dict[str, Any]]:
    """The pairs of the results file ``path`` (none if it does not exist)."""
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise UsageError(f"{path}: not valid JSON ({e}); restore it from git") from None
    return list(data.get("pairs", []))


def merge(pairs: list[dict[str, Any]], new: dict[str, Any]) -> list[dict[str, Any]]:
    """``pairs`` with ``new`` replacing the entry of the same (log, publisher, rerun, pins)."""
    key = ("log", "publisher", "rerun", "pins")
    kept = [p for p in pairs if tuple(str(p.get(k)) for k in key) !=
            tuple(str(new.get(k)) for k in key)]  # fmt: skip
    return sorted([*kept, new], key=lambda p: (p["log"], p["publisher"], p["rerun"]))


def table(pairs: Sequence[dict[str, Any]]) -> str:
    """The docs table of the pairs (markdown)."""
    if not pairs:
        return "(no pair measured yet)\n"
    lines = [
        "| log | made on | rerun on | pins | steps rerun | whole log | records identical "
        "| first difference | max abs diff | max rel diff |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in pairs:
        pins = ", ".join(f"{k}={v}" for k, v in sorted(p["pins"].items())) or "none"
        lines.append(
            f"| `{p['log']}` | {p['publisher']} | {p['rerun']} | {pins} | {p['steps']} | "
            f"{'yes' if p.get('complete') else 'no'} | "
            f"{p['records_identical']}/{p['records_compared']} | {p['first_difference'] or '-'} "
            f"| {p['max_abs_diff']:.3g} | {p['max_rel_diff']:.3g} |"
        )
    return "\n".join(lines) + "\n"


def write_table(pairs: Sequence[dict[str, Any]], doc: Path = DOC) -> None:
    """Regenerate the table between ``doc``'s :data:`START` and :data:`END` lines."""
    body = doc.read_text(encoding="utf-8")
    if START not in body or END not in body:
        raise UsageError(f"{doc}: no {START.strip()} ... {END} block to fill")
    head, rest = body.split(START, 1)
    atomic_write_text(doc, head + START + table(pairs) + rest[rest.index(END) :])


def parse_pins(text: str, error: Any) -> dict[str, str]:
    """``"MKL_CBWR=COMPATIBLE,MODELZOO_PORTABLE="`` -> ``{"MKL_CBWR": "COMPATIBLE",
    "MODELZOO_PORTABLE": ""}``; ``error`` (argparse's) for anything else. A value may hold a
    comma (``MKL_CBWR=AVX2,STRICT``): a piece without ``=`` continues the value before it."""
    pins: dict[str, str] = {}
    last = None
    for piece in text.split(","):
        name, eq, value = piece.partition("=")
        if not eq:
            if last is None:
                error(f"--pins {text!r}: expected NAME=VALUE,... (e.g. MKL_CBWR=COMPATIBLE)")
            pins[last] += "," + piece
            continue
        if name not in ISA_PIN_VARIABLES:
            error(f"--pins: {name!r} is not an ISA pin; one of {', '.join(ISA_PIN_VARIABLES)}")
        pins[name], last = value, name
    return pins
