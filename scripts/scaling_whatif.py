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
import functools
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from trainers.comm.cost import message_time  # noqa: E402, F401 (one model to one peer)
from trainers.logs import RunLogError, read_run_log  # noqa: E402

DEFAULT_WORKERS = (2, 4, 8, 16, 32, 64)
DEFAULT_BANDWIDTHS = (10.0, 25.0, 100.0, 400.0)  # Gbps
DEFAULT_LATENCY_US = 10.0
# The model itself (trainers.comm.whatif), under the names tests and benchmarks read here.
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
    scaling_factor,
)

# ---- reading a log ------------------------------------------------------------------------------
# The head each training script puts on a BERT (its gradient is what a step all-reduces).
SCRIPT_HEADS = {"pretrain_bert.py": "pretraining", "finetune_squad.py": "qa"}
# Scripts whose steps are not data-parallel SGD steps of one gradient all-reduce.
NOT_SGD_SCRIPTS = {
    "train_linear.py": "L-BFGS iterations or feature-partitioned CA-SGD rounds, whose messages "
    "its log counts (docs/linear.md)"
}
# scripts/train_gnn.py's GRAPH_DATASETS: graph classification, mini-batches of --batch-size graphs.
GNN_GRAPH_DATASETS = frozenset({"sbm_graphs"})


@functools.cache
def _zoo_grad_bytes(name: str, num_classes: int | None, head: str | None, vocab_size: int | None) -> float:  # fmt: skip
    import modelzoo  # only here: the formulas need no model zoo

    kwargs: dict[str, Any] = {} if num_classes is None else {"num_classes": num_classes}
    if head is not None:
        kwargs["head"] = head
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    model = modelzoo.get_model(name, **kwargs)
    return 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)


def _pretraining_vocab_size(config: dict[str, Any]) -> int:
    """The vocabulary ``pretrain_bert.py`` ran with (its ``load_tokenizer``, in the same order)."""
    from modelzoo.nlp.tokenizer import BertTokenizer, get_tokenizer

    if config.get("vocab_file"):
        return len(BertTokenizer.from_file(config["vocab_file"]))
    for n in (1, 2):
        data = config.get(f"phase{n}_data")
        if data and (Path(data) / "vocab.txt").is_file():
            return len(BertTokenizer.from_dir(data))
    if config.get("phase1_model") and (Path(config["phase1_model"]) / "vocab.txt").is_file():
        return len(BertTokenizer.from_dir(config["phase1_model"]))
    if any(config.get(f"phase{n}_data") for n in (1, 2)):
        raise FileNotFoundError("the run's vocab.txt is not on this machine")
    if config.get("phase1_model") and not config.get("corpus_vocab"):
        raise FileNotFoundError("the phase-1 model's vocab.txt is not on this machine")
    if config.get("corpus_vocab"):  # --corpus-vocab: the tokens the built-in corpus uses
        return _corpus_vocab_size()
    return len(get_tokenizer("minilm_l6_h384", progress=False))  # the built-in corpus's


@functools.cache
def _corpus_vocab_size() -> int:
    """``pretrain_bert.py --corpus-vocab``'s vocabulary size (tokenizes the built-in corpus
    once per process)."""
    from modelzoo.nlp.pretraining import corpus_vocabulary
    from modelzoo.nlp.tokenizer import get_tokenizer

    return len(corpus_vocabulary(get_tokenizer("minilm_l6_h384", progress=False)))


