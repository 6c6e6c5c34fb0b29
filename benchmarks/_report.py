"""What every benchmark prints and saves: the spread of its rounds, the machine, the ratio.

Each benchmark times ours and the peer in paired rounds (alternating which goes first), then

- prints :func:`machine_line` once (CPU, torch's CPU capability, threads, torch version),
- prints :func:`spread` (min / median / max) for each side,
- prints ``ratio=<peer median / our median>`` as its last line (above 1: ours is faster), and
- with ``--json FILE`` writes :func:`result` (the rounds themselves, the ratio and the machine)
  for ``benchmarks/make_doc.py``, which builds docs/benchmarks.md's table from such files.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

MIN_ROUNDS = 5


def spread(times: Sequence[float], unit: str = "s", scale: float = 1.0) -> str:
    """``min X  median Y  max Z <unit>`` of ``times`` (each multiplied by ``scale``)."""
    values = [t * scale for t in times]
    return (
        f"min {min(values):.4g}  median {statistics.median(values):.4g}  "
        f"max {max(values):.4g} {unit} ({len(values)} rounds)"
    )


def cpu_model() -> str:
    """The processor's model name (``/proc/cpuinfo``; else :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, Any]:
    """The fingerprint a result is read against."""
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # other work on the machine while this ran (1-minute load average against the cores)
        "load_average": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }


def machine_line() -> str:
    m = machine()
    gpu = f", GPU {m['cuda']}" if m["cuda"] else ""
    return (
        f"machine: {m['cpu']} ({m['cores']} cores), CPU capability {m['cpu_capability']}, "
        f"{m['threads']} threads, torch {m['torch']}{gpu}, load average {m['load_average']}"
    )


def check_rounds(rounds: int) -> int:
    """``--rounds``: at least :data:`MIN_ROUNDS` paired rounds (a median of fewer says little
    on a shared machine)."""
    if rounds < MIN_ROUNDS:
        raise SystemExit(f"--rounds must be >= {MIN_ROUNDS} (paired rounds), got {rounds}")
    return rounds


def result(
    name: str,
    ours: Sequence[float],
    peer: Sequence[float],
    *,
    ours_label: str,
    peer_label: str,
    target: float | None = None,
    unit: str = "s",
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One benchmark's result: both sides' rounds, ``ratio`` = peer median / our median,
    the target ratio (``None``: none stated) and the machine."""
    ratio = statistics.median(peer) / statistics.median(ours)
    return {
        "benchmark": name,
        "ours": ours_label,
        "peer": peer_label,
        "unit": unit,
        "ours_rounds": list(ours),
        "peer_rounds": list(peer),
        "ratio": ratio,
        "target": target,
        "met": None if target is None else ratio >= target,
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        **({"extra": extra} if extra else {}),
    }


def write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` atomically (a temporary file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_args(parser: Any, *, rounds: int = 7) -> None:
    """``--rounds`` (paired rounds, at least :data:`MIN_ROUNDS`) and ``--json FILE``."""
    parser.add_argument("--rounds", type=int, default=rounds,
                        help=f"paired rounds, ours and the peer alternating (>= {MIN_ROUNDS})")  # fmt: skip
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="also write the rounds, the ratio and the machine here "
                        "(benchmarks/make_doc.py reads benchmarks/results/*.json)")  # fmt: skip


def finish(
    json_path: str | None, name: str, ours: Sequence[float], peer: Sequence[float], **fields: Any
) -> dict[str, Any]:
    """Print the machine, both sides' spread and, last, ``ratio=``; write the JSON result to
    ``json_path`` when given. Returns the result."""
    out = result(name, ours, peer, **fields)  # fields: result()'s keyword arguments
    print(machine_line())
    print(f"ours ({out['ours']}): {spread(ours, out['unit'])}")
    print(f"peer ({out['peer']}): {spread(peer, out['unit'])}")
    if json_path:
        write_json(json_path, out)
        print(f"wrote {json_path}")
    print(f"ratio={out['ratio']:.3f}")
    return out
