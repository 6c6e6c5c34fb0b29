"""Pipeline parallelism for the zoo's BERTs and ResNeSts on ``torch.distributed.pipelining``.

A model is cut into a chain of *blocks* whose outputs feed the next block: for BERT the
embeddings, each Transformer layer and the task head (the attention mask travels with the
hidden states); for ResNeSt the stem, each bottleneck and the pooled classifier. Stage ``s``
of ``S`` holds blocks ``boundaries[s]`` to ``boundaries[s + 1] - 1`` and runs on pipeline
rank ``s``; PyTorch's schedules (``ScheduleGPipe``, ``Schedule1F1B``) move the micro-batches'
activations forward and their gradients back between the stages.

A pipeline step over ``M`` micro-batches gives the gradients of the mean of the
micro-batches' losses, the same as ``M`` accumulated micro-steps on the unsplit model
(tested for both schedules). BatchNorm sees one micro-batch at a time, as with accumulation.

Usage (each of ``S`` ranks)::

    pipe = build_pipeline(model, rank=rank, num_stages=S, micro_batches=4,
                          loss_fn=loss, schedule="1f1b")
    losses = pipe.step(inputs, target)   # inputs on the first stage, target on the last
    optimizer.step()                     # over pipe.module.parameters(): this stage's
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "PIPELINE_SCHEDULES",
    "Pipeline",
    "PipelineStageModule",
    "balanced_boundaries",
    "build_pipeline",
    "model_blocks",
]

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


# ---- blocks -------------------------------------------------------------------------------


class _BertEmbed(nn.Module):
    def __init__(self, embeddings: nn.Module) -> None:
        super().__init__()
        self.embeddings = embeddings

    def forward(
        self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embeddings(input_ids, token_type_ids), attention_mask


class _BertBlock(nn.Module):
    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from modelzoo.nlp.bert import _attention_mask

        return self.layer(x, _attention_mask(attention_mask)), attention_mask


class _BertSpanHead(nn.Module):
    """``(B, T, 2)``: start and end logits stacked (``SpanLogits`` is ``unbind(-1)`` of it)."""

    def __init__(self, classifier: nn.Module) -> None:
        super().__init__()
        self.span_classifier = classifier

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.span_classifier(x)


class _BertClassHead(nn.Module):
    def __init__(self, pooler: nn.Module, drop: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.pooler, self.drop, self.classifier = pooler, drop, classifier

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.drop(torch.tanh(self.pooler(x[:, 0]))))


class _ResNeStHead(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.avgpool, self.drop, self.fc = model.avgpool, model.drop, model.fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(self.avgpool(x).flatten(1)))


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The chain of blocks of a zoo model (they share the model's parameters).

    BERT span QA (``BertForQuestionAnswering``): inputs ``(input_ids, token_type_ids,
    attention_mask)``, output ``(B, T, 2)`` start/end logits. Sequence classification: output
    ``(B, classes)``. ResNeSt: input images, output logits.

    Raises:
        TypeError: another model; ``BertForPretraining`` is refused because its masked-LM
            decoder is tied to the word embeddings, which would sit on the first and the
            last stage at once.
    """
    from modelzoo.nlp.bert import (
        BertForPretraining,
        BertForQuestionAnswering,
        BertForSequenceClassification,
    )
    from modelzoo.vision.resnest import ResNeSt

    if isinstance(model, (BertForQuestionAnswering, BertForSequenceClassification)):
        bert = model.bert
        blocks: list[nn.Module] = [_BertEmbed(bert.embeddings)]
        blocks += [_BertBlock(layer) for layer in bert.layers]
        if isinstance(model, BertForQuestionAnswering):
            blocks.append(_BertSpanHead(model.span_classifier))
        else:
            blocks.append(_BertClassHead(bert.pooler, model.drop, model.classifier))
        return blocks
    if isinstance(model, ResNeSt):
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool)
        blocks = [stem]
        for name in ("layer1", "layer2", "layer3", "layer4"):
            blocks += list(getattr(model, name))
        blocks.append(_ResNeStHead(model))
        return blocks
    if isinstance(model, BertForPretraining):
        raise TypeError(
            "pipeline parallelism: BertForPretraining ties its masked-LM decoder to the word "
            "embeddings, which would live on the first and the last stage; it is not split yet"
        )
    raise TypeError(
        f"pipeline parallelism: no block chain for {type(model).__name__}; supported: the "
        "zoo's BertForQuestionAnswering, BertForSequenceClassification and ResNeSt"
    )


def balanced_boundaries(costs: Sequence[float], num_stages: int) -> list[int]:
    """Stage boundaries ``[0, b_1, ..., len(costs)]`` minimising the largest stage's total
    cost (contiguous stages, each at least one block; exact, by dynamic programming)."""
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(
            f"pipeline parallelism: {num_stages} stages for {n} blocks; use 1 to {n} stages"
        )
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: the smallest possible largest stage over the first i blocks in s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], cut[s][i] = value, j
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return bounds[::-1]


