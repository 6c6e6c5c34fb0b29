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
``scripts/reproduce.py`` re-applies. A seed whose run fails leaves no log behind (a log it
was replacing is put back).

Docs tables: a block ``<!-- claims: name1 name2 -->`` ... ``<!-- /claims -->`` in any file
of ``docs/`` (or README.md) is replaced by a table of those recipes (mean +- std over n seeds,
min, claim). Inline markers: ``<!--claim RECIPE FIELD-->TEXT<!--/claim-->`` in their prose
has TEXT set to that field of the recipe, formatted as the tables format it (MARKER_FIELDS:
mean, std, mean±std, min, max, range, n, claim, minimum, trivial, values), so that no number quoted
from ``logs/claims.json`` is written by hand; ``docs --check`` and ``check`` name every
out-of-date marker by file, line, recipe and field.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock

from trainers.checkpoint import atomic_write_text
from trainers.claims import ClaimsError, load_claims, make_recipe, write_claims
from trainers.cli import run_main, split_command
from trainers.logs import ISA_PIN_VARIABLES, PORTABLE_CPU_PINS, PORTABLE_EXACT_PINS, read_run_log

REPO_ROOT = Path(__file__).resolve().parents[1]
CLAIMS = REPO_ROOT / "logs" / "claims.json"
DOCS = REPO_ROOT / "docs"
BLOCK = re.compile(r"(<!-- claims: ([^>]*?) -->\n)(.*?)(<!-- /claims -->)", re.S)


