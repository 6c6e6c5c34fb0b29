"""Tensor parallelism for the zoo's BERTs on ``torch.distributed.tensor`` (Megatron's layout).

Every Transformer layer is split over the ``tp`` dimension of a device mesh:

- the fused query/key/value projection and the first feed-forward linear are column-parallel
  (each rank computes the heads, or the hidden units, of its slice; no communication forward),
- the attention output and the second feed-forward linear are row-parallel (each rank
  multiplies its slice; one all-reduce sums the partial results),

so a column -> row pair costs one all-reduce forward and one backward (the backward one sums
the input gradient of the column-parallel linear). Attention runs on ``num_heads / tp`` local
heads. The embeddings, LayerNorms, the pooler and the task heads (span QA, masked-LM, NSP,
sequence classification) are replicated: every rank holds them whole, computes them on the
same replicated activations, and so gets the same gradients without communication. The
word-embedding matrix stays whole because the masked-LM head is tied to it (vocab-sharding it
would need a vocab-parallel cross entropy); for the zoo's models it is under a quarter of the
parameters.

The fused ``qkv`` weight is stored ``[q; k; v]`` (each ``C`` rows, head-major). A contiguous
row shard of that would give rank 0 all of ``q`` and part of ``k``, so before sharding its rows
are regrouped rank-major, ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]`` (``q_r``: rank ``r``'s heads),
and each rank's contiguous shard is then exactly its heads' ``q, k, v``. ``state_dict()``
undoes the regrouping and gathers every sharded tensor, so a tensor-parallel model saves (and
loads) the ordinary unsharded format, the same file a single-process model reads; calling it is
therefore collective over the ``tp`` group, like FSDP's full state dict.

Usage::

    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize_bert(get_model("minilm_l6_h384_uncased"), mesh["tp"])
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

__all__ = [
    "bert_layers",
    "clip_grad_norm_",
    "gather_optimizer_state",
    "shard_optimizer_state_",
    "unsplit_model",
    "is_tensor_parallel",
    "parallelize_bert",
    "qkv_permutation",
    "sharded_parameter_names",
]

from trainers._dtensor import TP_ATTR as _TP_ATTR
from trainers._dtensor import is_tensor_parallel
from trainers.comm.flat import broadcast_


def _family(model: nn.Module) -> Any:
    from modelzoo.family import family_of

    return family_of(model, "tensor parallelism")


def bert_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of a zoo model that tensor parallelism splits, as its family declares them
    (:meth:`modelzoo.family.ModelFamily.tensor_parallel_layers`; a BERT's ``BertLayer``s)."""
    family = _family(model)
    layers = family.tensor_parallel_layers(model)
    if not layers or family.tp_plan is None:
        raise TypeError(
            f"parallelize_bert: {type(model).__name__} holds no layer its family "
            f"({family.name}) splits; tensor parallelism is laid out for the zoo's BERTs "
            "(modelzoo.nlp.bert)"
        )
    return layers


