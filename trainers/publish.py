"""Publishing a recipe: its seeds run under the portable CPU pins, its claim, its docs tables.

``scripts/publish.py`` is the command line; this module is what it does, with the repository
root, the claims file and the docs folder as parameters (defaults: this checkout's).

Each recipe states its task's trivial level, computed from the data by the training
script's ``trivial_level(records)`` (:func:`trivial_of`: majority class, best constant
masked-LM prediction, the untrained QA head's F1), and its plain baseline recipe; a claim at
or below the trivial level is refused. A method that fails in a setting is published with a
diagnosis: a negative result, listed apart in the docs.

Every run is made with ``trainers.logs.PORTABLE_CPU_PINS`` in its environment
(:func:`run_env`: ATen's and oneDNN's ISA at AVX2, MKL's conditional numerical
reproducibility at AVX2) and a fixed thread count, which its header's fingerprint records;
that is what ``scripts/reproduce.py`` re-applies. A seed whose run fails leaves no log behind
(:func:`run_seeds`: a log it was replacing is put back).

Docs tables: a block ``<!-- claims: name1 name2 -->`` ... ``<!-- /claims -->`` in any file
of ``docs/`` (or README.md) is replaced by a table of those recipes (:func:`render_table`:
mean +- std over n seeds, min, claim). Inline markers: ``<!--claim RECIPE FIELD-->TEXT<!--/claim-->``
in their prose has TEXT set to that field of the recipe, formatted as the tables format it
(:data:`MARKER_FIELDS`: mean, std, mean±std, min, max, range, n, claim, minimum, trivial,
values), so that no number quoted from ``logs/claims.json`` is written by hand;
:func:`doc_problems` and :func:`check` name every out-of-date marker by file, line, recipe and
field.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from filelock import FileLock

from trainers.checkpoint import atomic_write_text
from trainers.claims import ClaimsError, load_claims, make_recipe, write_claims
from trainers.logs import (
    ISA_PIN_VARIABLES,
    PORTABLE_CPU_PINS,
    PORTABLE_EXACT_PINS,
    PORTABLE_ONEDNN_PINS,
    read_run_log,
)

#: The checkout holding this package: the default root of every function taking ``root``.
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
    threads: int,
    *,
    native: bool,
    base: dict[str, str] | None = None,
    portable: bool | str = False,
    root: Path = REPO_ROOT,
) -> dict[str, str]:
    """The environment of a published run: the portable pins (unless ``native``; with
    ``portable``, the portable exact mode's: ``PORTABLE_EXACT_PINS``, or with
    ``portable="onednn"`` its variant with oneDNN on, ``PORTABLE_ONEDNN_PINS``) and the
    thread count;
    any other ISA pin the caller had is removed; the repository at ``root`` importable."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in ISA_PIN_VARIABLES
    }
    if not native:
        if portable == "onednn":
            env.update(PORTABLE_ONEDNN_PINS)
        else:
            env.update(PORTABLE_EXACT_PINS if portable else PORTABLE_CPU_PINS)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
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
    drill_recovery: str = "restart",
) -> list[str]:
    """``command`` (script relative to the repository, then its flags) for one seed;
    ``drill_recovery``: how the ``drill``'s job recovers (``restart``: torchrun; ``inproc``:
    in the running processes, ``python -m trainers.elastic inproc``)."""
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
            "--join-at-step", str(join), "--threads", str(threads),
            *(["--recovery", drill_recovery] if drill_recovery != "restart" else []), "--",
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


class SeedFailed(Exception):
    """A seed's run failed (exit status ``returncode``) or wrote no log; nothing was kept."""

    def __init__(self, seed: int, returncode: int) -> None:
        super().__init__(f"seed {seed} failed (exit {returncode}); nothing written")
        self.seed, self.returncode = seed, returncode


