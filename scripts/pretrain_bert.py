"""Pretrain BERT (masked LM + next-sentence prediction) at large batch with LAMB or LANS.

Two phases, as in the BERT, LAMB and LANS recipes: phase 1 on short sequences (128 tokens),
phase 2 on long ones (512) starting from phase 1's model, each with its own batch size,
gradient accumulation, learning rate and warmup-constant-poly schedule. Both run in one
invocation; ``--phases 2 --phase1-model DIR`` runs phase 2 alone. It runs on the shared
Trainer: one process or many under ``torchrun`` (``--grad-combine adasum``, elastic with
``--elastic-dir``), ``--dtype bfloat16|float16``, periodic checkpoints (``--checkpoint-steps``,
``--resume``). Every phase ends with a Hugging Face directory ``<output_dir>/phase<N>/model``
(``config.json``, ``model.safetensors``, ``vocab.txt``) that ``finetune_squad.py
--pretrained-bert-parameters`` fine-tunes.

With no data flags it builds (once, cached under ``$MODELZOO_HOME/pretraining``) shards of
the running Python's standard-library docstrings with MiniLM's uncased vocabulary and
pretrains a small BERT (2 layers, width 128) from scratch; the published runs
(``logs/bert_pretrain_*.jsonl``, commands in ``docs/pretraining.md``) use 64 and 128 tokens:

    python scripts/pretrain_bert.py --optimizer lans --lr 0.05 --phase1-max-seq-length 64 \
        --phase1-max-predictions 10 --phase2-max-seq-length 128 --phase2-max-predictions 20 \
        --phase1-steps 48 --phase1-accumulate 8 --phase2-steps 8 --phase2-accumulate 4 \
        --phase2-batch-size 16 --dupe-factor 2

BERT-Large with the LANS recipe (phase batches 96K and 33K through accumulation; shards from
``scripts/prepare_bert_data.py``), on 8 nodes x 8 GPUs:

    torchrun --nnodes 8 --nproc-per-node 8 ... scripts/pretrain_bert.py \\
        --bert-model bert_24_1024_16 --optimizer lans --lr 0.005 --phase2-lr 0.005 \\
        --phase1-data data/p1 --phase2-data data/p2 --phase1-steps 3519 --phase2-steps 782 \\
        --phase1-batch-size 64 --phase1-accumulate 24 --phase2-batch-size 8 \\
        --phase2-accumulate 66 --dtype float16 --output-dir runs/large
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import modelzoo
from modelzoo.convert.bert import save_hf_directory
from modelzoo.nlp.bert import bert_from_checkpoint
from modelzoo.nlp.pretraining import PretrainingCollate, PretrainingShards, ShardError
from modelzoo.nlp.pretraining.recipe import (
    builtin_shards,
    masked_lm_labels,
    new_pretraining_bert,
    recipe_tokenizer,
    schedule_shape,
    vocab_sha256,
)
from modelzoo.nlp.pretraining.task import (
    EMA_RATIOS,
    RATIOS,
    EvalTracker,
    eval_step,
    pipeline_inputs,
    train_step,
)
from modelzoo.nlp.tokenizer import BertTokenizer
from modelzoo.store import ChecksumError, DownloadError
from trainers import DistEnv, Trainer, make_header
from trainers.claims import majority_level
from trainers.cli import (
    ArgumentParser,
    Bound,
    add_distributed_args,
    add_elastic_args,
    add_ema_args,
    add_export_args,
    add_gradient_checkpointing_args,
    add_optimizer_args,
    add_run_args,
    add_tensor_parallel_args,
    add_tensorboard_args,
    apply_model_parallel,
    apply_plan,
    brief,
    build_combiner,
    build_elastic,
    build_ema,
    describe_defaults,
    elastic_config,
    elastic_resuming,
    export_source,
    optimizer_config,
    print_config,
    run_configs,
    run_main,
    trainer_config,
    unsplit_for_saving,
)
from trainers.config import ElasticConfig
from trainers.ema import ModelEMA
from trainers.errors import UsageError
from trainers.logs import PhasedRunLogger, ratio_metrics
from trainers.optim import create_optimizer
from trainers.schedules import LRSchedule, create_schedule

# --lr-schedule: the default rounds the phases to whole steps (the published runs use it)
LR_SCHEDULES = ("warmup_const_poly", "gluonnlp", "nvidia_poly_warmup")
PHASE_FLAGS = ("max_seq_length", "max_predictions", "steps", "batch_size", "accumulate", "lr",
               "warmup_ratio")  # fmt: skip
# phase -> defaults of the flags above (the LANS recipe's shape, CPU-sized steps).
PHASE_DEFAULTS = {
    1: dict(max_seq_length=128, max_predictions=20, steps=300, batch_size=16, accumulate=1,
            lr=None, warmup_ratio=0.05),
    2: dict(max_seq_length=512, max_predictions=80, steps=60, batch_size=4, accumulate=1,
            lr=None, warmup_ratio=0.05),
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Pretrain BERT (masked LM + next sentence) in two phases.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data (none given: built-in shards of the stdlib docstrings)")
    for phase in (1, 2):
        d.add_argument(f"--phase{phase}-data", type=str, default=None, help="training shards")
        d.add_argument(f"--phase{phase}-eval-data", type=str, default=None, help="held-out shards")
    d.add_argument(
        "--cache-dir",
        type=str,
        default=None,
        help="where the built-in shards are made (default $MODELZOO_HOME/pretraining)",
    )
    d.add_argument("--dupe-factor", type=int, default=5, help="built-in data: masking passes")
    d.add_argument("--data-seed", type=int, default=12345, help="built-in data: instance seed")
    d.add_argument(
        "--corpus-vocab",
        action="store_true",
        help="built-in data: keep only the tokens of MiniLM's vocabulary that the training "
        "corpus uses (about 5,300 instead of 30,522; the same tokens for the training text)",
    )

    m = p.add_argument_group("model (default: a small BERT; --bert-model for a zoo size)")
    m.add_argument("--bert-model", type=str, default=None, help="e.g. bert_12_768_12")
    m.add_argument("--num-layers", type=int, default=2)
    m.add_argument("--hidden-size", type=int, default=128)
    m.add_argument("--num-heads", type=int, default=2)
    m.add_argument("--intermediate-size", type=int, default=512)
    m.add_argument("--max-position-embeddings", type=int, default=512)
    m.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    m.add_argument(
        "--initializer-range",
        type=float,
        default=0.02,
        help="std of the normal initial weights (BERT's 0.02)",
    )
    m.add_argument(
        "--phase1-model",
        type=str,
        default=None,
        help="phase 2 alone (--phases 2): start from this phase-1 directory",
    )
    m.add_argument("--vocab-file", type=str, default=None, help="default: the shards' vocab.txt")

    add_optimizer_args(p, default="lans")
    p.set_defaults(wd=0.01, no_wd=True, epsilon=1e-6)
    add_distributed_args(p)
    add_tensor_parallel_args(p)
    add_elastic_args(p)
    add_ema_args(p)
    add_gradient_checkpointing_args(p)
    add_tensorboard_args(p)
    add_export_args(p)

    t = p.add_argument_group("phases (per-phase flags: --phase1-X / --phase2-X)")
    t.add_argument("--phases", type=str, default="1,2", help="phases to run: 1,2 or 1 or 2")
    for phase, defaults in PHASE_DEFAULTS.items():
        for flag in PHASE_FLAGS:
            kind = float if flag in ("lr", "warmup_ratio") else int
            help_ = "default: --lr" if flag == "lr" else None
            t.add_argument(
                f"--phase{phase}-{flag.replace('_', '-')}",
                type=kind,
                default=defaults[flag],
                help=help_,
            )
    t.add_argument(
        "--lr-schedule",
        type=str,
        default="warmup_const_poly",
        choices=LR_SCHEDULES,
        help="warmup_const_poly: the LANS schedule with its phases rounded to whole steps; "
        "gluonnlp: the same as gluon-nlp computes it (fractional phases; a zero warmup ratio "
        "is a constant lr); nvidia_poly_warmup: NVIDIA's PolyWarmUpScheduler (warmup, then "
        "base * (1 - (t + 1) / T) ** power over the whole phase, no constant phase)",
    )
    t.add_argument(
        "--const-ratio",
        type=float,
        default=None,
        help="constant-lr fraction (default 0.25; 0 with --lr-schedule nvidia_poly_warmup)",
    )
    t.add_argument(
        "--decay-power",
        type=float,
        default=None,
        help="polynomial decay degree (default 1; 0.5, NVIDIA's, with nvidia_poly_warmup)",
    )
    t.add_argument(
        "-j",
        "--num-workers",
        "--num-data-workers",
        dest="num_workers",
        type=int,
        default=0,
        help="DataLoader workers per rank",
    )
    t.add_argument("--eval-batch-size", type=int, default=64)
    t.add_argument(
        "--eval-interval-steps", type=int, default=0, help="evaluate every N steps (0: at the end)"
    )
    t.add_argument("--checkpoint-steps", type=int, default=0, help="save latest.pt every N steps")
    t.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="latest",
        help="continue from the latest checkpoint of each phase in --output-dir (pretraining "
        "takes no checkpoint path: its phases resume from their own directories)",
    )

    g = p.add_argument_group("logging and output")
    g.add_argument("--output-dir", type=str, default="./runs/pretrain")
    add_run_args(t, g, clip_grad_norm=0.0, accumulate=False, log_interval=10,
                 max_steps_help="stop after N steps (all phases)")  # fmt: skip
    p.add_renamed(
        "--eval-interval", "--eval-interval-steps", "pretraining counts steps; it has no epochs"
    )
    p.add_mxnet_options("--gpus", "--num-gpus", "--kvstore", "--bert-dataset")
    brief(p, "--phase1-data", "--phase2-data", "--bert-model", "--num-layers", "--hidden-size",
          "--phase1-model", "--phases", "--phase1-steps", "--phase2-steps", "--dtype", "--max-steps",
          "--resume", "--output-dir", "--run-log")  # fmt: skip
    describe_defaults(p, {"with --optimizer lans or lamb": {"lr": 5e-3},
                          "with another optimizer": {"lr": 1e-4}})  # fmt: skip
    args = p.parse_args(argv)
    if args.resume not in (None, "auto"):
        p.error(
            f"--resume {args.resume!r}: pretraining resumes every phase from --output-dir's "
            "checkpoints; pass --resume alone"
        )

    try:
        args.phase_list = sorted({int(x) for x in args.phases.split(",") if x.strip()})
    except ValueError:
        p.error(f"--phases must be 1, 2 or 1,2, got {args.phases!r}")
    if not args.phase_list or not set(args.phase_list) <= {1, 2}:
        p.error(f"--phases must be 1, 2 or 1,2, got {args.phases!r}")
    nvidia = args.lr_schedule == "nvidia_poly_warmup"
    if args.const_ratio is None:
        args.const_ratio = 0.0 if nvidia else 0.25
    if args.decay_power is None:
        args.decay_power = 0.5 if nvidia else 1.0
    if nvidia and args.const_ratio != 0:
        p.error("--lr-schedule nvidia_poly_warmup has no constant phase: drop --const-ratio")
    if args.decay_power <= 0:
        p.error(f"--decay-power must be positive, got {args.decay_power}")
    if args.lr is None:
        args.lr = {"lans": 5e-3, "lamb": 5e-3}.get(args.optimizer, 1e-4)
    for phase in (1, 2):
        if getattr(args, f"phase{phase}_lr") is None:
            setattr(args, f"phase{phase}_lr", args.lr)
        for flag in ("steps", "batch_size", "accumulate", "max_seq_length", "max_predictions"):
            if getattr(args, f"phase{phase}_{flag}") < 1:
                p.error(f"--phase{phase}-{flag.replace('_', '-')} must be >= 1")
        if not 0 <= getattr(args, f"phase{phase}_warmup_ratio") + args.const_ratio <= 1:
            p.error(f"--phase{phase}-warmup-ratio + --const-ratio must be in [0, 1]")
    args.builtin = all(getattr(args, f"phase{n}_data") is None for n in args.phase_list)
    for phase in args.phase_list if args.builtin else ():
        if getattr(args, f"phase{phase}_max_seq_length") > args.max_position_embeddings:
            p.error(
                f"--phase{phase}-max-seq-length exceeds --max-position-embeddings "
                f"{args.max_position_embeddings}"
            )
    if args.plan and len(args.phase_list) > 1:
        p.error(
            "--plan places one phase (its batch and sequence length): run --phases 1 and "
            "--phases 2 separately, each with its own plan"
        )
    if args.phase_list == [2] and args.phase1_model is None and not args.resume:
        p.error("--phases 2 needs --phase1-model DIR (a phase-1 <output_dir>/phase1/model)")
    p.check(args, bounds=BOUNDS)
    if args.bert_model is None and args.hidden_size % args.num_heads:
        p.error(f"--hidden-size {args.hidden_size} does not split into --num-heads "
                f"{args.num_heads}: make it a multiple")  # fmt: skip
    return p.finish(args)


# The script's own flags' ranges (the shared ones: trainers.cli.BOUNDS).
BOUNDS = {
    "num_layers": Bound(1), "hidden_size": Bound(1), "num_heads": Bound(1),
    "intermediate_size": Bound(1), "max_position_embeddings": Bound(1),
    "initializer_range": Bound(0, low_open=True), "dupe_factor": Bound(1),
    "eval_batch_size": Bound(1), "eval_interval_steps": Bound(0), "checkpoint_steps": Bound(0),
    "const_ratio": Bound(0, 1), "decay_power": Bound(0, low_open=True),
    **{f"phase{n}_{flag}": bound for n in (1, 2) for flag, bound in (
        ("lr", Bound(0)), ("warmup_ratio", Bound(0, 1)))},
}  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """What the flags name -- the model, the phase-1 model, the vocabulary -- exists, before
    any work (the shard folders are checked, with what to do, by their reader).

    Raises:
        UsageError: naming the flag and what to do.
    """
    if args.bert_model is not None:
        try:
            modality = modelzoo.registry.model_modality(args.bert_model)
        except ValueError as err:
            raise UsageError(f"--bert-model {args.bert_model}: {err}") from None
        if modality != "text":
            raise UsageError(
                f"--bert-model {args.bert_model} is not a BERT; choose one of "
                f"{', '.join(modelzoo.list_models(modality='text'))} or leave it out (a small "
                "BERT)"
            )
    if 2 in args.phase_list and args.phase1_model and not Path(args.phase1_model).is_dir():
        raise UsageError(f"--phase1-model {args.phase1_model}: no such directory (phase 1 saves "
                         "<output-dir>/phase1/model)")  # fmt: skip
    if args.vocab_file is not None and not Path(args.vocab_file).is_file():
        raise UsageError(f"--vocab-file {args.vocab_file}: no such file")


# ---------------------------------------------------------------------------------------------
# Data and model: the flags -> modelzoo/nlp/pretraining/recipe.py
# ---------------------------------------------------------------------------------------------


def builtin_data(
    args: argparse.Namespace,
    tokenizer: BertTokenizer,
    env: DistEnv,
    *,
    phases: Sequence[int] = (1, 2),
    splits: Sequence[str] = ("train", "dev"),
) -> dict[int, tuple[Path | None, Path | None]]:
    """The built-in shards (:func:`~modelzoo.nlp.pretraining.recipe.builtin_shards`) of the
    flags' phase shapes, made once and reused."""
    shapes = {n: (getattr(args, f"phase{n}_max_seq_length"),
                  getattr(args, f"phase{n}_max_predictions")) for n in (1, 2)}  # fmt: skip
    return builtin_shards(
        tokenizer, shapes, dupe_factor=args.dupe_factor, seed=args.data_seed,
        cache_dir=args.cache_dir, phases=phases, splits=splits, verbose=env.is_main,
        progress=env.is_main and not args.no_progress,
    )  # fmt: skip


