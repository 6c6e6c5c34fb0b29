"""The what-if model's workload read from a run log: ``T_c``, ``G``, ``r`` and ``o`` of a run.

``scripts/scaling_whatif.py`` predicts a logged run's scaling with :mod:`trainers.comm.whatif`;
this module reads what the prediction starts from (:func:`read_workload`):

* ``T_c`` = global batch / ``samples_per_sec``, the median over the step records after the
  first (:func:`step_times`). The global batch of a step record is ``batch_size x
  accumulate x`` the data shards of the world (:func:`data_parts`: the header's world size,
  or the latest ``membership`` record's after an elastic restart; fewer for a model split
  over ranks or ``--grad-combine coded``); a two-phase pretraining log's step has its phase's
  batch, and a full-graph GNN step is one sample (the graph).
* ``G`` from the step records' ``grad_bytes``, else ``grad_bytes`` given, else the model the
  header describes, counted by the ``model_grad_bytes`` the caller passes (trainers import no
  model family: ``modelzoo.logged_models.logged_model_grad_bytes`` counts the zoo's).
* ``r`` = the sum of ``grad_bytes`` over the sum of ``bytes_sent`` (1 without them); ``o``
  from the header's ``--grad-combine`` (:data:`trainers.comm.whatif.OVERLAP`).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..logs import RunLogError, read_run_log
from .whatif import ALLGATHER_COMPRESSORS, OVERLAP, Workload

__all__ = [
    "GNN_GRAPH_DATASETS",
    "NOT_SGD_SCRIPTS",
    "WhatIfLogError",
    "data_parts",
    "model_parallel_degree",
    "read_workload",
    "step_times",
]

# Scripts whose steps are not data-parallel SGD steps of one gradient all-reduce.
NOT_SGD_SCRIPTS = {
    "train_linear.py": "L-BFGS iterations or feature-partitioned CA-SGD rounds, whose messages "
    "its log counts (docs/linear.md)"
}
# scripts/train_gnn.py's GRAPH_DATASETS: graph classification, mini-batches of --batch-size graphs.
GNN_GRAPH_DATASETS = frozenset({"sbm_graphs"})

#: ``(model name or None, header config, script file name) -> G`` bytes; raises LookupError.
ModelGradBytes = Callable[[str | None, dict[str, Any], str], float]


class WhatIfLogError(ValueError):
    """A run log the what-if model cannot read; the message names the log (or the reading
    error) and what to pass instead."""


def _phase(record: dict[str, Any], config: dict[str, Any]) -> int:
    """The pretraining phase a step record ran in."""
    if record.get("phase") is not None:
        return int(record["phase"])
    phases = str(config.get("phases") or "1,2").replace(" ", "")
    if phases == "2":  # phase 2 alone counts its steps from 0
        return 2
    return 1 if int(record["step"]) <= int(config["phase1_steps"]) else 2


def _per_step_batch(record: dict[str, Any], config: dict[str, Any], script: str) -> int:
    """Samples one rank consumes per optimizer step."""
    if "phase1_batch_size" in config:
        n = _phase(record, config)
        return int(config[f"phase{n}_batch_size"]) * int(config.get(f"phase{n}_accumulate") or 1)
    if script == "train_gnn.py" and not config.get("fanout_list") and config.get("dataset") not in GNN_GRAPH_DATASETS:  # fmt: skip
        return 1  # full-graph node classification: each step is the whole graph
    if config.get("batch_size") is None:
        raise LookupError("has no batch_size in its header; pass --compute-time")
    return int(config["batch_size"]) * int(config.get("accumulate") or 1)


def step_times(records: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds per optimizer step of every step record with a speed: global batch / speed.

    Raises:
        LookupError: The header does not say the batch size.
    """
    header = records[0]
    config = header.get("config") or {}
    script = Path(str((header.get("command") or [""])[0])).name
    world = int(header.get("world_size", 1))
    times = []
    for r in records[1:]:
        if r.get("kind") == "membership" and r.get("new_world_size"):
            world = int(r["new_world_size"])  # an elastic restart with a new membership
        if r.get("kind") != "step" or not r.get("samples_per_sec"):
            continue
        batch = _per_step_batch(r, config, script)
        times.append(batch * data_parts(header, world) / float(r["samples_per_sec"]))
    return times


