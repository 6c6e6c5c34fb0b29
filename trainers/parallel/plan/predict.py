"""Placements and their predicted step time and memory: :class:`ParallelConfig`,
:class:`Prediction`, the per-stage cost model (``_Costs``, the formulas of the package
docstring, :mod:`trainers.parallel.plan`), :func:`predict_step_time` and plan files
(:class:`Plan`, :func:`load_plan`, :func:`save_plan`)."""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainers.parallel.pipeline import PIPELINE_SCHEDULES
from trainers.parallel.plan._io import _check_unknown, _get, _read_json, _write_json
from trainers.parallel.plan.network import Network, _layout_levels, p2p_time
from trainers.parallel.plan.profile import BlockProfile, Profile

SCHEDULES = PIPELINE_SCHEDULES  # ("gpipe", "1f1b")
PLAN_FORMAT = 1
DEFAULT_OPTIMIZER_STATE_FACTOR = 4.0


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
        ranks_per_core: float = 1.0,
    ) -> None:
        self.tp, self.pp, self.dp, self.m, self.schedule = tp, pp, dp, micro_batches, schedule
        self.bubble_factor = bubble_factor(pp, ranks_per_core)
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
            return network.levels[level].allreduce_time(nbytes, members)

        self._dp_ar = lambda nbytes: ar(nbytes, dp, dp_level)
        self.hop = [network.levels[h] for h in hops]
        fwd, bwd, comp, tpc, act, par, opt, out = ([] for _ in range(8))
        copies = []  # the data-parallel bucket copies around the all-reduce (dp > 1)
        for b in profile.blocks:
            f = _block_time(b, "forward_s", self.micro_batch, profile.batch)
            g = _block_time(b, "backward_s", self.micro_batch, profile.batch)
            a, w = b.activation_bytes * ratio, b.param_bytes
            comm = 0.0
            if b.tensor_parallel and tp > 1:
                sharded = b.tp_times.get(str(tp))
                if sharded is not None:  # timed sharded (DTensor), at the profile's batch
                    # its line, bent as the whole block's time bends at larger batches
                    f = _bend(b, "forward_s", self.micro_batch, profile.batch) * (
                        sharded["forward_fixed_s"]
                        + (sharded["forward_s"] - sharded["forward_fixed_s"]) * ratio
                    )
                    g = _bend(b, "backward_s", self.micro_batch, profile.batch) * (
                        sharded["backward_fixed_s"]
                        + (sharded["backward_s"] - sharded["backward_fixed_s"]) * ratio
                    )
                else:  # measured share of the whole block, else a perfect split
                    share = b.tp_time_ratio.get(str(tp), 1 / tp)
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
            copies.append(b.grad_copy_s * (w / b.param_bytes) if b.param_bytes and dp > 1 else 0.0)
            out.append(b.output_bytes * ratio)
        self.fwd, self.bwd, self.comp, self.tpc, self.out = fwd, bwd, comp, tpc, out
        self._pm = _prefix(comp)
        # the bubble's communication is not sped up by idle cores (see objective)
        self._comm_weight = (1 - self.bubble_factor) * (pp - 1) / pp
        self.act, self.par, self.opt = act, par, opt
        self._pf, self._pb = _prefix(fwd), _prefix(bwd)
        self._pa, self._pw, self._po = _prefix(act), _prefix(par), _prefix(opt)
        self._pc = _prefix(copies)
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
        return f, g, exposed + self._pc[j] - self._pc[i] + self._po[j] - self._po[i]

    def weight(self, i: int, j: int, f: float, g: float) -> float:
        """The stage of blocks ``i .. j-1`` with per-micro-batch ``f``, ``g``: its additive part
        of the step, ``c u_s + (1 - c) (S - 1) / S comm_s`` (``comm_s``: its tensor-parallel
        all-reduces and receives, which run at the link's speed however many ranks compute)."""
        if self._comm_weight == 0.0:
            return f + g
        comm = f + g - (self._pm[j] - self._pm[i])  # all but the blocks' computation
        return self.bubble_factor * (f + g) + self._comm_weight * comm

    def objective(self, total_w: float, max_f: float, max_g: float, max_e: float) -> float:
        """``T_step`` from the sum of the stages' :meth:`weight` and the maxima:
        ``M (F + G) + c (sum u - F - G) + (1 - c) (S - 1) / S sum comm + E`` (with ``c = 1``:
        ``sum u + (M - 1)(F + G) + E``); non-decreasing in each argument (``c <= 1 <= M``)."""
        return total_w + (self.m - self.bubble_factor) * (max_f + max_g) + max_e

    def predict(self, boundaries: Sequence[int]) -> Prediction:
        stages = []
        fs, gs, es, ws = [], [], [], []
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
            ws.append(self.weight(i, j, f, g))
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
                    "dp_grad_copy_s": self._pc[j] - self._pc[i],
                    "optimizer_s": self._po[j] - self._po[i],
                    "in_flight": self.in_flight(s),
                    "param_bytes": weights,
                    "activation_bytes": self.in_flight(s) * (self._pa[j] - self._pa[i]),
                    "memory_bytes": self.memory(s, i, j),
                }
            )
        bottleneck = max(fs) + max(gs)
        update = max(es)
        slowest = es.index(update)
        step = self.objective(sum(ws), max(fs), max(gs), update)
        breakdown = {
            "micro_batch_size": self.micro_batch,
            "steady_s": self.m * bottleneck,
            "bubble_s": step - self.m * bottleneck - update,
            "bubble_factor": self.bubble_factor,
            "update_s": update,
            "update_stage": slowest,
            "dp_allreduce_exposed_s": stages[slowest]["dp_allreduce_exposed_s"],
            "dp_grad_copy_s": stages[slowest]["dp_grad_copy_s"],
            "optimizer_s": stages[slowest]["optimizer_s"],
            "forward_bottleneck_stage": fs.index(max(fs)),
            "backward_bottleneck_stage": gs.index(max(gs)),
            "levels": self.levels,
            "stages": stages,
        }
        memory = max(st["memory_bytes"] for st in stages)
        return Prediction(step, memory, breakdown)


