"""Inference pipelines: preprocessing + model + post-processing as one object.

``modelzoo.pipeline(task, model)`` builds one from a registry name (its published weights,
their preprocessing and labels), an artifact folder (a training script's ``--export-dir``) or
a module at hand. The preprocessing is the very one the training scripts' evaluation uses
(:meth:`modelzoo.Weights.transforms`, the SQuAD windowing of
:func:`modelzoo.nlp.squad.make_features` and its post-processing), so predictions here are
the predictions the published metrics were measured on.

>>> classify = pipeline("image-classification", "resnest50")  # doctest: +SKIP
>>> classify("cat.jpg", top_k=2)  # doctest: +SKIP
[{'label': ..., 'index': ..., 'score': ...}, {'label': ..., 'index': ..., 'score': ...}]
>>> qa = pipeline("question-answering", "runs/squad/export")  # doctest: +SKIP
>>> qa(question="Who wrote it?", context="It was written by Ada.")  # doctest: +SKIP
{'answer': ..., 'score': ..., 'start': ..., 'end': ...}
"""

from __future__ import annotations

import io
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "ImageClassificationPipeline",
    "PIPELINES",
    "QuestionAnsweringPipeline",
    "pipeline",
]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
           "float16": torch.float16}  # fmt: skip


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or a torch.dtype, got {dtype!r}")
    return _DTYPES[dtype]


def _device(device: torch.device | str | int | None, model: nn.Module) -> torch.device:
    if device is None:
        param = next(iter(model.parameters()), None)
        return param.device if param is not None else torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device) if device >= 0 else torch.device("cpu")
    return torch.device(device)