def _meta_shapes(
    blocks: Sequence[nn.Module], inputs: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, ...]]:
    """``shapes[i]``: meta tensors shaped like block ``i``'s inputs (``shapes[-1]``: the last
    block's outputs), from a run of one block at a time on the meta device (no compute, no
    change to the real blocks' parameters or buffers)."""
    import copy

    values = tuple(t.detach().to("meta") for t in inputs)
    shapes = [values]
    with torch.enable_grad():  # hidden states then require grad, as in training
        for block in blocks:
            on_meta = copy.deepcopy(block).to("meta")
            out = on_meta(*values)
            values = out if isinstance(out, tuple) else (out,)
            shapes.append(values)
            del on_meta
    return shapes


class PipelineStageModule(nn.Module):
    """Blocks ``start`` to ``end - 1`` of the chain, run one after the other."""

    def __init__(self, blocks: Sequence[nn.Module], start: int, end: int) -> None:
        super().__init__()
        self.start, self.end = start, end
        self.blocks = nn.ModuleList(blocks[start:end])

    def forward(self, *inputs: torch.Tensor) -> Any:
        values: tuple[torch.Tensor, ...] = inputs
        for block in self.blocks:
            out = block(*values)
            values = out if isinstance(out, tuple) else (out,)
        return values[0] if len(values) == 1 else values


class Pipeline:
    """This rank's stage and its schedule; see the module docstring."""

    def __init__(self, module: PipelineStageModule, stage: Any, schedule: Any, num_stages: int):
        self.module, self.stage, self.schedule = module, stage, schedule
        self.num_stages = num_stages

    @property
    def is_first(self) -> bool:
        return self.stage.is_first

    @property
    def is_last(self) -> bool:
        return self.stage.is_last

    def step(self, inputs: Sequence[torch.Tensor] = (), target: Any = None) -> list[torch.Tensor]:
        """One forward and backward of every micro-batch; the gradients accumulate in
        ``module``'s parameters (the mean of the micro-batches' losses). Returns the
        micro-batches' losses on the last stage, ``[]`` elsewhere."""
        losses: list[torch.Tensor] = []
        kwargs: dict[str, Any] = {}
        if self.is_last:
            kwargs = {"target": target, "losses": losses}
        self.schedule.step(*(inputs if self.is_first else ()), **kwargs)
        return losses


def build_pipeline(
    model: nn.Module,
    *,
    rank: int,
    num_stages: int,
    micro_batches: int,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    example_inputs: Sequence[torch.Tensor],
    schedule: str = "1f1b",
    boundaries: Sequence[int] | None = None,
    group: Any = None,
    device: torch.device | str = "cpu",
) -> Pipeline:
    """This rank's stage of ``model`` and its schedule.

    Args:
        model: a zoo model (:func:`model_blocks`), the same weights on every rank.
        rank: this process's stage, ``0 .. num_stages - 1`` (its rank in ``group``).
        num_stages: pipeline stages (the processes of ``group``).
        micro_batches: micro-batches per step; the batch size must divide by it.
        loss_fn: ``loss_fn(output, target)`` of one micro-batch (on the last stage).
        example_inputs: the model's inputs for one micro-batch (shapes and dtypes only: meta
            tensors will do). Every stage's input and output shapes are derived from them by
            running the blocks on the meta device, so PyTorch's schedules skip their own
            shape inference, which runs each stage's forward once on uninitialised tensors
            and would thereby count a batch in, and write NaN into, BatchNorm's running
            statistics.
        schedule: ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"`` (one forward,
            one backward: at most ``num_stages`` micro-batches of activations held).
        boundaries: block index where each stage starts, plus the end (default: balanced by
            parameter count, :func:`balanced_boundaries`).
        group: the process group of the pipeline (default: the world).
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    blocks = model_blocks(model)
    if boundaries is None:
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        boundaries = balanced_boundaries(sizes, num_stages)
    boundaries = list(boundaries)
    if (
        len(boundaries) != num_stages + 1
        or boundaries[0] != 0
        or boundaries[-1] != len(blocks)
        or any(b >= c for b, c in zip(boundaries, boundaries[1:], strict=False))
    ):
        raise ValueError(
            f"pipeline boundaries {boundaries}: expected {num_stages + 1} increasing block "
            f"indices from 0 to {len(blocks)} (the model has {len(blocks)} blocks)"
        )
    start, end = boundaries[rank], boundaries[rank + 1]
    module = PipelineStageModule(blocks, start, end)
    shapes = _meta_shapes(blocks, example_inputs)
    stage = PipelineStage(
        module,
        rank,
        num_stages,
        torch.device(device),
        input_args=shapes[start],
        output_args=shapes[end],
        group=group,
    )
    cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
    return Pipeline(
        module, stage, cls(stage, n_microbatches=micro_batches, loss_fn=loss_fn), num_stages
    )
