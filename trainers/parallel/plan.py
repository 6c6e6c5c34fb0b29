"""The placement planner: tensor/pipeline/data-parallel degrees, stage boundaries, micro-batches
and schedule for a zoo model on a hierarchical network, under a per-device memory limit.

NEST's idea (network-, compute- and memory-aware device placement by dynamic programming,
Wang et al.), solved exactly without an ILP solver: every ``(tp, pp, dp, M, schedule)`` with
``tp * pp * dp = devices`` is enumerated, and for each an exact chain DP over the model's
blocks (those of :func:`trainers.parallel.pipeline.model_blocks`) finds the contiguous stage
boundaries with the smallest predicted step time whose stages all fit in memory.

Usage::

    python -m trainers.parallel.plan --model bert_24_1024_16 --seq-len 128 \\
        --global-batch 256 --devices 16 --memory-gb 16 --network "8:2400:3e-6,2:200:1e-5" \\
        [--save-profile prof.json | --profile prof.json] [--top 5] [--json plan.json]

    profile = profile_model("bert_24_1024_16", seq_len=128)
    best = plan(profile, Network.parse("8:2400:3e-6,2:200:1e-5"), global_batch=256,
                memory_bytes=16 * 2**30)
    best.flags()   # {"tensor_parallel": ..., "pipeline_parallel": ..., "micro_batches": ...,
                   #  "schedule": ..., "boundaries": [...]}

**Profile** (:func:`profile_model`, on the machine at hand). Every block ``k`` of the chain is
run forward and backward at a profiling micro-batch ``b0`` (``warmup`` runs, then the median
of ``repeats``): forward seconds ``F_k``, backward seconds ``B_k`` (including the gradient of
the block's input, as in a pipeline), the bytes autograd saves for the backward ``a_k``
(counted with ``torch.autograd.graph.saved_tensors_hooks``, each storage once, parameters
excluded), the bytes of its outputs ``o_k`` (what a stage sends on), its parameter bytes
``w_k`` and one AdamW step over its parameters ``O_k``. The times are measured again at a
smaller micro-batch ``b1`` (default 2) to fit a fixed per-call part ``F0_k, B0_k`` (Python and
kernel-launch overhead, and the lower efficiency of small matrix products).
For a Transformer layer it also records the bytes of the tensors tensor parallelism shards
``w^tp_k`` (the column-parallel ``qkv`` and ``fc1`` weights and biases, the row-parallel
``proj`` and ``fc2`` weights: the layout of :func:`trainers.parallel.parallelize_bert`), the
part of ``a_k`` that shards, ``a^tp_k`` (from the saved bytes of a copy of the layer cut to
``1/t`` of its heads and hidden units), and the bytes of one Megatron all-reduce
``r_k = o_k`` (the ``(b, T, C)`` hidden states). Blocks that are structurally identical with
identically shaped inputs (BERT's layers, ResNeSt's repeated bottlenecks) are measured once.

**Scaling assumption.** At micro-batch ``b``::

    F_k(b) = F0_k + (F_k - F0_k) b / b0        (B_k likewise: affine in b)
    a_k(b) = a_k b / b0,  o_k(b) = o_k b / b0,  r_k(b) = r_k b / b0      (linear in b)

**Network.** Levels innermost first, ``size:gbps:latency_s`` each; the product of the sizes is
the number of devices and level ``l`` groups ``size_0 * ... * size_l`` consecutive ranks.
Ranks are laid out as Megatron-LM does, tensor parallel innermost:
``rank = d * (tp * pp) + p * tp + t``. A collective over a group, or a message between two
ranks, runs at the bandwidth ``W_l`` (bytes/s) and latency ``alpha_l`` of the outermost level
its members span (the slowest); every group of a kind is taken at its slowest instance.
Bandwidth is per device: concurrent groups on one level do not share it. With ``S`` bytes::

    AR_N(S)  = 2 (N - 1) / N * S / W_l + 2 (N - 1) alpha_l    (ring all-reduce over N ranks,
                                                               scripts/scaling_whatif.py)
    P2P(S)   = S / W_l + alpha_l                               (one message)

**Tensor parallelism** (degree ``tp``, only blocks marked ``tensor_parallel``: BERT's layers;
embeddings and heads are replicated, as in :mod:`trainers.parallel.tensor`)::

    F'_k = rho_k(tp) F_k(b) + 2 AR_tp(r_k(b)),   B'_k = rho_k(tp) B_k(b) + 2 AR_tp(r_k(b))
    w'_k = w_k - w^tp_k + w^tp_k / tp,      a'_k = a_k(b) - a^tp_k(b) + a^tp_k(b) / tp

where ``rho_k(tp)`` is the measured time of one rank's share of the layer (its heads and
feed-forward units at the profile's micro-batch) over the whole layer's: more than ``1 / tp``
where the smaller matrix products run less efficiently, and ``1 / tp`` for a profile that
does not list the degree
(two all-reduces forward, after the attention output and the second feed-forward linear,
and two backward, for the input gradients of ``qkv`` and ``fc1``). Other blocks: ``F'_k =
F_k(b)``, ``w'_k = w_k``, ... The optimizer step scales with the local parameters,
``O'_k = O_k w'_k / w_k``.

**Pipeline** (``S = pp`` stages, stage ``s`` holds blocks ``beta_s .. beta_{s+1} - 1``, ``M``
micro-batches of ``b = G / (dp M)`` samples, ``G`` the global batch). Per micro-batch, a
stage's forward includes receiving its input and its backward receiving its output's
gradient (the same size)::

    f_s = sum_k F'_k + [s > 0] P2P(o_{beta_s - 1}(b))
    g_s = sum_k B'_k + [s < S - 1] P2P(o_{beta_{s+1} - 1}(b))
    u_s = f_s + g_s

    T_pipe = sum_s u_s + (M - 1) (max_s f_s + max_s g_s)

For GPipe (all forwards, then all backwards) this is exact: it is the makespan of two flow
shops of ``M`` identical jobs, checked against an event simulation of the schedule in the
tests. With ``f_s`` and ``g_s`` in proportion it is the familiar ``(M - 1) max_s t_s + sum_s
t_s``. For 1F1B (PyTorch's ``Schedule1F1B``: ``min(M, S - s)`` warm-up forwards on stage
``s``, then one backward, one forward) the same value is an upper bound, equal for balanced
stages; the event simulation shows 1F1B never slower than GPipe and, on strongly unbalanced
random stages, up to about 30 % faster. So the two schedules are predicted equally fast and
differ in memory; PyTorch's 1F1B needs ``M >= S``. The search therefore considers GPipe only
where 1F1B is not allowed (``M < S``) or not asked for: elsewhere 1F1B has the same predicted
time with the same boundaries and never holds more activations.

**Data parallelism and the update.** After the pipeline, each stage's ``dp`` replicas
all-reduce its gradients (fp32, the local parameter bytes ``W_s = sum_k w'_k``) and step the
optimizer; with an overlap fraction ``o`` (default 0: the gradient all-reduce starts after the
backward, as ``trainers.parallel``'s data-parallel averaging does)::

    E_s = max(0, AR_dp(W_s) - o M sum_k B'_k) + sum_k O'_k

    T_step = T_pipe + max_s E_s

**Memory** per device on stage ``s``, with ``phi`` the optimizer-state factor (default 4:
weights, gradients and Adam's two moments) and ``n_s`` micro-batches of activations held
(GPipe ``M``; 1F1B ``min(M, S - s)``)::

    mem_s = phi W_s + n_s sum_k a'_k(b)         mem = max_s mem_s <= limit

**Search.** For each ``(tp, pp, dp, M, schedule)`` the boundaries minimise ``T_step`` exactly:
a DP over (stage, first ``i`` blocks) keeps every Pareto-optimal label ``(sum u, max f, max g,
max E)`` (the objective grows with each), drops stages over the memory limit, and prunes
labels whose lower bound (remaining compute added, remaining single blocks in the maxima)
cannot reach the ``k`` best plans found so far. :func:`brute_force` enumerates every split
instead (for the tests). Plans are ranked by ``T_step``, then memory.

**Limits.** Profiles from this CPU stand in for an accelerator's times: ``--compute-scale`` or
``--device-tflops`` scales them uniformly, which keeps the CPU's relative costs of the blocks
(an accelerator's attention, LayerNorm and GEMM ratios differ). Activations are counted at
the profile's dtype (fp32 here; mixed precision roughly halves them). Compute does not
overlap communication except as ``o`` says; all-reduces in one level do not contend for
links; the pipeline's warm-up of the data loader, the loss and gradient clipping are not
modelled. ``--runtime-only`` leaves out what ``trainers.parallel`` cannot run: tensor
parallelism of a model without splittable blocks (ResNeSt). ``benchmarks/plan_check.py``
measures the error on this machine.
"""

from __future__ import annotations

import argparse
import bisect
import copy
import dataclasses
import itertools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainers.parallel.pipeline import PIPELINE_SCHEDULES, model_blocks

__all__ = [
    "BlockProfile",
    "InfeasiblePlanError",
    "Level",
    "Network",
    "ParallelConfig",
    "Plan",
    "Prediction",
    "Profile",
    "allreduce_time",
    "brute_force",
    "load_plan",
    "load_profile",
    "main",
    "p2p_time",
    "plan",
    "predict_step_time",
    "profile_model",
    "save_plan",
    "save_profile",
    "top_plans",
]

SCHEDULES = PIPELINE_SCHEDULES  # ("gpipe", "1f1b")
PROFILE_FORMAT = 1
PLAN_FORMAT = 1
DEFAULT_OPTIMIZER_STATE_FACTOR = 4.0
DEFAULT_MAX_MICRO_BATCHES = 64
_MISSING = object()


# ---- validation helpers ------------------------------------------------------------------------


