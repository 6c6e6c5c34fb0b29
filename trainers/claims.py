"""Claims over seeds: what a published recipe promises, computed from its run logs.

``logs/claims.json`` lists, per recipe, the metric, the run log of each seed, the seeds'
mean, (sample) standard deviation, min and max, and the claim a fresh run must meet::

    claim = max(documented minimum, mean - 3 std)

A recipe with a single published seed has no spread to speak of: its claim is its documented
minimum and ``std`` is null. ``status`` is ``"published"`` when every log carries a machine
fingerprint (made by ``scripts/publish.py``) and ``"legacy"`` when none does (a log written
before fingerprints existed, listed until it is republished over seeds). A recipe declared
with ``min_seeds=1`` is ``"single-seed"``: one fingerprinted run, a measurement rather than a
claim over seeds (the lab study's modes outside its best ones), marked so in every table. ``scripts/publish.py`` writes the file; ``scripts/reproduce.py
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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainers.checkpoint import atomic_write_text
from trainers.logs import read_run_log

__all__ = [
    "ClaimsError",
    "SOURCES",
    "claim_value",
    "find_recipe",
    "load_claims",
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
    "values", "n", "mean", "std", "min", "max", "claim", "status",
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
) -> dict[str, Any]:
    """A claims.json recipe entry computed from its seeds' run logs (paths kept relative to
    ``root``, the repository)."""
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
        "claim": claim_value(documented_minimum, stats["mean"], stats["std"]),
        # "legacy": logs written before fingerprints, one seed each, awaiting republication;
        # "single-seed": declared as one run (min_seeds=1), not a claim over seeds
        "status": (
            "legacy" if not all(fingerprinted) else "single-seed" if min_seeds == 1 else "published"
        ),  # fmt: skip
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
        for field in ("mean", "std", "min", "max", "claim"):
            value = entry.get(field)
            if value is not None and not math.isfinite(value):
                raise ClaimsError(f"recipe {name!r}: {field} is not finite ({value})")
    text = json.dumps({"recipes": recipes}, indent=1, sort_keys=False) + "\n"
    return atomic_write_text(path, text)