def parse_seeds(text: str) -> list[int]:
    """``"0-4"`` -> ``[0, 1, 2, 3, 4]``; ``"0,2,5"`` -> ``[0, 2, 5]``."""
    seeds: list[int] = []
    try:
        for part in text.split(","):
            if "-" in part:
                lo, hi = (int(v) for v in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                seeds.extend(range(lo, hi + 1))
            else:
                seeds.append(int(part))
    except ValueError:
        raise SystemExit(f"--seeds: expected e.g. 0-4 or 0,1,2, got {text!r}") from None
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--seeds: {text!r} repeats a seed")
    return seeds


def run_env(
    threads: int, *, native: bool, base: dict[str, str] | None = None, portable: bool = False
) -> dict[str, str]:
    """The environment of a published run: the portable pins (unless ``native``; with
    ``portable``, the portable exact mode's: ``PORTABLE_EXACT_PINS``) and the thread count;
    any other ISA pin the caller had is removed."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in ISA_PIN_VARIABLES
    }
    if not native:
        env.update(PORTABLE_EXACT_PINS if portable else PORTABLE_CPU_PINS)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def parse_drill(text: str) -> tuple[int, int, int]:
    """``"3:30:70"`` -> 3 nodes, kill one at step 30, one joins at step 70."""
    try:
        nodes, kill, join = (int(v) for v in text.split(":"))
    except ValueError:
        raise SystemExit(
            f"--elastic-drill: expected NODES:KILL_STEP:JOIN_STEP, got {text!r}"
        ) from None
    return nodes, kill, join


def parse_partition_drill(text: str) -> tuple[int, int, int, float]:
    """``"3:2:10:90"`` -> 3 lab nodes, node 2's cable pulled at step 10 for 90 s."""
    try:
        nodes, node, step, seconds = text.split(":")
        return int(nodes), int(node), int(step), float(seconds)
    except ValueError:
        raise SystemExit(
            f"--partition-drill: expected NODES:NODE:STEP:SECONDS, got {text!r}"
        ) from None


def seed_command(
    command: Sequence[str],
    seed: int,
    run_log: Path,
    *,
    nproc: int,
    python: str = sys.executable,
    drill: tuple[int, int, int] | None = None,
    partition_drill: tuple[int, int, int, float] | None = None,
    bandwidth: str = "1gbit",
    threads: int = 1,
) -> list[str]:
    """``command`` (script relative to the repository, then its flags) for one seed."""
    if not command or not command[0].endswith(".py"):
        raise SystemExit(
            "give the training command after --, e.g. -- scripts/train_imagenet.py ..."
        )
    for flag in ("--seed", "--run-log"):
        if any(a == flag or a.startswith(flag + "=") for a in command):
            raise SystemExit(f"leave {flag} out of the command: publish.py sets it per seed")
    args = [*command[1:], "--seed", str(seed), "--run-log", str(run_log)]
    if drill is not None:
        nodes, kill, join = drill
        launcher = [
            "-m", "trainers.elastic_drill", "--nodes", str(nodes), "--kill-at-step", str(kill),
            "--join-at-step", str(join), "--threads", str(threads), "--",
        ]  # fmt: skip
        return [python, *launcher, command[0], *args]
    if partition_drill is not None:
        nodes, node, step, seconds = partition_drill
        launcher = [
            "-m", "trainers.elastic_drill", "--netlab", "--nodes", str(nodes), "--bandwidth",
            bandwidth, "--partition", f"{node}:{step}:{seconds:g}", "--threads", str(threads),
            "--",
        ]  # fmt: skip
        return [python, *launcher, command[0], *args]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    return [python, *(launcher if nproc > 1 else []), command[0], *args]


def _terminate_as_exit(signum: int, _frame: Any) -> None:
    """SIGTERM (a killed job, a scheduler's stop) unwinds like an error, so that a seed's
    partial log is removed and the log it was replacing comes back."""
    raise SystemExit(128 + signum)


def cmd_run(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _terminate_as_exit)
    if args.native and args.portable:
        raise SystemExit("--native and --portable contradict: --native runs unpinned kernels")
    out_dir = Path(args.out_dir) if args.out_dir else REPO_ROOT / "logs" / args.recipe
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.elastic_drill and args.partition_drill:
        raise SystemExit("--elastic-drill and --partition-drill: give one drill")
    partition = parse_partition_drill(args.partition_drill) if args.partition_drill else None
    env = run_env(args.threads, native=args.native, portable=args.portable)
    for seed in parse_seeds(args.seeds):
        final = out_dir / f"seed{seed}.jsonl"
        # the header records the command as run: name the log by its final, relative path
        shown = (
            final.resolve().relative_to(REPO_ROOT)
            if final.resolve().is_relative_to(REPO_ROOT)
            else final
        )
        previous = final.with_name(f".{final.name}.previous")
        if final.exists():
            os.replace(final, previous)
        command = seed_command(
            args.command,
            seed,
            Path(shown),
            nproc=args.nproc_per_node,
            threads=args.threads,
            drill=parse_drill(args.elastic_drill) if args.elastic_drill else None,
            partition_drill=partition,
            bandwidth=args.drill_bandwidth,
        )
        print(f"[{args.recipe} seed {seed}] {' '.join(command)}", flush=True)
        start = time.perf_counter()
        try:
            result = subprocess.run(command, cwd=REPO_ROOT, env=env, check=False)
            failed = result.returncode != 0 or not final.is_file()
        except BaseException:
            failed = True
            raise
        finally:
            if failed:  # no partial log survives; the previous one (if any) comes back
                final.unlink(missing_ok=True)
                if previous.exists():
                    os.replace(previous, final)
        previous.unlink(missing_ok=True)
        if failed:
            print(f"publish.py: seed {seed} failed (exit {result.returncode}); nothing written",
                  file=sys.stderr)  # fmt: skip
            return 1
        print(
            f"[{args.recipe} seed {seed}] {shown} ({time.perf_counter() - start:.1f} s)", flush=True
        )
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


_SCRIPTS: dict[str, Any] = {}


def _script(name: str) -> Any:
    """The training script ``scripts/<name>`` as a module (imported once)."""
    if name not in _SCRIPTS:
        path = REPO_ROOT / "scripts" / name
        if not path.is_file():
            raise ClaimsError(f"the log's command runs {name}, which is not in scripts/")
        spec = importlib.util.spec_from_file_location(f"_publish_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up)
        spec.loader.exec_module(module)
        _SCRIPTS[name] = module
    return _SCRIPTS[name]


def trivial_of(logs: Sequence[str | os.PathLike[str]]) -> dict[str, Any]:
    """The task's trivial level for a recipe's seeds: each log's script computes it from the
    run's data (``trivial_level(records)``); the highest over the seeds is kept (seeds that
    draw their own data or their own untrained head may differ)."""
    levels = []
    for log in logs:
        records = read_run_log(log)
        script = Path(records[0]["command"][0]).name
        module = _script(script)
        if not hasattr(module, "trivial_level"):
            raise ClaimsError(
                f"{script} has no trivial_level(records): its task's level is unknown"
            )
        try:
            levels.append(module.trivial_level(records))
        except SystemExit as e:
            raise ClaimsError(f"{log}: the trivial level: {e}") from None
    best = max(levels, key=lambda level: level["value"])
    if len({level["value"] for level in levels}) > 1:
        best = {**best, "how": f"{best['how']}, the highest of the {len(levels)} seeds'"}
    return best


def _recipe(logs: Sequence[Path], args: argparse.Namespace) -> dict[str, Any]:
    """The claims entry of ``logs`` declared by ``args`` (run/add)."""
    claims = load_claims(args.claims) if Path(args.claims).is_file() else {"recipes": {}}
    if args.baseline is not None and args.baseline not in claims["recipes"]:
        raise ClaimsError(f"--baseline {args.baseline}: no such recipe in {args.claims}")
    return make_recipe(
        logs, metric=args.metric, source=args.source, documented_minimum=args.minimum,
        description=args.description, min_seeds=args.min_seeds, root=REPO_ROOT,
        trivial=trivial_of(logs), baseline=args.baseline, diagnosis=args.negative,
    )  # fmt: skip


def update_claims(path: Path, name: str, entry: dict[str, Any]) -> None:
    """Set one recipe's entry; a lock keeps two publishers from losing each other's update."""
    with FileLock(str(path) + ".lock"):
        claims = load_claims(path) if path.is_file() else {"recipes": {}}
        claims["recipes"][name] = entry
        write_claims(path, claims)


def cmd_add(args: argparse.Namespace) -> int:
    logs = [REPO_ROOT / p if not Path(p).is_absolute() else Path(p) for p in args.logs]
    entry = _recipe(logs, args)
    update_claims(Path(args.claims), args.recipe, entry)
    bound = "<=" if entry["status"] == "negative" else ">="
    print(f"{args.recipe}: {entry['status']}, n={entry['n']}, claim {bound} {entry['claim']:.4f}")
    return 0


def _fmt(value: float | None, percent: bool, unit: bool = True) -> str:
    """A claims value as the docs show it, tables and inline markers alike: a fraction
    (accuracy) in percent with two decimals ("98.79 %"; ``unit=False``: "98.79"), any other
    metric (F1, EM) as it is with two decimals ("90.15"); "-" for none."""
    if value is None:
        return "-"
    if percent:
        return f"{100 * value:.2f}" + (" %" if unit else "")
    return f"{value:.2f}"


def _is_fraction(entry: dict[str, Any]) -> bool:
    """Whether a recipe's metric is a fraction (accuracy 0..1, shown in %), judged on its
    mean and extremes together: a small standard deviation of an F1 stays an F1."""
    values = [entry[k] for k in ("mean", "min", "max") if entry.get(k) is not None]
    return bool(values) and all(abs(v) <= 1.5 for v in values)


def _mean_std(e: dict[str, Any], pct: bool) -> str:
    """The mean and standard deviation, "98.79 % ± 0.32 %" (the mean alone for one seed)."""
    if e["std"] is None:
        return _fmt(e["mean"], pct)
    return f"{_fmt(e['mean'], pct)} ± {_fmt(e['std'], pct)}"


def _range(e: dict[str, Any], pct: bool) -> str:
    """The seeds' min to max, "9.75-10.03 %" (one value when they agree)."""
    if e["min"] == e["max"]:
        return _fmt(e["min"], pct)
    return f"{_fmt(e['min'], pct, unit=False)}-{_fmt(e['max'], pct)}"


def _spread(e: dict[str, Any], pct: bool) -> str:
    return f"{_mean_std(e, pct)} ({e['n']})"


def _baseline(claims: dict[str, Any], e: dict[str, Any], pct: bool) -> str:
    name = e.get("baseline")
    if name is None:
        return "-"
    return f"`{name}`: {_fmt(claims['recipes'][name]['mean'], pct)}"


def render_table(claims: dict[str, Any], names: Sequence[str]) -> str:
    """The markdown table(s) of a docs block (see the module docstring): the recipes that hold,
    then, apart, the negative results with their diagnoses."""
    for name in names:
        if name not in claims["recipes"]:
            raise ClaimsError(f"docs name recipe {name!r}, which logs/claims.json does not list")
    held = [n for n in names if claims["recipes"][n]["status"] != "negative"]
    failed = [n for n in names if claims["recipes"][n]["status"] == "negative"]
    parts = []
    if held:
        lines = [
            "| recipe | status | metric | mean ± std (n seeds) | min | max | claim (a fresh run reaches) | trivial level | plain baseline (mean) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in held:
            e = claims["recipes"][name]
            pct = _is_fraction(e)
            trivial = e.get("trivial")
            lines.append(
                f"| `{name}` ({e['description']}) | {e['status']} | {e['metric']} | {_spread(e, pct)} "
                f"| {_fmt(e['min'], pct)} | {_fmt(e['max'], pct)} | ≥ {_fmt(e['claim'], pct)} "
                f"| {_fmt(trivial['value'], pct) if trivial else '-'} | {_baseline(claims, e, pct)} |"
            )
        parts.append("\n".join(lines) + "\n")
    if failed:
        lines = [
            "**Negative results** (the method fails in this setting; a fresh run reproduces the failure when it stays at or below the bound):\n",
            "| recipe | metric | mean ± std (n seeds) | min | max | trivial level | plain baseline (mean) | a fresh run stays ≤ | diagnosis |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name in failed:
            e = claims["recipes"][name]
            pct = _is_fraction(e)
            trivial = e.get("trivial")
            lines.append(
                f"| `{name}` ({e['description']}) | {e['metric']} | {_spread(e, pct)} "
                f"| {_fmt(e['min'], pct)} | {_fmt(e['max'], pct)} "
                f"| {_fmt(trivial['value'], pct) if trivial else '-'} | {_baseline(claims, e, pct)} "
                f"| {_fmt(e['claim'], pct)} | {e['diagnosis']} |"
            )
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


# Inline markers: ``<!--claim RECIPE FIELD-->TEXT<!--/claim-->`` in the prose of docs/*.md and
# README.md; ``publish.py docs`` rewrites TEXT from claims.json (HTML comments: invisible once
# rendered). One line each; markers inside code (a fenced block, a `span`) are text, not markers.
MARKER = re.compile(r"<!--claim ([^\s<>]+) ([^\s<>]+)-->(.*?)<!--/claim-->")
MARKER_PART = re.compile(r"<!--\s*/?\s*claim\b")
MARKER_FIELDS: dict[str, Any] = {
    "mean": lambda e, pct: _fmt(e["mean"], pct),
    "std": lambda e, pct: _fmt(e["std"], pct),
    "mean±std": _mean_std,
    "min": lambda e, pct: _fmt(e["min"], pct),
    "max": lambda e, pct: _fmt(e["max"], pct),
    "range": _range,
    "n": lambda e, pct: str(e["n"]),
    "claim": lambda e, pct: _fmt(e["claim"], pct),
    "minimum": lambda e, pct: _fmt(e["documented_minimum"], pct),
    "trivial": lambda e, pct: _fmt((e.get("trivial") or {}).get("value"), pct),
    "values": lambda e, pct: ", ".join(_fmt(v, pct) for v in e["values"]),
}


def claim_text(claims: dict[str, Any], name: str, field: str) -> str:
    """What an inline marker ``<!--claim NAME FIELD-->`` shows (MARKER_FIELDS), formatted as
    the tables format the recipe's metric.

    Raises:
        ClaimsError: an unknown recipe or field.
    """
    if name not in claims["recipes"]:
        raise ClaimsError(f"recipe {name!r}, which logs/claims.json does not list")
    if field not in MARKER_FIELDS:
        raise ClaimsError(
            f"field {field!r} of {name}: a marker shows one of {', '.join(MARKER_FIELDS)}"
        )
    entry = claims["recipes"][name]
    return MARKER_FIELDS[field](entry, _is_fraction(entry))


def _code_spans(line: str) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each `code span` of a line."""
    ticks = [i for i, ch in enumerate(line) if ch == "`"]
    return [(ticks[i], ticks[i + 1]) for i in range(0, len(ticks) - 1, 2)]


def markers(text: str, where: str = "<text>") -> list[tuple[int, re.Match[str], int]]:
    """Every inline marker of a document: ``(line number, match, offset of its line)``, code
    left out.

    Raises:
        ClaimsError: a marker that does not close on its line, or is malformed.
    """
    found = []
    fenced = False
    offset = 0
    for number, line in enumerate(text.splitlines(keepends=True), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        elif not fenced:
            spans = _code_spans(line)
            covered = []
            for m in MARKER.finditer(line):
                if not any(a < m.start() < b for a, b in spans):
                    found.append((number, m, offset))
                    covered.append((m.start(), m.end()))
            for part in MARKER_PART.finditer(line):
                inside = any(a <= part.start() < b for a, b in covered)
                if not inside and not any(a < part.start() < b for a, b in spans):
                    raise ClaimsError(
                        f"{where}:{number}: a malformed claim marker (expected "
                        "<!--claim RECIPE FIELD-->TEXT<!--/claim--> on one line)"
                    )
        offset += len(line)
    return found


def _marker_texts(claims: dict[str, Any], text: str, where: str):
    """``(line number, match, offset of its line, what claims gives)`` for every marker.

    Raises:
        ClaimsError: a marker naming an unknown recipe or field (with file and line).
    """
    for number, m, offset in markers(text, where):
        try:
            yield number, m, offset, claim_text(claims, m.group(1), m.group(2))
        except ClaimsError as e:
            raise ClaimsError(f"{where}:{number}: marker names {e}") from None


def render_markers(claims: dict[str, Any], text: str, where: str = "<text>") -> str:
    """``text`` with every inline marker's TEXT set from ``claims``."""
    parts, last = [], 0
    for _, m, offset, shown in _marker_texts(claims, text, where):
        start, end = offset + m.start(3), offset + m.end(3)
        parts += [text[last:start], shown]
        last = end
    return "".join(parts) + text[last:]


def doc_files(docs: Path | None = None, readme: Path | None = None) -> list[Path]:
    """The documents with claims: ``docs/**/*.md`` (default: the repository's) and the README
    beside ``docs/``."""
    docs = DOCS if docs is None else docs
    readme = docs.parent / "README.md" if readme is None else readme
    return sorted(docs.rglob("*.md")) + ([readme] if readme.is_file() else [])


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


def _render_tables(claims: dict[str, Any], text: str) -> str:
    return BLOCK.sub(
        lambda m: m.group(1) + render_table(claims, m.group(2).split()) + m.group(4), text
    )


def render_docs(
    claims: dict[str, Any], docs: Path | None = None, readme: Path | None = None
) -> dict[Path, str]:
    """``{file: new text}`` for every document whose claims tables or inline markers are out
    of date."""
    changed = {}
    for path in doc_files(docs, readme):
        text = path.read_text(encoding="utf-8")
        new = render_markers(claims, _render_tables(claims, text), _shown(path))
        if new != text:
            changed[path] = new
    return changed


def doc_problems(
    claims: dict[str, Any], docs: Path | None = None, readme: Path | None = None
) -> list[str]:
    """Every claims table and inline marker of the documents that differs from ``claims``,
    one line each (a marker's: file:line, recipe, field, its text and the claims' text)."""
    problems = []
    for path in doc_files(docs, readme):
        text = path.read_text(encoding="utf-8")
        if _render_tables(claims, text) != text:
            problems.append(
                f"{_shown(path)}: claims tables out of date (run scripts/publish.py docs)"
            )
        for number, m, _, new in _marker_texts(claims, text, _shown(path)):
            name, field, old = m.groups()
            if new != old:
                problems.append(
                    f"{_shown(path)}:{number}: {name} {field}: the marker reads {old!r}, "
                    f"logs/claims.json gives {new!r} (run scripts/publish.py docs)"
                )
    return problems


def cmd_docs(args: argparse.Namespace) -> int:
    claims = load_claims(args.claims)
    if args.check:
        problems = doc_problems(claims)
        for line in problems:
            print(line, file=sys.stderr)
        print("docs: ok" if not problems else f"docs: {len(problems)} problem(s)")
        return 1 if problems else 0
    for path, text in render_docs(claims).items():
        atomic_write_text(path, text)
        print(f"updated {_shown(path)}")
    return 0


def check(claims_path: Path = CLAIMS, docs: Path | None = None) -> list[str]:
    """Every disagreement between claims.json, the logs and the docs (its tables and inline
    markers; empty: none)."""
    problems = []
    claims = load_claims(claims_path)
    for name, entry in claims["recipes"].items():
        try:
            logs = [REPO_ROOT / p for p in entry["logs"]]
            fresh = make_recipe(
                logs, metric=entry["metric"], source=entry["source"],
                documented_minimum=entry["documented_minimum"],
                description=entry["description"], min_seeds=entry["min_seeds"], root=REPO_ROOT,
                trivial=trivial_of(logs), baseline=entry["baseline"],
                diagnosis=entry["diagnosis"],
            )  # fmt: skip
        except (ClaimsError, OSError, ValueError) as e:
            problems.append(f"{name}: {e}")
            continue
        for field, value in fresh.items():
            if entry.get(field) != value:
                problems.append(f"{name}: {field} is {entry.get(field)!r}, the logs give {value!r}")
    return problems + doc_problems(claims, docs)


def cmd_check(args: argparse.Namespace) -> int:
    problems = check(Path(args.claims))
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
    r.add_argument("--drill-bandwidth", default="1gbit",
                   help="--partition-drill: every lab node's link cap")  # fmt: skip
    r.add_argument("--native", action="store_true", help="no ISA pins (a check, not a publication)")
    r.add_argument(
        "--portable",
        action="store_true",
        help="the portable exact mode (trainers.logs.PORTABLE_EXACT_PINS: oneDNN off, MKL's "
        "COMPATIBLE branch; docs/run_logs.md): a trace meant to re-create on other x86-64 "
        "processor models, once scripts/cross_processor.py has verified it",
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
