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
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from modelzoo.convert.bert import save_hf_directory
from modelzoo.nlp.pretraining import PretrainingCollate, PretrainingShards
from modelzoo.nlp.pretraining.phases import (
    LR_SCHEDULES,
    PHASE_DEFAULTS,
    PHASE_FIELDS,
    Phase,
    PhaseChain,
    PhaseError,
    PhaseSources,
    check_sources,
    phase_epochs,
    plan_phases,
)
from modelzoo.nlp.pretraining.recipe import (
    new_pretraining_bert,
    save_pretraining_artifact,
    schedule_shape,
)
from modelzoo.nlp.pretraining.task import (
    EMA_RATIOS,
    RATIOS,
    EvalTracker,
    eval_step,
    fit_phase,
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(description="Pretrain BERT (masked LM + next sentence) in two phases.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    d = p.add_argument_group("data (none given: built-in shards of the stdlib docstrings)")
    for phase in (1, 2):
        d.add_argument(f"--phase{phase}-data", type=str, default=None, help="training shards")
        d.add_argument(f"--phase{phase}-eval-data", type=str, default=None, help="held-out shards")
    d.add_argument("--cache-dir", type=str, default=None,
                   help="where the built-in shards are made (default $MODELZOO_HOME/pretraining)")  # fmt: skip
    d.add_argument("--dupe-factor", type=int, default=5, help="built-in data: masking passes")
    d.add_argument("--data-seed", type=int, default=12345, help="built-in data: instance seed")
    d.add_argument("--corpus-vocab", action="store_true",
                   help="built-in data: keep only the tokens of MiniLM's vocabulary that the "
                   "training corpus uses (about 5,300 instead of 30,522; the same tokens for the "
                   "training text)")  # fmt: skip

    m = p.add_argument_group("model (default: a small BERT; --bert-model for a zoo size)")
    m.add_argument("--bert-model", type=str, default=None, help="e.g. bert_12_768_12")
    for flag, default in (("--num-layers", 2), ("--hidden-size", 128), ("--num-heads", 2),
                          ("--intermediate-size", 512), ("--max-position-embeddings", 512)):  # fmt: skip
        m.add_argument(flag, type=int, default=default)
    m.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    m.add_argument("--initializer-range", type=float, default=0.02,
                   help="std of the normal initial weights (BERT's 0.02)")  # fmt: skip
    m.add_argument("--phase1-model", type=str, default=None,
                   help="phase 2 alone (--phases 2): start from this phase-1 directory")  # fmt: skip
    m.add_argument("--vocab-file", type=str, default=None, help="default: the shards' vocab.txt")

    add_optimizer_args(p, default="lans")
    p.set_defaults(wd=0.01, no_wd=True, epsilon=1e-6)
    for add in (add_distributed_args, add_tensor_parallel_args, add_elastic_args, add_ema_args,
                add_gradient_checkpointing_args, add_tensorboard_args, add_export_args):  # fmt: skip
        add(p)

    t = p.add_argument_group("phases (per-phase flags: --phase1-X / --phase2-X)")
    t.add_argument("--phases", type=str, default="1,2", help="phases to run: 1,2 or 1 or 2")
    for phase, defaults in PHASE_DEFAULTS.items():
        for flag in PHASE_FIELDS:
            t.add_argument(f"--phase{phase}-{flag.replace('_', '-')}",
                           type=float if flag in ("lr", "warmup_ratio") else int,
                           default=defaults[flag], help="default: --lr" if flag == "lr" else None)  # fmt: skip
    t.add_argument("--lr-schedule", type=str, default="warmup_const_poly", choices=LR_SCHEDULES,
                   help="warmup_const_poly: the LANS schedule with its phases rounded to whole "
                   "steps; gluonnlp: the same as gluon-nlp computes it (fractional phases; a zero "
                   "warmup ratio is a constant lr); nvidia_poly_warmup: NVIDIA's "
                   "PolyWarmUpScheduler (warmup, then base * (1 - (t + 1) / T) ** power over the "
                   "whole phase, no constant phase)")  # fmt: skip
    t.add_argument("--const-ratio", type=float, default=None,
                   help="constant-lr fraction (default 0.25; 0 with --lr-schedule "
                   "nvidia_poly_warmup)")  # fmt: skip
    t.add_argument("--decay-power", type=float, default=None,
                   help="polynomial decay degree (default 1; 0.5, NVIDIA's, with "
                   "nvidia_poly_warmup)")  # fmt: skip
    t.add_argument("-j", "--num-workers", "--num-data-workers", dest="num_workers", type=int,
                   default=0, help="DataLoader workers per rank")  # fmt: skip
    t.add_argument("--eval-batch-size", type=int, default=64)
    t.add_argument("--eval-interval-steps", type=int, default=0,
                   help="evaluate every N steps (0: at the end)")  # fmt: skip
    t.add_argument("--checkpoint-steps", type=int, default=0, help="save latest.pt every N steps")
    t.add_argument("--resume", nargs="?", const="auto", default=None, metavar="latest",
                   help="continue from the latest checkpoint of each phase in --output-dir "
                   "(pretraining takes no checkpoint path: its phases resume from their own "
                   "directories)")  # fmt: skip

    g = p.add_argument_group("logging and output")
    g.add_argument("--output-dir", type=str, default="./runs/pretrain")
    add_run_args(t, g, clip_grad_norm=0.0, accumulate=False, log_interval=10,
                 max_steps_help="stop after N steps (all phases)")  # fmt: skip
    p.add_renamed("--eval-interval", "--eval-interval-steps",
                  "pretraining counts steps; it has no epochs")  # fmt: skip
    p.add_mxnet_options("--gpus", "--num-gpus", "--kvstore", "--bert-dataset")
    brief(p, "--phase1-data", "--phase2-data", "--bert-model", "--num-layers", "--hidden-size",
          "--phase1-model", "--phases", "--phase1-steps", "--phase2-steps", "--dtype", "--max-steps",
          "--resume", "--output-dir", "--run-log")  # fmt: skip
    describe_defaults(p, {"with --optimizer lans or lamb": {"lr": 5e-3},
                          "with another optimizer": {"lr": 1e-4}})  # fmt: skip
    args = p.parse_args(argv)
    if args.resume not in (None, "auto"):
        p.error(f"--resume {args.resume!r}: pretraining resumes every phase from --output-dir's "
                "checkpoints; pass --resume alone")  # fmt: skip
    try:  # the phases, their defaults filled in (modelzoo/nlp/pretraining/phases.py)
        plan = plan_phases(
            args.phases, phase_settings(args).values(),
            data={n: getattr(args, f"phase{n}_data") for n in (1, 2)}, optimizer=args.optimizer,
            lr=args.lr, lr_schedule=args.lr_schedule, const_ratio=args.const_ratio,
            decay_power=args.decay_power, max_position_embeddings=args.max_position_embeddings,
            plan=bool(args.plan), phase1_model=args.phase1_model, resume=bool(args.resume),
        )  # fmt: skip
    except PhaseError as err:
        p.error(str(err))
    args.phase_list, args.lr = plan.order, plan.lr
    args.const_ratio, args.decay_power = plan.const_ratio, plan.decay_power
    args.phase1_lr, args.phase2_lr = plan.phases[1].lr, plan.phases[2].lr
    args.builtin = plan.builtin
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


def phase_settings(args: argparse.Namespace) -> dict[int, Phase]:
    """The ``--phaseN-X`` flags of both phases."""
    return {n: Phase(n, **{f: getattr(args, f"phase{n}_{f}") for f in PHASE_FIELDS})
            for n in (1, 2)}  # fmt: skip


def phase_sources(args: argparse.Namespace) -> PhaseSources:
    """Where the flags' data and vocabulary come from (none given: the built-in shards)."""
    return PhaseSources(
        args.phase_list, {n: (getattr(args, f"phase{n}_data"), getattr(args, f"phase{n}_eval_data"))
                          for n in (1, 2)},
        {n: (s.max_seq_length, s.max_predictions) for n, s in phase_settings(args).items()},
        vocab_file=args.vocab_file, phase1_model=args.phase1_model, corpus_vocab=args.corpus_vocab,
        dupe_factor=args.dupe_factor, seed=args.data_seed, cache_dir=args.cache_dir,
    )  # fmt: skip


def trivial_level(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The masked-LM task's trivial level for a run log's claims (``logs/claims.json``): the
    accuracy of the best constant prediction (one token for every masked position; no unigram
    model does better) on the held-out instances of the run's last phase, which its final
    ``mlm_accuracy`` is measured on."""
    args = parse_args(list(records[0]["command"][1:]))
    try:  # read once for the seeds of a recipe (and recipes) that share their held-out data
        labels, what, name = phase_sources(args).heldout_labels(args.phase_list[-1],
                                                                progress=not args.no_progress)  # fmt: skip
    except PhaseError as exc:
        raise SystemExit(str(exc)) from None
    return majority_level(labels, what=what, kind="best constant prediction", name=name)


def new_model(args: argparse.Namespace, tokenizer: BertTokenizer) -> torch.nn.Module:
    """A fresh model of the flags' size, the same initial weights on every rank and rerun."""
    shape = ("bert_model", "num_layers", "hidden_size", "num_heads", "intermediate_size",
             "max_position_embeddings", "dropout", "initializer_range")  # fmt: skip
    return new_pretraining_bert(len(tokenizer), seed=args.seed,
                                **{k: getattr(args, k) for k in shape})  # fmt: skip


def _schedule(args: argparse.Namespace, phase: int, steps: int) -> LRSchedule:
    """The phase's lr schedule (``--lr-schedule``; formulas in ``trainers/schedules.py``)."""
    mode, shape = schedule_shape(args.lr_schedule, steps, const_ratio=args.const_ratio,
                                 warmup_ratio=getattr(args, f"phase{phase}_warmup_ratio"))  # fmt: skip
    return create_schedule(mode, base_lr=getattr(args, f"phase{phase}_lr"), total_steps=steps,
                           power=args.decay_power, **shape)  # fmt: skip


def _phase_elastic(args: argparse.Namespace, phase: int) -> ElasticConfig | None:
    """The elastic config of one phase: its own directory under ``--elastic-dir``."""
    config = elastic_config(args)
    return config and dataclasses.replace(config, dir=str(Path(config.dir) / f"phase{phase}"))


def run_phase(args: argparse.Namespace, phase: Phase, chain: PhaseChain, model: torch.nn.Module,
              data: tuple[PretrainingShards, PretrainingShards | None], env: DistEnv,
              logger: PhasedRunLogger) -> Trainer:  # fmt: skip
    """One phase's ``fit``, up to ``chain``'s limit of steps."""
    (train, dev), n = data, phase.number
    combiner = build_combiner(args, env)
    global_batch = phase.batch_size * phase.accumulate * combiner.data_parts(env.world_size)
    epochs = phase_epochs(n, len(train), steps=phase.steps, global_batch=global_batch)
    opt = dataclasses.replace(optimizer_config(args), lr=phase.lr)
    optimizer = create_optimizer(opt.name, model, **opt.kwargs())
    config = trainer_config(
        args, epochs=epochs, max_steps=chain.limit(phase.steps), batch_size=phase.batch_size,
        eval_batch_size=args.eval_batch_size, grad_accum_steps=phase.accumulate, eval_interval=0,
        eval_interval_steps=args.eval_interval_steps, save_dir=str(chain.save_dir(n)),
        save_frequency=0, save_interval_steps=args.checkpoint_steps,
    )  # fmt: skip
    tracker, schedule = EvalTracker(), _schedule(args, n, phase.steps)
    ema = build_ema(args, model, eval_dataset=dev, collate_fn=PretrainingCollate(train.pad_id))
    trainer = Trainer(
        model, optimizer, config, env=env, logger=logger, lr_schedule=schedule,
        train_step=train_step, eval_step=eval_step if dev is not None else None,
        combiner=combiner, hooks=[tracker] if ema is None else [tracker, ema],
    )  # fmt: skip
    logger.start_phase(n, chain.done, trainer)
    build_elastic(_phase_elastic(args, n), trainer)
    if args.elastic_dir is None and (latest := chain.checkpoint(n)) is not None:
        trainer.resume(latest)
        logger.info(f"[Phase {n}] resumed from {latest} at step {trainer.global_step}")
    fit_phase(trainer, train, dev, PretrainingCollate(train.pad_id), tracker=tracker,
              log_eval=logger.eval, first=n == args.phase_list[0], ema=ema)  # fmt: skip
    return trainer


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # what the flags name exists, before any work (the shards are checked by their reader)
        check_sources(bert_model=args.bert_model, vocab_file=args.vocab_file,
                      phase1_model=args.phase1_model if 2 in args.phase_list else None)  # fmt: skip
    except PhaseError as err:
        raise UsageError(str(err)) from None
    if print_config(args):
        return 0
    try:  # the data, the batch or phase 2's start do not fit: one error line
        return run(args, [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    except PhaseError as exc:
        raise SystemExit(f"pretrain_bert.py: error: {exc}") from None


def run(args: argparse.Namespace, command: list[str]) -> int:
    env, phases = DistEnv.from_env(), phase_settings(args)
    first = phases[args.phase_list[0]]  # --plan runs one phase
    apply_plan(args, env, model_name=args.bert_model, batch_size=first.batch_size,
               accumulate=first.accumulate, seq_len=first.max_seq_length)  # fmt: skip
    resuming = bool(args.resume) or elastic_resuming(_phase_elastic(args, first.number),
                                                     args.run_log, is_main=env.is_main)  # fmt: skip
    appending = resuming and args.run_log is not None and Path(args.run_log).is_file()
    logger = PhasedRunLogger(args.run_log, enabled=env.is_main, logging_file=args.logging_file,
                             mode="a" if appending else "w", ratios={**RATIOS, **EMA_RATIOS},
                             tensorboard=args.tensorboard)  # fmt: skip
    if not appending:
        logger.write(make_header(command, args.seed, env.world_size, args,
                                 configs=run_configs(args)))  # fmt: skip

    sources = phase_sources(args)
    tokenizer = sources.tokenizer(progress=not args.no_progress)
    data = sources.open(tokenizer, max_position_embeddings=args.max_position_embeddings,
                        verbose=env.is_main, progress=env.is_main and not args.no_progress)  # fmt: skip
    for n, (train, dev) in data.items():
        logger.info(f"[Phase {n}] {len(train)} training instances of {train.max_seq_length} "
                    f"tokens ({train.directory}); {len(dev) if dev is not None else 0} held out")  # fmt: skip

    start = time.perf_counter()
    chain = PhaseChain(args.output_dir, max_steps=args.max_steps, resuming=resuming,
                       phase1_model=args.phase1_model)  # fmt: skip
    final: dict[str, Any] = {}
    trainer: Trainer | None = None
    ema: ModelEMA | None = None
    for phase in chain.pending([phases[n] for n in args.phase_list], info=logger.info):
        n, model_dir = phase.number, chain.model_dir(phase.number)
        model = new_model(args, tokenizer) if n == 1 else chain.start_model(len(tokenizer))
        model.bert.set_gradient_checkpointing(args.gradient_checkpointing)
        # --tensor/--pipeline-parallel: the model split, and the Trainer's data-parallel world
        model, dp_env = apply_model_parallel(args, env, model, inputs_of=pipeline_inputs,
                                             batch_size=phase.batch_size)  # fmt: skip
        trainer = run_phase(args, phase, chain, model, data[n], dp_env, logger)
        ema = next((h for h in trainer.hooks if isinstance(h, ModelEMA)), None)  # --model-ema
        final = {**trainer.last_eval, **(ema.final_metrics() if ema is not None else {})}
        if complete := trainer.global_step >= phase.steps:  # else --max-steps ended the run
            saved = unsplit_for_saving(trainer.model)  # gathers a tensor-parallel model's shards
            if env.is_main:
                save_hf_directory(saved, tokenizer, model_dir)
                logger.info(f"[Phase {n}] saved {model_dir}")
            env.barrier()
        chain.end_phase(n, trainer.global_step, saved=complete)  # the next phase starts from it
    exported = (
        unsplit_for_saving(trainer.model) if args.export_dir and trainer is not None else None
    )
    if env.is_main and args.export_dir:
        if trainer is None or exported is None:
            raise SystemExit("--export-dir: every phase was already finished; nothing was trained")
        path = save_pretraining_artifact(
            args.export_dir, exported, tokenizer, model_name=args.bert_model or "bert",
            metrics=ratio_metrics(final, {**RATIOS, **EMA_RATIOS}),
            source=export_source(args, command, weights="ema" if ema else "model"),
            state_dict=ema.state_dict_for_export() if ema is not None else None,
        )  # fmt: skip
        logger.info(f"exported {path} (modelzoo.get_model(DIR); fine-tune it on SQuAD)")
    logger.finish(total_time=time.perf_counter() - start, steps=chain.done, **final)
    if env.is_main and final:
        shown = ratio_metrics(final, RATIOS)
        logger.info(f"Held-out masked-LM accuracy {shown.get('mlm_accuracy', math.nan):.4f}, "
                    f"next-sentence accuracy {shown.get('nsp_accuracy', math.nan):.4f} "
                    f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
    logger.close()
    env.destroy()
    return 0 if all(math.isfinite(v) for v in final.values() if isinstance(v, float)) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, expected=(DownloadError, ChecksumError)))