def _get(data: Mapping[str, Any], key: str, where: str, kind: type, *, default: Any = _MISSING,
         minimum: float | None = None) -> Any:  # fmt: skip
    """``data[key]`` checked to be of ``kind`` (int, float, str, bool, list, dict)."""
    if key not in data:
        if default is not _MISSING:
            return default
        raise ValueError(f"{where}: missing field {key!r}")
    value = data[key]
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
        what = "an integer"
    elif kind is float:
        ok = (
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        )
        what = "a finite number"
    elif kind is str:
        ok = isinstance(value, str) and bool(value)
        what = "a non-empty string"
    else:
        ok = isinstance(value, kind)
        what = f"a {'JSON object' if kind is dict else kind.__name__}"
    if not ok:
        raise ValueError(f"{where}: field {key!r} must be {what}, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{where}: field {key!r} must be >= {minimum:g}, got {value!r}")
    return float(value) if kind is float else value


def _check_unknown(data: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; known: "
            f"{', '.join(sorted(known))}"
        )


def _read_json(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: no such {what} file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON {what} file ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a {what} file holds a JSON object, got {type(data).__name__}")
    return data


def _write_json(path: str | os.PathLike[str], data: Mapping[str, Any]) -> Path:
    from trainers.checkpoint import atomic_write_text

    return atomic_write_text(path, json.dumps(data, indent=1, sort_keys=False) + "\n")


# ---- profile -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockProfile:
    """One block's costs at the profile's micro-batch (see the module docstring).

    Attributes:
        name: e.g. ``"embeddings"``, ``"layer3"``, ``"head"``.
        forward_s: forward seconds ``F_k``; ``forward_fixed_s`` of it do not scale with the batch.
        backward_s: backward seconds ``B_k`` (input gradient included); ``backward_fixed_s``.
        activation_bytes: bytes saved for the backward ``a_k``.
        output_bytes: bytes of the outputs ``o_k`` (sent to the next stage; the gradient sent
            back is taken to be as large).
        param_bytes: parameter bytes ``w_k``.
        optimizer_s: one AdamW step over the block's parameters ``O_k`` (batch-independent).
        tensor_parallel: tensor parallelism splits the block (BERT's layers).
        tp_param_bytes: the part of ``param_bytes`` that is sharded ``w^tp_k``.
        tp_activation_bytes: the part of ``activation_bytes`` that is sharded ``a^tp_k``.
        tp_allreduce_bytes: bytes of one of its four all-reduces ``r_k``.
        flops: forward + backward floating-point operations (0: unknown).
        tp_time_ratio: per tensor-parallel degree ``t`` (a string key, JSON's), the measured
            forward + backward time of one rank's share of the layer (``num_heads / t`` heads,
            ``intermediate / t`` units) over the whole layer's, ``rho_k(t)``; a degree not
            listed is taken to split the time perfectly (``1 / t``).
    """

    name: str
    forward_s: float
    backward_s: float
    activation_bytes: float
    output_bytes: float
    param_bytes: float
    forward_fixed_s: float = 0.0
    backward_fixed_s: float = 0.0
    optimizer_s: float = 0.0
    tensor_parallel: bool = False
    tp_param_bytes: float = 0.0
    tp_activation_bytes: float = 0.0
    tp_allreduce_bytes: float = 0.0
    flops: float = 0.0
    tp_time_ratio: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any, where: str) -> BlockProfile:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: must be a JSON object, got {data!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        _check_unknown(data, names, where)
        values: dict[str, Any] = {"name": _get(data, "name", where, str)}
        for f in dataclasses.fields(cls)[1:]:
            if f.name == "tensor_parallel":
                values[f.name] = _get(data, f.name, where, bool, default=False)
            elif f.name == "tp_time_ratio":
                ratios = _get(data, f.name, where, dict, default={})
                for key, value in ratios.items():
                    if not (key.isdigit() and int(key) > 1) or isinstance(value, bool) or not (
                        isinstance(value, (int, float)) and 0 < value <= 2
                    ):  # fmt: skip
                        raise ValueError(
                            f"{where}: field 'tp_time_ratio' maps degrees > 1 (as strings) to "
                            f"time ratios in (0, 2]; got {key!r}: {value!r}"
                        )
                values[f.name] = {k: float(v) for k, v in ratios.items()}
            else:
                default = _MISSING if f.default is dataclasses.MISSING else f.default
                values[f.name] = _get(data, f.name, where, float, default=default, minimum=0.0)
        for part, whole in (
            ("forward_fixed_s", "forward_s"),
            ("backward_fixed_s", "backward_s"),
            ("tp_param_bytes", "param_bytes"),
            ("tp_activation_bytes", "activation_bytes"),
        ):
            if values[part] > values[whole] * (1 + 1e-9):
                raise ValueError(
                    f"{where}: field {part!r} ({values[part]:g}) is larger than {whole!r} "
                    f"({values[whole]:g}); it is the part of it that {_PART_OF[part]}"
                )
        if not values["tensor_parallel"]:
            for name in ("tp_param_bytes", "tp_activation_bytes", "tp_allreduce_bytes",
                         "tp_time_ratio"):  # fmt: skip
                if values[name]:
                    raise ValueError(
                        f"{where}: field {name!r} is set but 'tensor_parallel' is false; set "
                        "'tensor_parallel': true for a block that tensor parallelism splits"
                    )
        return cls(**values)


_PART_OF = {
    "forward_fixed_s": "does not scale with the micro-batch",
    "backward_fixed_s": "does not scale with the micro-batch",
    "tp_param_bytes": "tensor parallelism shards",
    "tp_activation_bytes": "tensor parallelism shards",
}


@dataclass(frozen=True)
class Profile:
    """Per-block costs of a model at micro-batch ``batch`` (JSON: :meth:`to_dict`).

    The JSON schema (``format`` 1)::

        {"format": 1, "model": "bert_24_1024_16", "model_config": {...overrides...},
         "seq_len": 128 | "image_size": 224, "batch": 4,
         "tensor_parallel_degrees": [1, 2, 4, 8, 16],
         "source": {"device": "cpu", "cpu_capability": "AVX512", "torch": "2.13.0", ...},
         "blocks": [{"name": "embeddings", "forward_s": 0.01, "backward_s": 0.02,
                     "activation_bytes": 1e6, "output_bytes": 2e6, "param_bytes": 1.3e8,
                     ...the optional fields of BlockProfile...}, ...]}

    Exactly one of ``seq_len`` (BERT) and ``image_size`` (ResNeSt) is given.
    ``tensor_parallel_degrees`` lists the degrees the model divides into (BERT: those that
    divide the head count and the intermediate size; always includes 1).
    """

    model: str
    batch: int
    blocks: tuple[BlockProfile, ...]
    seq_len: int | None = None
    image_size: int | None = None
    tensor_parallel_degrees: tuple[int, ...] = (1,)
    model_config: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": PROFILE_FORMAT, "model": self.model}
        if self.model_config:
            data["model_config"] = dict(self.model_config)
        if self.seq_len is not None:
            data["seq_len"] = self.seq_len
        if self.image_size is not None:
            data["image_size"] = self.image_size
        data["batch"] = self.batch
        data["tensor_parallel_degrees"] = list(self.tensor_parallel_degrees)
        data["source"] = dict(self.source)
        data["blocks"] = [dataclasses.asdict(b) for b in self.blocks]
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "profile") -> Profile:
        """Validated; errors name ``where`` (the file) and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a profile is a JSON object, got {type(data).__name__}")
        known = ("format", "model", "model_config", "seq_len", "image_size", "batch",
                 "tensor_parallel_degrees", "source", "blocks")  # fmt: skip
        _check_unknown(data, known, where)
        fmt = _get(data, "format", where, int)
        if fmt != PROFILE_FORMAT:
            raise ValueError(
                f"{where}: field 'format' is {fmt}; this planner reads format {PROFILE_FORMAT}"
            )
        model = _get(data, "model", where, str)
        seq_len = _get(data, "seq_len", where, int, default=None, minimum=1)
        image_size = _get(data, "image_size", where, int, default=None, minimum=1)
        if (seq_len is None) == (image_size is None):
            raise ValueError(
                f"{where}: give exactly one of the fields 'seq_len' (BERT) and 'image_size' "
                "(ResNeSt)"
            )
        batch = _get(data, "batch", where, int, minimum=1)
        degrees = _get(data, "tensor_parallel_degrees", where, list, default=[1])
        if not degrees or any(
            not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in degrees
        ) or 1 not in degrees:  # fmt: skip
            raise ValueError(
                f"{where}: field 'tensor_parallel_degrees' must be a list of positive integers "
                f"that includes 1, got {degrees!r}"
            )
        blocks_data = _get(data, "blocks", where, list)
        if not blocks_data:
            raise ValueError(f"{where}: field 'blocks' is empty; a profile needs its blocks")
        blocks = tuple(
            BlockProfile.from_dict(b, f"{where}: blocks[{i}]") for i, b in enumerate(blocks_data)
        )
        return cls(
            model=model,
            batch=batch,
            blocks=blocks,
            seq_len=seq_len,
            image_size=image_size,
            tensor_parallel_degrees=tuple(sorted(set(degrees))),
            model_config=dict(_get(data, "model_config", where, dict, default={})),
            source=dict(_get(data, "source", where, dict, default={})),
        )

    def scaled(self, compute_scale: float) -> Profile:
        """Every time (compute and optimizer) multiplied by ``compute_scale`` (a device that
        is ``1 / compute_scale`` times as fast as the profiling one)."""
        if not compute_scale > 0:
            raise ValueError(f"compute scale must be > 0, got {compute_scale}")
        times = ("forward_s", "backward_s", "forward_fixed_s", "backward_fixed_s", "optimizer_s")
        blocks = tuple(
            dataclasses.replace(b, **{t: getattr(b, t) * compute_scale for t in times})
            for b in self.blocks
        )
        previous = float(self.source.get("compute_scale", 1.0))
        source = {**self.source, "compute_scale": previous * compute_scale}
        return dataclasses.replace(self, blocks=blocks, source=source)

    def achieved_tflops(self) -> float:
        """Floating-point rate of the profiled forward + backward passes (0: no FLOP counts)."""
        flops = sum(b.flops for b in self.blocks)
        seconds = sum(b.forward_s + b.backward_s for b in self.blocks)
        return flops / seconds / 1e12 if flops > 0 and seconds > 0 else 0.0

    def description(self) -> str:
        """``"bert_24_1024_16 (num_layers=48, ...), seq 128"``: the model and its input."""
        text = self.model
        if self.model_config:
            text += " (" + ", ".join(f"{k}={v}" for k, v in self.model_config.items()) + ")"
        if self.seq_len is not None:
            return f"{text}, seq {self.seq_len}"
        return f"{text}, image {self.image_size}"


def load_profile(path: str | os.PathLike[str]) -> Profile:
    """A profile JSON file (schema: :class:`Profile`); ``ValueError`` names the file and field."""
    return Profile.from_dict(_read_json(path, "profile"), where=str(path))


def save_profile(profile: Profile, path: str | os.PathLike[str]) -> Path:
    """Write ``profile`` atomically (temporary file + ``os.replace``)."""
    return _write_json(path, profile.to_dict())


# ---- network -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """One level of the network: ``size`` units of the level below, joined at ``gbps`` per
    device with ``latency_s`` per message."""

    size: int
    gbps: float
    latency_s: float

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8


def allreduce_time(nbytes: float, members: int, gbps: float, latency_s: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``members`` ranks: ``2 (N-1)/N S/B + 2 (N-1) a``."""
    if members <= 1:
        return 0.0
    rate = gbps * 1e9 / 8
    return 2 * (members - 1) / members * nbytes / rate + 2 * (members - 1) * latency_s


