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

from trainers._dtensor import local_tensor

__all__ = [
    "PIPELINE_SCHEDULES",
    "Pipeline",
    "PipelineStageModule",
    "PipelinedModel",
    "balanced_boundaries",
    "build_pipeline",
    "check_boundaries",
    "model_blocks",
]

PIPELINE_SCHEDULES = ("gpipe", "1f1b")


# ---- blocks -------------------------------------------------------------------------------


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The chain of blocks of a zoo model (they share the model's parameters), as its family
    declares them (:meth:`modelzoo.family.ModelFamily.pipeline_blocks`).

    BERT span QA (``BertForQuestionAnswering``): inputs ``(input_ids, token_type_ids,
    attention_mask)``, output ``(B, T, 2)`` start/end logits. Sequence classification: output
    ``(B, classes)``. Pretraining (``BertForPretraining``): inputs ``(input_ids,
    token_type_ids, attention_mask, masked_positions)``, output ``(mlm_logits, nsp_logits)``;
    its masked-LM decoder is the word embedding matrix, so the first and the last block
    share that parameter (:class:`PipelinedModel` sums its two gradients). ResNet-shaped
    image models (ResNeSt, ResNet v1b/v1d): input images, output logits.

    Raises:
        TypeError: a model of no family, or of one without a block chain.
    """
    from modelzoo.family import family_of

    return family_of(model, "pipeline parallelism").pipeline_blocks(model)


def _min_max_boundaries(
    num_blocks: int, num_stages: int, stage_cost: Callable[[int, int, int], float]
) -> tuple[float, list[int]]:
    """Contiguous stage boundaries ``[0, b_1, ..., num_blocks]`` (each stage at least one
    block) minimising the largest ``stage_cost(s, i, j)`` of stage ``s`` = blocks ``i .. j-1``,
    and that largest cost (exact, by dynamic programming). Shared by
    :func:`balanced_boundaries` and the planner's least-memory split."""
    n = num_blocks
    inf = float("inf")
    # best[s][j]: the smallest possible largest stage over the first j blocks in s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                value = max(best[s - 1][i], stage_cost(s - 1, i, j))
                if value < best[s][j]:
                    best[s][j], cut[s][j] = value, i
    bounds = [n]
    for s in range(num_stages, 0, -1):
        bounds.append(cut[s][bounds[-1]])
    return best[num_stages][n], bounds[::-1]


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
    return _min_max_boundaries(n, num_stages, lambda s, i, j: prefix[j] - prefix[i])[1]


def check_boundaries(
    blocks: Sequence[nn.Module], num_stages: int, boundaries: Sequence[int] | None
) -> list[int]:
    """``boundaries`` checked against the chain (default: balanced by parameter count)."""
    if boundaries is None:
        sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
        return balanced_boundaries(sizes, num_stages)
    bounds = [int(b) for b in boundaries]
    if (
        len(bounds) != num_stages + 1
        or bounds[0] != 0
        or bounds[-1] != len(blocks)
        or any(b >= c for b, c in zip(bounds, bounds[1:], strict=False))
    ):
        raise ValueError(
            f"pipeline boundaries {bounds}: expected {num_stages + 1} increasing block "
            f"indices from 0 to {len(blocks)} (the model has {len(blocks)} blocks)"
        )
    return bounds


def _meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no copy of
    their data is ever made)."""
    import copy

    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _meta_shapes(
    blocks: Sequence[nn.Module], inputs: Sequence[torch.Tensor], *, on_meta: bool = False
) -> list[tuple[torch.Tensor, ...]]:
    """``shapes[i]``: meta tensors shaped like block ``i``'s inputs (``shapes[-1]``: the last
    block's outputs), from a run of one block at a time on the meta device (no compute, no
    change to the real blocks' parameters or buffers). ``on_meta``: ``blocks`` are meta
    copies already (:func:`_meta_copy`)."""
    values = tuple(t.detach().to("meta") for t in inputs)
    shapes = [values]
    with torch.enable_grad():  # hidden states then require grad, as in training
        for block in blocks:
            meta_block = block if on_meta else _meta_copy(block)
            out = meta_block(*values)
            values = out if isinstance(out, tuple) else (out,)
            shapes.append(values)
            del meta_block
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
    tensor_mesh: Any = None,
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
        tensor_mesh: a 1-D tensor-parallel mesh (``mesh["tp"]`` of a ``(dp, pp, tp)`` mesh):
            the model's Transformer layers are also split over it
            (:func:`~trainers.parallel.tensor.parallelize_bert`), so each stage runs on
            ``tp`` ranks; ``group`` then holds the ranks of one tensor-parallel index, one
            per stage.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}")
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
    blocks = model_blocks(model)
    boundaries = check_boundaries(blocks, num_stages, boundaries)
    start, end = boundaries[rank], boundaries[rank + 1]
    shapes = _meta_shapes(blocks, example_inputs)  # of the unsplit blocks: see _split_layers
    _split_layers(model, tensor_mesh)
    module = PipelineStageModule(blocks, start, end)
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


def _split_layers(model: nn.Module, tensor_mesh: Any) -> None:
    """Tensor parallelism inside the stages: ``parallelize_bert(model, tensor_mesh)``. The
    stages' input and output shapes are taken from the unsplit blocks before this: a split
    layer's inputs and outputs are the whole hidden states (replicated over the tp ranks),
    so the shapes are the same, and the meta-device run never sees a DTensor."""
    if tensor_mesh is None:
        return
    from .tensor import parallelize_bert

    parallelize_bert(model, tensor_mesh)


# ---- the Trainer's pipeline-parallel model ----------------------------------------------------


def _output_wrapper(model: nn.Module) -> Callable[[Any], Any]:
    """Turns the last block's output back into ``model``'s own output type."""
    from modelzoo.family import family_of

    return family_of(model, "pipeline parallelism").pipeline_output(model)


def _tied_parameters(
    blocks: Sequence[nn.Module], boundaries: Sequence[int]
) -> list[tuple[nn.Parameter, list[int]]]:
    """The parameters that blocks of more than one stage share, with those stages (in the
    order of the blocks: the same list on every rank)."""
    stages: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for s in range(len(boundaries) - 1):
        for block in blocks[boundaries[s] : boundaries[s + 1]]:
            for p in block.parameters():
                holders = stages.setdefault(id(p), [])
                if s not in holders:
                    holders.append(s)
                params[id(p)] = p
    return [(params[k], v) for k, v in stages.items() if len(v) > 1]


class _Replay(nn.Module):
    """Stands in for the model inside ``train_step``: returns the pipeline's output of the
    micro-batch, whatever the inputs."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output


