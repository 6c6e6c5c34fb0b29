"""Train a GNN from the zoo on the shared Trainer: DGL's examples, one script.

Node classification (GCN, GraphSAGE, GAT) full-graph, or on neighbour-sampled mini-batches
with ``--fanouts 25,10``; graph classification (GIN). With no flags it trains a GCN on
Zachary's karate club (built in) and prints the held-out accuracy:

    python scripts/train_gnn.py

Planetoid, as in DGL's examples (files from the Planetoid repository in --data-dir):

    python scripts/train_gnn.py --dataset cora --model gcn --data-dir ~/data/cora
    python scripts/train_gnn.py --dataset cora --model gat --lr 0.005 --early-stop 100
    python scripts/train_gnn.py --dataset ogbn-products --model graphsage_mean \
        --hidden 256 --dropout 0.5 --fanouts 25,10 --batch-size 1024 --lr 0.003 --num-epochs 20

Mini-batch training runs data-parallel under ``torchrun --nproc-per-node N``
(``--batch-size`` seeds per worker). Evaluation runs on the whole graph with all
neighbours, as DGL's and PyG's examples do; ``--early-stop P`` stops after P evaluations
without a better validation accuracy and keeps the best weights. Every run writes a JSON
Lines run log (``--run-log``) that ``scripts/reproduce.py`` reruns and compares.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

import modelzoo
from modelzoo.artifact import is_artifact
from modelzoo.fileio import atomic_write
from modelzoo.graph import datasets as gdata
from modelzoo.graph.tasks import GraphClassificationTask, NodeClassificationTask, NodeItems
from modelzoo.graph.transforms import NodeFeatures
from modelzoo.store import ChecksumError, DownloadError, cache_root
from trainers import DistEnv, RunLogger, Trainer, make_header
from trainers.claims import majority_level
from trainers.cli import (
    ArgumentParser,
    Bound,
    add_distributed_args,
    add_ema_args,
    add_export_args,
    add_optimizer_args,
    add_run_args,
    add_schedule_args,
    add_tensorboard_args,
    brief,
    build_combiner,
    build_ema,
    build_optimizer,
    build_schedule,
    export_source,
    print_config,
    run_configs,
    run_main,
    trainer_config,
)
from trainers.errors import UsageError
from trainers.hooks import EarlyStopping

NODE_DATASETS = ("karate", "sbm", "cora", "citeseer", "pubmed", "npz")
GRAPH_DATASETS = ("sbm_graphs",)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Train a GNN from the model zoo (node or graph classification).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data")
    d.add_argument(
        "--dataset", type=str.lower, default="karate",
        help=f"one of {', '.join(NODE_DATASETS + GRAPH_DATASETS)} or ogbn-<name>",
    )  # fmt: skip
    d.add_argument("--data-dir", type=str, default=None, help="folder of the dataset's files")
    d.add_argument("--download", action="store_true", help="fetch missing files from the host")
    d.add_argument("--ogb-split", type=str, default=None, help="OGB split scheme folder")
    d.add_argument(
        "--ogb-sha256", type=str, default=None,
        help="--download of ogbn-<name>: the sha256 of <name>.zip to verify it against (OGB "
        "publishes none; docs/data.md)",
    )  # fmt: skip
    d.add_argument("--npz", type=str, default=None, help="--dataset npz: the .npz file")
    d.add_argument("--normalize-features", action="store_true", help="row-normalize x (DGL)")
    d.add_argument("--sbm-nodes", type=int, default=100_000, help="--dataset sbm: nodes")
    d.add_argument("--sbm-degree", type=float, default=10.0, help="--dataset sbm: avg degree")
    d.add_argument("--sbm-graphs", type=int, default=2500, help="--dataset sbm_graphs: graphs")
    d.add_argument("--data-seed", type=int, default=0, help="seed of the synthetic graphs")

    m = p.add_argument_group("model")
    m.add_argument("--model", type=str, default="gcn", help="a graph model of list_models()")
    m.add_argument("--hidden", type=int, default=None, help="hidden width (per head for GAT)")
    m.add_argument("--num-layers", type=int, default=None, help="layers (GIN: with the input)")
    m.add_argument("--heads", type=int, default=None, help="GAT: hidden attention heads")
    m.add_argument("--dropout", type=float, default=None, help="feature dropout")
    m.add_argument("--use-pretrained", action="store_true", help="start from published weights")

    add_optimizer_args(p, default="adam", lr=0.01)
    add_schedule_args(p, default="constant")
    add_distributed_args(p)
    add_ema_args(p)
    add_tensorboard_args(p)
    add_export_args(p)
    p.set_defaults(wd=5e-4)
    o = p.add_argument_group("training")
    o.add_argument(
        "--fanouts", type=str, default="",
        help="neighbours sampled per layer, e.g. 25,10 (-1: all); empty: full-graph training",
    )  # fmt: skip
    o.add_argument("--batch-size", type=int, default=1024, help="mini-batch: seeds (graphs)/worker")
    o.add_argument("--num-epochs", "--epochs", dest="num_epochs", type=int, default=200)
    o.add_argument("--early-stop", type=int, default=0, help="patience in evaluations (0: off)")
    o.add_argument("--eval-interval", type=int, default=1, help="epochs between evaluations")

    g = p.add_argument_group("logging and weights")
    g.add_argument("--save-dir", type=str, default=None, help="trainer checkpoints")
    g.add_argument(
        "--export-weights", action="store_true",
        help="write the kept weights as <model>-<sha256[:8]>.pth to $MODELZOO_HOME/trained",
    )  # fmt: skip
    add_run_args(o, g, seed_help="run seed: initial weights, data order, neighbour sampling",
                 clip_grad_norm=False, accumulate=False, precision=False, logging_file=False,
                 log_interval_help="steps between step records", compile_default="off",
                 compile_help="torch.compile the model (default off: sampled subgraphs change "
                 "shape every step and recompile; sparse message passing)")  # fmt: skip
    p.add_mxnet_options("--gpus", "--num-gpus", "--kvstore")
    brief(p, "--dataset", "--data-dir", "--download", "--model", "--hidden", "--num-layers",
          "--dropout", "--fanouts", "--batch-size", "--num-epochs", "--early-stop", "--seed",
          "--run-log")  # fmt: skip
    args = p.parse_args(argv)

    known = NODE_DATASETS + GRAPH_DATASETS
    if args.dataset not in known and not args.dataset.startswith("ogbn-"):
        p.error(f"--dataset {args.dataset!r}: choose one of {', '.join(known)} or ogbn-<name>")
    try:
        args.fanout_list = [int(f) for f in args.fanouts.split(",") if f.strip()]
    except ValueError:
        p.error(f"--fanouts must be comma-separated integers like 25,10, got {args.fanouts!r}")
    if args.dataset == "npz" and not args.npz:
        p.error("--dataset npz needs --npz PATH")
    bad = [f for f in args.fanout_list if f < 1 and f != -1]
    if bad:
        p.error(f"--fanouts {args.fanouts}: {bad[0]} neighbours; give 1 or more, or -1 for all")
    if args.dataset in GRAPH_DATASETS and args.export_dir:
        p.error("--export-dir writes a node-classification artifact; graph classification "
                f"({args.dataset}) has no pipeline: use --export-weights")  # fmt: skip
    p.check(args, bounds=BOUNDS)
    return p.finish(args)


# The script's own flags' ranges (the shared ones: trainers.cli.BOUNDS).
BOUNDS = {
    "hidden": Bound(1), "num_layers": Bound(1), "heads": Bound(1), "early_stop": Bound(0),
    "eval_interval": Bound(1), "sbm_nodes": Bound(2), "sbm_degree": Bound(0, low_open=True),
    "sbm_graphs": Bound(2),
}  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """What the flags name -- the model, the .npz file -- exists, before any work (a missing
    data set is named by its loader).

    Raises:
        UsageError: naming the flag and what to do.
    """
    if args.npz and not Path(args.npz).is_file():
        raise UsageError(f"--npz {args.npz}: no such file")
    name = args.model
    if is_artifact(name):
        return
    try:
        modality = modelzoo.registry.model_modality(name)
    except ValueError as err:
        raise UsageError(f"--model {name}: {err}") from None
    if modality != "graph":
        graphs = sorted({n.split("_")[0] for n in modelzoo.list_models(modality="graph")})
        raise UsageError(f"--model {name} is not a graph model; choose one of {', '.join(graphs)}")


# ------------------------------------------------------------------------------------- data
def load_dataset(args: argparse.Namespace) -> Any:
    """The node-classification ``Data``, or ``(graphs, splits)`` for graph classification."""
    name, root = args.dataset, args.data_dir
    if name == "karate":
        data = gdata.karate_club()
    elif name == "sbm":
        data = gdata.sbm_graph(args.sbm_nodes, avg_degree=args.sbm_degree, seed=args.data_seed)
    elif name == "sbm_graphs":
        return gdata.sbm_graph_classification(args.sbm_graphs, seed=args.data_seed)
    elif name in gdata.PLANETOID_NAMES:
        data = gdata.load_planetoid(name, root, download=args.download)
    elif name == "npz":
        data = gdata.load_npz_graph(args.npz)
    else:
        data = gdata.load_ogb_node(
            name, root, split=args.ogb_split, download=args.download, sha256=args.ogb_sha256
        )
    for key in ("train_mask", "val_mask", "test_mask"):
        if key not in data:
            raise SystemExit(f"dataset {name!r} has no {key}; a node split is needed to train")
    if args.normalize_features:
        data = NodeFeatures(normalize=True)(data)  # what the weights' transforms() apply
    return data


def export_weights(model: torch.nn.Module, name: str, directory: Path) -> Path:
    """Write the state dict as ``<name>-<sha256[:8]>.pth`` (temp file, then rename)."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    payload = buffer.getvalue()
    digest = hashlib.sha256(payload).hexdigest()
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / f"{name}-{digest[:8]}.pth"
    atomic_write(dest, lambda f: f.write(payload), mode=0o644)
    return dest


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"hidden_channels": args.hidden, "num_layers": args.num_layers,
               "heads": args.heads, "dropout": args.dropout}  # fmt: skip
    return {k: v for k, v in options.items() if v is not None}


