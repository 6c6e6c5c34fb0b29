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

import modelzoo
from modelzoo.artifact import is_artifact
from modelzoo.store import ChecksumError, DownloadError
from modelzoo.vision.data import BadImageError, ImageFolder, RecordIOError
from modelzoo.vision.recipe import (
    ImageSetError,
    image_datasets,
    image_root,
    is_image_classifier,
    model_options,
    parse_rgb,
    save_classifier_artifact,
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

# The built-in default: what a newcomer gets with no data flags. Measured on seed 0 (AVX2
# pins, docs/training.md): the GluonCV-like 8 epochs at lr 0.1 with flips reached 0.9526 and
# its BatchNorm statistics blew up the first validations (loss 122, 137); without flips
# (a mirrored digit is another glyph) 0.969; with lr 0.05, weight decay 5e-4, label smoothing
# 0.1, 2 warm-up epochs of 12 the validation loss stays below 4 and top-1 reached 0.989.
DIGITS_DEFAULTS = dict(
    model="resnest14",
    input_size=32,
    crop_ratio=1.0,
    batch_size=64,
    num_epochs=12,
    lr=0.05,
    wd=5e-4,
    label_smoothing=0.1,
    warmup_epochs=2,
    rgb_mean="127.5,127.5,127.5",
    rgb_std="127.5,127.5,127.5",
    jitter=0.0,
    lighting=0.0,
    min_random_area=0.6,
    hflip=0.0,
    log_interval=10,
    last_gamma=True,
    no_wd=True,
)
IMAGENET_DEFAULTS = dict(
    model="resnest50",
    input_size=224,
    crop_ratio=0.875,
    batch_size=32,
    num_epochs=120,
    lr=0.1,
    wd=1e-4,
    label_smoothing=0.0,
    warmup_epochs=0,
    rgb_mean="123.68,116.779,103.939",
    rgb_std="58.393,57.12,57.375",
    jitter=0.4,
    lighting=0.1,
    min_random_area=0.08,
    hflip=0.5,
    log_interval=50,
    last_gamma=False,
    no_wd=False,
)


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

    digits = args.data_dir is None and not args.use_rec
    defaults = DIGITS_DEFAULTS if digits else IMAGENET_DEFAULTS
    defaulted = {key for key in defaults if getattr(args, key) is None}
    for key in defaulted:
        setattr(args, key, defaults[key])
    args.dataset = "digits" if digits else ("recordio" if args.use_rec else "folder")
    fits = args.warmup_epochs + args.const_epochs <= args.num_epochs
    if "warmup_epochs" in defaulted and args.num_epochs >= 1 and not fits:
        # The recipe's warmup does not fit a shorter run: warm up over half of it (say so).
        args.warmup_epochs = max(0.0, args.num_epochs - args.const_epochs) / 2
        print(
            f"note: the default --warmup-epochs {defaults['warmup_epochs']} does not fit "
            f"--num-epochs {args.num_epochs}: warming up for {args.warmup_epochs:g} epochs "
            "(half the run); pass --warmup-epochs to choose",
            file=sys.stderr,
        )
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
    """What the flags must satisfy together, in their own terms."""
    if args.dtype not in DTYPES:
        p.error(f"--dtype must be one of {sorted(DTYPES)}")
    for flag, text in (("--rgb-mean", args.rgb_mean), ("--rgb-std", args.rgb_std)):
        try:
            parse_rgb(text, flag)
        except ValueError as err:
            p.error(str(err))
    if 0 in parse_rgb(args.rgb_std, "--rgb-std"):
        p.error(f"--rgb-std {args.rgb_std}: a standard deviation of 0 divides by zero")
    if args.mixup_off_epoch > args.num_epochs:
        p.error(f"--mixup-off-epoch {args.mixup_off_epoch} exceeds --num-epochs {args.num_epochs}")
    if args.use_rec and not (args.rec_train and args.rec_train_idx):
        p.error("--use-rec needs --rec-train and --rec-train-idx (and --rec-val/--rec-val-idx to "
                "evaluate)")  # fmt: skip
    if args.rec_val and not args.rec_val_idx:
        p.error("--rec-val needs --rec-val-idx")
    if args.target_top1 is not None and args.dataset == "recordio" and not args.rec_val:
        p.error("--target-top1 needs a validation set: --rec-val and --rec-val-idx")
    if args.pipeline_parallel > 1:
        for flag, on in (("--mixup", args.mixup), ("--teacher", args.teacher),
                         ("--channels-last", args.channels_last)):  # fmt: skip
            if on:
                p.error(f"{flag} does not run with --pipeline-parallel yet (the stages take the "
                        "images as the loader gives them); drop one of the two")  # fmt: skip


def check_args(args: argparse.Namespace) -> None:
    """What the flags name -- models, files, folders -- exists, before any work.

    Raises:
        UsageError: naming the flag and what to do.
    """
    for flag, name in (("--model", args.model), ("--teacher", args.teacher)):
        if name is not None:
            _check_image_model(flag, name)
    if args.dataset == "recordio":
        for flag in ("--rec-train", "--rec-train-idx", "--rec-val", "--rec-val-idx"):
            path = getattr(args, flag[2:].replace("-", "_"))
            if path and not Path(path).expanduser().is_file():
                raise UsageError(f"{flag} {path}: no such file")
    if args.dataset == "folder":
        root = Path(args.data_dir).expanduser()
        if not (root / "train").is_dir():
            what = "has no train/ folder" if root.is_dir() else "does not exist"
            raise UsageError(
                f"--data-dir {args.data_dir} {what}: give a folder with train/<class>/* (and "
                "val/<class>/* to evaluate), or no --data-dir for the built-in digits"
            )
        if args.target_top1 is not None and not (root / "val").is_dir():
            raise UsageError(f"--target-top1 needs a validation set: {root / 'val'} is missing")
    if args.resume == "auto" and args.save_dir is None:
        raise UsageError("--resume without a path continues from <save-dir>/latest.pt: pass "
                         "--save-dir")  # fmt: skip
    if args.resume is not None and not _resume_path(args).is_file():
        raise UsageError(f"--resume {_resume_path(args)}: no such checkpoint")


def _check_image_model(flag: str, name: str) -> None:
    """``name`` is a zoo image model or an exported artifact folder."""
    if is_artifact(name):
        return
    try:
        modelzoo.registry.get_model_entry(name)
    except ValueError as err:
        raise UsageError(f"{flag} {name}: {err}") from None
    if not is_image_classifier(name):
        images = ", ".join(modelzoo.list_models(modality="image"))
        raise UsageError(f"{flag} {name} is not an image classifier; choose one of {images}")


def build_datasets(args: argparse.Namespace) -> tuple[Any, Any, int]:
    """The training and validation sets and the number of classes the flags name
    (:func:`modelzoo.vision.recipe.image_datasets`)."""
    try:
        return image_datasets(
            args.dataset, input_size=args.input_size, crop_ratio=args.crop_ratio,
            mean=parse_rgb(args.rgb_mean, "--rgb-mean"), std=parse_rgb(args.rgb_std, "--rgb-std"),
            jitter=args.jitter, lighting=args.lighting, min_random_area=args.min_random_area,
            hflip=args.hflip, data_dir=args.data_dir, rec_train=args.rec_train,
            rec_train_idx=args.rec_train_idx, rec_val=args.rec_val, rec_val_idx=args.rec_val_idx,
            num_classes=args.num_classes, skip_bad=args.skip_bad_images,
        )  # fmt: skip
    except ImageSetError as err:
        raise SystemExit(str(err)) from None


def _resume_path(args: argparse.Namespace) -> Path:
    if args.resume != "auto":
        return Path(args.resume)
    if args.save_dir is None:
        raise SystemExit(
            "--resume without a path continues from <save-dir>/latest.pt: pass --save-dir"
        )
    return Path(args.save_dir) / "latest.pt"


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
    train_set, val_set, num_classes = build_datasets(args)
    torch.manual_seed(args.seed)  # the same initial weights on every rank and every rerun
    model = modelzoo.get_model(
        args.model,
        pretrained=args.use_pretrained,
        num_classes=num_classes,
        progress=env.is_main,
        **_model_options(args),
    )
    _check_batch_norm(args, model)
    teacher = None
    if args.teacher:
        teacher = modelzoo.get_model(args.teacher, pretrained=True, num_classes=num_classes).eval()
        teacher.to(env.device).requires_grad_(False)

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
        trainer.resume(_resume_path(args))

    start = time.perf_counter()
    metrics = trainer.fit(train_set, eval_dataset=val_set)
    exported = unsplit_for_saving(trainer.model) if args.export_dir else None  # collective
    if env.is_main:
        for ds, name in ((train_set, "train"), (val_set, "val")):
            report = getattr(ds, "report", None)
            if ds is not None and report is not None and ds.bad_files:
                logger.info(f"[{name}] {report()}")
        if val_set is not None and "top1" in trainer.last_eval:
            top1 = trainer.last_eval["top1"]
            logger.info(
                f"Held-out top-1 accuracy: {top1:.4f} ({len(val_set)} images, "
                f"{time.perf_counter() - start:.1f} s)"
            )
        if ema is not None and "ema_top1" in ema.last_metrics:
            logger.info(f"Held-out top-1 accuracy of the EMA: {ema.last_metrics['ema_top1']:.4f}")
        if args.export_dir:
            path = export_model(args, trainer, exported, ema, train_set, num_classes, command)
            logger.info(f"exported {path} (modelzoo.get_model / modelzoo.pipeline load it)")
    logger.close()
    world.destroy()
    return 0 if all(math.isfinite(v) for v in metrics.values() if isinstance(v, float)) else 1


def export_model(
    args: argparse.Namespace,
    trainer: Trainer,
    model: torch.nn.Module,
    ema: Any,
    train_set: Any,
    num_classes: int,
    command: list[str],
) -> Path:
    """``--export-dir``: the artifact folder of the run (the EMA's weights with
    ``--model-ema``): the model, its evaluation preprocessing and the class folder names."""
    return save_classifier_artifact(
        args.export_dir, model, model_name=args.model,
        model_kwargs={"num_classes": num_classes, **_model_options(args)},
        labels=getattr(train_set, "classes", None), input_size=args.input_size,
        crop_ratio=args.crop_ratio, mean=parse_rgb(args.rgb_mean, "--rgb-mean"),
        std=parse_rgb(args.rgb_std, "--rgb-std"),
        metrics={**trainer.last_eval, **(ema.last_metrics if ema is not None else {})},
        source=export_source(args, command, weights="ema" if ema else "model"),
        state_dict=ema.state_dict_for_export() if ema is not None else None,
    )  # fmt: skip


def _check_batch_norm(args: argparse.Namespace, model: torch.nn.Module) -> None:
    """BatchNorm normalizes each channel over the batch: one image per forward pass has no
    spread to normalize (ResNeSt's split attention pools to 1x1 first), so refuse it."""
    per_forward = args.batch_size
    if args.pipeline_parallel > 1:
        per_forward //= args.micro_batches or args.pipeline_parallel
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    if has_bn and per_forward < 2:
        what = "--batch-size 1" if per_forward == args.batch_size else (
            f"--batch-size {args.batch_size} in {args.batch_size // max(per_forward, 1)} "
            "micro-batches")  # fmt: skip
        raise UsageError(
            f"{what}: {args.model} has BatchNorm layers, which need at least 2 images per "
            "forward pass in training; pass --batch-size 2 or more"
        )


def _model_options(args: argparse.Namespace) -> dict[str, Any]:
    return model_options(last_gamma=args.last_gamma, dropblock_prob=args.dropblock_prob,
                         final_drop=args.final_drop)  # fmt: skip


if __name__ == "__main__":
    sys.exit(run_main(main, expected=EXPECTED_ERRORS))