def run_seeds(
    recipe: str,
    command: Sequence[str],
    seeds: Sequence[int],
    out_dir: Path,
    *,
    env: dict[str, str],
    nproc: int,
    threads: int,
    drill: tuple[int, int, int] | None = None,
    partition_drill: tuple[int, int, int, float] | None = None,
    bandwidth: str = "1gbit",
    python: str = sys.executable,
    root: Path = REPO_ROOT,
    drill_recovery: str = "restart",
) -> None:
    """Run ``command`` (:func:`seed_command`) once per seed from ``root``, in ``env``
    (:func:`run_env`), into ``out_dir/seed<k>.jsonl``, printing each command and its time.

    A seed's run that fails, or is interrupted (an exception, e.g. SIGTERM turned into
    ``SystemExit``), leaves no partial log: the log it was replacing comes back.

    Raises:
        SeedFailed: the first seed whose run failed or wrote no log (later seeds do not run).
    """
    for seed in seeds:
        final = out_dir / f"seed{seed}.jsonl"
        # the header records the command as run: name the log by its final, relative path
        shown = final.resolve().relative_to(root) if final.resolve().is_relative_to(root) else final
        previous = final.with_name(f".{final.name}.previous")
        if final.exists():
            os.replace(final, previous)
        cmd = seed_command(
            command,
            seed,
            Path(shown),
            nproc=nproc,
            python=python,
            threads=threads,
            drill=drill,
            partition_drill=partition_drill,
            bandwidth=bandwidth,
            drill_recovery=drill_recovery,
        )
        print(f"[{recipe} seed {seed}] {' '.join(cmd)}", flush=True)
        start = time.perf_counter()
        try:
            result = subprocess.run(cmd, cwd=root, env=env, check=False)
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
            raise SeedFailed(seed, result.returncode)
        print(f"[{recipe} seed {seed}] {shown} ({time.perf_counter() - start:.1f} s)", flush=True)


_SCRIPTS: dict[Path, Any] = {}


