"""The hierarchical network: :class:`Level`, :class:`Network`, the all-reduce and
point-to-point time models and the Megatron-LM rank layout (the package docstring,
:mod:`trainers.parallel.plan`)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from trainers.comm.cost import message_time, ring_allreduce_time


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


# The project's one latency-bandwidth model (trainers.comm.cost), under the planner's names.
allreduce_time = ring_allreduce_time
p2p_time = message_time


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
