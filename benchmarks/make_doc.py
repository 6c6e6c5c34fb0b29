"""Build docs/benchmarks.md's results table from benchmarks/results/*.json.

Each benchmark run with ``--json benchmarks/results/<name>.json`` leaves its rounds, the
ratio and the machine there (``benchmarks/_report.py``). This script renders one table row per
benchmark (the spread of both sides, the ratio of the medians, the target, the machine it ran
on) between the markers in docs/benchmarks.md; a benchmark without a result file gets a row
that says so.

    python benchmarks/make_doc.py                  # rewrite the table from the stored results
    python benchmarks/make_doc.py --run bench_optim,bench_trainer   # run those first
    python benchmarks/make_doc.py --check          # exit 1 when the doc is not the rendering
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- results: python benchmarks/make_doc.py -->"
END = "<!-- /results -->"

# Every benchmark with a peer, in the table's order (the checks without a peer,
# bench_elastic, whatif_check and plan_check, report errors, not ratios; bench_network's
# peer is the ring all-reduce's floor, the physics of the capped links, and it needs root).
BENCHMARKS = (
    "bench_trainer",
    "bench_data",
    "bench_optim",
    "bench_adasum",
    "bench_bert",
    "bench_gnn",
    "bench_linear",
    "bench_network",
)
FIELDS = ("benchmark", "ours", "peer", "unit", "ours_rounds", "peer_rounds", "ratio", "target",
          "machine", "date")  # fmt: skip


def load(path: Path) -> dict[str, Any]:
    """A result file, checked: its fields, at least 5 rounds a side, and a ratio that is the
    rounds' peer median over our median."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"{path}: not a readable JSON result ({err})") from None
    missing = [f for f in FIELDS if f not in data]
    if missing:
        raise SystemExit(f"{path}: missing field(s) {missing}; rerun the benchmark with --json")
    for side in ("ours_rounds", "peer_rounds"):
        if len(data[side]) < 5:
            raise SystemExit(f"{path}: field {side!r} has {len(data[side])} rounds, fewer than 5")
    for where, part in [("", data), *((f"extra.{k}.", v) for k, v in _subresults(data))]:
        ratio = statistics.median(part["peer_rounds"]) / statistics.median(part["ours_rounds"])
        if abs(ratio - part["ratio"]) > 1e-9 * ratio:
            raise SystemExit(f"{path}: field '{where}ratio' {part['ratio']} is not the rounds' "
                             f"{ratio}")  # fmt: skip
    return data


def _subresults(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The further comparisons a benchmark keeps under ``extra`` (bench_data's other sizes):
    entries with both sides' rounds and a ratio."""
    extra = data.get("extra") or {}
    return [(k, v) for k, v in extra.items()
            if isinstance(v, dict) and {"ours_rounds", "peer_rounds", "ratio"} <= set(v)]  # fmt: skip


def _spread(values: list[float]) -> str:
    return f"{min(values):.4g} / {statistics.median(values):.4g} / {max(values):.4g}"


def render(results: dict[str, dict[str, Any]]) -> str:
    """The markdown table (markers included) for ``results`` (benchmark name -> result)."""
    lines = [
        BEGIN,
        "| benchmark | ours | peer | ours min / median / max | peer min / median / max | "
        "ratio (peer / ours, medians) | target | machine (CPU, capability, threads, load) | date |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in [*BENCHMARKS, *sorted(set(results) - set(BENCHMARKS))]:
        r = results.get(name)
        if r is None:
            lines.append(f"| `{name}.py` | | | no result file yet | | | | | |")
            continue
        m = r["machine"]
        gpu = f", {m['cuda']}" if m.get("cuda") else ""
        where = (f"{m['cpu']}, {m['cpu_capability']}, {m['threads']} threads, load "
                 f"{m.get('load_average')}{gpu} | {r['date']} |")  # fmt: skip
        rows = [(f"`{name}.py`", r["ours"], r["peer"], r)]
        rows += [(f"`{name}.py` ({key})", "same", "same", sub) for key, sub in _subresults(r)]
        for label, ours, peer, part in rows:
            target = part.get("target")
            met = "" if target is None else (" (met)" if part["ratio"] >= target else
                                             " (**not met**)")  # fmt: skip
            unit = part.get("unit", r["unit"])
            lines.append(
                f"| {label} | {ours} | {peer} | {_spread(part['ours_rounds'])} {unit} | "
                f"{_spread(part['peer_rounds'])} {unit} | {part['ratio']:.3f}{met} | "
                f"{'none' if target is None else f'≥ {target:.3g}'} | {where}"
            )
    lines.append(END)
    return "\n".join(lines)


def stored() -> dict[str, dict[str, Any]]:
    return {p.stem: load(p) for p in sorted(RESULTS.glob("*.json"))}


def rewritten(text: str, table: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{DOC}: the markers {BEGIN!r} and {END!r} are missing")
    head, rest = text.split(BEGIN, 1)
    return head + table + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", default="", help="benchmarks to run first, e.g. bench_optim,bench_gnn")
    p.add_argument("--check", action="store_true", help="only compare; exit 1 on a difference")
    args = p.parse_args(argv)
    for name in filter(None, args.run.split(",")):
        if name not in BENCHMARKS:
            p.error(f"--run: {name!r} is not one of {', '.join(BENCHMARKS)}")
        out = RESULTS / f"{name}.json"
        print(f"running {name} -> {out}", flush=True)
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--json",
                        str(out)], check=True)  # fmt: skip
    text = DOC.read_text(encoding="utf-8")
    new = rewritten(text, render(stored()))
    if args.check:
        if new != text:
            print(f"{DOC} is not the rendering of {RESULTS}: run python benchmarks/make_doc.py")
            return 1
        return 0
    DOC.write_text(new, encoding="utf-8")
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
