"""The search: every ``(tp, pp, dp, M, schedule)`` and, for each, the exact chain DP over
stage boundaries under the memory limit (:func:`top_plans`, :func:`plan`,
:func:`brute_force`; the package docstring, :mod:`trainers.parallel.plan`)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from typing import Any

from trainers.parallel.pipeline import _min_max_boundaries
from trainers.parallel.plan.network import Network
from trainers.parallel.plan.predict import (
    DEFAULT_OPTIMIZER_STATE_FACTOR,
    SCHEDULES,
    InfeasiblePlanError,
    ParallelConfig,
    Plan,
    Prediction,
    _Costs,
)
from trainers.parallel.plan.profile import Profile

DEFAULT_MAX_MICRO_BATCHES = 64


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
    n, stages = costs.n, costs.pp
    bound = cutoff * (1 + 1e-9) if math.isfinite(cutoff) else cutoff
    # labels: (sum of the stages' weights (u with c = 1), max f, max g, max E,
    # (parent label, parent end)); stage -1 ends at 0
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
                u = costs.weight(i, j, f, g)
                lb_f, lb_g = costs.suf_f[j], costs.suf_g[j]
                for lab in labels:
                    total = lab[0] + u
                    mf, mg, me = max(lab[1], f), max(lab[2], g), max(lab[3], e)
                    low = costs.objective(total + costs.bubble_factor * costs.rest[j],
                                          max(mf, lb_f), max(mg, lb_g), me)  # fmt: skip
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
    value, bounds = _min_max_boundaries(costs.n, costs.pp, costs.memory)
    return value, tuple(bounds)


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
    ranks_per_core: float = 1.0,
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
    if not ranks_per_core >= 1.0:
        raise ValueError(f"ranks_per_core must be >= 1, got {ranks_per_core}")
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
                   overlap=overlap, ranks_per_core=ranks_per_core)  # fmt: skip
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
            profile,
            network,
            cfg,
            pred,
            global_batch,
            memory_bytes,
            optimizer_state_factor,
            overlap,
            ranks_per_core,
        )
        for _, cfg, pred in found
    ]


def _make_plan(profile: Profile, network: Network, config: ParallelConfig, pred: Prediction,
               global_batch: int, memory_bytes: float, phi: float, overlap: float,
               ranks_per_core: float) -> Plan:  # fmt: skip
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
        ranks_per_core=ranks_per_core,
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
        **options: ``optimizer_state_factor`` (4), ``overlap`` (0), ``ranks_per_core`` (1:
            a core or a device per rank; see :func:`~.predict.bubble_factor`), ``max_tp`` (8),
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
