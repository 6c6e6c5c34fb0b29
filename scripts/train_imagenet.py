"""Train an image classifier from the zoo: GluonCV's train_imagenet.py on the shared Trainer.

With no data flags it trains on scikit-learn's real handwritten digits (written once as an
ImageNet-layout folder in the cache, with a held-out split) and prints the held-out top-1:

    python scripts/train_imagenet.py

ImageNet, as GluonCV users know it (flag names are GluonCV's):

    python scripts/train_imagenet.py --data-dir ~/imagenet --model resnest50 \
        --batch-size 128 --num-epochs 270 --lr 0.05 --lr-mode cosine --warmup-epochs 5 \
        --no-wd --last-gamma --label-smoothing 0.1 --mixup --mixup-alpha 0.2 \
        --dropblock-prob 0.1 --dtype bfloat16 -j 8 --save-dir runs/resnest50

The same command under ``torchrun --nproc-per-node 8 [--nnodes ...]`` trains data-parallel
(``--batch-size`` is per worker; ``--grad-combine`` picks how the workers combine gradients:
averaging, Adasum, compression with error feedback, CSER, PowerSGD, local SGD, SlowMo, Local
AdaAlter — docs/communication.md). Every run writes a JSON Lines run log (``--run-log``) that
``scripts/reproduce.py`` can rerun and compare.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from modelzoo.store import ChecksumError, DownloadError
from modelzoo.vision.data import BadImageError, ImageFolder, RecordIOError
from modelzoo.vision.recipe import (
    DIGITS_DEFAULTS,
    IMAGENET_DEFAULTS,
    ImageRecipe,
    ImageSetError,
    RecipeOptionError,
    held_out_report,
    image_root,
    recipe_defaults,
)
from modelzoo.vision.tasks import DropBlockRamp, ImageClassificationTask
from trainers import DistEnv, RunLogger, Trainer, make_header
from trainers.claims import majority_level
from trainers.cli import (
    DTYPES,
    ArgumentParser,
    Bound,
    add_distributed_args,
    add_elastic_args,
    add_ema_args,
    add_export_args,
    add_optimizer_args,
    add_run_args,
    add_schedule_args,
    add_tensor_parallel_args,
    add_tensorboard_args,
    apply_model_parallel,
    apply_plan,
    brief,
    build_combiner,
    build_elastic,
    build_ema,
    build_optimizer,
    describe_defaults,
    elastic_resuming,
    export_source,
    print_config,
    run_configs,
    run_main,
    schedule_config,
    trainer_config,
    unsplit_for_saving,
)
from trainers.errors import UsageError
from trainers.hooks import StopAtTarget

# modelzoo's errors a run expects (bad image files, a failed download): one line, exit 2.
EXPECTED_ERRORS = (BadImageError, RecordIOError, DownloadError, ChecksumError)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(
        description="Train an image classifier from the model zoo (GluonCV-compatible flags).",
    )
    d = p.add_argument_group("data (none given: the built-in handwritten digits)")
    d.add_argument(
        "--data-dir", type=str, default=None, help="ImageNet layout: train/<class>/*, val/<class>/*"
    )
    d.add_argument("--use-rec", action="store_true", help="read MXNet RecordIO files instead")
    d.add_argument("--rec-train", type=str, default=None)
    d.add_argument("--rec-train-idx", type=str, default=None)
    d.add_argument("--rec-val", type=str, default=None)
    d.add_argument("--rec-val-idx", type=str, default=None)
    d.add_argument("--num-classes", type=int, default=None, help="RecordIO: classes (default 1000)")
    d.add_argument(
        "-j",
        "--num-data-workers",
        "--num-workers",
        dest="num_workers",
        type=int,
        default=2,
        help="DataLoader workers per rank",
    )
    d.add_argument("--input-size", type=int, default=None, help="224 for ImageNet, 32 for digits")
    d.add_argument("--crop-ratio", type=float, default=None, help="eval resize = input / crop")
    d.add_argument("--rgb-mean", type=str, default=None, help="0-255 units, comma separated")
    d.add_argument("--rgb-std", type=str, default=None, help="0-255 units, comma separated")
    d.add_argument("--jitter", type=float, default=None, help="colour jitter (GluonCV: 0.4)")
    d.add_argument("--lighting", type=float, default=None, help="PCA lighting std (GluonCV: 0.1)")
    d.add_argument(
        "--min-random-area", type=float, default=None, help="random-resized-crop lower area"
    )
    d.add_argument(
        "--hflip",
        type=float,
        default=None,
        help="horizontal-flip probability (ImageNet 0.5; digits 0: a mirrored digit is no digit)",
    )
    d.add_argument(
        "--skip-bad-images",
        action="store_true",
        help="skip unreadable images, count and report them",
    )

    m = p.add_argument_group("model")
    m.add_argument("--model", type=str, default=None, help="a name from modelzoo.list_models()")
    m.add_argument("--use-pretrained", action="store_true", help="start from published weights")
    m.add_argument(
        "--last-gamma",
        action="store_true",
        default=None,
        help="zero-init the last BN gamma of each block (on by default for the digits)",
    )
    m.add_argument(
        "--dropblock-prob", type=float, default=0.0, help="DropBlock, ramped linearly over training"
    )
    m.add_argument("--final-drop", type=float, default=0.0, help="dropout before the classifier")
    m.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        default=None,
        metavar="PATH",
        help="continue from this checkpoint; alone: <save-dir>/latest.pt",
    )
    m.add_argument(
        "--teacher", type=str, default=None, help="distil from this pretrained zoo model"
    )
    m.add_argument("--temperature", type=float, default=20.0, help="distillation temperature")
    m.add_argument(
        "--hard-weight",
        type=float,
        default=0.5,
        help="weight of the hard-label loss when distilling",
    )

    add_optimizer_args(p, default="nag", wd=None)
    add_schedule_args(p, default="cosine")
    add_distributed_args(p)
    add_elastic_args(p)
    add_tensor_parallel_args(p, tensor=False)  # --pipeline-parallel N --micro-batches M
    add_ema_args(p)
    add_tensorboard_args(p)
    add_export_args(p)
    o = p.add_argument_group("training")
    o.add_argument("--batch-size", type=int, default=None, help="per worker")
    o.add_argument(
        "--num-epochs",
        "--epochs",
        dest="num_epochs",
        type=int,
        default=None,
        help="epochs to train",
    )
    o.add_argument(
        "--target-top1", type=float, default=None, metavar="ACC",
        help="time to accuracy: stop at the first evaluation with held-out top-1 >= ACC (0-1); "
        "the end record gets time_to_target",
    )  # fmt: skip
    o.add_argument(
        "--label-smoothing",
        type=float,
        nargs="?",
        const=0.1,
        default=None,
        metavar="ETA",
        help="smooth the targets by ETA; alone (GluonCV's switch): 0.1",
    )
    o.add_argument("--mixup", action="store_true", help="train on mixed pairs of images (mixup)")
    o.add_argument("--mixup-alpha", type=float, default=0.2)
    o.add_argument("--mixup-off-epoch", type=int, default=0, help="no mixup in the last N epochs")
    o.add_argument("--channels-last", action="store_true")

    g = p.add_argument_group("logging and checkpoints")
    g.add_argument(
        "--save-frequency", type=int, default=0, help="epochs between checkpoints (0: last only)"
    )
    g.add_argument(
        "--save-dir", type=str, default=None, help="checkpoints (latest.pt) and the run log"
    )
    add_run_args(o, g)  # --accumulate, --dtype, --seed, --max-steps, --run-log...
    p.add_mxnet_options("--num-gpus", "--gpus", "--kvstore", "--mode")
    brief(p, "--data-dir", "--use-rec", "--model", "--use-pretrained", "--resume", "--batch-size",
          "--num-epochs", "--max-steps", "--label-smoothing", "--mixup", "--dtype", "--seed",
          "--save-dir", "--run-log")  # fmt: skip
    describe_defaults(p, {"for the built-in digits": DIGITS_DEFAULTS,
                          "with --data-dir or --use-rec": IMAGENET_DEFAULTS})  # fmt: skip
    args = p.parse_args(argv)

    args.dataset, defaults, note = recipe_defaults(vars(args))  # digits, folder or recordio
    for key, value in defaults.items():
        setattr(args, key, value)
    if note:  # the digits' default warm-up, shortened to fit the run
        print(note, file=sys.stderr)
    p.check(args, bounds=BOUNDS)
    _check_flags(p, args)
    return p.finish(args)


# The script's own flags' ranges (the shared ones: trainers.cli.BOUNDS).
BOUNDS = {
    "input_size": Bound(1), "crop_ratio": Bound(0, 1, low_open=True), "jitter": Bound(0),
    "lighting": Bound(0), "min_random_area": Bound(0, 1, low_open=True), "hflip": Bound(0, 1),
    "num_classes": Bound(1), "dropblock_prob": Bound(0, 1, high_open=True),
    "final_drop": Bound(0, 1, high_open=True), "temperature": Bound(0, low_open=True),
    "hard_weight": Bound(0, 1), "label_smoothing": Bound(0, 1, high_open=True),
    "mixup_alpha": Bound(0, low_open=True), "mixup_off_epoch": Bound(0),
    "save_frequency": Bound(0), "target_top1": Bound(0, 1, low_open=True),
}  # fmt: skip


def _check_flags(p: ArgumentParser, args: argparse.Namespace) -> None:
    """What the flags must satisfy together (:meth:`ImageRecipe.check_options`)."""
    if args.dtype not in DTYPES:
        p.error(f"--dtype must be one of {sorted(DTYPES)}")
    try:
        ImageRecipe.from_options(vars(args)).check_options()
    except RecipeOptionError as err:
        p.error(str(err))


def check_args(args: argparse.Namespace) -> None:
    """What the flags name -- models, files, folders -- exists, before any work
    (:meth:`ImageRecipe.check_inputs`).

    Raises:
        UsageError: naming the flag and what to do.
    """
    try:
        ImageRecipe.from_options(vars(args)).check_inputs()
    except RecipeOptionError as err:
        raise UsageError(str(err)) from None


def trivial_level(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The task's trivial level for a run log's claims (``logs/claims.json``): the top-1 of the
    best constant prediction (the majority class) on the images the run evaluates."""
    args = parse_args(list(records[0]["command"][1:]))
    if args.dataset == "recordio":
        raise SystemExit("the trivial level of a RecordIO validation set is not computed: "
                         "publish the recipe from an image folder")  # fmt: skip
    val = ImageFolder(image_root(args.dataset, args.data_dir) / "val", None)
    where = "held-out digits" if args.dataset == "digits" else f"images of {args.data_dir}/val"
    return majority_level(
        [target for _, target in val.samples], what=where, name=lambda t: val.classes[t]
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_args(args)
    if print_config(args):
        return 0
    env = DistEnv.from_env()
    apply_plan(args, env, model_name=args.model, batch_size=args.batch_size,
               accumulate=args.accumulate, image_size=args.input_size)  # fmt: skip
    command = [sys.argv[0], *(sys.argv[1:] if argv is None else argv)]
    # The data and the model before the run log: a data set or model that cannot be used
    # stops the run before it has a log.
    recipe = ImageRecipe.from_options(vars(args))  # the data and model flags
    try:
        train_set, val_set, num_classes = recipe.datasets()
    except ImageSetError as err:
        raise SystemExit(str(err)) from None
    torch.manual_seed(args.seed)  # the same initial weights on every rank and every rerun
    try:
        model = recipe.build_model(num_classes, pretrained=args.use_pretrained,
                                   progress=env.is_main)  # fmt: skip
    except RecipeOptionError as err:  # one image per BatchNorm forward pass
        raise UsageError(str(err)) from None
    teacher = recipe.build_teacher(num_classes, env.device)

    run_log = args.run_log or next(
        (str(Path(d) / "run.jsonl") for d in (args.save_dir, args.elastic_dir) if d), None
    )
    resuming = elastic_resuming(args, run_log, is_main=env.is_main)  # append, no new header
    logger = RunLogger(
        run_log, enabled=env.is_main, logging_file=args.logging_file, mode="a" if resuming else "w",
        tensorboard=args.tensorboard,
    )  # fmt: skip
    config = trainer_config(
        args, epochs=args.num_epochs, batch_size=args.batch_size, save_dir=args.save_dir,
        save_frequency=args.save_frequency, channels_last=args.channels_last,
    )  # fmt: skip
    if not resuming:
        logger.write(
            make_header(
                command, args.seed, env.world_size, args, configs=run_configs(args, run=config)
            )
        )

    world = env  # the whole world; env becomes its data-parallel view with --pipeline-parallel
    model, env = apply_model_parallel(args, world, model, inputs_of=lambda batch: batch[:1])
    optimizer = build_optimizer(args, model)
    combiner = build_combiner(args, env)
    task = ImageClassificationTask(
        num_classes,
        label_smoothing=args.label_smoothing,
        mixup_alpha=args.mixup_alpha if args.mixup else None,
        mixup_epochs=args.num_epochs - args.mixup_off_epoch,
        teacher=teacher,
        temperature=args.temperature,
        hard_weight=args.hard_weight,
    )
    hooks: list[Any] = [task]
    if args.target_top1 is not None:
        hooks.append(StopAtTarget("top1", args.target_top1))
    if args.dropblock_prob > 0:
        hooks.append(DropBlockRamp(model, args.num_epochs))
    ema = build_ema(args, model, eval_dataset=val_set)  # --model-ema: evaluated as ema_top1
    if ema is not None:
        hooks.append(ema)
    trainer = Trainer(
        model, optimizer, config, env=env, logger=logger, lr_schedule=schedule_config(args),
        train_step=task.train_step, eval_step=task.eval_step if val_set is not None else None,
        combiner=combiner, hooks=hooks,
    )  # fmt: skip
    build_elastic(args, trainer)  # with --elastic-dir: fit() resumes from its state
    if args.resume:
        trainer.resume(recipe.resume_path())

    start = time.perf_counter()
    metrics = trainer.fit(train_set, eval_dataset=val_set)
    exported = unsplit_for_saving(trainer.model) if args.export_dir else None  # collective
    if env.is_main:
        for line in held_out_report(train_set, val_set, trainer.last_eval,
                                    ema.last_metrics if ema is not None else None,
                                    time.perf_counter() - start):  # fmt: skip
            logger.info(line)
        if args.export_dir:  # the EMA's weights with --model-ema (ImageRecipe.export)
            path = recipe.export(
                args.export_dir, exported, num_classes=num_classes,
                labels=getattr(train_set, "classes", None),
                metrics={**trainer.last_eval, **(ema.last_metrics if ema is not None else {})},
                source=export_source(args, command, weights="ema" if ema else "model"),
                state_dict=ema.state_dict_for_export() if ema is not None else None,
            )  # fmt: skip
            logger.info(f"exported {path} (modelzoo.get_model / modelzoo.pipeline load it)")
    logger.close()
    world.destroy()
    return 0 if all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)) else 1


if __name__ == "__main__":
    sys.exit(run_main(main, expected=EXPECTED_ERRORS))
