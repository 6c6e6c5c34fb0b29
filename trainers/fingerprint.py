"""The machine fingerprint of a run-log header, and when two machines compute alike.

:func:`machine_fingerprint` records what changes the numbers of a CPU or GPU run: the
processor and its SIMD flags, torch's CPU capability and the ISA pins in force, threads,
the device, the versions of every package that touches the numbers, the world size and the
git state (see docs/run_logs.md). :func:`not_comparable_reason` says why a log made on one
machine cannot be re-created exactly on another (``scripts/reproduce.py`` exits 4 then).
:data:`PORTABLE_CPU_PINS` is the environment published CPU logs are made under.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "FINGERPRINT_PACKAGES",
    "ISA_PIN_VARIABLES",
    "PORTABLE_CPU_PINS",
    "PORTABLE_EXACT_PINS",
    "PORTABLE_MODE_VERSIONS",
    "PORTABLE_ONEDNN_PINS",
    "apply_portable_mode",
    "portable_mode",
    "cpu_info",
    "device_info",
    "machine_fingerprint",
    "not_comparable_reason",
]

_REPO_ROOT = Path(__file__).resolve().parents[1]
_DISTRIBUTION = "modelzoo-trainers-pt"


# -- header -----------------------------------------------------------------------------------
def _git_sha(root: Path = _REPO_ROOT) -> str | None:
    """``git rev-parse HEAD`` of the repository holding this package, or None."""
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = out.stdout.strip()
    return sha or None


def _modelzoo_version() -> str | None:
    # trainers never imports modelzoo: read it only if the script already imported it.
    module = sys.modules.get("modelzoo")
    version = getattr(module, "__version__", None)
    if version is not None:
        return str(version)
    try:
        return importlib.metadata.version(_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


# -- machine fingerprint ----------------------------------------------------------------------
# The environment variables that pin the vector ISA of torch's CPU kernels: ATen's own
# dispatch, oneDNN's (convolutions) and MKL's (matmul; MKL_CBWR is its documented
# "conditional numerical reproducibility" switch). Published CPU logs are made under
# PORTABLE_CPU_PINS (scripts/publish.py); scripts/reproduce.py re-applies what a log recorded.
ISA_PIN_VARIABLES = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "MKL_CBWR",
    "MKL_ENABLE_INSTRUCTIONS",
    "MKL_DYNAMIC",
    "MODELZOO_PORTABLE",
)


PORTABLE_CPU_PINS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "AVX2",
}

#: The portable exact mode (``scripts/publish.py --portable``): every kernel is ATen's own at
#: AVX2 (oneDNN off: the mode sets ``torch.backends.mkldnn.enabled = False``
#: when :mod:`trainers` is imported) or MKL's on its ``COMPATIBLE`` code branch, the one MKL
#: offers for Intel and Intel-compatible processors alike (same bits at a fixed thread count).
#: Its ``AVX2`` branch is Intel-only (on other vendors MKL falls back to its AUTO dispatch):
#: measured, the first mode (``MKL_CBWR=AVX2,STRICT``) parted between an AMD EPYC and an Intel
#: Xeon at MKL's small-N ``sgemm`` in every family (docs/run_logs.md). ``MKL_DYNAMIC=FALSE``:
#: MKL may not lower the thread count by itself (a CNR condition MKL names for runs on different
#: systems). oneDNN picks its kernels and blockings by processor; ATen's kernels depend on
#: the pinned capability and the thread count only.
#:
#: ``MODELZOO_PORTABLE`` is the mode's version. ``1``: the above. ``2`` (the current one) adds
#: correctly rounded square roots (:mod:`trainers._portable_ops`): ATen computes ``sqrt`` with
#: MKL's vector math library, whose code path MKL picks by processor whatever ``MKL_CBWR``
#: says (measured: Adam's ``exp_avg_sq.sqrt()`` parted an Intel Xeon and an AMD EPYC at the
#: first step of ``karate_gcn``). Logs made in version 1 are re-created in version 1.
PORTABLE_EXACT_PINS = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "COMPATIBLE",
    "MKL_DYNAMIC": "FALSE",
    "MODELZOO_PORTABLE": "2",
}

#: The portable exact mode with oneDNN kept on, at AVX2 (``ONEDNN_MAX_CPU_ISA``), for the
#: convolution recipes, which run 7x slower on ATen's own convolutions. oneDNN may choose its
#: blockings by processor, so this variant holds for a recipe only where a pair verifies it.
PORTABLE_ONEDNN_PINS = {**PORTABLE_EXACT_PINS, "MODELZOO_PORTABLE": "2-onednn"}

#: The versions of the portable exact mode (``MODELZOO_PORTABLE``) this code runs.
PORTABLE_MODE_VERSIONS = ("1", "2", "2-onednn")


def portable_mode() -> bool:
    """Whether this process runs in the portable exact mode (``MODELZOO_PORTABLE`` set to one
    of :data:`PORTABLE_MODE_VERSIONS`)."""
    return os.environ.get("MODELZOO_PORTABLE") in PORTABLE_MODE_VERSIONS


def apply_portable_mode() -> bool:
    """In the portable exact mode: turn oneDNN off (convolutions, GELU and the other ops it
    would take run on ATen's kernels; not in the ``-onednn`` variant) and, from version 2
    on, replace ATen's CPU square root with a correctly rounded one. Called when
    :mod:`trainers` is imported; returns whether the mode is on. An unknown version is
    refused (exit 2: it would run another mode's kernels under that mode's name)."""
    version = os.environ.get("MODELZOO_PORTABLE")
    if not version:
        return False
    if version not in PORTABLE_MODE_VERSIONS:
        print(
            f"error: MODELZOO_PORTABLE={version!r}: this code runs the portable exact mode's "
            f"versions {', '.join(PORTABLE_MODE_VERSIONS)} (docs/run_logs.md); unset it or use "
            "one of those",
            file=sys.stderr,
        )
        raise SystemExit(2)
    number, _, variant = version.partition("-")
    if variant != "onednn":
        torch.backends.mkldnn.enabled = False
    if int(number) >= 2:
        from . import _portable_ops  # noqa: PLC0415

        _portable_ops.install()
    return True


# Packages whose code computes or feeds the numbers of some script.
FINGERPRINT_PACKAGES = (
    "numpy", "Pillow", "scikit-learn", "tokenizers", "torch_geometric", "safetensors",
)  # fmt: skip


def cpu_info() -> dict[str, Any]:
    """Architecture, vendor, model name, family/model numbers and the SIMD flags that decide
    which kernels torch, oneDNN and MKL run (from ``/proc/cpuinfo`` where there is one)."""
    info: dict[str, Any] = {
        "arch": platform.machine(),
        "vendor": None,
        "model_name": platform.processor() or None,
        "family": None,
        "model": None,
        "flags": [],
    }
    keys = {
        "vendor_id": "vendor",
        "model name": "model_name",
        "cpu family": "family",
        "model": "model",
    }
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return info
    first = text.split("\n\n", 1)[0]  # one processor block is enough
    for line in first.splitlines():
        name, _, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if name in keys:
            info[keys[name]] = (
                int(value) if name in ("cpu family", "model") and value.isdigit() else value
            )
        elif name in ("flags", "Features"):
            simd = ("avx", "fma", "f16c", "amx", "sve", "neon", "asimd")
            info["flags"] = sorted(f for f in value.split() if f.startswith(simd))
    return info


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_info() -> dict[str, Any]:
    """``{"type": "cpu"}``, or the CUDA device's name, capability and CUDA/cuDNN/NCCL versions."""
    if not torch.cuda.is_available():
        return {"type": "cpu"}
    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    nccl = None
    with contextlib.suppress(AttributeError, RuntimeError):
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {
        "type": "cuda",
        "name": torch.cuda.get_device_name(index),
        "capability": f"{major}.{minor}",
        "count": torch.cuda.device_count(),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "nccl": nccl,
    }


def _git_state(root: Path = _REPO_ROOT) -> dict[str, Any]:
    """``{"commit", "dirty", "dirty_paths"}`` of the checkout holding this package.

    ``dirty`` is True when a tracked file outside ``logs/`` differs from the commit: the
    published logs and ``logs/claims.json`` are outputs (``scripts/publish.py`` updates them
    between seeds), not code. ``dirty_paths`` lists every changed tracked path (up to 50,
    ``logs/`` included), so a reader sees what differed. Untracked files do not count.
    """
    sha = _git_sha(root)
    if sha is None:
        return {"commit": None, "dirty": None, "dirty_paths": None}
    try:
        out = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, timeout=10, check=True,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {"commit": sha, "dirty": None, "dirty_paths": None}
    paths = [line[3:].split(" -> ")[-1] for line in out.stdout.splitlines() if line.strip()]
    code = [p for p in paths if not p.startswith("logs/")]
    return {"commit": sha, "dirty": bool(code), "dirty_paths": paths[:50]}


def machine_fingerprint(world_size: int = 1) -> dict[str, Any]:
    """Everything about this machine and software that changes the numbers of a run.

    docs/run_logs.md lists the fields; ``scripts/reproduce.py`` decides from two fingerprints
    whether a rerun can re-create a log exactly.
    """
    return {
        "cpu": cpu_info(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "isa_pins": {name: os.environ.get(name) for name in ISA_PIN_VARIABLES},
        "threads": torch.get_num_threads(),
        "device": device_info(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "onednn": bool(torch.backends.mkldnn.enabled),
        "world_size": int(world_size),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "modelzoo": _modelzoo_version(),
            **{name: _package_version(name) for name in FINGERPRINT_PACKAGES},
        },
        "git": _git_state(),
    }


# -- comparability ----------------------------------------------------------------------------
def _supports(cpu: Mapping[str, Any], pins: Mapping[str, Any]) -> str | None:
    """Why this CPU cannot run kernels at the pinned ISA level, or None if it can."""
    level = (pins.get("ATEN_CPU_CAPABILITY") or "").lower()
    needed = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq")}
    missing = [f for f in needed.get(level, ()) if f not in set(cpu.get("flags") or ())]
    if missing:
        return f"the log pins ATEN_CPU_CAPABILITY={level} but this CPU lacks {', '.join(missing)}"
    return None


def _processor(cpu: Mapping[str, Any]) -> str:
    return (
        f"{cpu.get('vendor')} family {cpu.get('family')} model {cpu.get('model')} "
        f"({cpu.get('model_name')})"
    )


def not_comparable_reason(
    recorded: Mapping[str, Any] | None,
    here: Mapping[str, Any],
    *,
    portable_verified: str | None = None,
    portable_refuted: str | None = None,
) -> str | None:
    """Why a log with fingerprint ``recorded`` cannot be re-created exactly on the machine with
    fingerprint ``here`` (after re-applying the recorded threads and ISA pins), or None.

    The rules (docs/run_logs.md): same architecture and device (CUDA: the same GPU model and
    capability); a pinned ISA level this CPU supports, or, for an unpinned log, the same
    ATen capability; and the same processor (vendor, family, model). The last rule is
    measured, not assumed: under the same AVX2 pins, logs made on another processor diverged
    on an Intel Sapphire Rapids within 10 steps (oneDNN and MKL pick blockings by processor),
    so a trace is only called reproducible on the processor model that made it.

    A log made in the portable exact mode (:data:`PORTABLE_EXACT_PINS`, its ``isa_pins``
    has ``MODELZOO_PORTABLE`` set) is exempt from the processor rule when
    ``portable_verified`` names the evidence that the mode holds for its recipe across
    processors (``scripts/reproduce.py`` reads it from ``logs/cross_processor.json``); without
    it, the rule stands and the reason says the mode is not verified yet, or, with
    ``portable_refuted`` (a rerun on another processor model that differed), that it was
    refuted for the recipe.
    """
    if not recorded:
        return (
            "the log has no machine fingerprint (written before fingerprints were recorded); "
            "republish it with scripts/publish.py"
        )
    rec_cpu, cpu = recorded.get("cpu") or {}, here.get("cpu") or {}
    if rec_cpu.get("arch") != cpu.get("arch"):
        return f"the log was made on {rec_cpu.get('arch')}, this machine is {cpu.get('arch')}"
    rec_dev, dev = recorded.get("device") or {}, here.get("device") or {}
    if rec_dev.get("type") == "cuda":
        if dev.get("type") != "cuda":
            return (
                f"the log was made on a CUDA device ({rec_dev.get('name')}); this machine has none"
            )
        if (rec_dev.get("name"), rec_dev.get("capability")) != (
            dev.get("name"),
            dev.get("capability"),
        ):
            return (
                f"the log was made on {rec_dev.get('name')} (sm {rec_dev.get('capability')}), "
                f"this machine has {dev.get('name')} (sm {dev.get('capability')})"
            )
    pins = recorded.get("isa_pins") or {}
    if pins.get("ATEN_CPU_CAPABILITY"):
        reason = _supports(cpu, pins)
        if reason:
            return reason
    elif recorded.get("cpu_capability") != here.get("cpu_capability"):
        return (
            f"the log ran unpinned CPU kernels at {recorded.get('cpu_capability')}, this machine "
            f"runs {here.get('cpu_capability')}; only logs made with the ISA pinned can be "
            "re-created on another ISA"
        )
    key = ("vendor", "family", "model")
    portable = (pins.get("MODELZOO_PORTABLE") or "") in PORTABLE_MODE_VERSIONS
    if tuple(rec_cpu.get(k) for k in key) != tuple(cpu.get(k) for k in key):
        if portable and portable_verified:
            return None
        if portable and portable_refuted:
            return (
                f"the log was made on {_processor(rec_cpu)} in the portable exact mode, this "
                f"machine is {_processor(cpu)}, and a rerun on another processor model refuted "
                f"the mode for this recipe ({portable_refuted}; docs/run_logs.md)"
            )
        if portable:
            return (
                f"the log was made on {_processor(rec_cpu)} in the portable exact mode, this "
                f"machine is {_processor(cpu)}, and no rerun on a processor of the other "
                "vendor has verified the mode for this recipe yet (scripts/cross_processor.py, "
                "docs/run_logs.md)"
            )
        return (
            f"the log was made on {_processor(rec_cpu)}, this machine is {_processor(cpu)}: "
            "oneDNN and MKL choose kernels by processor, so the trace can differ in the last "
            "bits even under the same ISA pins"
        )
    return None