def trivial_level(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The task's trivial level for a run log's claims (``logs/claims.json``): the accuracy of
    the best constant prediction (the majority class) on the run's test nodes (or test
    graphs), which its ``best_test_acc`` is measured on."""
    args = parse_args(list(records[0]["command"][1:]))
    loaded = load_dataset(args)
    if args.dataset in GRAPH_DATASETS:
        graphs, splits = loaded
        labels = [int(graphs[int(i)].y) for i in splits["test"]]
        return majority_level(labels, what=f"test graphs of {args.dataset}")
    return majority_level(loaded.y[loaded.test_mask].tolist(), what=f"test nodes of {args.dataset}")


# ------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    if print_config(args):
        return 0
    env = DistEnv.from_env()
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    logger = RunLogger(args.run_log, enabled=env.is_main, tensorboard=args.tensorboard)
    logger.write(make_header(command, args.seed, env.world_size, args, configs=run_configs(args)))

    loaded = load_dataset(args)
    graph_level = args.dataset in GRAPH_DATASETS
    if graph_level:
        graphs, splits = loaded
        in_channels = graphs[0].num_node_features
        num_classes = int(max(int(g.y) for g in graphs)) + 1
        task: Any = GraphClassificationTask(graphs, splits, env.device)
        train_set: Dataset = NodeItems(torch.tensor(splits["train"]))
        batch_size = args.batch_size
    else:
        data = loaded
        in_channels, num_classes = data.num_node_features, int(data.y.max()) + 1
        task = NodeClassificationTask(data, env.device, args.fanout_list)
        minibatch = bool(args.fanout_list)
        if not minibatch and env.world_size > 1:
            raise SystemExit(
                "full-graph training runs in one process; give --fanouts (e.g. 25,10) to "
                "train on sampled mini-batches data-parallel"
            )
        train_nodes = data.train_mask.nonzero().view(-1)
        train_set = NodeItems(train_nodes if minibatch else None)
        batch_size = args.batch_size if minibatch else 1
    if len(train_set) < batch_size * env.world_size:
        batch_size = max(1, len(train_set) // env.world_size)

    torch.manual_seed(args.seed)  # the same initial weights on every rank and every rerun
    options = _model_options(args)
    try:
        model = modelzoo.get_model(
            args.model, pretrained=args.use_pretrained, num_classes=num_classes,
            in_channels=in_channels, progress=env.is_main, **options,
        )  # fmt: skip
    except TypeError as e:
        flags = ", ".join(f"--{k.split('_')[0]}" for k in options)
        raise SystemExit(f"--model {args.model} does not take one of {flags}: {e}") from None
    if not graph_level:
        task.trim = getattr(model, "supports_layer_sizes", False)
    logger.info(f"{args.model}: {sum(p.numel() for p in model.parameters())} parameters, "
                f"{in_channels} input features, {num_classes} classes")  # fmt: skip
    optimizer = build_optimizer(args, model)
    combiner = build_combiner(args, env)
    steps_per_epoch = max(1, len(train_set) // (batch_size * combiner.data_parts(env.world_size)))
    try:
        schedule = build_schedule(args, steps_per_epoch=steps_per_epoch, epochs=args.num_epochs)
    except ValueError as err:  # whole steps: a warmup that fits in epochs may not in steps
        raise UsageError(f"--warmup-epochs {float(args.warmup_epochs or 0):g}: {err}") from None
    config = trainer_config(
        args,
        epochs=args.num_epochs,
        batch_size=batch_size,
        log_interval=args.log_interval or max(1, steps_per_epoch // 4),
        eval_interval=args.eval_interval,
        save_dir=args.save_dir,
        save_frequency=0,
        drop_last=False,
    )
    stopper = EarlyStopping(
        model,
        score=lambda m: (m["val_acc"], -m["val_loss"]),  # ties in accuracy: lower loss
        patience=args.early_stop,
        report={"best_val_acc": "val_acc", "best_test_acc": "test_acc"},
        name="validation accuracy",
    )
    trainer = Trainer(
        model, optimizer, config, env=env, logger=logger, lr_schedule=schedule,
        train_step=task.train_step, eval_step=task.eval_step,
        combiner=combiner, hooks=[stopper],
    )  # fmt: skip
    ema = build_ema(args, model, eval_dataset=NodeItems(None), collate_fn=task.collate)
    if ema is not None:
        trainer.add_hook(ema)  # evaluated after each evaluation: ema_val_acc, ema_test_acc

    start = time.perf_counter()
    metrics = trainer.fit(train_set, eval_dataset=NodeItems(None), collate_fn=task.collate)
    if stopper.best_state is not None:
        model.load_state_dict(stopper.best_state)
    if env.is_main:
        best = stopper.best_metrics
        if best:
            logger.info(
                f"Best validation accuracy {best['best_val_acc']:.4f} at epoch "
                f"{best['best_epoch']}: held-out test accuracy {best['best_test_acc']:.4f} "
                f"({time.perf_counter() - start:.1f} s)"
            )
        if args.export_weights:
            path = export_weights(model, args.model, cache_root() / "trained")
            logger.info(f"Weights written to {path}")
        if args.export_dir:
            path = modelzoo.save_artifact(
                args.export_dir, model, model_name=args.model,
                model_kwargs={"num_classes": num_classes, "in_channels": in_channels, **options},
                task="node-classification", labels=getattr(data, "class_names", None),
                preprocessing={"normalize_features": bool(args.normalize_features)},
                metrics={**stopper.best_metrics, **(ema.last_metrics if ema is not None else {})},
                source=export_source(args, command, weights="ema" if ema else "best"),
                state_dict=ema.state_dict_for_export() if ema is not None else None,
            )  # fmt: skip
            logger.info(f"exported {path} (modelzoo.pipeline('node-classification', DIR))")
    logger.close()
    env.destroy()
    return 0 if all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)) else 1


if __name__ == "__main__":
    expected = (gdata.DatasetError, gdata.DatasetNotFoundError, DownloadError, ChecksumError)
    sys.exit(run_main(main, expected=expected))