def p2p_time(nbytes: float, gbps: float, latency_s: float) -> float:
    """One message of ``nbytes``: ``S / B + a``."""
    return nbytes / (gbps * 1e9 / 8) + latency_s


@dataclass(frozen=True)
class Network:
    """A hierarchical network, levels innermost first (see the module docstring)."""

    levels: tuple[Level, ...]

    @classmethod
    def parse(cls, text: str, *, devices: int | None = None) -> Network:
        """``"size:gbps:latency_s,..."`` innermost first, e.g. ``"8:2400:3e-6,2:200:1e-5"``
        (8 devices per node on an NVLink-class link, 2 nodes at 200 Gbps).

        Raises:
            ValueError: a malformed level, or the sizes' product is not ``devices``.
        """
        levels = []
        parts = [p.strip() for p in str(text).split(",")]
        for index, part in enumerate(parts):
            fields = part.split(":")
            try:
                if len(fields) != 3:
                    raise ValueError
                size, gbps, latency = int(fields[0]), float(fields[1]), float(fields[2])
            except ValueError:
                raise ValueError(
                    f"network {text!r}: level {index} {part!r} must be size:gbps:latency_s "
                    "(e.g. 8:2400:3e-6 for 8 devices joined at 2400 Gbps, 3 us per message)"
                ) from None
            if size < 1 or not (gbps > 0 and math.isfinite(gbps)) or not (
                latency >= 0 and math.isfinite(latency)
            ):  # fmt: skip
                raise ValueError(
                    f"network {text!r}: level {index} {part!r} needs size >= 1, gbps > 0 and "
                    "latency_s >= 0"
                )
            levels.append(Level(size, gbps, latency))
        network = cls(tuple(levels))
        if devices is not None and network.devices != devices:
            sizes = " x ".join(str(level.size) for level in levels)
            raise ValueError(
                f"network {text!r} describes {network.devices} devices ({sizes}) but there are "
                f"{devices}; make the product of the level sizes equal the number of devices"
            )
        return network

    def __str__(self) -> str:
        return ",".join(f"{lv.size}:{lv.gbps:g}:{lv.latency_s:g}" for lv in self.levels)

    @property
    def devices(self) -> int:
        return math.prod(level.size for level in self.levels)

    def level_of(self, ranks: Iterable[int]) -> int:
        """The outermost level the ``ranks`` span (``-1``: a single rank, no link)."""
        ranks = list(ranks)
        lo, hi = min(ranks), max(ranks)
        if lo == hi:
            return -1
        unit = 1
        for index, level in enumerate(self.levels):
            unit *= level.size
            if lo // unit == hi // unit:
                return index
        return len(self.levels) - 1

    def scaled(self, level: int, *, gbps: float = 1.0, latency: float = 1.0) -> Network:
        """A copy with level ``level``'s bandwidth and latency multiplied (for what-ifs)."""
        levels = list(self.levels)
        old = levels[level]
        levels[level] = Level(old.size, old.gbps * gbps, old.latency_s * latency)
        return Network(tuple(levels))


def _layout_levels(network: Network, tp: int, pp: int, dp: int) -> tuple[int, int, list[int]]:
    """Levels of the tp groups, the dp groups and each pipeline hop ``s -> s + 1`` (the
    slowest instance of each), with ``rank = d * tp * pp + p * tp + t``."""

    def rank(d: int, p: int, t: int) -> int:
        return d * tp * pp + p * tp + t

    tp_level = max(
        network.level_of(rank(d, p, t) for t in range(tp)) for d in range(dp) for p in range(pp)
    )
    dp_level = max(
        network.level_of(rank(d, p, t) for d in range(dp)) for p in range(pp) for t in range(tp)
    )
    hops = [
        max(
            network.level_of((rank(d, s, t), rank(d, s + 1, t)))
            for d in range(dp)
            for t in range(tp)
        )
        for s in range(pp - 1)
    ]
    return tp_level, dp_level, hops


# ---- configurations, predictions, plans ---------------------------------------------------------


@dataclass(frozen=True)
class ParallelConfig:
    """One placement: degrees, micro-batches, schedule and stage boundaries
    (``boundaries[s]`` is stage ``s``'s first block; the last entry is the number of blocks)."""

    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batches: int
    schedule: str
    boundaries: tuple[int, ...]


@dataclass(frozen=True)
class Prediction:
    """``step_s`` = ``breakdown["steady_s"] + breakdown["bubble_s"] + breakdown["update_s"]``."""

    step_s: float
    memory_per_device_bytes: float
    breakdown: dict[str, Any]


class InfeasiblePlanError(ValueError):
    """No placement fits the memory limit; ``min_memory_bytes`` is the least any needs
    (``inf`` when no configuration applies at all)."""

    def __init__(self, message: str, min_memory_bytes: float, config: ParallelConfig | None):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.config = config


