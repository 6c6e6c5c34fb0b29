"""Claims over seeds: what a published recipe promises, computed from its run logs.

``logs/claims.json`` lists, per recipe, the metric, the run log of each seed, the seeds'
mean, (sample) standard deviation, min and max, and the claim a fresh run must meet::

    claim = max(documented minimum, mean - 3 std)

A recipe with a single published seed has no spread to speak of: its claim is its documented
minimum and ``std`` is null.

Every recipe also states its task's **trivial level** (``trivial``: the value and how it was
computed from the data: the held-out set's majority class, the best constant masked-LM
prediction, the untrained QA head's F1) and its plain **baseline** recipe (``baseline``: the
recipe of the same task without the method, or null for a plain recipe). A claim at or below
the trivial level is no result: :func:`make_recipe` refuses it. A method that fails in a
setting is published as a **negative result** (``status: "negative"``, with its
``diagnosis``): its claim is then an upper bound that a fresh run stays under (the failure
reproduces), ``max(documented level, mean + 3 std)`` (its max for one seed), where the
documented level is the one the method fails to reach (0 if none), and the docs list it
apart. ``status`` is ``"published"`` when every log carries a machine
fingerprint (made by ``scripts/publish.py``) and ``"legacy"`` when none does (a log written
before fingerprints existed, listed until it is republished over seeds). A recipe declared
with ``min_seeds=1`` is ``"single-seed"``: one fingerprinted run, a measurement rather than a
claim over seeds (the lab study's modes outside its best ones), marked so in every table;
``"negative"`` is a failure published with its diagnosis (above). ``scripts/publish.py`` writes the file; ``scripts/reproduce.py
--full`` checks a fresh run against it; the tests recompute every number from the logs.

Example:
    >>> claims = load_claims("logs/claims.json")
    >>> name, recipe = find_recipe(claims, "logs/digits_resnest14/seed0.jsonl")
    >>> recipe["claim"], recipe["mean"], recipe["n"]
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trainers.checkpoint import atomic_write_text
from trainers.logs import read_run_log

__all__ = [
    "ClaimsError",
    "SOURCES",
    "at_trivial_level",
    "claim_met",
    "claim_value",
    "find_recipe",
    "load_claims",
    "majority_level",
    "make_recipe",
    "metric_of",
    "published_logs",
    "summarize",
    "write_claims",
]

# Where a log's headline metric is read: the end record (e.g. the GNNs' test accuracy at the
# best-validation epoch, SQuAD's F1) or the last eval record (the image classifiers' top-1).
SOURCES = ("end", "last_eval")
RECIPE_FIELDS = (
    "description", "metric", "source", "documented_minimum", "min_seeds", "logs", "seeds",
    "values", "n", "mean", "std", "min", "max", "claim", "status", "trivial", "baseline",
    "diagnosis",
)  # fmt: skip


class ClaimsError(ValueError):
    """A claims file that is missing, malformed, or does not list the log asked about."""


def published_logs(logs_dir: str | os.PathLike[str]) -> list[Path]:
    """Every run log under ``logs_dir`` (``*.jsonl``, any depth), sorted; the per-rank ledgers
    of elastic runs (``*.ledger/``) are not run logs, and a run's per-processor traces
    (``<recipe>/processors/``: the same run re-made on another processor model,
    ``scripts/cross_processor.py --add-trace``) are not runs of their own: both are left out."""
    root = Path(logs_dir)
    return sorted(
        p for p in root.rglob("*.jsonl")
        if not any(part.endswith(".ledger") or part.startswith(".") or part == "processors"
                   for part in p.relative_to(root).parts)
    )  # fmt: skip


def metric_of(records: Sequence[Mapping[str, Any]], metric: str, source: str) -> float:
    """The headline ``metric`` of a run log's records, read from ``source`` (see SOURCES).

    Raises:
        KeyError: the record is missing or lacks the metric (a truncated or failed run).
    """
    if source == "end":
        ends = [r for r in records if r.get("kind") == "end"]
        if not ends or ends[-1].get(metric) is None:
            raise KeyError(f"the log has no end record with {metric!r} (did the run finish?)")
        return float(ends[-1][metric])
    if source == "last_eval":
        evals = [r for r in records if r.get("kind") == "eval"]
        if not evals or evals[-1].get(metric) is None:
            raise KeyError(f"the log has no eval record with {metric!r}")
        return float(evals[-1][metric])
    raise ValueError(f"source must be one of {SOURCES}, got {source!r}")


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """``n``, ``mean``, sample ``std`` (None for one value), ``min``, ``max``."""
    if not values:
        raise ValueError("summarize needs at least one value")
    values = [float(v) for v in values]
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
    }


def claim_value(documented_minimum: float, mean: float, std: float | None) -> float:
    """What a fresh run must reach: ``max(documented_minimum, mean - 3 std)``."""
    if std is None:
        return float(documented_minimum)
    return max(float(documented_minimum), mean - 3.0 * std)


def negative_claim_value(stats: Mapping[str, Any]) -> float:
    """A negative result's bound, which a fresh run stays under (the failure reproduces):
    ``mean + 3 std``, or the one seed's value."""
    if stats["std"] is None:
        return float(stats["max"])
    return float(stats["mean"]) + 3.0 * float(stats["std"])