def _model_grad_bytes(name: str | None, config: dict[str, Any], script: str = "") -> float:
    """4 bytes per trainable parameter of the model a run trained: the zoo model ``name``
    (classes and head as the run had), or the BERT that ``pretrain_bert.py``'s flags build.

    Raises:
        LookupError: The log does not say which model (or its vocabulary is not here).
    """
    head = SCRIPT_HEADS.get(script)
    vocab_size = None
    source = config.get("pretrained_bert_parameters")
    if script == "finetune_squad.py" and source:  # the script's build_model, in its order
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        if (folder / "config.json").is_file():
            from modelzoo.nlp.bert import BertConfig, build_bert

            model = build_bert(BertConfig.from_hf(folder / "config.json"), head="qa")
            return 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if not Path(source).exists():
            raise LookupError(
                f"fine-tuned the BERT in {source}, which is not on this machine (its size "
                "may not be --bert-model's); pass --grad-bytes"
            )
    if script == "pretrain_bert.py":
        try:
            vocab_size = _pretraining_vocab_size(config)
        except (OSError, ValueError, RuntimeError) as e:  # RuntimeError: store's download errors
            raise LookupError(f"no vocabulary for its model ({e}); pass --grad-bytes") from None
        if not name:
            from modelzoo.nlp.bert import BertConfig, build_bert

            bert = BertConfig(
                vocab_size=vocab_size,
                hidden_size=int(config["hidden_size"]),
                num_layers=int(config["num_layers"]),
                num_heads=int(config["num_heads"]),
                intermediate_size=int(config["intermediate_size"]),
                max_position_embeddings=int(config["max_position_embeddings"]),
            )
            model = build_bert(bert, head=head)
            return 4.0 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    if not name:
        raise LookupError("names no model; pass --grad-bytes")
    num_classes = None
    if config.get("dataset") == "digits":
        num_classes = 10
    elif config.get("num_classes"):
        num_classes = int(config["num_classes"])
    return _zoo_grad_bytes(name, num_classes, head, vocab_size)


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
    from trainers.comm import combiner_class  # noqa: PLC0415

    try:
        cls = combiner_class(str(combiner["mode"]))
        return int(cls(cls.Options(**combiner.get("options", {}))).data_parts(world))
    except (KeyError, TypeError, ValueError):
        return world


def workload_from_log(path: str | Path, *, grad_bytes: float | None = None) -> Workload:
    """``T_c``, ``G``, ``r`` and the overlap of the run in ``path`` (see the module docstring).
    ``grad_bytes``: ``G`` when the log recorded none (``--grad-bytes``), instead of counting
    the parameters of the model it names."""
    try:
        records = read_run_log(path)
    except RunLogError as e:
        raise SystemExit(f"scaling_whatif.py: {e}") from None
    header = records[0]
    config = header.get("config") or {}
    script = Path(str((header.get("command") or [""])[0])).name
    if script in NOT_SGD_SCRIPTS:
        raise SystemExit(
            f"scaling_whatif.py: {path} is a {script} run ({NOT_SGD_SCRIPTS[script]}); this "
            "model is for data-parallel SGD steps, give --compute-time and --grad-bytes instead"
        )
    world = int(header.get("world_size", 1))
    steps = [r for r in records if r.get("kind") == "step" and r.get("samples_per_sec")]
    if not steps:
        raise SystemExit(f"scaling_whatif.py: {path} has no step record with samples_per_sec")
    try:
        times = step_times(records)
    except LookupError as e:
        raise SystemExit(f"scaling_whatif.py: {path} {e.args[0]}") from None
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
            grad_bytes = _model_grad_bytes(str(name) if name else None, config, script)
        except LookupError as e:
            raise SystemExit(f"scaling_whatif.py: {path} {e.args[0]}") from None
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


# ---- output -------------------------------------------------------------------------------------
def tables(
    w: Workload, workers: Sequence[int], bandwidths: Sequence[float], latency: float, target: float
) -> str:
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


def plot(w: Workload, workers: Sequence[int], bandwidths: Sequence[float], latency: float, output: str) -> None:  # fmt: skip
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
    print(tables(w, args.workers, args.bandwidths, latency, args.target))
    print()
    print(method_table(w, args.workers, args.bandwidths[0], latency))
    if args.plot:
        plot(w, args.workers, args.bandwidths, latency, args.plot)
        print(f"\nwrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
