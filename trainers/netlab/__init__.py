"""The lab network: rehearse a multi-node job on one Linux machine.

:class:`Lab` builds N nodes as network namespaces joined by a bridge, with bandwidth caps
and partitions; :func:`run_job` starts one torchrun agent per node and counts the bytes each
node's cable carried. ``python -m trainers.netlab {up,down,status,run}`` is the command line.
See docs/netlab.md.
"""

from .job import JobResult, Partition, run_job, start_ranks, wait_ranks
from .lab import (
    LAB_NETWORK,
    MAX_NODES,
    PREFIX,
    Lab,
    LabError,
    NodeCounters,
    burst_bytes,
    format_rate,
    interface_tx_bytes,
    list_labs,
    missing_requirements,
    node_address,
    parse_rate,
    remove_labs,
)

__all__ = [
    "JobResult",
    "Partition",
    "run_job",
    "start_ranks",
    "wait_ranks",
    "LAB_NETWORK",
    "MAX_NODES",
    "PREFIX",
    "Lab",
    "LabError",
    "NodeCounters",
    "burst_bytes",
    "format_rate",
    "interface_tx_bytes",
    "list_labs",
    "missing_requirements",
    "node_address",
    "parse_rate",
    "remove_labs",
]