def load_tokenizer(args: argparse.Namespace) -> BertTokenizer:
    tokenizer = recipe_tokenizer(
        vocab_file=args.vocab_file,
        data_dirs=[getattr(args, f"phase{n}_data") for n in args.phase_list],
        phase1_model=args.phase1_model, builtin=args.builtin, corpus_vocab=args.corpus_vocab,
        progress=not args.no_progress,
    )  # fmt: skip
    if tokenizer is None:
        raise SystemExit(
            "pretrain_bert.py: error: no vocab.txt beside the shards; pass --vocab-file"
        )
    return tokenizer


def load_phase_data(
    args: argparse.Namespace, tokenizer: BertTokenizer, env: DistEnv
) -> dict[int, tuple[PretrainingShards, PretrainingShards | None]]:
    dirs: dict[int, tuple[Any, Any]] = {}
    if args.builtin:
        dirs = builtin_data(args, tokenizer, env)
    else:
        for n in args.phase_list:
            train = getattr(args, f"phase{n}_data")
            if train is None:
                raise SystemExit(f"pretrain_bert.py: error: --phase{n}_data is missing")
            dirs[n] = (train, getattr(args, f"phase{n}_eval_data"))
    sha = vocab_sha256(tokenizer)
    out = {}
    for n in args.phase_list:
        train_dir, eval_dir = dirs[n]
        try:
            train = PretrainingShards(train_dir, vocab_sha256=sha)
            dev = PretrainingShards(eval_dir, vocab_sha256=sha) if eval_dir else None
        except ShardError as exc:
            raise SystemExit(f"pretrain_bert.py: error: {exc}") from None
        if train.max_seq_length > args.max_position_embeddings:
            raise SystemExit(
                f"pretrain_bert.py: error: {train_dir} has {train.max_seq_length}-token "
                f"instances, more than --max-position-embeddings {args.max_position_embeddings}"
            )
        out[n] = (train, dev)
    return out