def bubble_factor(pp: int, ranks_per_core: float) -> float:
    """The factor ``c`` on a pipeline's bubble, ``T_pipe = M (F + G) + c (sum u - F - G)``,
    where ``ranks_per_core = r`` ranks share each core and the profile was taken with every
    rank busy (each then had ``1 / r`` of a core). While ``k`` of the ``pp`` stages compute, a
    busy rank gets ``min(1, cores / busy ranks)`` of a core, so their work takes
    ``phi_k = max(1 / r, k / pp)`` of its profiled time. With balanced stages a schedule of
    ``M >= pp`` micro-batches runs ``M - pp + 1`` slots with every stage busy and, in its
    ramp up and down, two slots with ``k`` busy for each ``k = 1 .. pp - 1``, so
    ``T_pipe = (M - pp + 1 + 2 sum_k phi_k) (f + g)``: ``c = 2 mean_k phi_k - 1`` (checked
    against an event simulation with shared cores in the tests: exact for both schedules; with
    communication in the stages, which :meth:`_Costs.weight` keeps at its own speed, exact for
    GPipe and an upper bound for 1F1B, whose overlapping stages compute while another talks,
    up to 15 % above the simulation there). 1 (no change)
    with one stage or with a core (or a device) per rank; 0 for two stages on half a core
    each (one stage alone runs twice as fast)."""
    if pp <= 1 or ranks_per_core <= 1:
        return 1.0
    mean = sum(max(1 / ranks_per_core, k / pp) for k in range(1, pp)) / (pp - 1)
    return 2 * mean - 1


def _line(block: BlockProfile, key: str, micro_batch: int, batch: int) -> float:
    """``key``'s time at ``micro_batch`` on the line through the profile's two batches: the
    per-call part once, the rest in proportion to the micro-batch."""
    fixed = getattr(block, key.replace("_s", "_fixed_s"))
    return fixed + (getattr(block, key) - fixed) * micro_batch / batch


def _block_time(block: BlockProfile, key: str, micro_batch: int, batch: int) -> float:
    """``key`` (``forward_s``/``backward_s``) of ``block`` at ``micro_batch``: up to the profile's
    ``batch`` the line (:func:`_line`); above it, piecewise linear through the times measured at
    ``batch`` and at the larger batches of ``batch_times``, and past the largest along its last
    piece (the line where none is measured)."""
    points = sorted((int(m), t[key]) for m, t in block.batch_times.items() if int(m) > batch)
    if micro_batch <= batch or not points:
        return _line(block, key, micro_batch, batch)
    points.insert(0, (batch, getattr(block, key)))
    pieces = list(itertools.pairwise(points))
    # the piece that holds micro_batch, else the last one (extrapolated along it)
    (b1, t1), (b2, t2) = next((p for p in pieces if micro_batch <= p[1][0]), pieces[-1])
    return t1 + (t2 - t1) * (micro_batch - b1) / (b2 - b1)


def _bend(block: BlockProfile, key: str, micro_batch: int, batch: int) -> float:
    """How far the measured larger batches bend ``block``'s time away from its line at
    ``micro_batch`` (1: not at all)."""
    line = _line(block, key, micro_batch, batch)
    return _block_time(block, key, micro_batch, batch) / line if line > 0 else 1.0


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
    ranks_per_core: float = 1.0,
) -> Prediction:
    """Predicted seconds per optimizer step, memory per device and breakdown of ``config``
    (the formulas of the module docstring). ``ranks_per_core``: ranks sharing one core, where
    a machine runs more ranks than it has cores and the profile was taken with every rank
    busy (:func:`bubble_factor`); 1 (the default) where each rank has its own device.

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
        ranks_per_core=ranks_per_core,
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
    ranks_per_core: float = 1.0

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
            ranks_per_core=_get(data, "ranks_per_core", where, float, default=1.0, minimum=1.0),
        )


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """A plan JSON file written by ``--json``; ``ValueError`` names the file and the field."""
    return Plan.from_dict(_read_json(path, "plan"), where=str(path))


def save_plan(plan_: Plan, path: str | os.PathLike[str]) -> Path:
    """Write ``plan_`` atomically (temporary file + ``os.replace``)."""
    return _write_json(path, plan_.to_dict())
