"""The scaling what-if model: the step time and scaling factor of data-parallel training
for N workers on links of B Gbps, and of the decentralized and pipelined modes.

The model (Zhang et al., "Is Network the Bottleneck of Distributed Training?", NetAI 2020):
each worker computes for ``T_c`` seconds per step, then sends ``S = G / r`` bytes (``G`` the
dense fp32 gradient, ``r`` the compression ratio). A ring all-reduce over ``N`` workers at
``B`` bytes/s with per-message latency ``a`` takes::

    T_comm = 2 (N - 1) / N * S / B + 2 (N - 1) a          (all-gather: (N - 1) S / B + (N - 1) a)

Part of it hides behind the backward pass: with overlap fraction ``o`` of the compute
(DistributedDataParallel all-reduces buckets during the backward, which is about 2/3 of a
step: ``o = 2/3``; the combiners that communicate after the backward have ``o = 0``; a node
whose compute threads fill its cores has none left to overlap with, ``o = 0``:
:func:`overlap_for_cores`)::

    T_step = T_c + max(0, T_comm - o T_c)        scaling factor f = T_c / T_step

``f = 1`` is linear scaling (N workers are N times as fast as one). For a target ``f*`` the
exposed communication may be at most ``T_c (1 / f* - 1)``, so the compression ratio needed is::

    r* = (2 (N - 1) / N * G / B) / (T_c (1 / f* - 1) + o T_c - 2 (N - 1) a)

(``inf`` when even an empty message costs too much latency; ``1`` when none is needed).

The all-reduce and message times are the project's one latency-bandwidth model
(:mod:`trainers.comm.cost`); each combining mode's communication and step time are its class's
(:meth:`~trainers.comm.GradCombiner.comm_time`, :meth:`~trainers.comm.GradCombiner.step_time`).
``scripts/scaling_whatif.py`` reads ``T_c``, ``G``, ``r`` and ``o`` from a run log
(:mod:`trainers.comm.whatif_log`) and prints the tables (:func:`scaling_tables`,
:func:`method_table`; :func:`plot_scaling` draws them); ``benchmarks/whatif_check.py`` and
``whatif_lab_check.py`` check the model against measured runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .base import GradCombiner, create_combiner
from .cost import allgather_time, bytes_per_s, ring_allreduce_time

__all__ = [
    "ALLGATHER_COMPRESSORS",
    "BACKWARD_SHARE",
    "METHODS",
    "OVERLAP",
    "Workload",
    "bucketed_step_time",
    "comm_time",
    "method_combiner",
    "method_step_time",
    "method_table",
    "needed_ratio",
    "overlap_for_cores",
    "plot_scaling",
    "scaling_factor",
    "scaling_tables",
]

BACKWARD_SHARE = 2.0 / 3.0  # of a step's compute; DDP overlaps its all-reduces with it
# How much of the compute the communication of each --grad-combine mode can hide behind.
OVERLAP = {"average": BACKWARD_SHARE, "powersgd": BACKWARD_SHARE, "fp16": BACKWARD_SHARE}
OVERLAP["bf16"] = BACKWARD_SHARE
ALLGATHER_COMPRESSORS = frozenset({"topk", "sign"})


@dataclass(frozen=True)
class Workload:
    """What one step costs: compute seconds, dense gradient bytes, compression, overlap."""

    compute_time: float  # T_c, seconds per step per worker
    grad_bytes: float  # G
    compression_ratio: float = 1.0  # r
    overlap: float = 0.0  # o, fraction of T_c that communication can hide behind
    allgather: bool = False  # compressed payloads all-gathered instead of all-reduced
    source: str = ""


def comm_time(w: Workload, workers: int, gbps: float, latency: float, ratio: float | None = None) -> float:  # fmt: skip
    """Seconds one step's communication takes on a ring of ``workers`` at ``gbps``
    (the project's one latency-bandwidth model, :mod:`trainers.comm.cost`)."""
    sent = w.grad_bytes / (w.compression_ratio if ratio is None else ratio)
    if w.allgather:
        return allgather_time(sent, workers, gbps, latency)
    return ring_allreduce_time(sent, workers, gbps, latency)


def scaling_factor(w: Workload, workers: int, gbps: float, latency: float) -> float:
    """``T_c / T_step``: 1 is linear scaling."""
    exposed = max(0.0, comm_time(w, workers, gbps, latency) - w.overlap * w.compute_time)
    return w.compute_time / (w.compute_time + exposed)


def bucketed_step_time(
    w: Workload,
    workers: int,
    gbps: float,
    latency: float,
    buckets: Sequence[tuple[float, float]],
    optimizer_share: float = 0.0,
) -> float:
    """Seconds per step of DDP's bucketed all-reduce on one link, from when each bucket is ready.

    ``buckets`` is DDP's buckets in launch order, each ``(ready, nbytes)``: ``ready`` the
    fraction of ``T_c`` after which the bucket's gradients are complete (measured in one
    process, e.g. with a communication hook's timestamps), ``nbytes`` its size.
    ``optimizer_share`` is the fraction of ``T_c`` spent after the backward (the optimizer
    step), which waits for every bucket. A bucket's all-reduce starts when it is ready and
    the previous one has finished (one collective at a time on the link) and takes its share
    of :func:`comm_time` (``nbytes / sum of nbytes`` of the whole gradient's time)::

        done_0 = 0;  done_i = max(ready_i T_c, done_{i-1}) + T_comm nbytes_i / G
        T_step = max((1 - optimizer_share) T_c, done_last) + optimizer_share T_c

    This replaces the flat overlap ``o`` when the buckets' timing is known: the overlap a
    bucket gets is the backward that is left after it is ready, not a fixed share.
    """
    total = sum(nbytes for _, nbytes in buckets)
    if total <= 0:
        raise ValueError("buckets: need at least one bucket with bytes")
    comm = comm_time(w, workers, gbps, latency)
    done = 0.0
    for ready, nbytes in buckets:
        if not 0.0 <= ready <= 1.0:
            raise ValueError(f"bucket ready fraction {ready}: must be in [0, 1]")
        done = max(ready * w.compute_time, done) + comm * nbytes / total
    backward_end = (1.0 - optimizer_share) * w.compute_time
    return max(backward_end, done) + optimizer_share * w.compute_time


def overlap_for_cores(overlap: float, compute_threads: float, cores: float) -> float:
    """The overlap a node can get: ``overlap`` when it has a core its compute does not use,
    else 0.

    Overlapping the all-reduce with the backward needs CPU time beside the compute (TCP, the
    reduction, copying buckets; gloo does all of it on the CPU). A node whose compute
    threads occupy every core it has (a CPU-trained node at ``OMP_NUM_THREADS`` = its cores;
    the lab's nodes, which share one machine's cores) runs its all-reduce only when the
    compute pauses: ``T_step = T_c + T_comm``. ``cores`` may be fractional (4 lab nodes on
    2 cores: 0.5 each). A GPU node computes on the accelerator and keeps its ``overlap``;
    pass its host cores and 0 compute threads.
    """
    if cores <= 0 or compute_threads < 0:
        raise ValueError(f"cores {cores} must be > 0 and compute_threads {compute_threads} >= 0")
    return overlap if compute_threads < cores else 0.0


def needed_ratio(w: Workload, workers: int, gbps: float, latency: float, target: float) -> float:
    """The compression ratio (relative to dense fp32) that reaches scaling factor ``target``."""
    if not 0 < target <= 1:
        raise ValueError(f"--target must be in (0, 1], got {target}")
    if workers <= 1:
        return 1.0
    rate = bytes_per_s(gbps)
    hops = (workers - 1) if w.allgather else 2 * (workers - 1)
    per_byte = ((workers - 1) if w.allgather else 2 * (workers - 1) / workers) / rate
    budget = w.compute_time * (1 / target - 1) + w.overlap * w.compute_time - hops * latency
    if budget <= 0:
        return math.inf
    return max(1.0, per_byte * w.grad_bytes / budget)


def scaling_tables(
    w: Workload, workers: Sequence[int], bandwidths: Sequence[float], latency: float, target: float
) -> str:
    """The predicted scaling factor and the compression ratio needed for ``target``, per
    number of workers (rows) and link speed in Gbps (columns), under a line saying ``w``."""
    head = "workers " + "".join(f"{b:>10g}Gbps" for b in bandwidths)
    lines = [
        f"what-if for {w.source or 'the given workload'}: compute {w.compute_time * 1e3:.1f} ms/step, "
        f"gradient {w.grad_bytes / 2**20:.1f} MiB, compression ratio {w.compression_ratio:.3g}, "
        f"overlap {w.overlap:.2f}, latency {latency * 1e6:g} us"
        f"{', all-gather' if w.allgather else ''}",
        "",
        "predicted scaling factor (1 = linear)",
        head,
    ]
    for n in workers:
        row = "".join(f"{scaling_factor(w, n, b, latency):>14.3f}" for b in bandwidths)
        lines.append(f"{n:>7d} {row}")
    lines += ["", f"compression ratio needed for scaling factor {target:g}", head]
    for n in workers:
        row = "".join(f"{needed_ratio(w, n, b, latency, target):>14.3g}" for b in bandwidths)
        lines.append(f"{n:>7d} {row}")
    return "\n".join(lines)


def plot_scaling(w: Workload, workers: Sequence[int], bandwidths: Sequence[float], latency: float, output: str) -> None:  # fmt: skip
    """Draw the scaling factor against the workers, one line per link speed, into the PNG
    ``output`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for b in bandwidths:
        ax.plot(workers, [scaling_factor(w, n, b, latency) for n in workers], marker="o", label=f"{b:g} Gbps")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("workers")
    ax.set_ylabel("scaling factor")
    ax.set_title(w.source or "what-if", fontsize="small")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


# ---- decentralized and pipelined methods ---------------------------------------------------------
# Each method is a registered combining mode, and its formulas live on its class
# (``comm_time``: ``T_m``, the communication of a step; ``step_time``: the step times of the fast
# ranks and of a straggler whose compute takes ``s T_c``):
#
#   average (all-reduce after the backward, o = 0)   T_m ring all-reduce   s T_c + max(0, T_m - o T_c)
#   pipesgd (width 2: the all-reduce of step t-1      T_m ring all-reduce   max(s T_c, T_m)
#     runs during step t's compute)
#   sgp, overlap 0 / adpsgd synchronous rounds      T_m one message       s T_c + T_m
#   sgp, overlap tau >= 1 (tau messages in flight)  T_m one message       max(s T_c, T_m / tau)
#   adpsgd asynchronous (its own thread)            T_m two messages      T_c (fast), s T_c (straggler)
#   coded (CodedReduce, s <= its tolerance: the     T_m 2 (n-1) messages  T_c + T_m (fast),
#     straggler's message is not waited for; its                          s T_c + T_m (straggler)
#     default one-level tree: the root's link)
#
# (a message: one model, ``S / B + a``). A blocking all-reduce or a lockstep gossip round makes
# every rank wait for the slowest, after at most log2(n) rounds for gossip; only the
# asynchronous method lets the fast ranks run at their own speed (its exchanges happen less
# often than steps when 2 T_m > T_c).
METHODS = ("average", "pipesgd", "sgp", "sgp-overlap", "adpsgd", "adpsgd-async", "coded")


def method_combiner(method: str, *, tau: int = 1) -> GradCombiner:
    """The combining mode (with its options) that ``method`` names; ``tau``: the messages in
    flight of ``sgp-overlap``."""
    modes: dict[str, tuple[str, dict[str, Any]]] = {
        "average": ("average", {}),
        "pipesgd": ("pipesgd", {}),
        "sgp": ("sgp", {"overlap": 0}),
        "sgp-overlap": ("sgp", {"overlap": max(1, tau)}),
        "adpsgd": ("adpsgd", {"asynchronous": False}),
        "adpsgd-async": ("adpsgd", {"asynchronous": True}),
        "coded": ("coded", {}),
    }
    if method not in modes:
        raise ValueError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    mode, options = modes[method]
    return create_combiner(mode, **options)


def method_step_time(
    method: str,
    compute: float,
    comm: float,
    *,
    straggler: float = 1.0,
    overlap: float = 0.0,
    tau: int = 1,
) -> tuple[float, float]:
    """``(fast ranks, straggler)`` seconds per step of ``method`` (its class's ``step_time``,
    see the table above).

    Args:
        compute: ``T_c`` of a normal rank.
        comm: ``T_m`` of the method (its class's ``comm_time``).
        straggler: ``s``, the slowest rank's compute factor (1: none).
        overlap: ``o`` of ``average`` (DDP hides up to ``o T_c``).
        tau: messages in flight of ``sgp-overlap``.
    """
    combiner = method_combiner(method, tau=tau)
    return combiner.step_time(compute, comm, straggler=straggler, overlap=overlap)


def method_table(w: Workload, workers: Sequence[int], gbps: float, latency: float) -> str:
    """Predicted step times (ms) of each method at ``gbps``, no straggler and one 2x slower."""
    lines = [f"step time per method at {gbps:g} Gbps, ms (fast ranks; / with one rank 2x slower)"]
    lines.append("workers " + "".join(f"{m:>20s}" for m in METHODS))
    for n in workers:
        cells = []
        for m in METHODS:
            combiner = method_combiner(m)
            comm = combiner.comm_time(w.grad_bytes, n, gbps, latency)
            o = w.overlap if m == "average" else 0.0
            base = combiner.step_time(w.compute_time, comm, overlap=o)[0]
            slow = combiner.step_time(w.compute_time, comm, straggler=2.0, overlap=o)[0]
            cells.append(f"{base * 1e3:>10.1f} / {slow * 1e3:>7.1f}")
        lines.append(f"{n:>7d} " + "".join(cells))
    return "\n".join(lines)