def majority_level(
    labels: Sequence[Any],
    *,
    what: str = "held-out examples",
    name: Callable[[Any], str] = str,
    kind: str = "majority class",
) -> dict[str, Any]:
    """The trivial level of a classification task: the accuracy of the best constant
    prediction on the evaluated ``labels`` (the most frequent class's share; no constant
    predictor does better). Returns ``{"value": ..., "how": ...}`` as claims store it; ``how``
    names the class (``name(label)``) and counts the ``what``."""
    counts: dict[Any, int] = {}
    for label in labels:
        key = label.item() if hasattr(label, "item") else label
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        raise ValueError(f"no labels among the {what}: the trivial level needs the evaluated set")
    best = max(sorted(counts, key=str), key=lambda k: counts[k])
    total = sum(counts.values())
    return {
        "value": counts[best] / total,
        "how": f"{kind} ({name(best)}: {counts[best]} of the {total} {what})",
    }


def at_trivial_level(value: float, entry: Mapping[str, Any]) -> bool:
    """Whether ``value`` of ``entry``'s metric is at or below its task's trivial level."""
    trivial = entry.get("trivial")
    return trivial is not None and value <= float(trivial["value"])


def claim_met(value: float, entry: Mapping[str, Any]) -> bool:
    """Whether a fresh run's ``value`` meets ``entry``'s claim: at least the claim and above
    the trivial level, or, for a negative result, at most its bound (the failure reproduces)."""
    if entry["status"] == "negative":
        return value <= float(entry["claim"])
    return value >= float(entry["claim"]) and not at_trivial_level(value, entry)


def _relative(path: str | os.PathLike[str], root: Path) -> str:
    resolved = Path(path).resolve()
    try:
        return resolved.relative_to(root.resolve()).as_posix()
    except ValueError:
        return resolved.as_posix()


