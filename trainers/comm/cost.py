"""The latency-bandwidth cost of a message and of the collectives, shared by every model of
communication time in the project: the placement planner (:mod:`trainers.parallel.plan`),
``scripts/scaling_whatif.py`` (and through it each combining mode's own formula,
:meth:`~trainers.comm.GradCombiner.comm_time`) and the sparse all-reduce's choice of
algorithm (:class:`trainers.comm.sparse.CostModel`).

The model is Hockney's (the "alpha-beta" model of Thakur, Rabenseifner and Gropp,
"Optimization of Collective Communication Operations in MPICH", IJHPCA 2005): a message of
``S`` bytes over a link of ``B`` bytes/s costs ``a + S / B``, ``a`` the per-message latency.
A ring all-reduce over ``N`` ranks sends ``2 (N - 1)`` messages of ``S / N`` bytes from each
rank one after another (reduce-scatter, then all-gather); a ring all-gather of ``S`` bytes
from each rank sends ``N - 1`` messages of ``S``.

Bandwidths are given as ``gbps`` (10^9 bits per second, as links are sold); :func:`alpha_beta`
takes bytes per second for callers that measure it so.
"""

from __future__ import annotations

__all__ = [
    "allgather_time",
    "alpha_beta",
    "bytes_per_s",
    "message_time",
    "ring_allreduce_time",
]


def bytes_per_s(gbps: float) -> float:
    """``gbps`` (10^9 bits per second) in bytes per second."""
    return gbps * 1e9 / 8


def alpha_beta(messages: float, nbytes: float, *, latency_s: float, rate: float) -> float:
    """``messages`` messages carrying ``nbytes`` in all, one after another, at ``rate`` bytes
    per second and ``latency_s`` per message: ``messages a + nbytes / B``."""
    return messages * latency_s + nbytes / rate


def message_time(nbytes: float, gbps: float, latency_s: float) -> float:
    """One message of ``nbytes`` to one peer: ``S / B + a``."""
    return nbytes / bytes_per_s(gbps) + latency_s


def ring_allreduce_time(nbytes: float, members: int, gbps: float, latency_s: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``members`` ranks: ``2 (N-1)/N S/B + 2 (N-1) a``
    (0 for one rank)."""
    if members <= 1:
        return 0.0
    rate = bytes_per_s(gbps)
    return 2 * (members - 1) / members * nbytes / rate + 2 * (members - 1) * latency_s


def allgather_time(nbytes: float, members: int, gbps: float, latency_s: float) -> float:
    """Ring all-gather of ``nbytes`` from each of ``members`` ranks: ``(N-1) S/B + (N-1) a``
    (0 for one rank)."""
    if members <= 1:
        return 0.0
    rate = bytes_per_s(gbps)
    return (members - 1) * nbytes / rate + (members - 1) * latency_s