def _positive(owner: str, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")


class _Pipeline:
    """The shared part: the model on its device and dtype, in eval mode."""

    task = ""

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | str | None = None,
        batch_size: int = 8,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{type(self).__name__}: model must be a torch.nn.Module")
        _positive(type(self).__name__, batch_size=batch_size)
        self.device = _device(device, model)
        self.dtype = _dtype(dtype)
        self.model = model.to(self.device).eval()
        if self.dtype is not None:
            self.model.to(self.dtype)
        self.batch_size = batch_size

    def _floats(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device)
        return x.to(self.dtype) if self.dtype is not None else x


# ------------------------------------------------------------------------------------------
# image classification
# ------------------------------------------------------------------------------------------
class ImageClassificationPipeline(_Pipeline):
    """Top-k class names and probabilities of images.

    Args:
        model: an image classifier (``(N, 3, H, W) -> (N, classes)`` logits).
        transforms: the evaluation preprocessing, a PIL image -> ``(3, H, W)`` tensor
            (:meth:`modelzoo.Weights.transforms`).
        labels: class names in output order (default: the indices as strings).
        top_k: how many classes to return per image.
        batch_size: images per forward pass.
        device, dtype: where and in which precision the model runs (``"bfloat16"``...).

    Call it on one image or a list: a path (``str``/``Path``), the bytes of an image file,
    a PIL image, or a tensor already preprocessed to ``(3, H, W)``. One image gives a list
    of ``{"label", "index", "score"}`` dicts (best first); a list gives a list of those.
    """

    task = "image-classification"

    def __init__(
        self,
        model: nn.Module,
        *,
        transforms: Callable[[Any], torch.Tensor],
        labels: Sequence[str] | None = None,
        top_k: int = 5,
        batch_size: int = 8,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(model, device=device, dtype=dtype, batch_size=batch_size)
        _positive("ImageClassificationPipeline", top_k=top_k)
        if not callable(transforms):
            raise TypeError("ImageClassificationPipeline: transforms must be callable")
        self.transforms = transforms
        self.labels = tuple(labels) if labels is not None else None
        self.top_k = top_k

    def preprocess(self, image: Any) -> torch.Tensor:
        """One input -> the model's ``(3, H, W)`` tensor, decoded as the evaluation decodes."""
        from PIL import Image

        from .vision.data import BadImageError, _decode_sample

        if isinstance(image, torch.Tensor):
            if image.dim() != 3 or image.shape[0] != 3 or not image.is_floating_point():
                raise ValueError(
                    "image-classification: a tensor input must be an already preprocessed "
                    f"float (3, H, W) image, got {tuple(image.shape)} {image.dtype}; pass a "
                    "PIL image or a path to have the pipeline preprocess it"
                )
            return image
        if isinstance(image, (str, os.PathLike)):
            path = Path(image).expanduser()
            if not path.is_file():
                raise FileNotFoundError(f"image-classification: no image file {path}")
            with path.open("rb") as f:
                return _decode_sample(f, self.transforms, str(path))
        if isinstance(image, (bytes, bytearray)):
            return _decode_sample(io.BytesIO(bytes(image)), self.transforms, "<bytes>")
        if isinstance(image, Image.Image):
            from .vision.transforms import decode_rgb

            try:
                rgb, _, _ = decode_rgb(image)
            except OSError as exc:
                raise BadImageError(f"image-classification: cannot decode image ({exc})") from exc
            return self.transforms(rgb)
        raise TypeError(
            "image-classification: inputs are image paths, image-file bytes, PIL images or "
            f"preprocessed (3, H, W) tensors, got {type(image).__name__}"
        )

    @torch.inference_mode()
    def __call__(self, images: Any, *, top_k: int | None = None) -> Any:
        top_k = self.top_k if top_k is None else top_k
        single = not isinstance(images, (list, tuple))
        items = [images] if single else list(images)
        out: list[list[dict[str, Any]]] = []
        for i in range(0, len(items), self.batch_size):
            batch = torch.stack([self.preprocess(x) for x in items[i : i + self.batch_size]])
            logits = self.model(self._floats(batch)).float()
            out.extend(self._top(logits, top_k))
        return out[0] if single else out

    def _top(self, logits: torch.Tensor, top_k: int) -> list[list[dict[str, Any]]]:
        classes = logits.shape[-1]
        if self.labels is not None and len(self.labels) != classes:
            raise ValueError(
                f"image-classification: {len(self.labels)} labels for a model with {classes} "
                "outputs"
            )
        if top_k > classes:
            raise ValueError(f"image-classification: top_k={top_k} > {classes} classes")
        scores, indices = logits.softmax(-1).topk(top_k, dim=-1)
        return [
            [
                {"label": self._label(int(k)), "index": int(k), "score": float(p)}
                for p, k in zip(row_p, row_k, strict=True)
            ]
            for row_p, row_k in zip(scores, indices, strict=True)
        ]

    def _label(self, index: int) -> str:
        return self.labels[index] if self.labels is not None else str(index)


# ------------------------------------------------------------------------------------------
# question answering
# ------------------------------------------------------------------------------------------
class QuestionAnsweringPipeline(_Pipeline):
    """Extractive question answering, SQuAD style.

    Args:
        model: a BERT with the span head (``head="qa"``), e.g. ``finetune_squad.py``'s.
        tokenizer: its :class:`~modelzoo.nlp.tokenizer.BertTokenizer`.
        max_seq_length, doc_stride, max_query_length: the windowing of long contexts (as in
            training: :func:`~modelzoo.nlp.squad.make_features`).
        max_answer_length, n_best_size: span post-processing
            (:func:`~modelzoo.nlp.squad.postprocess`).
        version_2: SQuAD 2.0: the null answer ``""`` wins when its score beats the best
            span's by more than ``null_score_diff_threshold``.
        top_k: answers per question (``> 1`` returns a list, best first).
        batch_size: windows per forward pass.

    Call it as ``qa(question=..., context=...)``, ``qa({"question": ..., "context": ...})`` or
    on a list of such dicts. Each answer is ``{"answer", "score", "start", "end"}`` with
    ``context[start:end] == answer`` and ``score`` the answer's probability among the
    n best spans (Hugging Face's fields).
    """

    task = "question-answering"

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        *,
        max_seq_length: int = 384,
        doc_stride: int = 128,
        max_query_length: int = 64,
        max_answer_length: int = 30,
        n_best_size: int = 20,
        version_2: bool = False,
        null_score_diff_threshold: float = 0.0,
        top_k: int = 1,
        batch_size: int = 8,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | str | None = None,
    ) -> None:
        super().__init__(model, device=device, dtype=dtype, batch_size=batch_size)
        _positive("QuestionAnsweringPipeline", max_seq_length=max_seq_length,
                  doc_stride=doc_stride, max_query_length=max_query_length,
                  max_answer_length=max_answer_length, n_best_size=n_best_size,
                  top_k=top_k)  # fmt: skip
        if max_seq_length <= max_query_length + 3:
            raise ValueError(
                f"QuestionAnsweringPipeline: max_seq_length ({max_seq_length}) must exceed "
                f"max_query_length ({max_query_length}) + 3"
            )
        self.tokenizer = tokenizer
        self.window = dict(max_seq_length=max_seq_length, doc_stride=doc_stride,
                           max_query_length=max_query_length)  # fmt: skip
        self.post = dict(n_best_size=n_best_size, max_answer_length=max_answer_length,
                         version_2=version_2,
                         null_score_diff_threshold=null_score_diff_threshold)  # fmt: skip
        self.top_k = top_k

    @staticmethod
    def _examples(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> tuple[list[Any], bool]:
        from .nlp.squad import SquadExample

        if kwargs:
            unknown = sorted(set(kwargs) - {"question", "context"})
            if unknown or args:
                raise TypeError(
                    "question-answering: call qa(question=..., context=...) or qa(dict | list "
                    f"of dicts); got unexpected {unknown or 'positional and keyword inputs'}"
                )
            inputs: Any = dict(kwargs)
        elif len(args) == 1:
            inputs = args[0]
        else:
            raise TypeError("question-answering: call qa(question=..., context=...)")
        single = isinstance(inputs, Mapping)
        items = [inputs] if single else list(inputs)
        examples = []
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise TypeError(
                    f"question-answering: input {i} is not a dict with question/context"
                )
            for key in ("question", "context"):
                value = item.get(key)
                if not isinstance(value, str) or not value.strip():
                    raise ValueError(
                        f"question-answering: input {i}: {key!r} must be a non-empty string"
                    )
            examples.append(SquadExample(str(i), item["question"], item["context"], ()))
        return examples, single

    @torch.inference_mode()
    def __call__(self, *args: Any, top_k: int | None = None, **kwargs: Any) -> Any:
        from .nlp.squad import make_features, pad_features, postprocess

        top_k = self.top_k if top_k is None else top_k
        examples, single = self._examples(args, kwargs)
        features = make_features(examples, self.tokenizer, **self.window)
        starts: list[Any] = []
        ends: list[Any] = []
        for i in range(0, len(features), self.batch_size):
            batch = pad_features(features[i : i + self.batch_size], self.tokenizer.pad_id)
            mask = batch["attention_mask"]
            out = self.model(
                batch["input_ids"].to(self.device),
                batch["token_type_ids"].to(self.device),
                mask.to(self.device) if mask is not None else None,
            )
            starts.extend(out.start.float().cpu().numpy())
            ends.extend(out.end.float().cpu().numpy())
        by_example: list[list[int]] = [[] for _ in examples]
        for j, feature in enumerate(features):
            by_example[feature.example_index].append(j)
        answers = []
        for example, rows in zip(examples, by_example, strict=True):
            text, nbest, _ = postprocess(
                example, [features[j] for j in rows], [starts[j] for j in rows],
                [ends[j] for j in rows], **self.post,
            )  # fmt: skip
            ranked = [p for p in nbest if p.start >= 0]
            if self.post["version_2"]:  # the thresholded decision comes first
                ranked.sort(key=lambda p: p.text != text)
            picked = [
                {"answer": p.text, "score": p.probability, "start": p.start, "end": p.end}
                for p in ranked[:top_k]
            ]
            if not picked:  # no window had a valid span (e.g. a context of specials only)
                picked = [{"answer": "", "score": 0.0, "start": 0, "end": 0}]
            answers.append(picked[0] if top_k == 1 else picked)
        return answers[0] if single else answers


# ------------------------------------------------------------------------------------------
# the factory
# ------------------------------------------------------------------------------------------
PIPELINES: dict[str, str] = {
    "image-classification": "modelzoo.pipelines.ImageClassificationPipeline",
    "question-answering": "modelzoo.pipelines.QuestionAnsweringPipeline",
    "node-classification": "modelzoo.graph.inference.NodeClassificationPipeline",
}
_DEFAULT_MODELS = {"image-classification": "resnest50"}


def _source(model: Any, task: str, pretrained: bool | str) -> tuple[nn.Module, Any]:
    """(module, metadata: Weights | Artifact | None) of a name, a folder or a module."""
    from .artifact import TASKS, is_artifact, load_artifact
    from .registry import get_model, get_model_entry, get_weights

    if isinstance(model, nn.Module):
        return model, None
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"pipeline({task!r}): model must be a registry name, an artifact folder or a "
            f"torch.nn.Module, got {type(model).__name__}"
        )
    if is_artifact(model):
        artifact = load_artifact(model)
        if TASKS[artifact.task] != TASKS[task]:
            raise ValueError(
                f"pipeline({task!r}): {model} is a {artifact.task} artifact "
                f"({artifact.model_name}); use pipeline({artifact.task!r}, ...)"
            )
        head = {"head": "qa"} if task == "question-answering" else {}
        if task == "question-answering" and artifact.task != task:
            warnings.warn(
                f"pipeline('question-answering', {str(model)!r}): a {artifact.task} artifact "
                "has no span head; it is freshly initialized and the answers are not "
                "meaningful (fine-tune it: finetune_squad.py --pretrained-bert-parameters DIR)",
                UserWarning,
                stacklevel=3,
            )
        return artifact.build(**head), artifact
    folder = Path(model).expanduser()
    if task == "question-answering" and (folder / "config.json").is_file():
        return _hf_bert_folder(folder)
    if folder.is_dir():
        from .artifact import ArtifactError

        raise ArtifactError(
            f"pipeline({task!r}): {model} is a folder without modelzoo.json; pass an artifact "
            "folder (a training script's --export-dir) or a registry name"
        )
    name = str(model)
    entry = get_model_entry(name)
    if not entry.weights or pretrained is False:
        raise ValueError(
            f"pipeline({task!r}): {entry.name} "
            + ("has no published weights" if not entry.weights else "with pretrained=False")
            + " would predict with random weights; pass an artifact folder or a module with "
            "its labels/transforms"
        )
    weights = get_weights(name, pretrained)
    if task == "question-answering":
        net = get_model(name, pretrained=pretrained, head="qa")
        warnings.warn(
            f"pipeline('question-answering', {name!r}): the published weights have no "
            "fine-tuned span head, so it is freshly initialized and the answers are not "
            "meaningful; fine-tune with scripts/finetune_squad.py --export-dir DIR and pass DIR",
            UserWarning,
            stacklevel=3,
        )
        return net, weights
    return get_model(name, pretrained=pretrained), weights


class _FolderTokenizer:
    """The metadata of a Hugging Face BERT folder: its tokenizer, no labels."""

    labels = None

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def tokenizer(self) -> Any:
        from .nlp.tokenizer import BertTokenizer

        return BertTokenizer.from_dir(self.folder)


def _hf_bert_folder(folder: Path) -> tuple[nn.Module, Any]:
    """A Hugging Face BERT folder (``config.json`` + weights + ``vocab.txt``), e.g. a
    SQuAD-fine-tuned ``BertForQuestionAnswering`` or ``finetune_squad.py``'s output."""
    import json

    from .nlp.bert import bert_from_checkpoint

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if not (folder / "vocab.txt").is_file():
        raise ValueError(f"pipeline('question-answering'): {folder} has no vocab.txt")
    if "BertForQuestionAnswering" not in config.get("architectures", []):
        warnings.warn(
            f"pipeline('question-answering', {str(folder)!r}): config.json's architectures "
            f"{config.get('architectures')} have no BertForQuestionAnswering; the span head "
            "is freshly initialized and the answers are not meaningful",
            UserWarning,
            stacklevel=4,
        )
    return bert_from_checkpoint(folder, head="qa").eval(), _FolderTokenizer(folder)


def pipeline(
    task: str,
    model: str | os.PathLike[str] | nn.Module | None = None,
    *,
    pretrained: bool | str = True,
    labels: Sequence[str] | None = None,
    transforms: Callable[[Any], Any] | None = None,
    tokenizer: Any = None,
    device: torch.device | str | int | None = None,
    dtype: torch.dtype | str | None = None,
    **options: Any,
) -> Any:
    """An inference pipeline for ``task``.

    Args:
        task: ``"image-classification"``, ``"question-answering"`` or
            ``"node-classification"``.
        model: a registry name (with its published weights: ``pretrained`` picks the tag),
            an artifact folder (``--export-dir`` of a training script), for question
            answering also a Hugging Face BERT folder (``BertForQuestionAnswering``'s
            ``save_pretrained``, ``finetune_squad.py --output-dir``), or a module (then give
            ``labels``/``transforms``/``tokenizer``). Default for images: resnest50.
        labels, transforms, tokenizer: override what the weights or the artifact carry.
        device, dtype: where and in which precision to run.
        **options: the task pipeline's options (``top_k``, ``batch_size``, the SQuAD
            windowing, ...): see :class:`ImageClassificationPipeline`,
            :class:`QuestionAnsweringPipeline` and
            :class:`modelzoo.graph.inference.NodeClassificationPipeline`.

    Raises:
        ValueError: an unknown task, a model for another task, a model without weights, or
            a module without the preprocessing its task needs.
    """
    if task not in PIPELINES:
        raise ValueError(f"pipeline: unknown task {task!r}; choose one of {sorted(PIPELINES)}")
    if model is None:
        if task not in _DEFAULT_MODELS:
            raise ValueError(f"pipeline({task!r}): give model= (a registry name or a folder)")
        model = _DEFAULT_MODELS[task]
    net, meta = _source(model, task, pretrained)
    if labels is None and meta is not None:
        labels = meta.labels
    if task == "question-answering":
        if tokenizer is None:
            if meta is None:
                raise ValueError("pipeline('question-answering', module): pass tokenizer=")
            tokenizer = meta.tokenizer()
        from .artifact import Artifact

        if isinstance(meta, Artifact):
            options = {**meta.preprocessing, **options}
        return QuestionAnsweringPipeline(net, tokenizer, device=device, dtype=dtype, **options)
    if transforms is None:
        if meta is None:
            raise ValueError(f"pipeline({task!r}, module): pass transforms= (the preprocessing)")
        transforms = meta.transforms()
    if task == "image-classification":
        return ImageClassificationPipeline(
            net, transforms=transforms, labels=labels, device=device, dtype=dtype, **options
        )
    from .graph.inference import NodeClassificationPipeline

    return NodeClassificationPipeline(
        net, labels=labels, transform=transforms, device=device, dtype=dtype, **options
    )