class _Costs:
    """Per-block costs of one ``(tp, pp, dp, M, schedule)`` and the per-stage formulas."""

    def __init__(
        self,
        profile: Profile,
        network: Network,
        tp: int,
        pp: int,
        dp: int,
        micro_batches: int,
        schedule: str,
        *,
        global_batch: int,
        optimizer_state_factor: float,
        overlap: float,
    ) -> None:
        self.tp, self.pp, self.dp, self.m, self.schedule = tp, pp, dp, micro_batches, schedule
        self.n = len(profile.blocks)
        self.micro_batch = global_batch // (dp * micro_batches)
        self.phi, self.overlap = optimizer_state_factor, overlap
        tp_level, dp_level, hops = _layout_levels(network, tp, pp, dp)
        self.levels = {"tensor_parallel": tp_level, "data_parallel": dp_level, "pipeline": hops}
        self.network = network
        ratio = self.micro_batch / profile.batch

        def ar(nbytes: float, members: int, level: int) -> float:
            if members <= 1:
                return 0.0
            lv = network.levels[level]
            return allreduce_time(nbytes, members, lv.gbps, lv.latency_s)

        self._dp_ar = lambda nbytes: ar(nbytes, dp, dp_level)
        self.hop = [network.levels[h] for h in hops]
        fwd, bwd, comp, tpc, act, par, opt, out = ([] for _ in range(8))
        for b in profile.blocks:
            f = b.forward_fixed_s + (b.forward_s - b.forward_fixed_s) * ratio
            g = b.backward_fixed_s + (b.backward_s - b.backward_fixed_s) * ratio
            a, w = b.activation_bytes * ratio, b.param_bytes
            comm = 0.0
            if b.tensor_parallel and tp > 1:
                share = b.tp_time_ratio.get(str(tp), 1 / tp)  # measured, else a perfect split
                f, g = f * share, g * share
                comm = 2 * ar(b.tp_allreduce_bytes * ratio, tp, tp_level)
                a -= b.tp_activation_bytes * ratio * (1 - 1 / tp)
                w -= b.tp_param_bytes * (1 - 1 / tp)
            fwd.append(f + comm)
            bwd.append(g + comm)
            comp.append(f + g)
            tpc.append(2 * comm)
            act.append(a)
            par.append(w)
            opt.append(b.optimizer_s * (w / b.param_bytes) if b.param_bytes else 0.0)
            out.append(b.output_bytes * ratio)
        self.fwd, self.bwd, self.comp, self.tpc, self.out = fwd, bwd, comp, tpc, out
        self.act, self.par, self.opt = act, par, opt
        self._pf, self._pb = _prefix(fwd), _prefix(bwd)
        self._pa, self._pw, self._po = _prefix(act), _prefix(par), _prefix(opt)
        # lower bounds for the DP's pruning: what blocks i.. add at least
        self.rest = [0.0] * (self.n + 1)
        self.suf_f = [0.0] * (self.n + 1)
        self.suf_g = [0.0] * (self.n + 1)
        for i in range(self.n - 1, -1, -1):
            self.rest[i] = self.rest[i + 1] + fwd[i] + bwd[i]
            self.suf_f[i] = max(self.suf_f[i + 1], fwd[i])
            self.suf_g[i] = max(self.suf_g[i + 1], bwd[i])

    def in_flight(self, s: int) -> int:
        """Micro-batches of activations stage ``s`` holds at once."""
        return self.m if self.schedule == "gpipe" else min(self.m, self.pp - s)

    def recv(self, s: int, i: int, j: int) -> tuple[float, float]:
        """Stage ``s`` = blocks ``i .. j-1``: receiving its input (forward) and its output's
        gradient (backward), per micro-batch."""
        fin = 0.0
        if s > 0:
            lv = self.hop[s - 1]
            fin = p2p_time(self.out[i - 1], lv.gbps, lv.latency_s)
        bin_ = 0.0
        if s < self.pp - 1:
            lv = self.hop[s]
            bin_ = p2p_time(self.out[j - 1], lv.gbps, lv.latency_s)
        return fin, bin_

    def memory(self, s: int, i: int, j: int) -> float:
        weights = self._pw[j] - self._pw[i]
        return self.phi * weights + self.in_flight(s) * (self._pa[j] - self._pa[i])

    def stage(self, s: int, i: int, j: int) -> tuple[float, float, float]:
        """``(f_s, g_s, E_s)`` of stage ``s`` = blocks ``i .. j-1`` (module docstring)."""
        fin, bin_ = self.recv(s, i, j)
        f = self._pf[j] - self._pf[i] + fin
        backward = self._pb[j] - self._pb[i]
        g = backward + bin_
        exposed = max(
            0.0, self._dp_ar(self._pw[j] - self._pw[i]) - self.overlap * self.m * backward
        )
        return f, g, exposed + self._po[j] - self._po[i]

    def objective(self, total_u: float, max_f: float, max_g: float, max_e: float) -> float:
        return total_u + (self.m - 1) * (max_f + max_g) + max_e

    def predict(self, boundaries: Sequence[int]) -> Prediction:
        stages = []
        fs, gs, es = [], [], []
        for s in range(self.pp):
            i, j = boundaries[s], boundaries[s + 1]
            f, g, e = self.stage(s, i, j)
            fin, bin_ = self.recv(s, i, j)
            weights = self._pw[j] - self._pw[i]
            backward = self._pb[j] - self._pb[i]
            dp_ar = self._dp_ar(weights)
            exposed = max(0.0, dp_ar - self.overlap * self.m * backward)
            fs.append(f)
            gs.append(g)
            es.append(e)
            stages.append(
                {
                    "blocks": [i, j],
                    "forward_s": f,
                    "backward_s": g,
                    "compute_s": sum(self.comp[i:j]),
                    "tp_allreduce_s": sum(self.tpc[i:j]),
                    "p2p_s": fin + bin_,
                    "dp_allreduce_s": dp_ar,
                    "dp_allreduce_exposed_s": exposed,
                    "optimizer_s": self._po[j] - self._po[i],
                    "in_flight": self.in_flight(s),
                    "param_bytes": weights,
                    "activation_bytes": self.in_flight(s) * (self._pa[j] - self._pa[i]),
                    "memory_bytes": self.memory(s, i, j),
                }
            )
        total_u = sum(f + g for f, g in zip(fs, gs, strict=True))
        bottleneck = max(fs) + max(gs)
        update = max(es)
        slowest = es.index(update)
        breakdown = {
            "micro_batch_size": self.micro_batch,
            "steady_s": self.m * bottleneck,
            "bubble_s": total_u - bottleneck,
            "update_s": update,
            "update_stage": slowest,
            "dp_allreduce_exposed_s": stages[slowest]["dp_allreduce_exposed_s"],
            "optimizer_s": stages[slowest]["optimizer_s"],
            "forward_bottleneck_stage": fs.index(max(fs)),
            "backward_bottleneck_stage": gs.index(max(gs)),
            "levels": self.levels,
            "stages": stages,
        }
        step = self.objective(total_u, max(fs), max(gs), update)
        memory = max(st["memory_bytes"] for st in stages)
        return Prediction(step, memory, breakdown)


