"""``python -m modelzoo``: predict, evaluate and export from the command line.

* ``predict --model M IMAGE...`` — top-k labels of images (``--task question-answering
  --question Q --context C`` for a QA artifact); one JSON line per input.
* ``evaluate --model M --data-dir VAL`` — top-1/top-5 of a zoo model or an artifact on an
  ImageFolder (or ``--rec-val F.rec --rec-val-idx F.idx``), GluonCV's
  ``verify_pretrained.py``, with the weights' own evaluation preprocessing.
* ``export --model M --output FILE`` — ONNX / ``torch.export`` / TorchScript
  (:mod:`modelzoo.export`).

``M`` is a registry name (``--pretrained TAG`` picks its weights) or an artifact folder.

A mistake in the command (a flag value, a missing file, an unknown model, an unreadable
image) prints one line naming it and exits with status 2; ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

__all__ = ["evaluate_images", "main", "run"]


class _Parser(argparse.ArgumentParser):
    """A usage error is one line and a pointer to ``--help`` (not the whole usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog}: see --help\n")


def _tag(text: str) -> bool | str:
    if text.lower() in ("false", "none"):
        return False  # no pretrained weights: the architecture with its initial weights
    return True if text in ("", "default", "true") else text


def _check_model(args: argparse.Namespace) -> None:
    """``--model`` is an artifact folder or a registry name with the ``--pretrained`` tag."""
    from .artifact import is_artifact
    from .registry import get_model_entry, get_weights

    name = args.model
    if is_artifact(name):
        return
    if os.sep in name or name.startswith(".") or Path(name).expanduser().exists():
        raise SystemExit(
            f"--model {name}: no artifact folder (a folder with modelzoo.json, written by a "
            "training script's --export-dir) and not a registry name"
        )
    try:
        get_model_entry(name)
        tag = _tag(args.pretrained)
        if tag is not False:
            get_weights(name, tag)
    except ValueError as err:
        flag = "--pretrained" if "weights" in str(err) else "--model"
        raise SystemExit(f"{flag}: {err}") from None


def _modality(args: argparse.Namespace) -> str | None:
    """What ``--model`` reads (image, text, graph), without building it; None if unknown."""
    from .artifact import is_artifact, load_artifact
    from .registry import get_model_entry

    if is_artifact(args.model):
        return load_artifact(args.model).modality
    tag = _tag(args.pretrained)
    entry = get_model_entry(args.model)
    weights = entry.weights.get(entry.default_tag if tag is True else tag) if tag else None
    return getattr(weights, "modality", None)


def _meta_and_model(name: str, tag: bool | str) -> tuple[Any, Any]:
    from .artifact import is_artifact, load_artifact
    from .registry import get_model, get_weights

    if is_artifact(name):
        artifact = load_artifact(name)
        return artifact, artifact.build()
    weights = get_weights(name, tag)
    return weights, get_model(name, pretrained=tag).eval()


def _topk_correct(logits: torch.Tensor, target: torch.Tensor, ks: Sequence[int]) -> list[int]:
    k = min(max(ks), logits.shape[-1])
    top = logits.topk(k, dim=-1).indices
    hit = top == target[:, None]
    return [int(hit[:, : min(j, k)].any(dim=-1).sum()) for j in ks]