def _take(batch: Any, index: torch.Tensor, rows: int) -> Any:
    """The rows ``index`` of a collated batch of ``rows`` samples: tensors by their first
    dimension; dicts, tuples and lists of tensors (collated columns) element by element; a
    list of ``rows`` other values (one per sample) by position; other leaves as they are."""
    if isinstance(batch, torch.Tensor):
        return batch[index.to(batch.device)] if batch.dim() and len(batch) == rows else batch
    if isinstance(batch, dict):
        return {k: _take(v, index, rows) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        columns = any(isinstance(v, (torch.Tensor, dict, list, tuple)) for v in batch)
        if columns:
            taken = [_take(v, index, rows) for v in batch]
            return type(batch)(taken) if not hasattr(batch, "_fields") else type(batch)(*taken)
        if isinstance(batch, list) and len(batch) == rows:
            return [batch[i] for i in index.tolist()]
    return batch


class PipelinedModel(nn.Module):
    """A zoo model as pipeline stages over a process group: what the shared
    :class:`~trainers.Trainer` trains with ``--pipeline-parallel N``.

    Each of the group's ``N`` ranks trains the blocks of its stage (the module's
    ``parameters()`` are that stage's: build the optimizer on this module). A training step
    (:meth:`train_step`, which the Trainer calls instead of ``train_step(model, batch)`` plus
    a backward) splits the batch into ``micro_batches`` and runs PyTorch's schedule over them;
    the script's own ``train_step`` is reused as the schedule's loss function, with the model
    replaced by the pipeline's output of the micro-batch. Loss and metrics come from the last
    stage and are broadcast to the group.

    Every rank keeps the whole model (the stages share its parameters):
    :meth:`synchronize` copies each stage's parameters and buffers from its rank to all, after
    which ``forward`` (evaluation: the whole model, locally), ``state_dict`` (the ordinary
    unsplit format) and export see the trained model. The memory of the *training* state
    (gradients, optimizer state, activations) is the stage's; the weights of the other stages
    are the price of exact, shape-free evaluation and checkpoints.

    Args:
        model: a zoo model (:func:`model_blocks`), the same weights on every rank.
        group: the pipeline's process group (its ranks are the stages, in order).
        micro_batches: micro-batches per training step (the batch must divide by it).
        inputs_of: ``batch -> tuple of tensors``, the model's positional inputs from a
            collated batch (no ``None``: e.g. an all-ones attention mask).
        schedule: ``"1f1b"`` or ``"gpipe"``.
        boundaries: the blocks' stage boundaries (default: balanced by parameter count).
        device: where the stage computes.
        tensor_mesh: with tensor parallelism inside the stages, the 1-D tp mesh
            (``mesh["tp"]`` of a ``(dp, pp, tp)`` mesh); ``group`` is then the ``pp`` group
            of this rank's tensor-parallel index. ``model``'s Transformer layers are split
            over it (:func:`~trainers.parallel.tensor.parallelize_bert`; BERTs only): the
            stage's ``tp`` ranks run its schedule together, each on its shards.

    With ``tensor_mesh``, everything that crosses stages stays per tensor-parallel index: the
    activations a stage sends are the whole (replicated) hidden states, the clip norm adds the
    sharded gradients' squares over the tp group before the stages', :meth:`synchronize`
    broadcasts each rank's local shards to the same shard index of the other stages, and the
    checkpoint's model and optimizer state are gathered into the unsplit format.

    The micro-batches' shapes may change from step to step (e.g. padding to the longest
    sequence of the batch): a stage and schedule are built per shape, the same on every rank,
    since every rank of a pipeline sees the same batch.
    """

    is_pipeline_stage = True

    def __init__(
        self,
        model: nn.Module,
        *,
        group: Any,
        micro_batches: int,
        inputs_of: Callable[[Any], Sequence[torch.Tensor]],
        schedule: str = "1f1b",
        boundaries: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        tensor_mesh: Any = None,
    ) -> None:
        import torch.distributed as dist

        super().__init__()
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(
                f"pipeline schedule must be one of {PIPELINE_SCHEDULES}, got {schedule!r}"
            )
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        self.group = group
        self.num_stages = dist.get_world_size(group)
        self.stage_index = dist.get_rank(group)
        self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.num_stages)]
        self.micro_batches = micro_batches
        self.schedule_name = schedule
        self.inputs_of = inputs_of
        self.device = torch.device(device)
        model.to(self.device)
        blocks = model_blocks(model)
        self.boundaries = check_boundaries(blocks, self.num_stages, boundaries)
        start, end = self.boundaries[self.stage_index], self.boundaries[self.stage_index + 1]
        self.tensor_mesh = tensor_mesh
        # The shapes' meta copies are of the unsplit blocks (see _split_layers).
        meta = None if tensor_mesh is None else [_meta_copy(b) for b in blocks]
        _split_layers(model, tensor_mesh)
        self.stage = PipelineStageModule(blocks, start, end)
        # Not submodules: parameters() and the optimizer see this stage only.
        self.__dict__["full_model"] = model
        self.__dict__["_blocks"] = blocks
        self.__dict__["_meta_blocks"] = meta
        self._wrap = _output_wrapper(model)
        self.__dict__["_tied"] = _tied_parameters(blocks, self.boundaries)
        self._pipes: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self._step_fn: Any = None

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    # -- training ------------------------------------------------------------------------------
    def _pipeline_for(self, inputs: Sequence[torch.Tensor]) -> Any:
        size = inputs[0].shape[0] // self.micro_batches
        key = tuple((tuple(t.shape[1:]), t.dtype) for t in inputs) + (size,)
        if key not in self._pipes:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            if self._meta_blocks is None:
                self.__dict__["_meta_blocks"] = [_meta_copy(b) for b in self._blocks]
            example = [t[:size] for t in inputs]
            shapes = _meta_shapes(self._meta_blocks, example, on_meta=True)
            start, end = self.stage.start, self.stage.end
            stage = PipelineStage(
                self.stage, self.stage_index, self.num_stages, self.device,
                input_args=shapes[start], output_args=shapes[end], group=self.group,
            )  # fmt: skip
            cls = ScheduleGPipe if self.schedule_name == "gpipe" else Schedule1F1B
            # scale_grads=False: the schedule would divide *every* gradient by M after the
            # step, also what earlier accumulation steps left there; the loss is divided instead
            schedule = cls(
                stage, n_microbatches=self.micro_batches, loss_fn=self._loss, scale_grads=False
            )
            self._pipes[key] = (stage, schedule)
        return self._pipes[key][1]

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        step_fn, batch, scale, records, rows = self._step_fn
        loss, metrics = step_fn(_Replay(self._wrap(output)), _take(batch, index, rows))
        records.append((loss.detach(), metrics))
        return loss * (scale / self.micro_batches)

    def train_step(
        self, step_fn: Callable[[nn.Module, Any], tuple[torch.Tensor, Any]], batch: Any,
        *, scale: float = 1.0,
    ) -> tuple[torch.Tensor, dict[str, Any]]:  # fmt: skip
        """Forward and backward of ``batch`` through the pipeline; the gradients of
        ``scale`` x the mean of the micro-batches' losses accumulate in this stage's
        parameters. Returns the mean loss and the metrics (summed over the micro-batches
        when they have a ``"count"``, else averaged) on every rank of the group."""
        import torch.distributed as dist

        inputs = tuple(self.inputs_of(batch))
        rows = int(inputs[0].shape[0])
        if rows % self.micro_batches:
            raise ValueError(
                f"pipeline parallelism: a batch of {rows} does not split into "
                f"{self.micro_batches} micro-batches; make --batch-size a multiple of "
                "--micro-batches"
            )
        schedule = self._pipeline_for(inputs)
        records: list[tuple[torch.Tensor, Any]] = []
        self._step_fn = (step_fn, batch, scale, records, rows)
        try:
            target = torch.arange(rows) if self.is_last else None
            args = inputs if self.is_first else ()
            schedule.step(*args, target=target, return_outputs=False)
        finally:
            self._step_fn = None
        payload: list[Any] = [None]
        if self.is_last:
            losses = torch.stack([loss.float() for loss, _ in records])
            names = list(records[0][1]) if records else []
            sums = {
                k: sum(torch.as_tensor(m[k]).detach().double().cpu() for _, m in records)
                for k in names
            }
            if "count" not in sums:
                sums = {k: v / len(records) for k, v in sums.items()}
            payload = [(losses.mean().item(), {k: v.item() if v.dim() == 0 else v
                                                for k, v in sums.items()})]  # fmt: skip
        if self.num_stages > 1:
            dist.broadcast_object_list(payload, src=self.global_ranks[-1], group=self.group)
        loss_value, metrics = payload[0]
        return torch.tensor(loss_value), metrics

    def reduce_tied_gradients(self) -> None:
        """Sum the gradients of the parameters that several stages share (BERT pretraining's
        word embeddings and masked-LM decoder) over those stages: each copy then gets the
        gradient of the whole model and steps alike. One all-reduce per tied parameter over
        the group (the stages without it send zeros); call once per optimizer step, after
        the last backward (the Trainer does)."""
        import torch.distributed as dist

        for p, holders in self._tied:
            mine = self.stage_index in holders
            grad = p.grad if mine and p.grad is not None else None
            buffer = grad if grad is not None else torch.zeros_like(p)
            dist.all_reduce(buffer, group=self.group)
            if mine and grad is None:
                p.grad = buffer

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the norm of every stage's
        gradients together (one all-reduce over the group; a tied parameter counted once,
        on the first stage that holds it). With tensor parallelism, the squares of the
        stage's sharded gradients are summed over the tp group first (one all-reduce), its
        replicated ones counted once."""
        import torch.distributed as dist

        from .tensor import _shard_group

        counted_elsewhere = {id(p) for p, holders in self._tied if holders[0] != self.stage_index}
        params = [p for p in self.stage.parameters() if p.grad is not None]
        with torch.no_grad():
            grads = [local_tensor(p.grad) for p in params]
        square = torch.zeros((), dtype=torch.float64, device=self.device)
        sharded = torch.zeros((), dtype=torch.float64, device=self.device)
        for p, g in zip(params, grads, strict=True):
            if id(p) in counted_elsewhere:
                continue
            if self.tensor_mesh is not None and _shard_group(p) is not None:
                sharded += g.detach().double().pow(2).sum()
            else:
                square += g.detach().double().pow(2).sum()
        if self.tensor_mesh is not None:
            dist.all_reduce(sharded, group=self.tensor_mesh.get_group())
            square += sharded
        if self.num_stages > 1:
            dist.all_reduce(square, group=self.group)
        total = square.sqrt()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.detach().mul_(coef.to(g.dtype))
        return total

    # -- the whole model -----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Every stage's current parameters and buffers on every rank of the group (a
        collective): the whole model is then the trained one everywhere."""
        if self.num_stages == 1:
            return
        from trainers.comm.flat import broadcast_

        for s in range(self.num_stages):
            blocks = self._blocks[self.boundaries[s] : self.boundaries[s + 1]]
            with torch.no_grad():  # a DTensor's own shard: its rank's index on every stage
                tensors = [
                    local_tensor(t).data for b in blocks for t in (*b.parameters(), *b.buffers())
                ]
            broadcast_(tensors, src=self.global_ranks[s], group=self.group)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The whole model, on this rank (evaluation; :meth:`synchronize` first)."""
        if self.training:
            raise RuntimeError(
                "PipelinedModel: training runs through train_step() (the Trainer calls it); "
                "forward() is the whole model for evaluation: call .eval() and synchronize()"
            )
        return self.full_model(*args, **kwargs)

    def train(self, mode: bool = True) -> PipelinedModel:
        super().train(mode)
        self.full_model.train(mode)
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """The whole model's state dict, in its ordinary (unsplit) names: a collective
        (:meth:`synchronize`)."""
        self.synchronize()
        return self.full_model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load an unsplit state dict (every rank loads it all; its stage trains on)."""
        return self.full_model.load_state_dict(state_dict, strict=strict, assign=assign)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Every stage's optimizer state (a collective over the group): what a checkpoint
        keeps, with the boundaries it belongs to."""
        import torch.distributed as dist

        own_state = optimizer.state_dict()
        if self.tensor_mesh is not None:  # the unsplit optimizer state (collective over tp)
            from .tensor import gather_optimizer_state

            own_state = gather_optimizer_state(self.full_model, optimizer, own_state)
        own = _to_cpu(own_state)
        states: list[Any] = [None] * self.num_stages
        if self.num_stages > 1:
            dist.all_gather_object(states, own, group=self.group)
        else:
            states = [own]
        return {"pipeline_stages": states, "pipeline_boundaries": list(self.boundaries)}

    def load_optimizer_state(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], *, source: str = "state"
    ) -> None:
        """This stage's part of :meth:`optimizer_state`'s result."""
        stages = state.get("pipeline_stages") if isinstance(state, dict) else None
        if stages is None:
            raise ValueError(
                f"{source!r}: its optimizer state is not a pipeline's; resume it with the "
                "--pipeline-parallel it was written with"
            )
        if list(state["pipeline_boundaries"]) != list(self.boundaries):
            raise ValueError(
                f"{source!r} was written by a pipeline with boundaries "
                f"{state['pipeline_boundaries']}, this one has {self.boundaries}: resume "
                "with the same --pipeline-parallel and --pipeline-boundaries"
            )
        optimizer.load_state_dict(stages[self.stage_index])
        if self.tensor_mesh is not None:  # each rank keeps its shards
            from .tensor import shard_optimizer_state_

            shard_optimizer_state_(self.full_model, optimizer)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