def _prefix(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in values:
        out.append(out[-1] + v)
    return out


def _check_config(profile: Profile, network: Network, config: ParallelConfig, global_batch: int) -> None:  # fmt: skip
    tp, pp, dp = config.tensor_parallel, config.pipeline_parallel, config.data_parallel
    n = len(profile.blocks)
    if min(tp, pp, dp, config.micro_batches) < 1:
        raise ValueError(f"{config}: the degrees and micro_batches must be >= 1")
    if tp * pp * dp != network.devices:
        raise ValueError(
            f"tensor_parallel {tp} x pipeline_parallel {pp} x data_parallel {dp} = "
            f"{tp * pp * dp}, but the network has {network.devices} devices"
        )
    if tp not in profile.tensor_parallel_degrees:
        raise ValueError(
            f"tensor_parallel {tp}: {profile.model} splits over "
            f"{list(profile.tensor_parallel_degrees)} only"
        )
    if global_batch % (dp * config.micro_batches):
        raise ValueError(
            f"global batch {global_batch} does not divide into data_parallel {dp} x "
            f"micro_batches {config.micro_batches}"
        )
    if config.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {config.schedule!r}")
    if config.schedule == "1f1b" and config.micro_batches < pp:
        raise ValueError(
            f"1F1B needs micro_batches >= pipeline stages (PyTorch's Schedule1F1B), got "
            f"{config.micro_batches} < {pp}"
        )
    b = list(config.boundaries)
    if len(b) != pp + 1 or b[0] != 0 or b[-1] != n or any(x >= y for x, y in itertools.pairwise(b)):
        raise ValueError(
            f"boundaries {b}: expected {pp + 1} increasing block indices from 0 to {n}"
        )


def predict_step_time(
    profile: Profile,
    network: Network,
    config: ParallelConfig,
    *,
    global_batch: int,
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR,
    overlap: float = 0.0,
) -> Prediction:
    """Predicted seconds per optimizer step, memory per device and breakdown of ``config``
    (the formulas of the module docstring).

    Raises:
        ValueError: ``config`` does not fit the profile, the network or the global batch.
    """
    _check_config(profile, network, config, global_batch)
    costs = _Costs(
        profile,
        network,
        config.tensor_parallel,
        config.pipeline_parallel,
        config.data_parallel,
        config.micro_batches,
        config.schedule,
        global_batch=global_batch,
        optimizer_state_factor=optimizer_state_factor,
        overlap=overlap,
    )
    return costs.predict(config.boundaries)


@dataclass(frozen=True)
class Plan:
    """A placement with its prediction, as written to and read from a plan JSON file."""

    model: str
    global_batch: int
    devices: int
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    micro_batches: int
    schedule: str
    boundaries: tuple[int, ...]
    predicted_step_s: float
    breakdown: dict[str, Any]
    memory_per_device_bytes: float
    network: str
    profile: dict[str, Any]
    seq_len: int | None = None
    image_size: int | None = None
    memory_limit_bytes: float | None = None
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR
    overlap: float = 0.0

    @property
    def config(self) -> ParallelConfig:
        return ParallelConfig(
            self.tensor_parallel,
            self.pipeline_parallel,
            self.data_parallel,
            self.micro_batches,
            self.schedule,
            self.boundaries,
        )

    def flags(self) -> dict[str, Any]:
        """What the training scripts take from ``--plan``: ``tensor_parallel``,
        ``pipeline_parallel``, ``micro_batches`` (gradient-accumulation steps when
        ``pipeline_parallel`` is 1), ``schedule`` and ``boundaries``."""
        return {
            "tensor_parallel": self.tensor_parallel,
            "pipeline_parallel": self.pipeline_parallel,
            "micro_batches": self.micro_batches,
            "schedule": self.schedule,
            "boundaries": list(self.boundaries),
        }

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": PLAN_FORMAT}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("seq_len", "image_size") and value is None:
                continue  # exactly one of the two is written
            data[f.name] = list(value) if f.name == "boundaries" else value
        return data

    @classmethod
    def from_dict(cls, data: Any, where: str = "plan") -> Plan:
        """Validated; ``ValueError`` names ``where`` (the file) and the field."""
        if not isinstance(data, dict):
            raise ValueError(f"{where}: a plan is a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} | {"format"}
        _check_unknown(data, names, where)
        fmt = _get(data, "format", where, int)
        if fmt != PLAN_FORMAT:
            raise ValueError(f"{where}: field 'format' is {fmt}; expected {PLAN_FORMAT}")
        seq_len = _get(data, "seq_len", where, int, default=None, minimum=1)
        image_size = _get(data, "image_size", where, int, default=None, minimum=1)
        if (seq_len is None) == (image_size is None):
            raise ValueError(f"{where}: give exactly one of the fields 'seq_len' and 'image_size'")
        devices = _get(data, "devices", where, int, minimum=1)
        tp = _get(data, "tensor_parallel", where, int, minimum=1)
        pp = _get(data, "pipeline_parallel", where, int, minimum=1)
        dp = _get(data, "data_parallel", where, int, minimum=1)
        if tp * pp * dp != devices:
            raise ValueError(
                f"{where}: fields 'tensor_parallel' x 'pipeline_parallel' x 'data_parallel' = "
                f"{tp} x {pp} x {dp} = {tp * pp * dp}, but field 'devices' is {devices}"
            )
        global_batch = _get(data, "global_batch", where, int, minimum=1)
        micro = _get(data, "micro_batches", where, int, minimum=1)
        if global_batch % (dp * micro):
            raise ValueError(
                f"{where}: field 'global_batch' {global_batch} does not divide into "
                f"'data_parallel' {dp} x 'micro_batches' {micro}"
            )
        schedule = _get(data, "schedule", where, str)
        if schedule not in SCHEDULES:
            raise ValueError(
                f"{where}: field 'schedule' must be one of {list(SCHEDULES)}, got {schedule!r}"
            )
        bounds = _get(data, "boundaries", where, list)
        if (
            len(bounds) != pp + 1
            or any(not isinstance(b, int) or isinstance(b, bool) for b in bounds)
            or bounds[0] != 0
            or any(x >= y for x, y in itertools.pairwise(bounds))
        ):
            raise ValueError(
                f"{where}: field 'boundaries' must be {pp + 1} increasing block indices "
                f"starting at 0 ('pipeline_parallel' is {pp}), got {bounds!r}"
            )
        network = _get(data, "network", where, str)
        try:
            Network.parse(network, devices=devices)
        except ValueError as exc:
            raise ValueError(f"{where}: field 'network': {exc}") from None
        limit = data.get("memory_limit_bytes")
        if limit is not None:
            limit = _get(data, "memory_limit_bytes", where, float, minimum=0.0)
        return cls(
            model=_get(data, "model", where, str),
            global_batch=global_batch,
            devices=devices,
            tensor_parallel=tp,
            pipeline_parallel=pp,
            data_parallel=dp,
            micro_batches=micro,
            schedule=schedule,
            boundaries=tuple(bounds),
            predicted_step_s=_get(data, "predicted_step_s", where, float, minimum=0.0),
            breakdown=_get(data, "breakdown", where, dict),
            memory_per_device_bytes=_get(
                data, "memory_per_device_bytes", where, float, minimum=0.0
            ),  # fmt: skip
            network=network,
            profile=_get(data, "profile", where, dict),
            seq_len=seq_len,
            image_size=image_size,
            memory_limit_bytes=limit,
            optimizer_state_factor=_get(
                data,
                "optimizer_state_factor",
                where,
                float,
                default=DEFAULT_OPTIMIZER_STATE_FACTOR,
                minimum=0.0,
            ),  # fmt: skip
            overlap=_get(data, "overlap", where, float, default=0.0, minimum=0.0),
        )


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """A plan JSON file written by ``--json``; ``ValueError`` names the file and the field."""
    return Plan.from_dict(_read_json(path, "plan"), where=str(path))


def save_plan(plan_: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``plan_`` atomically (temporary file + ``os.replace``)."""
    return _write_json(path, plan_.to_dict())


# ---- search ------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _candidates(
    profile: Profile,
    network: Network,
    *,
    global_batch: int,
    max_tp: int,
    max_pp: int,
    micro_batches: Sequence[int] | None,
    schedules: Sequence[str],
    tensor_parallel: Sequence[int] | None,
    pipeline_parallel: Sequence[int] | None,
    runtime_only: bool,
    min_micro_batch_size: int,
) -> list[tuple[int, int, int, int, str]]:
    """Every ``(tp, pp, dp, M, schedule)`` the options allow."""
    for s in schedules:
        if s not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {s!r}")
    devices, n = network.devices, len(profile.blocks)
    splittable = any(b.tensor_parallel for b in profile.blocks)
    out = []
    for tp in _divisors(devices):
        if tp > max_tp or tp not in profile.tensor_parallel_degrees:
            continue
        if tensor_parallel is not None and tp not in tensor_parallel:
            continue
        if runtime_only and tp > 1 and not splittable:
            continue
        for pp in _divisors(devices // tp):
            if pp > max_pp or pp > n:
                continue
            if pipeline_parallel is not None and pp not in pipeline_parallel:
                continue
            dp = devices // (tp * pp)
            if global_batch % dp:
                continue
            per_replica = global_batch // dp
            if micro_batches is None:
                ms = [m for m in _divisors(per_replica) if m <= DEFAULT_MAX_MICRO_BATCHES]
            else:
                ms = sorted({m for m in micro_batches if m >= 1 and per_replica % m == 0})
            ms = [m for m in ms if per_replica // m >= min_micro_batch_size]
            for m in ms:
                for schedule in schedules:
                    if schedule == "1f1b" and m < pp:
                        continue
                    if schedule == "gpipe" and "1f1b" in schedules and m >= pp:
                        continue  # 1F1B: the same predicted time, never more memory
                    out.append((tp, pp, dp, m, schedule))
    return out


def _pareto(labels: list[tuple]) -> list[tuple]:
    """The labels ``(A, max_f, max_g, max_e, back)`` no other label is <= in all four."""
    labels.sort(key=lambda x: x[:4])
    kept: list[tuple] = []
    for lab in labels:
        if any(k[1] <= lab[1] and k[2] <= lab[2] and k[3] <= lab[3] for k in kept):
            continue
        kept.append(lab)
    return kept


def _best_split(costs: _Costs, limit: float, cutoff: float) -> tuple[float, tuple[int, ...]] | None:
    """The boundaries minimising the step time with every stage under ``limit``: the exact
    Pareto-label chain DP of the module docstring. Labels whose lower bound exceeds
    ``cutoff`` are dropped; None when nothing feasible beats it."""
    n, stages, m = costs.n, costs.pp, costs.m
    bound = cutoff * (1 + 1e-9) if math.isfinite(cutoff) else cutoff
    # labels: (sum u, max f, max g, max E, (parent label, parent end)); stage -1 ends at 0
    frontier: dict[int, list[tuple]] = {0: [(0.0, 0.0, 0.0, 0.0, None)]}
    for s in range(stages):
        ends = [n] if s == stages - 1 else range(s + 1, n - (stages - s - 1) + 1)
        nxt: dict[int, list[tuple]] = {}
        for j in ends:
            cands = []
            for i, labels in frontier.items():
                if i >= j or costs.memory(s, i, j) > limit:
                    continue
                f, g, e = costs.stage(s, i, j)
                u = f + g
                lb_f, lb_g = costs.suf_f[j], costs.suf_g[j]
                for lab in labels:
                    total = lab[0] + u
                    mf, mg, me = max(lab[1], f), max(lab[2], g), max(lab[3], e)
                    low = total + costs.rest[j] + (m - 1) * (max(mf, lb_f) + max(mg, lb_g)) + me
                    if low > bound:
                        continue
                    cands.append((total, mf, mg, me, (lab, i)))
            if cands:
                nxt[j] = _pareto(cands)
        frontier = nxt
        if not frontier:
            return None
    finals = frontier.get(n)
    if not finals:
        return None
    best = min(finals, key=lambda lab: costs.objective(*lab[:4]))
    bounds = [n]
    lab = best
    while lab[4] is not None:
        lab, start = lab[4]
        bounds.append(start)
    return costs.objective(*best[:4]), tuple(reversed(bounds))


def _min_memory_split(costs: _Costs) -> tuple[float, tuple[int, ...]]:
    """The boundaries with the smallest largest stage memory (bottleneck DP)."""
    n, stages = costs.n, costs.pp
    inf = math.inf
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], costs.memory(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds = [n]
    for s in range(stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return best[stages][n], tuple(reversed(bounds))


def _search(
    profile: Profile,
    network: Network,
    *,
    global_batch: int,
    memory_bytes: float,
    k: int,
    exhaustive: bool,
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR,
    overlap: float = 0.0,
    max_tp: int = 8,
    max_pp: int = 8,
    micro_batches: Sequence[int] | None = None,
    schedules: Sequence[str] = SCHEDULES,
    tensor_parallel: Sequence[int] | None = None,
    pipeline_parallel: Sequence[int] | None = None,
    runtime_only: bool = False,
    min_micro_batch_size: int = 1,
) -> list[Plan]:
    if k < 1:
        raise ValueError(f"top k must be >= 1, got {k}")
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be in [0, 1], got {overlap}")
    if global_batch < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch}")
    configs = _candidates(
        profile, network, global_batch=global_batch, max_tp=max_tp, max_pp=max_pp,
        micro_batches=micro_batches, schedules=schedules, tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel, runtime_only=runtime_only,
        min_micro_batch_size=min_micro_batch_size,
    )  # fmt: skip
    if not configs:
        raise InfeasiblePlanError(
            f"no (tensor, pipeline, data) degrees and micro-batch count fit {network.devices} "
            f"devices, global batch {global_batch} and {len(profile.blocks)} blocks with these "
            "options (the batch must divide by data_parallel x micro_batches; 1F1B needs "
            "micro_batches >= pipeline stages); relax --max-tp/--max-pp/--micro-batches",
            math.inf,
            None,
        )
    options = dict(global_batch=global_batch, optimizer_state_factor=optimizer_state_factor,
                   overlap=overlap)  # fmt: skip
    found: list[tuple[tuple, ParallelConfig, Prediction]] = []
    for tp, pp, dp, m, schedule in configs:
        costs = _Costs(profile, network, tp, pp, dp, m, schedule, **options)
        if exhaustive:
            splits = (
                (0, *cuts, costs.n) for cuts in itertools.combinations(range(1, costs.n), pp - 1)
            )
        else:
            cutoff = found[k - 1][0][0] if len(found) >= k else math.inf
            best = _best_split(costs, memory_bytes, cutoff)
            splits = iter(() if best is None else (best[1],))
        chosen = None
        for bounds in splits:
            pred = costs.predict(bounds)
            if pred.memory_per_device_bytes > memory_bytes:
                continue
            key = (pred.step_s, pred.memory_per_device_bytes)
            if chosen is None or key < chosen[0]:
                chosen = (key, bounds, pred)
        if chosen is None:
            continue
        key, bounds, pred = chosen
        config = ParallelConfig(tp, pp, dp, m, schedule, tuple(bounds))
        entry = ((*key, tp, pp, m, schedule), config, pred)
        bisect.insort(found, entry, key=lambda x: x[0])
        del found[k:]
    if not found:
        least, at = math.inf, None
        for tp, pp, dp, m, schedule in configs:
            costs = _Costs(profile, network, tp, pp, dp, m, schedule, **options)
            value, bounds = _min_memory_split(costs)
            if value < least:
                least, at = value, ParallelConfig(tp, pp, dp, m, schedule, bounds)
        raise InfeasiblePlanError(
            f"no placement of {profile.model} fits {_gib(memory_bytes)} per device; the "
            f"smallest memory any needs is {_gib(least)} ({_describe(at)}); give more memory "
            "per device (--memory-gb), more devices, or allow more pipeline stages, tensor "
            "parallelism or micro-batches",
            least,
            at,
        )
    return [
        _make_plan(
            profile, network, cfg, pred, global_batch, memory_bytes, optimizer_state_factor, overlap
        )  # fmt: skip
        for _, cfg, pred in found
    ]


def _make_plan(profile: Profile, network: Network, config: ParallelConfig, pred: Prediction,
               global_batch: int, memory_bytes: float, phi: float, overlap: float) -> Plan:  # fmt: skip
    source = {
        "model": profile.model,
        "model_config": dict(profile.model_config),
        "batch": profile.batch,
        "blocks": len(profile.blocks),
        "source": dict(profile.source),
    }
    return Plan(
        model=profile.model,
        global_batch=global_batch,
        devices=network.devices,
        tensor_parallel=config.tensor_parallel,
        pipeline_parallel=config.pipeline_parallel,
        data_parallel=config.data_parallel,
        micro_batches=config.micro_batches,
        schedule=config.schedule,
        boundaries=tuple(config.boundaries),
        predicted_step_s=pred.step_s,
        breakdown=pred.breakdown,
        memory_per_device_bytes=pred.memory_per_device_bytes,
        network=str(network),
        profile=source,
        seq_len=profile.seq_len,
        image_size=profile.image_size,
        memory_limit_bytes=memory_bytes if math.isfinite(memory_bytes) else None,
        optimizer_state_factor=phi,
        overlap=overlap,
    )


def _gib(nbytes: float) -> str:
    return "unbounded" if not math.isfinite(nbytes) else f"{nbytes / 2**30:.2f} GiB"


def _describe(config: ParallelConfig | None) -> str:
    if config is None:
        return "no configuration"
    return (
        f"tp {config.tensor_parallel}, pp {config.pipeline_parallel}, dp {config.data_parallel}, "
        f"{config.micro_batches} micro-batches, {config.schedule}, boundaries "
        f"{list(config.boundaries)}"
    )


def top_plans(profile: Profile, network: Network, *, global_batch: int, memory_bytes: float,
              k: int = 5, **options: Any) -> list[Plan]:  # fmt: skip
    """The ``k`` fastest placements (each ``(tp, pp, dp, M, schedule)`` once, with its best
    boundaries), fastest first.

    Args:
        profile: per-block costs (:func:`profile_model` or :func:`load_profile`).
        network: the devices and their links (:meth:`Network.parse`).
        global_batch: samples per optimizer step over all replicas.
        memory_bytes: the memory limit per device.
        k: how many plans.
        **options: ``optimizer_state_factor`` (4), ``overlap`` (0), ``max_tp`` (8),
            ``max_pp`` (8), ``micro_batches`` (default: the divisors of the per-replica batch
            up to 64), ``min_micro_batch_size`` (1: samples per micro-batch at least),
            ``schedules`` (both), ``tensor_parallel`` / ``pipeline_parallel`` (only these
            degrees), ``runtime_only`` (leave out what ``trainers.parallel`` cannot run).

    Raises:
        InfeasiblePlanError: nothing fits ``memory_bytes`` (it carries the least memory any
            placement needs).
    """
    return _search(profile, network, global_batch=global_batch, memory_bytes=memory_bytes, k=k,
                   exhaustive=False, **options)  # fmt: skip


def plan(profile: Profile, network: Network, *, global_batch: int, memory_bytes: float,
         **options: Any) -> Plan:  # fmt: skip
    """The fastest placement under the memory limit (see :func:`top_plans`)."""
    return top_plans(profile, network, global_batch=global_batch, memory_bytes=memory_bytes, k=1,
                     **options)[0]  # fmt: skip


def brute_force(profile: Profile, network: Network, *, global_batch: int, memory_bytes: float,
                k: int = 1, **options: Any) -> list[Plan]:  # fmt: skip
    """:func:`top_plans` by enumerating every boundary split of every configuration (the
    reference for the tests; exponential in the number of stages)."""
    return _search(profile, network, global_batch=global_batch, memory_bytes=memory_bytes, k=k,
                   exhaustive=True, **options)  # fmt: skip


# ---- profiling ---------------------------------------------------------------------------------


def _tp_degrees(config: Any) -> tuple[int, ...]:
    return tuple(
        d
        for d in range(1, config.num_heads + 1)
        if config.num_heads % d == 0 and config.intermediate_size % d == 0
    )


def _build(model: str, overrides: Mapping[str, Any]) -> nn.Module:
    """The zoo model ``model`` on the meta device: BERTs with the span-QA head (as
    ``scripts/finetune_squad.py`` builds them), with ``overrides`` replacing fields of their
    ``BertConfig``."""
    import modelzoo
    from modelzoo.nlp.bert import BertConfig, BertForQuestionAnswering

    entry = modelzoo.registry.get_model_entry(model)  # unknown names: a close-match hint
    with torch.device("meta"):
        try:
            net = entry.builder(head="qa")
        except TypeError:
            if overrides:
                raise ValueError(
                    f"model config overrides are for BERTs; {model} is not one"
                ) from None
            return entry.builder()
        if overrides:
            try:
                config = dataclasses.replace(net.config, **overrides)
            except TypeError as exc:
                fields = ", ".join(f.name for f in dataclasses.fields(BertConfig))
                raise ValueError(
                    f"model config overrides: {exc}; BertConfig has {fields}"
                ) from None
            net = BertForQuestionAnswering(config)
    return net


def _materialize(module: nn.Module) -> None:
    """Give a meta module real (CPU) storage and a fresh initialization."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return
    module.to_empty(device="cpu")
    with torch.no_grad():
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
            if callable(reset) and own:
                reset()
        for p in itertools.chain(module.parameters(), module.buffers()):
            if p.is_floating_point() and not torch.isfinite(p).all():
                p.normal_(0.0, 0.02)


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _saved_bytes(run: Callable[[], Any], exclude: set[int]) -> tuple[int, Any]:
    """Bytes autograd saves for the backward while ``run()`` runs (each storage once; storages
    in ``exclude``, the parameters', left out) and ``run()``'s result."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def _local_bert_block(block: nn.Module, degree: int) -> nn.Module:
    """A copy of a ``_BertBlock`` with one tensor-parallel rank's shapes at ``degree``:
    ``num_heads / degree`` heads, ``intermediate / degree`` feed-forward units."""
    local = copy.deepcopy(block)
    layer = local.layer
    attn = layer.attn
    width = attn.qkv.in_features
    inner = layer.fc1.out_features
    attn.qkv = nn.Linear(width, 3 * width // degree)
    attn.proj = nn.Linear(width // degree, width)
    attn.num_heads //= degree
    layer.fc1 = nn.Linear(width, inner // degree)
    layer.fc2 = nn.Linear(inner // degree, width)
    return local


def _sharded_param_bytes(block: nn.Module) -> int:
    """Bytes of the parameters :func:`trainers.parallel.parallelize_bert` shards in a layer
    (column-parallel: weight and bias; row-parallel: weight; its layout table)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from trainers.parallel.tensor import _linear_styles

    total = 0
    for name, style in _linear_styles(block.layer).items():
        linear = block.layer.get_submodule(name)
        tensors = []
        if isinstance(style, ColwiseParallel):
            tensors = [linear.weight, linear.bias]
        elif isinstance(style, RowwiseParallel):
            tensors = [linear.weight]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def _time_block(block: nn.Module, inputs: Sequence[torch.Tensor], repeats: int, warmup: int,
                optimizer: bool) -> dict[str, float]:  # fmt: skip
    """Median forward, backward and AdamW-step seconds of ``block`` on ``inputs``."""
    params = [p for p in block.parameters() if p.requires_grad]
    grads: list[torch.Tensor] | None = None
    forward, backward = [], []
    for r in range(warmup + repeats):
        xs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        for p in params:
            p.grad = None
        start = time.perf_counter()
        outs = _tensors(block(*xs))
        mid = time.perf_counter()
        diff = [o for o in outs if o.requires_grad]
        if grads is None:
            gen = torch.Generator().manual_seed(0)
            grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
        torch.autograd.backward(diff, grads)
        end = time.perf_counter()
        if r >= warmup:
            forward.append(mid - start)
            backward.append(end - mid)
    step = 0.0
    if optimizer and params:
        opt = torch.optim.AdamW(params, lr=1e-8, foreach=True)
        times = []
        for r in range(warmup + repeats):
            start = time.perf_counter()
            opt.step()
            if r >= warmup:
                times.append(time.perf_counter() - start)
        step = statistics.median(times)
        for p in params:
            p.grad = None
    return {
        "forward_s": statistics.median(forward),
        "backward_s": statistics.median(backward),
        "optimizer_s": step,
    }


def _flops(block: nn.Module, inputs: Sequence[torch.Tensor]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    xs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with FlopCounterMode(display=False) as counter:
        outs = [o for o in _tensors(block(*xs)) if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    for p in block.parameters():
        p.grad = None
    return float(counter.get_total_flops())


def _example_inputs(model: nn.Module, batch: int, seq_len: int | None, image_size: int | None,
                    name: str) -> tuple[bool, tuple[torch.Tensor, ...]]:  # fmt: skip
    """``(is_bert, inputs)`` of one micro-batch of ``batch`` samples."""
    from modelzoo.nlp.bert import BertForQuestionAnswering, BertForSequenceClassification

    gen = torch.Generator().manual_seed(0)
    if isinstance(model, (BertForQuestionAnswering, BertForSequenceClassification)):
        if seq_len is None:
            raise ValueError(f"profiling {name}: a BERT needs the sequence length (--seq-len)")
        vocab = model.config.vocab_size
        ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
        types = torch.randint(0, model.config.type_vocab_size, (batch, seq_len), generator=gen)
        return True, (ids, types, torch.ones(batch, seq_len, dtype=torch.long))
    if image_size is None:
        raise ValueError(f"profiling {name}: an image model needs the image size (--image-size)")
    return False, (torch.randn(batch, 3, image_size, image_size, generator=gen),)


def _block_names(model: nn.Module, count: int) -> list[str]:
    from modelzoo.vision.resnest import ResNeSt

    if isinstance(model, ResNeSt):
        names = ["stem"]
        for stage in ("layer1", "layer2", "layer3", "layer4"):
            names += [f"{stage}.{i}" for i in range(len(getattr(model, stage)))]
        return [*names, "head"]
    return ["embeddings", *[f"layer{i}" for i in range(count - 2)], "head"]


def _measure(blocks: Sequence[nn.Module], inputs: tuple[torch.Tensor, ...], *, repeats: int,
             warmup: int, dedupe: bool, full: bool, tp_degree: int,
             time_degrees: Sequence[int] = ()) -> list[dict[str, Any]]:  # fmt: skip
    """Per-block measurements along the chain (``full``: also bytes, FLOPs, the AdamW step;
    for a BERT layer the sharded bytes at ``tp_degree`` and the time ratio of one rank's share
    of the layer at each of ``time_degrees``)."""
    from modelzoo.nlp.bert import BertLayer

    results: list[dict[str, float]] = []
    twins: dict[Any, tuple[dict[str, float], tuple[torch.Tensor, ...]]] = {}
    values = inputs
    for block in blocks:
        key = (type(block).__name__, repr(block),
               tuple((tuple(t.shape), t.dtype) for t in values))  # fmt: skip
        if dedupe and key in twins:
            record, outputs = twins[key]
            results.append(dict(record))
            values = outputs
            continue
        was_meta = any(p.is_meta for p in block.parameters())
        _materialize(block)
        block.train()
        record = _time_block(block, values, repeats, warmup, optimizer=full)
        if full:
            exclude = {p.untyped_storage().data_ptr() for p in block.parameters()}
            xs = [t.detach().requires_grad_(t.is_floating_point()) for t in values]
            saved, outs = _saved_bytes(lambda xs=xs, block=block: block(*xs), exclude)
            outs = _tensors(outs)
            record["activation_bytes"] = float(saved)
            record["output_bytes"] = float(sum(o.numel() * o.element_size() for o in outs))
            record["flops"] = _flops(block, values)
            layer = getattr(block, "layer", None)
            if isinstance(layer, BertLayer):
                record["tp_param_bytes"] = float(_sharded_param_bytes(block))
                record["tp_allreduce_bytes"] = float(outs[0].numel() * outs[0].element_size())
                record["tp_activation_bytes"] = 0.0
                if tp_degree > 1:
                    local = _local_bert_block(block, tp_degree)
                    lex = {p.untyped_storage().data_ptr() for p in local.parameters()}
                    xs = [t.detach().requires_grad_(t.is_floating_point()) for t in values]
                    part, _ = _saved_bytes(lambda xs=xs, local=local: local(*xs), lex)
                    # saved = replicated + sharded / t, at t = 1 and t = tp_degree
                    sharded = (saved - part) * tp_degree / (tp_degree - 1)
                    record["tp_activation_bytes"] = float(min(max(sharded, 0.0), saved))
                whole = record["forward_s"] + record["backward_s"]
                ratios = {}
                for degree in time_degrees:
                    part = _time_block(_local_bert_block(block, degree), values, repeats, warmup,
                                       optimizer=False)  # fmt: skip
                    ratio = (part["forward_s"] + part["backward_s"]) / whole if whole > 0 else 0
                    if 0 < ratio <= 2:  # outside: a measurement too noisy to use
                        ratios[str(degree)] = ratio
                record["tp_time_ratio"] = ratios
        with torch.no_grad():
            outputs = tuple(t.detach() for t in _tensors(block(*values)))
        for p in block.parameters():
            p.grad = None
        if was_meta:
            block.to("meta")
        twins[key] = (record, outputs)
        results.append(dict(record))
        values = outputs
    return results


def profile_model(
    model: str | nn.Module,
    *,
    seq_len: int | None = None,
    image_size: int | None = None,
    batch: int = 4,
    fit_batch: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    overrides: Mapping[str, Any] | None = None,
    dedupe: bool = True,
    name: str | None = None,
) -> Profile:
    """Measure every block of a zoo model on this machine (see the module docstring).

    Args:
        model: a zoo name (``modelzoo.get_model``; BERTs get the span-QA head) or a model
            :func:`~trainers.parallel.pipeline.model_blocks` cuts.
        seq_len: BERT's sequence length; ``image_size``: ResNeSt's input size.
        batch: the profiling micro-batch ``b0``.
        fit_batch: a second, smaller batch to fit the fixed per-call time (default 2 when
            ``batch > 2``, the least ResNeSt's BatchNorm trains on; ``batch`` itself or 0: no
            fixed part, time linear in the batch).
        repeats: timed runs per block (the median is kept), after ``warmup`` runs.
        overrides: ``BertConfig`` fields replacing the named BERT's (a larger BERT).
        dedupe: measure structurally identical blocks with equally shaped inputs once.
        name: the model's name in the profile (default: ``model`` or its class name).

    Zoo models are built on the meta device and each measured block gets real storage only
    while it runs, so profiling a model larger than this machine's memory works when its
    largest block fits.
    """
    if batch < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"profiling needs batch >= 1, repeats >= 1, warmup >= 0; got "
                         f"{batch}, {repeats}, {warmup}")  # fmt: skip
    overrides = dict(overrides or {})
    if isinstance(model, str):
        label = name or model
        net = _build(model, overrides)
    else:
        if overrides:
            raise ValueError("overrides apply to a zoo model name, not to a built model")
        label, net = name or type(model).__name__, model
    try:
        blocks = model_blocks(net)
    except TypeError as exc:
        raise ValueError(f"profiling {label}: {exc}") from None
    config = getattr(net, "config", None)
    degrees = _tp_degrees(config) if config is not None else (1,)
    tp_degree = next((d for d in degrees if d > 1), 1)
    fit = (2 if batch > 2 else 0) if fit_batch is None else fit_batch
    is_bert, inputs = _example_inputs(net, batch, seq_len, image_size, label)
    common = dict(repeats=repeats, warmup=warmup, dedupe=dedupe)
    measured = _measure(blocks, inputs, full=True, tp_degree=tp_degree,
                        time_degrees=[d for d in degrees if d > 1], **common)  # fmt: skip
    small = None
    if 1 <= fit < batch:
        _, fit_inputs = _example_inputs(net, fit, seq_len, image_size, label)
        small = _measure(blocks, fit_inputs, full=False, tp_degree=1, **common)
    names = _block_names(net, len(blocks))
    records = []
    for k, (block, rec) in enumerate(zip(blocks, measured, strict=True)):
        fixed_f = fixed_b = 0.0
        if small is not None:
            for key in ("forward_s", "backward_s"):
                # t(b) = fixed + slope b through (fit, t_fit) and (batch, t_batch)
                t1, t0 = small[k][key], rec[key]
                fixed = (t1 * batch - t0 * fit) / (batch - fit)
                fixed = min(max(fixed, 0.0), t1, t0)
                if key == "forward_s":
                    fixed_f = fixed
                else:
                    fixed_b = fixed
        tp_block = "tp_param_bytes" in rec and tp_degree > 1
        records.append(
            BlockProfile(
                name=names[k],
                forward_s=rec["forward_s"],
                backward_s=rec["backward_s"],
                forward_fixed_s=fixed_f,
                backward_fixed_s=fixed_b,
                optimizer_s=rec["optimizer_s"],
                activation_bytes=rec["activation_bytes"],
                output_bytes=rec["output_bytes"],
                param_bytes=float(sum(p.numel() * p.element_size() for p in block.parameters())),
                tensor_parallel=tp_block,
                tp_param_bytes=rec.get("tp_param_bytes", 0.0) if tp_block else 0.0,
                tp_activation_bytes=rec.get("tp_activation_bytes", 0.0) if tp_block else 0.0,
                tp_allreduce_bytes=rec.get("tp_allreduce_bytes", 0.0) if tp_block else 0.0,
                flops=rec["flops"],
                tp_time_ratio=rec.get("tp_time_ratio", {}) if tp_block else {},
            )
        )
    source = {
        "device": "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__.split("+")[0],
        "threads": torch.get_num_threads(),
        "batches": [batch] + ([fit] if small is not None else []),
        "repeats": repeats,
        "warmup": warmup,
        "statistic": "median",
        "dedupe": dedupe,
        "dtype": str(next(iter(net.parameters())).dtype).replace("torch.", ""),
    }
    return Profile(
        model=label,
        batch=batch,
        blocks=tuple(records),
        seq_len=seq_len if is_bert else None,
        image_size=None if is_bert else image_size,
        tensor_parallel_degrees=degrees if any(r.tensor_parallel for r in records) else (1,),
        model_config=overrides,
        source=source,
    )


# ---- command line ------------------------------------------------------------------------------


def _int_list(flag: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            values = []
        if not values or any(v < 1 for v in values):
            raise argparse.ArgumentTypeError(
                f"{flag} takes comma-separated positive integers, e.g. 1,2,4,8; got {text!r}"
            )
        return values

    return parse


def _overrides(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(
                f"--bert-config takes key=value pairs, e.g. num_layers=48,hidden_size=1600; got "
                f"{item!r}"
            )
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _table(plans: Sequence[Plan]) -> str:
    head = (
        f"{'#':>2} {'tp':>3} {'pp':>3} {'dp':>4} {'M':>4} {'mb':>4} {'schedule':>8} "
        f"{'step s':>10} {'steady':>9} {'bubble':>9} {'update':>9} {'GiB/dev':>8}  boundaries"
    )
    lines = [head]
    for rank, p in enumerate(plans, 1):
        b = p.breakdown
        lines.append(
            f"{rank:>2} {p.tensor_parallel:>3} {p.pipeline_parallel:>3} {p.data_parallel:>4} "
            f"{p.micro_batches:>4} {b['micro_batch_size']:>4} {p.schedule:>8} "
            f"{p.predicted_step_s:>10.4g} {b['steady_s']:>9.3g} {b['bubble_s']:>9.3g} "
            f"{b['update_s']:>9.3g} {p.memory_per_device_bytes / 2**30:>8.2f}  "
            f"{list(p.boundaries)}"
        )
    return "\n".join(lines)


def _stages(p: Plan) -> str:
    lines = [
        f"best plan, per stage (per micro-batch of {p.breakdown['micro_batch_size']}; "
        "update = exposed dp all-reduce + optimizer step):",
        f"{'stage':>5} {'blocks':>9} {'fwd s':>9} {'bwd s':>9} {'tp comm':>9} {'p2p':>9} "
        f"{'update':>9} {'held':>5} {'GiB':>7}",
    ]
    for s, st in enumerate(p.breakdown["stages"]):
        update = st["dp_allreduce_exposed_s"] + st["optimizer_s"]
        lines.append(
            f"{s:>5} {st['blocks'][0]:>4}-{st['blocks'][1] - 1:<4} {st['forward_s']:>9.3g} "
            f"{st['backward_s']:>9.3g} {st['tp_allreduce_s']:>9.3g} {st['p2p_s']:>9.3g} "
            f"{update:>9.3g} {st['in_flight']:>5} {st['memory_bytes'] / 2**30:>7.2f}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainers.parallel.plan",
        description="Choose tensor/pipeline/data-parallel degrees, stage boundaries, "
        "micro-batches and schedule for a zoo model (see the module docstring for the model).",
    )
    p.add_argument("--model", help="zoo model name (BERTs: span-QA head; ResNeSt)")
    p.add_argument("--seq-len", type=int, default=None, help="BERT sequence length")
    p.add_argument("--image-size", type=int, default=None, help="ResNeSt input size")
    p.add_argument("--bert-config", type=_overrides, default={},
                   help="BertConfig fields replacing the model's, e.g. "
                   "num_layers=48,hidden_size=1600,num_heads=16,intermediate_size=6400")  # fmt: skip
    p.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--memory-gb", type=float, required=True, help="memory per device, GiB")
    p.add_argument("--network", required=True,
                   help='levels innermost first, "size:gbps:latency_s,...", e.g. '
                   '"8:2400:3e-6,2:200:1e-5"')  # fmt: skip
    source = p.add_mutually_exclusive_group()
    source.add_argument("--profile", default=None, help="read this profile JSON")
    source.add_argument("--save-profile", default=None, help="profile here and write it")
    p.add_argument("--profile-batch", type=int, default=4, help="profiling micro-batch")
    p.add_argument("--profile-repeats", type=int, default=5)
    p.add_argument("--optimizer-state-factor", type=float, default=DEFAULT_OPTIMIZER_STATE_FACTOR,
                   help="bytes kept per parameter byte (4: weights, grads, Adam's moments)")  # fmt: skip
    p.add_argument("--overlap", type=float, default=0.0,
                   help="fraction of the backward the dp all-reduce hides behind (0..1)")  # fmt: skip
    scale = p.add_mutually_exclusive_group()
    scale.add_argument("--compute-scale", type=float, default=None,
                       help="multiply the profile's times (a device 1/x times as fast)")  # fmt: skip
    scale.add_argument("--device-tflops", type=float, default=None,
                       help="scale the profile's times so its blocks run at this TFLOP/s")  # fmt: skip
    p.add_argument("--max-tp", type=int, default=8)
    p.add_argument("--max-pp", type=int, default=8)
    p.add_argument("--micro-batches", type=_int_list("--micro-batches"), default=None,
                   help="candidate micro-batch counts (default: divisors of the per-replica "
                   f"batch up to {DEFAULT_MAX_MICRO_BATCHES})")  # fmt: skip
    p.add_argument("--min-micro-batch-size", type=int, default=1,
                   help="smallest micro-batch (samples) to consider; an accelerator needs "
                   "enough work per micro-batch, which a CPU profile does not show")  # fmt: skip
    p.add_argument("--schedules", default="gpipe,1f1b", help="candidate schedules")
    p.add_argument("--runtime-only", action="store_true",
                   help="only placements trainers.parallel runs (no tensor parallelism for a "
                   "model without splittable blocks, e.g. ResNeSt)")  # fmt: skip
    p.add_argument("--top", type=int, default=5, help="print the K best plans")
    p.add_argument("--json", default=None, help="write the best plan here (atomically)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (module docstring); exit 2 on a usage error or when nothing fits."""
    parser = _parser()
    args = parser.parse_args(argv)
    for flag, value in (("--global-batch", args.global_batch), ("--devices", args.devices),
                        ("--top", args.top), ("--max-tp", args.max_tp), ("--max-pp", args.max_pp),
                        ("--profile-batch", args.profile_batch),
                        ("--min-micro-batch-size", args.min_micro_batch_size),
                        ("--profile-repeats", args.profile_repeats)):  # fmt: skip
        if value < 1:
            parser.error(f"{flag} must be >= 1, got {value}")
    if not args.memory_gb > 0:
        parser.error(f"--memory-gb must be > 0, got {args.memory_gb}")
    if not 0 <= args.overlap <= 1:
        parser.error(f"--overlap must be in [0, 1], got {args.overlap}")
    if args.optimizer_state_factor < 0:
        parser.error(f"--optimizer-state-factor must be >= 0, got {args.optimizer_state_factor}")
    schedules = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if not schedules or any(s not in SCHEDULES for s in schedules):
        parser.error(f"--schedules takes a comma-separated subset of {','.join(SCHEDULES)}, "
                     f"got {args.schedules!r}")  # fmt: skip
    try:
        network = Network.parse(args.network, devices=args.devices)
    except ValueError as exc:
        parser.error(f"--network: {exc}")
    if args.profile is not None:
        try:
            profile = load_profile(args.profile)
        except ValueError as exc:
            parser.error(f"--profile: {exc}")
        for flag, asked, measured in (("--seq-len", args.seq_len, profile.seq_len),
                                      ("--image-size", args.image_size, profile.image_size)):  # fmt: skip
            if asked is not None and asked != measured:
                parser.error(f"{flag} {asked} but --profile {args.profile} was measured at "
                             f"{measured}; profile again at {asked} (--save-profile)")  # fmt: skip
        if args.model is not None and args.model.lower() != profile.model.lower():
            parser.error(f"--model {args.model} but --profile {args.profile} profiles "
                         f"{profile.model}; drop --model or profile that model")  # fmt: skip
    else:
        if args.model is None:
            parser.error("give --model to profile (or --profile with a saved profile)")
        try:
            profile = profile_model(
                args.model, seq_len=args.seq_len, image_size=args.image_size,
                batch=args.profile_batch, repeats=args.profile_repeats,
                overrides=args.bert_config,
            )  # fmt: skip
        except ValueError as exc:
            parser.error(f"--model {args.model}: {exc}")
        if args.save_profile:
            save_profile(profile, args.save_profile)
            print(f"wrote profile {args.save_profile}")
    if args.compute_scale is not None:
        if not args.compute_scale > 0:
            parser.error(f"--compute-scale must be > 0, got {args.compute_scale}")
        profile = profile.scaled(args.compute_scale)
    elif args.device_tflops is not None:
        rate = profile.achieved_tflops()
        if not args.device_tflops > 0:
            parser.error(f"--device-tflops must be > 0, got {args.device_tflops}")
        if rate <= 0:
            parser.error("--device-tflops needs FLOP counts in the profile ('flops' fields)")
        profile = profile.scaled(rate / args.device_tflops)
    try:
        plans = top_plans(
            profile, network, global_batch=args.global_batch,
            memory_bytes=args.memory_gb * 2**30, k=args.top,
            optimizer_state_factor=args.optimizer_state_factor, overlap=args.overlap,
            max_tp=args.max_tp, max_pp=args.max_pp, micro_batches=args.micro_batches,
            schedules=schedules, runtime_only=args.runtime_only,
            min_micro_batch_size=args.min_micro_batch_size,
        )  # fmt: skip
    except InfeasiblePlanError as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    scale = profile.source.get("compute_scale")
    rate = profile.achieved_tflops()
    print(
        f"plans for {profile.description()}; profiled at micro-batch {profile.batch} on "
        f"{profile.source.get('device', '?')} {profile.source.get('cpu_capability', '')}"
        f"{f', times x {scale:.3g}' if scale else ''}"
        f"{f' ({rate:.3g} TFLOP/s)' if rate else ''}; global batch {args.global_batch}, "
        f"{args.devices} devices of {args.memory_gb:g} GiB, network {network}"
    )
    print(_table(plans))
    print()
    print(_stages(plans[0]))
    if args.json:
        save_plan(plans[0], args.json)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