def evaluate_images(
    model: torch.nn.Module,
    dataset: Any,
    *,
    batch_size: int = 64,
    num_workers: int = 0,
    device: str | torch.device = "cpu",
    progress: bool = True,
) -> dict[str, float]:
    """Top-1/top-5 accuracy (in [0, 1]) of ``model`` on a dataset of ``(image, label)``."""
    from tqdm.auto import tqdm

    loader = torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers
    )
    model = model.to(device).eval()
    correct = [0, 0]
    count = 0
    with torch.inference_mode():
        for x, y in tqdm(loader, desc="evaluate", disable=not progress, unit="batch"):
            logits = model(x.to(device)).float()
            hits = _topk_correct(logits, y.to(device), (1, 5))
            correct = [a + b for a, b in zip(correct, hits, strict=True)]
            count += y.numel()
    return {"top1": correct[0] / count, "top5": correct[1] / count, "count": count}


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from .vision.data import ImageFolder

    _check_model(args)
    for flag in ("data_dir", "rec_val", "rec_val_idx"):
        path = getattr(args, flag)
        if path and not Path(path).expanduser().exists():
            raise SystemExit(f"--{flag.replace('_', '-')} {path}: no such file or folder")
    meta, model = _meta_and_model(args.model, _tag(args.pretrained))
    if meta.modality != "image":
        raise SystemExit(f"evaluate: {args.model} is a {meta.modality} model; evaluate images")
    transform = meta.transforms()
    if args.rec_val:
        from .vision.recordio import RecordIODataset

        if not args.rec_val_idx:
            raise SystemExit("evaluate: --rec-val needs --rec-val-idx")
        dataset = RecordIODataset(
            args.rec_val, args.rec_val_idx, transform, skip_bad=args.skip_bad_images
        )
    elif args.data_dir:
        dataset = ImageFolder(args.data_dir, transform, skip_bad=args.skip_bad_images)
        labels = getattr(meta, "labels", None)
        classes = getattr(meta, "num_classes", None)
        if classes is not None and len(dataset.classes) != classes:
            raise SystemExit(
                f"evaluate: {args.data_dir} has {len(dataset.classes)} class folders, the model "
                f"{classes} outputs; folder i (sorted names) must be output i"
            )
        named = labels is not None and set(dataset.classes) & set(labels)
        if named and list(dataset.classes) != list(labels):
            raise SystemExit(
                f"evaluate: the class folders of {args.data_dir} are named like the model's "
                "labels but in another order; the sorted folder names must be the labels"
            )
    else:
        raise SystemExit(
            "evaluate: give --data-dir VAL (an ImageFolder) or --rec-val/--rec-val-idx"
        )
    metrics = evaluate_images(
        model, dataset, batch_size=args.batch_size, num_workers=args.num_workers,
        device=args.device, progress=not args.no_progress,
    )  # fmt: skip
    report = {"model": args.model, **metrics}
    if getattr(dataset, "bad_files", None):
        report["skipped_images"] = len(dataset.bad_files)
    if args.json:
        print(json.dumps(report))
    else:
        print(
            f"{args.model}: top-1 {100 * metrics['top1']:.2f} %, top-5 "
            f"{100 * metrics['top5']:.2f} % on {metrics['count']} images "
            f"(top-1 error {1 - metrics['top1']:.4f}, top-5 error {1 - metrics['top5']:.4f})"
        )
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from .artifact import TASKS, is_artifact, load_artifact
    from .pipelines import pipeline
    from .vision.data import BadImageError

    _check_model(args)
    if _tag(args.pretrained) is False and not is_artifact(args.model):
        raise SystemExit(
            f"predict --pretrained {args.pretrained}: {args.model} would predict with random "
            "weights; drop --pretrained, or pass an artifact folder as --model"
        )
    task = args.task
    if task is None and (args.question or args.context):
        task = "question-answering"  # what --question and --context ask for
    if task is None:
        task = load_artifact(args.model).task if is_artifact(args.model) else None
        task = task if task in TASKS and task != "fill-mask" else "image-classification"
    modality = _modality(args)
    if modality is not None and modality != TASKS[task]:
        hint = (" (a BERT fine-tuned on SQuAD: scripts/finetune_squad.py --export-dir DIR)"
                if task == "question-answering" else "")  # fmt: skip
        raise SystemExit(
            f"--model {args.model} reads {modality}; {task} needs a model that reads "
            f"{TASKS[task]}{hint}"
        )
    if task == "question-answering":
        if not (args.question and args.context):
            raise SystemExit("predict: question answering needs --question and --context")
        if args.inputs:
            raise SystemExit("predict: question answering takes --question and --context, "
                             f"not files ({args.inputs[0]})")  # fmt: skip
        context = args.context
        if context.startswith("@"):
            source = Path(context[1:]).expanduser()
            if not source.is_file():
                raise SystemExit(f"--context {context}: no such file")
            context = source.read_text(encoding="utf-8")
    elif task != "image-classification":
        raise SystemExit(f"predict: the command line predicts images and answers; not {task}")
    elif not args.inputs:
        raise SystemExit("predict: give one or more image files")
    missing = [path for path in args.inputs if not Path(path).expanduser().is_file()]
    if missing:
        raise SystemExit(f"predict: no such image file: {missing[0]}")
    options: dict[str, Any] = {"top_k": args.top_k}
    pipe = pipeline(
        task, args.model, pretrained=_tag(args.pretrained), device=args.device, **options
    )
    if task == "question-answering":
        print(json.dumps(pipe(question=args.question, context=context)))
        return 0
    skipped = 0
    for path in args.inputs:
        try:
            predictions = pipe(path)
        except BadImageError as err:
            if not args.skip_bad_images:
                raise
            skipped += 1
            print(f"skipped {str(err).split('; fix or delete')[0]}", file=sys.stderr)
            continue
        print(json.dumps({"input": path, "predictions": predictions}))
    if skipped:
        print(f"skipped {skipped} unreadable image(s) of {len(args.inputs)}", file=sys.stderr)
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from . import export

    meta, model = _meta_and_model(args.model, _tag(args.pretrained))
    options: dict[str, Any] = {}
    if meta.modality == "image":  # the side the weights are evaluated at, unless given
        size = args.image_size or getattr(meta, "input_size", None)
        size = size or meta.preprocessing["input_size"]  # an artifact's
        options["image_size"] = int(size)
    elif args.image_size:
        raise SystemExit(f"export: --image-size is for image models, {args.model} is not one")
    path = export.export_model(model, args.output, format=args.format, **options)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m modelzoo", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--model", required=True, help="a registry name or an artifact folder")
        q.add_argument(
            "--pretrained", default="default",
            help="weights tag of a registry model (false: no pretrained weights)",
        )  # fmt: skip
        q.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
        q.add_argument("--debug", action="store_true", help="show the traceback of an error")

    q = sub.add_parser("predict", help="labels of images, answers to questions", allow_abbrev=False)
    common(q)
    q.add_argument("inputs", nargs="*", help="image files")
    q.add_argument(
        "--task", default=None, choices=["image-classification", "question-answering"],
        help="default: the artifact's task; question-answering with --question",
    )  # fmt: skip
    q.add_argument(
        "--skip-bad-images", action="store_true",
        help="skip unreadable image files (each named on stderr) instead of stopping",
    )  # fmt: skip
    q.add_argument("--top-k", type=int, default=5)
    q.add_argument("--question", default=None)
    q.add_argument("--context", default=None, help="the context text, or @FILE")
    q.set_defaults(run=_cmd_predict)

    q = sub.add_parser("evaluate", help="top-1/top-5 on a validation set", allow_abbrev=False)
    common(q)
    q.add_argument("--data-dir", default=None, help="an ImageFolder: <dir>/<class>/<image>")
    q.add_argument("--rec-val", default=None, help="a RecordIO .rec instead")
    q.add_argument("--rec-val-idx", default=None)
    q.add_argument("--batch-size", type=int, default=64)
    q.add_argument("-j", "--num-workers", type=int, default=0)
    q.add_argument("--skip-bad-images", action="store_true")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.add_argument("--no-progress", action="store_true")
    q.set_defaults(run=_cmd_evaluate)

    q = sub.add_parser("export", help="ONNX, torch.export or TorchScript", allow_abbrev=False)
    common(q)
    q.add_argument("--output", required=True, help="FILE.onnx, FILE.pt2 or FILE.ts")
    q.add_argument(
        "--format", default=None, choices=["onnx", "torch.export", "pt2", "torchscript", "ts"]
    )
    q.add_argument(
        "--image-size", type=int, default=None,
        help="image side of the exported graph (default: the weights' evaluation size)",
    )  # fmt: skip
    q.set_defaults(run=_cmd_export)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a mistake in it raises ``SystemExit("message")`` (see :func:`run`)."""
    args = build_parser().parse_args(argv)
    return int(args.run(args))


def run(argv: Sequence[str] | None = None) -> int:
    """:func:`main` with the error path of ``python -m modelzoo``: a mistake in the command
    (``SystemExit("message")``, an artifact or image that cannot be read, a missing file, a
    failed download) prints ``python -m modelzoo: error: message`` and returns 2; ``--debug``
    prints the traceback first. Anything else is a bug and keeps its traceback."""
    from .artifact import ArtifactError
    from .store import ChecksumError, DownloadError
    from .vision.data import BadImageError, RecordIOError

    given = list(sys.argv[1:] if argv is None else argv)
    expected = (ArtifactError, BadImageError, RecordIOError, DownloadError, ChecksumError,
                FileNotFoundError)  # fmt: skip
    debug = "--debug" in given
    try:
        return main(given)
    except SystemExit as err:
        if err.code is None or isinstance(err.code, int):
            raise  # argparse's exits, its message printed
        message, trace = str(err.code), traceback.format_exc() if debug else ""
    except expected as err:
        message, trace = str(err), traceback.format_exc() if debug else ""
    command = f"python -m modelzoo {given[0]}" if given else "python -m modelzoo"
    message = message.removeprefix(f"{given[0]}: " if given else "")
    print(f"{trace}{command}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(run())
