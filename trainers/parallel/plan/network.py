"""The hierarchical network: :class:`Level`, :class:`Network`, the all-reduce and
point-to-point time models and the Megatron-LM rank layout (the package docstring,
:mod:`trainers.parallel.plan`)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable
from dataclasses import dataclass

from trainers.comm.cost import message_time, ring_allreduce_time

# The project's one latency-bandwidth model (trainers.comm.cost), under the planner's names.
allreduce_time = ring_allreduce_time
p2p_time = message_time


@dataclass(frozen=True)
class Level:
    """One level of the network: ``size`` units of the level below, joined at ``gbps`` per
    device with ``latency_s`` per message.

    ``hops``: optionally, a ring all-reduce's time per step measured on the link at a few
    chunk sizes, ``((chunk_bytes, seconds), ...)`` in increasing chunk size. A ring
    all-reduce of ``S`` bytes over ``N`` ranks is ``2 (N-1)`` steps of ``S / N`` bytes; with a
    curve each step costs its value at ``S / N``, interpolated linearly between the measured
    chunks, the first value below them and the last segment's slope above. Real links are not
    a straight line in the size: gloo between processes on one host took 1.7x the line
    through 4 bytes and 16 MiB at 2 MiB (2026-12-07). Point-to-point messages keep
    ``S / B + a``.
    """

    size: int
    gbps: float
    latency_s: float
    hops: tuple[tuple[float, float], ...] = ()

    @property
    def bytes_per_s(self) -> float:
        return self.gbps * 1e9 / 8

    def hop_time(self, chunk_bytes: float) -> float:
        """One ring step of ``chunk_bytes``: the curve's value, or ``chunk / B + a``."""
        if not self.hops:
            return chunk_bytes / self.bytes_per_s + self.latency_s
        sizes = [c for c, _ in self.hops]
        times = [t for _, t in self.hops]
        if chunk_bytes <= sizes[0]:
            return times[0]
        i = bisect.bisect_left(sizes, chunk_bytes)
        if i == len(sizes):  # beyond the largest chunk: its segment's slope
            i -= 1
        c0, c1, t0, t1 = sizes[i - 1], sizes[i], times[i - 1], times[i]
        return t0 + (t1 - t0) * (chunk_bytes - c0) / (c1 - c0)

    def allreduce_time(self, nbytes: float, members: int) -> float:
        """Ring all-reduce of ``nbytes`` over ``members`` ranks on this level."""
        if not self.hops:
            return allreduce_time(nbytes, members, self.gbps, self.latency_s)
        if members <= 1:
            return 0.0
        return 2 * (members - 1) * self.hop_time(nbytes / members)

    def __str__(self) -> str:
        text = f"{self.size}:{self.gbps:g}:{self.latency_s:g}"
        if self.hops:
            text += ":" + "/".join(f"{c:g}@{t:g}" for c, t in self.hops)
        return text


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
                if len(fields) not in (3, 4):
                    raise ValueError
                size, gbps, latency = int(fields[0]), float(fields[1]), float(fields[2])
            except ValueError:
                raise ValueError(
                    f"network {text!r}: level {index} {part!r} must be size:gbps:latency_s "
                    "(e.g. 8:2400:3e-6 for 8 devices joined at 2400 Gbps, 3 us per message), "
                    "optionally :CHUNK@SECONDS/... (a ring step's measured time per chunk size)"
                ) from None
            hops = _parse_hops(text, index, fields[3]) if len(fields) == 4 else ()
            if size < 1 or not (gbps > 0 and math.isfinite(gbps)) or not (
                latency >= 0 and math.isfinite(latency)
            ):  # fmt: skip
                raise ValueError(
                    f"network {text!r}: level {index} {part!r} needs size >= 1, gbps > 0 and "
                    "latency_s >= 0"
                )
            levels.append(Level(size, gbps, latency, hops))
        network = cls(tuple(levels))
        if devices is not None and network.devices != devices:
            sizes = " x ".join(str(level.size) for level in levels)
            raise ValueError(
                f"network {text!r} describes {network.devices} devices ({sizes}) but there are "
                f"{devices}; make the product of the level sizes equal the number of devices"
            )
        return network

    def __str__(self) -> str:
        return ",".join(str(level) for level in self.levels)

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
        if old.hops:  # the measured steps: bytes over the bandwidth, the rest latency
            hops = tuple(
                (c, c / (old.bytes_per_s * gbps) + (t - c / old.bytes_per_s) * latency)
                for c, t in old.hops
            )
        else:
            hops = ()
        levels[level] = Level(old.size, old.gbps * gbps, old.latency_s * latency, hops)
        return Network(tuple(levels))


def _parse_hops(text: str, index: int, field: str) -> tuple[tuple[float, float], ...]:
    """``"CHUNK@SECONDS/..."``: a ring step's measured seconds per chunk size in bytes."""
    hops = []
    for item in field.split("/"):
        try:
            chunk, seconds = (float(x) for x in item.split("@"))
        except ValueError:
            raise ValueError(
                f"network {text!r}: level {index}: {item!r} must be CHUNK_BYTES@SECONDS (a ring "
                "step's time at a chunk size, e.g. 1048576@0.0009)"
            ) from None
        if not (chunk >= 0 and seconds > 0 and math.isfinite(chunk) and math.isfinite(seconds)):
            raise ValueError(
                f"network {text!r}: level {index}: {item!r} needs a chunk >= 0 and seconds > 0"
            )
        hops.append((chunk, seconds))
    if any(b[0] <= a[0] for a, b in zip(hops, hops[1:], strict=False)):
        raise ValueError(
            f"network {text!r}: level {index}: the measured chunks must grow strictly: "
            f"{[c for c, _ in hops]}"
        )
    return tuple(hops)


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