def make_recipe(
    logs: Sequence[str | os.PathLike[str]],
    *,
    metric: str,
    source: str,
    documented_minimum: float,
    description: str,
    min_seeds: int = 5,
    root: str | os.PathLike[str] = ".",
    trivial: Mapping[str, Any] | None = None,
    baseline: str | None = None,
    diagnosis: str | None = None,
) -> dict[str, Any]:
    """A claims.json recipe entry computed from its seeds' run logs (paths kept relative to
    ``root``, the repository).

    ``trivial`` (``{"value", "how"}``, e.g. from :func:`majority_level`) is the task's trivial
    level, ``baseline`` the plain recipe of the same task, ``diagnosis`` (a negative result)
    why the method fails here.

    Raises:
        ClaimsError: among others, a claim (or the seeds' mean) at or below the trivial level
            for a recipe that is not declared a negative result.
    """
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    root = Path(root)
    seeds, values, fingerprinted = [], [], []
    for log in logs:
        records = read_run_log(log)
        seeds.append(records[0].get("seed"))
        fingerprinted.append(bool(records[0].get("fingerprint")))
        try:
            values.append(metric_of(records, metric, source))
        except KeyError as e:
            raise ClaimsError(f"{log}: {e.args[0]}") from None
    if len(set(seeds)) != len(seeds):
        raise ClaimsError(f"the logs repeat a seed: {seeds}; each log must be another seed")
    if any(fingerprinted) and not all(fingerprinted):
        raise ClaimsError(
            f"some logs of {list(map(str, logs))} have a machine fingerprint and some do not: "
            "republish the old ones, or list only one kind"
        )
    stats = summarize(values)
    if trivial is not None:
        trivial = {"value": float(trivial["value"]), "how": str(trivial["how"])}
        if not math.isfinite(trivial["value"]):
            raise ClaimsError(f"the trivial level is not finite ({trivial['value']})")
    if diagnosis is not None and not diagnosis.strip():
        raise ClaimsError("a negative result needs its diagnosis: say why the method fails here")
    claim = claim_value(documented_minimum, stats["mean"], stats["std"])
    if diagnosis is None and trivial is not None:
        level = trivial["value"]
        if stats["mean"] <= level:
            raise ClaimsError(
                f"the seeds' mean {metric} {stats['mean']:.4g} is at or below the task's trivial "
                f"level {level:.4g} ({trivial['how']}): a constant predictor does as well; "
                "publish it as a negative result with its diagnosis (--negative)"
            )
        if claim <= level:
            raise ClaimsError(
                f"the claim {claim:.4g} is at or below the task's trivial level {level:.4g} "
                f"({trivial['how']}): raise the documented minimum above it (every seed "
                f"reaches {stats['min']:.4g}), or publish a negative result (--negative)"
            )
    if diagnosis is not None:  # the documented minimum is then the level it fails to reach
        claim = max(float(documented_minimum), negative_claim_value(stats))
    return {
        "description": description,
        "metric": metric,
        "source": source,
        "documented_minimum": float(documented_minimum),
        "min_seeds": int(min_seeds),
        "logs": [_relative(p, root) for p in logs],
        "seeds": seeds,
        "values": values,
        **stats,
        "claim": claim,
        # "legacy": logs written before fingerprints, one seed each, awaiting republication;
        # "single-seed": declared as one run (min_seeds=1), not a claim over seeds;
        # "negative": a failure published with its diagnosis
        "status": (
            "negative"
            if diagnosis is not None
            else "legacy"
            if not all(fingerprinted)
            else "single-seed"
            if min_seeds == 1
            else "published"
        ),  # fmt: skip
        "trivial": trivial,
        "baseline": baseline,
        "diagnosis": diagnosis,
    }


def load_claims(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a claims file: ``{"recipes": {name: entry}}``."""
    path = Path(path)
    if not path.is_file():
        raise ClaimsError(f"no claims file at {path}; scripts/publish.py writes it")
    try:
        claims = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ClaimsError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    recipes = claims.get("recipes") if isinstance(claims, dict) else None
    if not isinstance(recipes, dict):
        raise ClaimsError(f"{path}: expected an object with a 'recipes' object")
    for name, entry in recipes.items():
        missing = [f for f in RECIPE_FIELDS if f not in entry]
        if missing:
            raise ClaimsError(f"{path}: recipe {name!r} lacks {', '.join(missing)}")
        if entry["source"] not in SOURCES:
            raise ClaimsError(f"{path}: recipe {name!r}: source must be one of {SOURCES}")
        if (entry["status"] == "negative") != bool(entry["diagnosis"]):
            raise ClaimsError(
                f"{path}: recipe {name!r}: a negative result, and only one, carries a diagnosis"
            )
        if entry["baseline"] is not None and entry["baseline"] not in recipes:
            raise ClaimsError(
                f"{path}: recipe {name!r}: its baseline {entry['baseline']!r} is no recipe here"
            )
    return claims


def find_recipe(
    claims: Mapping[str, Any], log: str | os.PathLike[str], *, root: str | os.PathLike[str] = "."
) -> tuple[str, dict[str, Any]]:
    """The ``(name, entry)`` of the recipe that lists ``log`` among its seeds."""
    wanted = _relative(log, Path(root))
    for name, entry in claims["recipes"].items():
        if wanted in entry["logs"]:
            return name, entry
    raise ClaimsError(
        f"{wanted} is not a seed of any recipe in the claims file; publish it with "
        "scripts/publish.py or pass the log of a published recipe"
    )


def write_claims(path: str | os.PathLike[str], claims: Mapping[str, Any]) -> Path:
    """Write the claims file atomically, recipes sorted by name."""
    recipes = dict(sorted(claims["recipes"].items()))
    for name, entry in recipes.items():
        trivial = (entry.get("trivial") or {}).get("value")
        for field, value in [*((f, entry.get(f)) for f in ("mean", "std", "min", "max", "claim")),
                             ("trivial level", trivial)]:  # fmt: skip
            if value is not None and not math.isfinite(value):
                raise ClaimsError(f"recipe {name!r}: {field} is not finite ({value})")
    text = json.dumps({"recipes": recipes}, indent=1, sort_keys=False) + "\n"
    return atomic_write_text(path, text)
