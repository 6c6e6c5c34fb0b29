"""``python -m modelzoo``: predict, evaluate and export from the command line.

* ``predict --model M IMAGE...`` — top-k labels of images (``--task question-answering
  --question Q --context C`` for a QA artifact); one JSON line per input.
* ``evaluate --model M --data-dir VAL`` — top-1/top-5 of a zoo model or an artifact on an
  ImageFolder (or ``--rec-val F.rec --rec-val-idx F.idx``), GluonCV's
  ``verify_pretrained.py``, with the weights' own evaluation preprocessing.
* ``export --model M --output FILE`` — ONNX / ``torch.export`` / TorchScript
  (:mod:`modelzoo.export`).

``M`` is a registry name (``--pretrained TAG`` picks its weights) or an artifact folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["evaluate_images", "main"]


def _tag(text: str) -> bool | str:
    return True if text in ("", "default", "true") else text


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
    from .pipelines import pipeline

    task = args.task
    if task is None:
        from .artifact import TASKS, is_artifact, load_artifact

        task = load_artifact(args.model).task if is_artifact(args.model) else None
        task = task if task in TASKS and task != "fill-mask" else "image-classification"
    options: dict[str, Any] = {"top_k": args.top_k}
    pipe = pipeline(
        task, args.model, pretrained=_tag(args.pretrained), device=args.device, **options
    )
    if task == "question-answering":
        if not (args.question and args.context):
            raise SystemExit("predict --task question-answering needs --question and --context")
        context = args.context
        if context.startswith("@"):
            context = Path(context[1:]).expanduser().read_text(encoding="utf-8")
        print(json.dumps(pipe(question=args.question, context=context)))
        return 0
    if task != "image-classification":
        raise SystemExit(f"predict: the command line predicts images and answers; not {task}")
    if not args.inputs:
        raise SystemExit("predict: give one or more image files")
    for path in args.inputs:
        print(json.dumps({"input": path, "predictions": pipe(path)}))
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
    p = argparse.ArgumentParser(
        prog="python -m modelzoo", description=__doc__, allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--model", required=True, help="a registry name or an artifact folder")
        q.add_argument("--pretrained", default="default", help="weights tag of a registry model")
        q.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")

    q = sub.add_parser("predict", help="labels of images, answers to questions", allow_abbrev=False)
    common(q)
    q.add_argument("inputs", nargs="*", help="image files")
    q.add_argument("--task", default=None, choices=["image-classification", "question-answering"])
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
    args = build_parser().parse_args(argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