def model_parallel_degree(config: dict[str, Any]) -> int:
    """Ranks that share one data shard because they hold parts of one model replica:
    ``--tensor-parallel`` x ``--pipeline-parallel`` (1 for logs without them)."""
    return int(config.get("tensor_parallel") or 1) * int(config.get("pipeline_parallel") or 1)


def data_parts(header: dict[str, Any], world: int) -> int:
    """Distinct data shards of a global batch at ``world`` ranks: the world size, fewer for
    a model split over ranks (``--tensor-parallel``/``--pipeline-parallel``: its replicas,
    world / degree) or a combiner whose ranks share data (``--grad-combine coded``), read from
    the header's ``configs.combiner``; logs without it are taken as one shard a rank."""
    degree = model_parallel_degree(header.get("config") or {})
    if degree > 1:
        return world // degree
    combiner = (header.get("configs") or {}).get("combiner")
    if not combiner:
        return world
    from . import combiner_class  # noqa: PLC0415 (the package: every mode registered)

    try:
        cls = combiner_class(str(combiner["mode"]))
        return int(cls(cls.Options(**combiner.get("options", {}))).data_parts(world))
    except (KeyError, TypeError, ValueError):
        return world


def read_workload(
    path: str | Path,
    *,
    grad_bytes: float | None = None,
    model_grad_bytes: ModelGradBytes | None = None,
) -> Workload:
    """``T_c``, ``G``, ``r`` and the overlap of the run in ``path`` (see the module docstring).
    ``grad_bytes``: ``G`` when the log recorded none (``--grad-bytes``), instead of counting
    the parameters of the model it names with ``model_grad_bytes``.

    Raises:
        WhatIfLogError: The log cannot be read, is not of data-parallel SGD steps, has no
            step record with a speed, or does not say its batch size or (without
            ``grad_bytes``) its model.
    """
    try:
        records = read_run_log(path)
    except RunLogError as e:
        raise WhatIfLogError(str(e)) from None
    header = records[0]
    config = header.get("config") or {}
    script = Path(str((header.get("command") or [""])[0])).name
    if script in NOT_SGD_SCRIPTS:
        raise WhatIfLogError(
            f"{path} is a {script} run ({NOT_SGD_SCRIPTS[script]}); this model is for "
            "data-parallel SGD steps, give --compute-time and --grad-bytes instead"
        )
    world = int(header.get("world_size", 1))
    steps = [r for r in records if r.get("kind") == "step" and r.get("samples_per_sec")]
    if not steps:
        raise WhatIfLogError(f"{path} has no step record with samples_per_sec")
    try:
        times = step_times(records)
    except LookupError as e:
        raise WhatIfLogError(f"{path} {e.args[0]}") from None
    compute = statistics.median(times[1:] or times)
    grad = [float(r["grad_bytes"]) for r in steps if r.get("grad_bytes") is not None]
    # Over the whole run: an interval that sent nothing (local SGD between two averagings)
    # has an infinite ratio (null in the log).
    sent = [float(r["bytes_sent"]) for r in steps if r.get("bytes_sent") is not None]
    ratio = 1.0
    if grad and sent:
        ratio = sum(grad) / sum(sent) if sum(sent) > 0 else math.inf
    if grad:
        grad_bytes = grad[-1]
    elif grad_bytes is None:
        name = config.get("model") or config.get("bert_model")
        try:
            if model_grad_bytes is None:
                raise LookupError("records no grad_bytes; pass --grad-bytes")
            grad_bytes = model_grad_bytes(str(name) if name else None, config, script)
        except LookupError as e:
            raise WhatIfLogError(f"{path} {e.args[0]}") from None
    mode = str(config.get("grad_combine", "average"))
    compressor = config.get("compressor") or ("topk" if mode in ("ef", "cser-update") else None)
    allgather = mode == "ef" and compressor in ALLGATHER_COMPRESSORS
    return Workload(
        compute_time=compute,
        grad_bytes=grad_bytes,
        compression_ratio=ratio,
        overlap=OVERLAP.get(mode, 0.0),
        allgather=allgather,
        source=f"{Path(path).name} ({mode}, world size {world})",
    )