def _script(name: str, root: Path = REPO_ROOT) -> Any:
    """The training script ``<root>/scripts/<name>`` as a module (imported once)."""
    path = root / "scripts" / name
    if path not in _SCRIPTS:
        if not path.is_file():
            raise ClaimsError(f"the log's command runs {name}, which is not in scripts/")
        spec = importlib.util.spec_from_file_location(f"_publish_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (dataclasses look their module up)
        spec.loader.exec_module(module)
        _SCRIPTS[path] = module
    return _SCRIPTS[path]


def trivial_of(logs: Sequence[str | os.PathLike[str]], root: Path = REPO_ROOT) -> dict[str, Any]:
    """The task's trivial level for a recipe's seeds: each log's script (in ``root``'s
    ``scripts/``) computes it from the run's data (``trivial_level(records)``); the highest
    over the seeds is kept (seeds that draw their own data or their own untrained head may
    differ)."""
    levels = []
    for log in logs:
        records = read_run_log(log)
        script = Path(records[0]["command"][0]).name
        module = _script(script, root)
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


def recipe_entry(
    logs: Sequence[Path],
    *,
    claims: str | os.PathLike[str],
    metric: str,
    source: str,
    documented_minimum: float,
    description: str,
    min_seeds: int,
    baseline: str | None = None,
    diagnosis: str | None = None,
    root: Path = REPO_ROOT,
) -> dict[str, Any]:
    """The claims entry of ``logs`` (:func:`trainers.claims.make_recipe`, the trivial level
    from :func:`trivial_of`); ``baseline`` must be a recipe of the claims file ``claims``.

    Raises:
        ClaimsError: an unknown baseline, or what ``make_recipe`` refuses.
    """
    existing = load_claims(claims) if Path(claims).is_file() else {"recipes": {}}
    if baseline is not None and baseline not in existing["recipes"]:
        raise ClaimsError(f"--baseline {baseline}: no such recipe in {claims}")
    return make_recipe(
        logs, metric=metric, source=source, documented_minimum=documented_minimum,
        description=description, min_seeds=min_seeds, root=root, trivial=trivial_of(logs, root),
        baseline=baseline, diagnosis=diagnosis,
    )  # fmt: skip


def update_claims(path: Path, name: str, entry: dict[str, Any]) -> None:
    """Set one recipe's entry; a lock keeps two publishers from losing each other's update."""
    with FileLock(str(path) + ".lock"):
        claims = load_claims(path) if path.is_file() else {"recipes": {}}
        claims["recipes"][name] = entry
        write_claims(path, claims)


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
    """The documents with claims: ``docs/**/*.md`` (default: this checkout's, :data:`DOCS`)
    and the README beside ``docs/``."""
    docs = DOCS if docs is None else docs
    readme = docs.parent / "README.md" if readme is None else readme
    return sorted(docs.rglob("*.md")) + ([readme] if readme.is_file() else [])


def _shown(path: Path, root: Path = REPO_ROOT) -> str:
    """``path`` relative to the repository (``root``) where it lies inside it."""
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _render_tables(claims: dict[str, Any], text: str) -> str:
    return BLOCK.sub(
        lambda m: m.group(1) + render_table(claims, m.group(2).split()) + m.group(4), text
    )


def render_docs(
    claims: dict[str, Any],
    docs: Path | None = None,
    readme: Path | None = None,
    *,
    root: Path = REPO_ROOT,
) -> dict[Path, str]:
    """``{file: new text}`` for every document whose claims tables or inline markers are out
    of date (:func:`doc_files`; errors name a file relative to ``root``)."""
    changed = {}
    for path in doc_files(docs, readme):
        text = path.read_text(encoding="utf-8")
        new = render_markers(claims, _render_tables(claims, text), _shown(path, root))
        if new != text:
            changed[path] = new
    return changed


def update_docs(
    claims: dict[str, Any],
    docs: Path | None = None,
    readme: Path | None = None,
    *,
    root: Path = REPO_ROOT,
) -> list[str]:
    """Rewrite every document whose claims tables or inline markers are out of date
    (:func:`render_docs`); the files written, relative to ``root``."""
    written = []
    for path, text in render_docs(claims, docs, readme, root=root).items():
        atomic_write_text(path, text)
        written.append(_shown(path, root))
    return written


def doc_problems(
    claims: dict[str, Any],
    docs: Path | None = None,
    readme: Path | None = None,
    *,
    root: Path = REPO_ROOT,
) -> list[str]:
    """Every claims table and inline marker of the documents that differs from ``claims``,
    one line each (a marker's: file:line, recipe, field, its text and the claims' text; a file
    is named relative to ``root``)."""
    problems = []
    for path in doc_files(docs, readme):
        text = path.read_text(encoding="utf-8")
        shown = _shown(path, root)
        if _render_tables(claims, text) != text:
            problems.append(f"{shown}: claims tables out of date (run scripts/publish.py docs)")
        for number, m, _, new in _marker_texts(claims, text, shown):
            name, field, old = m.groups()
            if new != old:
                problems.append(
                    f"{shown}:{number}: {name} {field}: the marker reads {old!r}, "
                    f"logs/claims.json gives {new!r} (run scripts/publish.py docs)"
                )
    return problems


def check(
    claims_path: Path = CLAIMS, docs: Path | None = None, *, root: Path = REPO_ROOT
) -> list[str]:
    """Every disagreement between claims.json, the logs (relative to ``root``) and the docs
    (its tables and inline markers; empty: none)."""
    problems = []
    claims = load_claims(claims_path)
    for name, entry in claims["recipes"].items():
        try:
            logs = [root / p for p in entry["logs"]]
            fresh = make_recipe(
                logs, metric=entry["metric"], source=entry["source"],
                documented_minimum=entry["documented_minimum"],
                description=entry["description"], min_seeds=entry["min_seeds"], root=root,
                trivial=trivial_of(logs, root), baseline=entry["baseline"],
                diagnosis=entry["diagnosis"],
            )  # fmt: skip
        except (ClaimsError, OSError, ValueError) as e:
            problems.append(f"{name}: {e}")
            continue
        for field, value in fresh.items():
            if entry.get(field) != value:
                problems.append(f"{name}: {field} is {entry.get(field)!r}, the logs give {value!r}")
    return problems + doc_problems(claims, docs, root=root)