def qkv_permutation(num_heads: int, head_dim: int, tp: int) -> torch.Tensor:
    """Row order that regroups a fused ``[q; k; v]`` projection rank-major.

    ``weight[perm]`` lists, for each rank ``r`` in turn, the rows of ``q``, ``k`` and ``v``
    for heads ``r * num_heads / tp`` to ``(r + 1) * num_heads / tp - 1``. The inverse is
    ``torch.argsort(perm)``.
    """
    if num_heads % tp:
        raise ValueError(
            f"tensor parallelism: {num_heads} attention heads do not divide over "
            f"--tensor-parallel {tp}; use a degree that divides the head count"
        )
    width = num_heads * head_dim
    local = (num_heads // tp) * head_dim
    rows = [
        torch.arange(part * width + r * local, part * width + (r + 1) * local)
        for r in range(tp)
        for part in range(3)
    ]
    return torch.cat(rows)


_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def _linear_styles(plan: dict[str, str]) -> dict[str, Any]:
    """The family's plan (submodule -> ``"colwise"``/``"rowwise"``) as PyTorch's styles."""
    return {name: _STYLES[style]() for name, style in plan.items()}


def _check_divisible(layer: nn.Module, plan: dict[str, str], tp: int) -> None:
    """Every split linear of ``plan`` has a number of features (outputs of a column-parallel
    one, inputs of a row-parallel one) that ``tp`` divides."""
    for name, style in plan.items():
        linear = layer.get_submodule(name)
        size = linear.out_features if style == "colwise" else linear.in_features
        if size % tp:
            side = "output" if style == "colwise" else "input"
            raise ValueError(
                f"tensor parallelism: the {size} {side} features of {name} (the intermediate "
                f"size, for a BERT's fc1/fc2) do not divide over --tensor-parallel {tp}"
            )


def _broadcast_replicated(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every plain (replicated) parameter and buffer equal to the tp group's first
    rank's, so that ranks that initialised differently still hold one model."""
    group = mesh.get_group()
    tensors = [t for t in (*model.parameters(), *model.buffers()) if not isinstance(t, DTensor)]
    broadcast_(tensors, src=dist.get_global_rank(group, 0), group=group)


def parallelize_bert(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Split a zoo BERT's layers over the 1-D mesh ``mesh`` (in place; returns ``model``).

    Args:
        model: ``BertModel``, ``BertForQuestionAnswering``, ``BertForPretraining`` or
            ``BertForSequenceClassification`` with the same weights on every rank of ``mesh``
            (the sharded tensors are scattered from the mesh's first rank, the replicated ones
            broadcast from it).
        mesh: the tensor-parallel mesh (``mesh["tp"]`` of a ``(dp, tp)`` mesh), 1-D.

    Raises:
        ValueError: the head count or the intermediate size does not divide by the degree,
            or the mesh is not 1-D.
        TypeError: ``model`` holds no ``BertLayer``.
    """
    if mesh.ndim != 1:
        raise ValueError(
            f"parallelize_bert: expected the 1-D tensor-parallel mesh (mesh['tp']), got a "
            f"{mesh.ndim}-D mesh {mesh.mesh_dim_names}"
        )
    if getattr(model, _TP_ATTR, None) is not None:
        raise ValueError("parallelize_bert: the model is already tensor-parallel")
    tp = mesh.size()
    layers = bert_layers(model)
    family = _family(model)
    plan, attention = family.tp_plan, family.tp_attention
    for layer in layers:
        attn = layer.get_submodule(attention)
        qkv_permutation(attn.num_heads, attn.head_dim, tp)  # validates the head count
        _check_divisible(layer, plan, tp)
    for layer in layers:
        attn = layer.get_submodule(attention)
        perm = qkv_permutation(attn.num_heads, attn.head_dim, tp)
        with torch.no_grad():
            attn.qkv.weight.copy_(attn.qkv.weight[perm])
            if attn.qkv.bias is not None:
                attn.qkv.bias.copy_(attn.qkv.bias[perm])
        parallelize_module(layer, mesh, _linear_styles(plan))
        attn.num_heads //= tp
        attn._tp_perm = perm  # read by the state-dict hooks and the optimizer-state helpers
    setattr(model, _TP_ATTR, mesh)
    _broadcast_replicated(model, mesh)
    model.register_state_dict_post_hook(_full_state_dict_hook)
    model.register_load_state_dict_pre_hook(_shard_state_dict_hook)
    return model


def unsplit_model(model: nn.Module) -> nn.Module:
    """A plain (single-process) copy of a tensor-parallel BERT with the same weights, for
    saving and exporting; a collective over the tp group (every rank gets the copy). A model
    that is not tensor-parallel is returned as is."""
    if not is_tensor_parallel(model):
        return model
    state = model.state_dict()  # gathers the shards
    with torch.random.fork_rng():  # building a model draws its init; training's RNG is kept
        plain = _family(model).unsplit_copy(model)
    first = next(iter(state.values()))
    plain.to(device=first.device, dtype=first.dtype)
    plain.load_state_dict(state)
    return plain


def sharded_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters split over the tp mesh (the row-parallel biases are DTensors
    too, but replicated: every rank holds them whole)."""
    return [
        n
        for n, p in model.named_parameters()
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)
    ]


def _qkv_keys(model: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, module in model.named_modules():
        perm = getattr(module, "_tp_perm", None)
        if perm is None:
            continue
        for leaf in ("weight", "bias"):
            yield f"{prefix}{name}.qkv.{leaf}", perm


def _full_state_dict_hook(
    model: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """``state_dict()`` -> the unsharded format: gather DTensors, undo the qkv regrouping."""
    for key, value in list(state_dict.items()):
        if isinstance(value, DTensor):
            state_dict[key] = value.full_tensor().detach()
    for key, perm in _qkv_keys(model, prefix):
        if key in state_dict:
            state_dict[key] = state_dict[key][torch.argsort(perm)]


def _shard_state_dict_hook(
    model: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """``load_state_dict(unsharded)``: regroup qkv, keep each rank's shard of split tensors."""
    perms = dict(_qkv_keys(model, prefix))
    params = dict(model.named_parameters(prefix=prefix.rstrip(".") if prefix else ""))
    for key, value in list(state_dict.items()):
        target = params.get(key)
        if not isinstance(target, DTensor) or isinstance(value, DTensor):
            continue
        if key in perms:
            value = value[perms[key]]
        if value.shape != target.shape:
            raise ValueError(
                f"load_state_dict: {key} has shape {tuple(value.shape)}, the model's "
                f"(unsharded) {tuple(target.shape)}"
            )
        state_dict[key] = distribute_tensor(
            value.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )


# ---- the trainer's side: clipping and optimizer state with sharded parameters -------------


def _shard_group(param: torch.Tensor) -> tuple[int, Any, int, int] | None:
    """``(dim, group, index, parts)`` of a tp-sharded DTensor; None for anything else."""
    if not isinstance(param, DTensor):
        return None
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Shard):
            mesh = param.device_mesh
            return (
                placement.dim,
                mesh.get_group(mesh_dim),
                mesh.get_local_rank(mesh_dim),
                mesh.size(mesh_dim),
            )
    return None


def clip_grad_norm_(parameters: Any, max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models with tensor-parallel parameters.

    The norm is the norm of the whole model's gradient: the squared norms of sharded
    gradients are summed over their shards (one all-reduce per process group), replicated
    ones counted once. Then every gradient is scaled by ``min(1, max_norm / (norm + 1e-6))``,
    torch's rule. Without DTensor gradients it is torch's function.
    """
    params = [p for p in parameters if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    locals_ = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    dtype = locals_[0].dtype
    whole = torch.zeros((), dtype=dtype)
    per_group: dict[Any, torch.Tensor] = {}
    for p, g in zip(params, locals_, strict=True):
        square = torch.linalg.vector_norm(g).to(dtype).square()
        info = _shard_group(p)
        if info is None:
            whole = whole + square
        else:
            group = info[1]
            per_group[group] = per_group.get(group, torch.zeros((), dtype=dtype)) + square
    for group, square in per_group.items():
        dist.all_reduce(square, group=group)
        whole = whole + square
    total = whole.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    torch._foreach_mul_(locals_, coef)
    return total


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _row_orders(model: nn.Module) -> dict[int, torch.Tensor]:
    """``id(parameter) -> row permutation`` of the regrouped qkv parameters. Kept on the
    attention modules, not on the parameters: ``Module.to()`` swaps a DTensor parameter's
    contents (``torch.utils.swap_tensors``), which drops attributes set on it."""
    orders = {}
    for module in model.modules():
        perm = getattr(module, "_tp_perm", None)
        if perm is None:
            continue
        for tensor in (module.qkv.weight, module.qkv.bias):
            if tensor is not None:
                orders[id(tensor)] = perm
    return orders


def gather_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every state tensor of a DTensor parameter (moments,
    master copies) whole and plain, and the qkv rows put back in ``[q; k; v]`` order: the
    state dict of the unsplit model's optimizer. Two kinds of state are gathered: the
    layer-wise optimizers' (LAMB, LANS), plain tensors of the local shard's shape, and
    torch's optimizers' (AdamW, SGD), DTensors laid out like their parameter. A collective
    over each tp group; ``state_dict`` is not modified (it holds the live state), a new one is
    returned."""
    state = dict(state_dict["state"])
    orders = _row_orders(model)
    for index, param in enumerate(_optimizer_params(optimizer)):
        if not isinstance(param, DTensor) or index not in state:
            continue
        info = _shard_group(param)
        local_shape = param.to_local().shape
        entry = dict(state[index])
        for key, value in entry.items():
            if isinstance(value, DTensor):
                whole = value.full_tensor().detach()  # no communication when replicated
            elif info is None or not torch.is_tensor(value) or value.shape != local_shape:
                continue  # also 0-d values (a step count): never a shard's shape
            else:
                dim, group, _, parts = info
                pieces = [torch.empty_like(value) for _ in range(parts)]
                dist.all_gather(pieces, value.contiguous(), group=group)
                whole = torch.cat(pieces, dim=dim)
            rows = orders.get(id(param))
            if rows is not None and whole.shape == param.shape:
                whole = whole[torch.argsort(rows)]
            entry[key] = whole
        state[index] = entry
    return {**state_dict, "state": state}


def shard_optimizer_state_(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer.load_state_dict(unsplit)``: lay every state tensor that has its
    DTensor parameter's whole shape out like the parameter (the inverse of
    :func:`gather_optimizer_state`; no communication): each rank's shard as a plain tensor
    for the layer-wise optimizers (``state_on_local_shards``), a DTensor with the
    parameter's placements for torch's optimizers."""
    orders = _row_orders(model)
    local_state = getattr(optimizer, "state_on_local_shards", False)
    for param in _optimizer_params(optimizer):
        if not isinstance(param, DTensor) or param not in optimizer.state:
            continue
        info = _shard_group(param)
        entry = optimizer.state[param]
        for key, value in list(entry.items()):
            if isinstance(value, DTensor) or not torch.is_tensor(value) or value.dim() == 0:
                continue
            if value.shape != param.shape:
                continue
            rows = orders.get(id(param))
            if rows is not None:
                value = value[rows]
            if info is not None:
                dim, _, index, parts = info
                value = value.chunk(parts, dim=dim)[index]
            value = value.contiguous()
            if not local_state:
                value = DTensor.from_local(
                    value, param.device_mesh, param.placements, run_check=False
                )
            entry[key] = value