def trivial_level(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The masked-LM task's trivial level for a run log's claims (``logs/claims.json``): the
    accuracy of the best constant prediction (one token for every masked position; no unigram
    model does better) on the held-out instances of the run's last phase, which its final
    ``mlm_accuracy`` is measured on."""
    args = parse_args(list(records[0]["command"][1:]))
    phase = args.phase_list[-1]
    data = ("vocab_file", "corpus_vocab", "phase1_model", "phase1_data", "phase2_data",
            f"phase{phase}_eval_data", f"phase{phase}_max_seq_length",
            f"phase{phase}_max_predictions", "dupe_factor", "data_seed", "cache_dir")  # fmt: skip
    key = json.dumps([phase, *(getattr(args, k) for k in data)], default=str)
    if key not in _TRIVIAL:  # the seeds of a recipe (and recipes) share their held-out data
        _TRIVIAL[key] = _trivial_level(args, phase)
    return dict(_TRIVIAL[key])


_TRIVIAL: dict[str, dict[str, Any]] = {}


def _trivial_level(args: argparse.Namespace, phase: int) -> dict[str, Any]:
    tokenizer = load_tokenizer(args)
    if args.builtin:
        _, dev_dir = builtin_data(args, tokenizer, DistEnv(), phases=(phase,), splits=("dev",))[
            phase
        ]
        where = f"the built-in corpus's held-out phase-{phase} instances"
    else:
        dev_dir = getattr(args, f"phase{phase}_eval_data")
        where = f"--phase{phase}-eval-data {dev_dir}"
        if dev_dir is None:
            raise SystemExit(f"the run evaluated no held-out data (--phase{phase}-eval-data)")
    dev = PretrainingShards(dev_dir, vocab_sha256=vocab_sha256(tokenizer))
    return majority_level(
        masked_lm_labels(dev), what=f"masked tokens of {where}", kind="best constant prediction",
        name=lambda i: repr(tokenizer.convert_ids_to_tokens([int(i)])[0]),
    )  # fmt: skip


def new_model(args: argparse.Namespace, tokenizer: BertTokenizer) -> torch.nn.Module:
    """A fresh model of the flags' size, the same initial weights on every rank and rerun."""
    return new_pretraining_bert(
        len(tokenizer), seed=args.seed, bert_model=args.bert_model, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings, dropout=args.dropout,
        initializer_range=args.initializer_range,
    )  # fmt: skip


def phase_model(
    args: argparse.Namespace, phase: int, tokenizer: BertTokenizer, previous: Path | None
) -> torch.nn.Module:
    """Phase 1: a fresh model; phase 2: phase 1's saved model."""
    if phase == 1:
        return new_model(args, tokenizer)
    source = previous or (Path(args.phase1_model) if args.phase1_model else None)
    if source is None or not (source / "config.json").is_file():
        raise SystemExit(
            f"pretrain_bert.py: error: phase 2 starts from phase 1's model, but {source} has no "
            "config.json; run phase 1 first or pass --phase1-model DIR"
        )
    model = bert_from_checkpoint(source, head="pretraining")
    if model.config.vocab_size != len(tokenizer):
        raise SystemExit(
            f"pretrain_bert.py: error: {source} has a {model.config.vocab_size}-token vocabulary, "
            f"the data {len(tokenizer)}"
        )
    return model


def _schedule(args: argparse.Namespace, phase: int, steps: int) -> LRSchedule:
    """The phase's lr schedule (``--lr-schedule``; formulas in ``trainers/schedules.py``)."""
    mode, shape = schedule_shape(
        args.lr_schedule, steps, warmup_ratio=getattr(args, f"phase{phase}_warmup_ratio"),
        const_ratio=args.const_ratio,
    )  # fmt: skip
    return create_schedule(mode, base_lr=getattr(args, f"phase{phase}_lr"), total_steps=steps,
                           power=args.decay_power, **shape)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def _phase_elastic(args: argparse.Namespace, phase: int) -> ElasticConfig | None:
    """The elastic config of one phase: its own directory under ``--elastic-dir``."""
    config = elastic_config(args)
    if config is None:
        return None
    return dataclasses.replace(config, dir=str(Path(config.dir) / f"phase{phase}"))


def run_phase(
    args: argparse.Namespace,
    phase: int,
    limit: int,
    model: torch.nn.Module,
    data: tuple[PretrainingShards, PretrainingShards | None],
    env: DistEnv,
    logger: PhasedRunLogger,
    resuming: bool,
    done: int,
) -> Trainer:
    """One phase's ``fit``; ``done``: the optimizer steps of the phases before it."""
    train, dev = data
    steps = getattr(args, f"phase{phase}_steps")
    batch = getattr(args, f"phase{phase}_batch_size")
    accumulate = getattr(args, f"phase{phase}_accumulate")
    combiner = build_combiner(args, env)
    global_batch = batch * accumulate * combiner.data_parts(env.world_size)
    if len(train) < global_batch:
        raise SystemExit(
            f"pretrain_bert.py: error: phase {phase}: {len(train)} instances are fewer than one "
            f"global batch of {global_batch} (batch x accumulate x workers)"
        )
    opt = dataclasses.replace(optimizer_config(args), lr=getattr(args, f"phase{phase}_lr"))
    optimizer = create_optimizer(opt.name, model, **opt.kwargs())
    save_dir = Path(args.output_dir) / f"phase{phase}"
    config = trainer_config(
        args,
        epochs=math.ceil(steps / (len(train) // global_batch)),
        max_steps=limit,
        batch_size=batch,
        eval_batch_size=args.eval_batch_size,
        grad_accum_steps=accumulate,
        eval_interval=0,
        eval_interval_steps=args.eval_interval_steps,
        save_dir=str(save_dir),
        save_frequency=0,
        save_interval_steps=args.checkpoint_steps,
    )
    tracker = EvalTracker()
    ema = build_ema(args, model, eval_dataset=dev, collate_fn=PretrainingCollate(train.pad_id))
    trainer = Trainer(
        model, optimizer, config, env=env, logger=logger, lr_schedule=_schedule(args, phase, steps),
        train_step=train_step, eval_step=eval_step if dev is not None else None,
        combiner=combiner, hooks=[tracker] if ema is None else [tracker, ema],
    )  # fmt: skip
    logger.start_phase(phase, done, trainer)
    build_elastic(_phase_elastic(args, phase), trainer)
    latest = save_dir / "latest.pt"
    if resuming and args.elastic_dir is None and latest.is_file():
        trainer.resume(latest)
        logger.info(f"[Phase {phase}] resumed from {latest} at step {trainer.global_step}")
    collate = PretrainingCollate(train.pad_id)
    if dev is not None and phase == args.phase_list[0] and trainer.global_step == 0:
        metrics = trainer.evaluate(dev, collate)  # the starting point of the curves
        tracker.step = 0
        logger.eval(epoch=0, step=0, **metrics)
    trainer.fit(train, eval_dataset=dev, collate_fn=collate)
    if dev is not None and tracker.step != trainer.global_step:
        metrics = trainer.evaluate(dev, collate, remember=True)
        logger.eval(epoch=trainer.epoch, step=trainer.global_step, **metrics)
        if ema is not None:
            ema.evaluate_and_log(trainer)  # the phase's EMA weights, ema_ metrics
    return trainer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    if print_config(args):
        return 0
    env = DistEnv.from_env()
    n = args.phase_list[0]  # --plan runs one phase
    apply_plan(
        args, env, model_name=args.bert_model, batch_size=getattr(args, f"phase{n}_batch_size"),
        accumulate=getattr(args, f"phase{n}_accumulate"),
        seq_len=getattr(args, f"phase{n}_max_seq_length"),
    )  # fmt: skip
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    output_dir = Path(args.output_dir)
    first = _phase_elastic(args, args.phase_list[0])
    resuming = bool(args.resume) or elastic_resuming(first, args.run_log, is_main=env.is_main)
    appending = resuming and args.run_log is not None and Path(args.run_log).is_file()
    logger = PhasedRunLogger(
        args.run_log, enabled=env.is_main, logging_file=args.logging_file,
        mode="a" if appending else "w", ratios={**RATIOS, **EMA_RATIOS},
        tensorboard=args.tensorboard,
    )  # fmt: skip
    if not appending:
        logger.write(
            make_header(command, args.seed, env.world_size, args, configs=run_configs(args))
        )

    tokenizer = load_tokenizer(args)
    data = load_phase_data(args, tokenizer, env)
    for n, (train, dev) in data.items():
        logger.info(
            f"[Phase {n}] {len(train)} training instances of {train.max_seq_length} tokens "
            f"({train.directory}); {len(dev) if dev is not None else 0} held out"
        )

    start = time.perf_counter()
    done = 0  # optimizer steps of the phases before the current one
    previous: Path | None = None
    final: dict[str, Any] = {}
    trainer: Trainer | None = None
    for phase in args.phase_list:
        steps = getattr(args, f"phase{phase}_steps")
        model_dir = output_dir / f"phase{phase}" / "model"
        if resuming and (model_dir / "config.json").is_file():
            logger.info(f"[Phase {phase}] already finished: {model_dir}")
            done, previous = done + steps, model_dir
            continue
        limit = steps if args.max_steps is None else min(steps, args.max_steps - done)
        if limit <= 0:
            break
        model = phase_model(args, phase, tokenizer, previous)
        model.bert.set_gradient_checkpointing(args.gradient_checkpointing)
        # --tensor-parallel / --pipeline-parallel: the model split, and the data-parallel view
        # of the world that the Trainer sees
        model, dp_env = apply_model_parallel(
            args, env, model, inputs_of=pipeline_inputs,
            batch_size=getattr(args, f"phase{phase}_batch_size"),
        )  # fmt: skip
        trainer = run_phase(args, phase, limit, model, data[phase], dp_env, logger, resuming, done)
        final = dict(trainer.last_eval)
        for hook in trainer.hooks:
            if isinstance(hook, ModelEMA):
                final.update(hook.final_metrics())  # the phase's EMA evaluation (ema_ sums)
        if trainer.global_step >= steps:
            saved = unsplit_for_saving(trainer.model)  # gathers a tensor-parallel model's shards
            if env.is_main:
                save_hf_directory(saved, tokenizer, model_dir)
                logger.info(f"[Phase {phase}] saved {model_dir}")
            env.barrier()
            previous = model_dir
        done += trainer.global_step
        if trainer.global_step < steps:
            break  # --max-steps ended the run inside this phase
    exported = (
        unsplit_for_saving(trainer.model) if args.export_dir and trainer is not None else None
    )
    if env.is_main and args.export_dir:
        if trainer is None or exported is None:
            raise SystemExit("--export-dir: every phase was already finished; nothing was trained")
        ema = next((h for h in trainer.hooks if isinstance(h, ModelEMA)), None)
        path = modelzoo.save_artifact(
            args.export_dir, exported, model_name=args.bert_model or "bert",
            model_kwargs={"head": "pretraining"}, task="fill-mask", tokenizer=tokenizer,
            metrics=ratio_metrics(final, {**RATIOS, **EMA_RATIOS}),
            source=export_source(args, command, weights="ema" if ema else "model"),
            state_dict=ema.state_dict_for_export() if ema is not None else None,
        )  # fmt: skip
        logger.info(f"exported {path} (modelzoo.get_model(DIR); fine-tune it on SQuAD)")
    logger.finish(total_time=time.perf_counter() - start, steps=done, **final)
    if env.is_main and final:
        shown = ratio_metrics(final, RATIOS)
        logger.info(
            f"Held-out masked-LM accuracy {shown.get('mlm_accuracy', math.nan):.4f}, "
            f"next-sentence accuracy {shown.get('nsp_accuracy', math.nan):.4f} "
            f"({time.perf_counter() - start:.1f} s)"
        )
    logger.close()
    env.destroy()
    return 0 if all(math.isfinite(v) for v in final.values() if isinstance(v, float)) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, expected=(DownloadError, ChecksumError)))
