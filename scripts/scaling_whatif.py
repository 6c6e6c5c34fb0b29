"""What if the network were different? Predict the scaling factor of a run for N workers x B Gbps.

Usage::

    python scripts/scaling_whatif.py logs/<run>.jsonl [--workers 2,4,8,16,32,64]
        [--bandwidths 10,25,100,400] [--target 0.9] [--plot whatif.png]
    python scripts/scaling_whatif.py --model resnest50 --compute-time 0.20   # no log

The model (Zhang et al., NetAI 2020) and its formulas are in :mod:`trainers.comm.whatif`.

What it reads from the log: ``T_c`` = global batch / ``samples_per_sec``, the median over the
step records after the first (for a multi-process log this includes this machine's own
loopback communication, so it slightly over-estimates compute). The global batch of a step
record is ``batch_size x accumulate x`` world size (the header's, or the latest ``membership``
record's after an elastic restart; the data parts for ``--grad-combine coded``, whose ranks
share data; world / (tensor x pipeline degree) for a model-parallel run, whose ranks of one
replica read the same batch); ``scripts/train_gnn.py``'s full-graph steps are one
sample (the graph). A two-phase pretraining log (``scripts/pretrain_bert.py``: per-phase
``phase1_batch_size``, ``phase1_accumulate``, ``phase2_...``, no ``batch_size``) gives every
step record the batch of the phase it ran in (its ``phase`` field; else its step number
against ``phase1_steps``), so ``T_c`` is the median step of both phases, which is phase 1's
when, as in the BERT, LAMB and LANS recipes, phase 1 has most of the steps; for one phase
alone pass that phase's ``--compute-time``. ``G`` from the step records' ``grad_bytes`` (logs
written since the communication modes exist) or from the model the header describes
(parameter count x 4 bytes): the zoo model it names, with the head the script trains
(``pretrain_bert.py``: masked LM + next sentence, over the run's vocabulary;
``finetune_squad.py``: span prediction), or the BERT that the pretraining flags
(``num_layers``, ``hidden_size``, ...) build. ``r`` = the sum of ``grad_bytes`` over the sum
of ``bytes_sent`` of the step records (1 without them); ``o`` from the header's
``--grad-combine``. Every one of them can be overridden.

The last table compares the decentralized and pipelined modes (Pipe-SGD, SGP, AD-PSGD) with
all-reduce averaging, with and without a straggler: see "decentralized and pipelined
methods" below for their cost models, and ``benchmarks/bench_decentralized.py`` for the
measured check (injected link delay and straggler).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trainers.comm.cost import message_time  # noqa: E402, F401 (one model to one peer)
from trainers.logs import read_run_log  # noqa: E402, F401

DEFAULT_WORKERS = (2, 4, 8, 16, 32, 64)
DEFAULT_BANDWIDTHS = (10.0, 25.0, 100.0, 400.0)  # Gbps
DEFAULT_LATENCY_US = 10.0
# The model itself (trainers.comm.whatif) and its reading of a log (trainers.comm.whatif_log),
# under the names tests and benchmarks read here.
from trainers.comm.whatif import (  # noqa: E402, F401
    ALLGATHER_COMPRESSORS,
    BACKWARD_SHARE,
    METHODS,
    OVERLAP,
    Workload,
    bucketed_step_time,
    comm_time,
    method_combiner,
    method_step_time,
    method_table,
    needed_ratio,
    overlap_for_cores,
    plot_scaling,
    scaling_factor,
    scaling_tables,
)
from trainers.comm.whatif_log import (  # noqa: E402, F401
    GNN_GRAPH_DATASETS,
    NOT_SGD_SCRIPTS,
    WhatIfLogError,
    data_parts,
    model_parallel_degree,
    read_workload,
    step_times,
)


def _model_grad_bytes(name: str | None, config: dict[str, Any], script: str = "") -> float:
    """``G`` of the model a run trained (:func:`modelzoo.logged_models.logged_model_grad_bytes`).

    Raises:
        LookupError: The log does not say which model (or its vocabulary is not here).
    """
    # only here: the formulas need no model zoo
    from modelzoo.logged_models import logged_model_grad_bytes

    return logged_model_grad_bytes(name, config, script)


def workload_from_log(path: str | Path, *, grad_bytes: float | None = None) -> Workload:
    """``T_c``, ``G``, ``r`` and the overlap of the run in ``path`` (see the module docstring,
    :func:`trainers.comm.whatif_log.read_workload`). ``grad_bytes``: ``G`` when the log
    recorded none (``--grad-bytes``), instead of counting the parameters of the model it names."""
    try:
        return read_workload(path, grad_bytes=grad_bytes, model_grad_bytes=_model_grad_bytes)
    except WhatIfLogError as e:
        raise SystemExit(f"scaling_whatif.py: {e}") from None


def _numbers(text: str, kind: type) -> list[Any]:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("log", nargs="?", help="a run log (JSON Lines)")
    p.add_argument("--workers", type=lambda t: _numbers(t, int), default=list(DEFAULT_WORKERS))
    p.add_argument("--bandwidths", type=lambda t: _numbers(t, float), default=list(DEFAULT_BANDWIDTHS), help="Gbps")  # fmt: skip
    p.add_argument("--latency-us", type=float, default=DEFAULT_LATENCY_US, help="per message hop")
    p.add_argument("--target", type=float, default=0.9, help="scaling factor to reach")
    p.add_argument("--compute-time", type=float, default=None, help="T_c seconds per step")
    p.add_argument("--grad-bytes", type=float, default=None, help="G, dense gradient bytes")
    p.add_argument("--model", default=None, help="G from this zoo model's parameter count")
    p.add_argument("--compression-ratio", type=float, default=None)
    p.add_argument("--overlap", type=float, default=None, help="fraction of T_c hidden (0..1)")
    p.add_argument(
        "--cores-per-node",
        type=float,
        default=None,
        help="with --compute-threads: o = 0 when the compute fills the node's cores",
    )
    p.add_argument(
        "--compute-threads",
        type=float,
        default=None,
        help="CPU threads the compute uses per node (0 for a GPU node)",
    )
    p.add_argument("--plot", default=None, help="also draw the scaling factors into this PNG")
    args = p.parse_args(argv)

    if args.log is None and (args.compute_time is None or (args.grad_bytes is None and args.model is None)):  # fmt: skip
        p.error("without a log, give --compute-time and --grad-bytes (or --model)")
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        p.error(f"--overlap must be in [0, 1], got {args.overlap}")
    if not 0 < args.target <= 1:
        p.error(f"--target must be in (0, 1], got {args.target}")
    if (args.cores_per_node is None) != (args.compute_threads is None):
        p.error("give --cores-per-node and --compute-threads together")
    if args.cores_per_node is not None and not (args.cores_per_node > 0 <= args.compute_threads):
        p.error(
            f"--cores-per-node must be > 0 and --compute-threads >= 0, got "
            f"{args.cores_per_node} and {args.compute_threads}"
        )
    if args.log is not None:
        w = workload_from_log(args.log, grad_bytes=args.grad_bytes)
    else:
        w = Workload(compute_time=args.compute_time, grad_bytes=0.0, source="")
    changes: dict[str, Any] = {}
    if args.compute_time is not None:
        changes["compute_time"] = args.compute_time
    if args.model is not None:
        changes["grad_bytes"] = _model_grad_bytes(args.model, {})
        changes["source"] = f"{args.model}" + (f" ({w.source})" if w.source else "")
    if args.grad_bytes is not None:
        changes["grad_bytes"] = args.grad_bytes
    if args.compression_ratio is not None:
        changes["compression_ratio"] = args.compression_ratio
    if args.overlap is not None:
        changes["overlap"] = args.overlap
    w = Workload(**{**w.__dict__, **changes})
    if args.cores_per_node is not None:
        o = overlap_for_cores(w.overlap, args.compute_threads, args.cores_per_node)
        if o != w.overlap:
            print(
                f"the compute's {args.compute_threads:g} threads fill the node's "
                f"{args.cores_per_node:g} cores: no overlap (o = 0 instead of {w.overlap:.2f})"
            )
        w = Workload(**{**w.__dict__, "overlap": o})
    latency = args.latency_us * 1e-6
    print(scaling_tables(w, args.workers, args.bandwidths, latency, args.target))
    print()
    print(method_table(w, args.workers, args.bandwidths[0], latency))
    if args.plot:
        plot_scaling(w, args.workers, args.bandwidths, latency, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
