"""Profiling a zoo model's blocks on this machine (:func:`profile_model`): times, saved
activation bytes, outputs, parameters, the AdamW step and the tensor-parallel shares (the
package docstring, :mod:`trainers.parallel.plan`)."""

from __future__ import annotations

import copy
import itertools
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from modelzoo.family import family_of
from trainers.parallel.pipeline import model_blocks
from trainers.parallel.plan.profile import BlockProfile, Profile


def _split_sizes(layer: nn.Module, family: Any) -> list[int]:
    """The sizes tensor parallelism divides in one of ``family``'s layers: the outputs of
    each column-parallel linear, the inputs of each row-parallel one, the attention heads."""
    sizes = []
    for name, style in family.tp_plan.items():
        linear = layer.get_submodule(name)
        sizes.append(linear.out_features if style == "colwise" else linear.in_features)
    if family.tp_attention is not None:
        sizes.append(layer.get_submodule(family.tp_attention).num_heads)
    return sizes


def _tp_degrees(net: nn.Module, family: Any) -> tuple[int, ...]:
    """The tensor-parallel degrees ``net``'s family can split it at (``(1,)``: none)."""
    layers = family.tensor_parallel_layers(net) if family.tp_plan is not None else []
    if not layers:
        return (1,)
    sizes = _split_sizes(layers[0], family)
    return tuple(d for d in range(1, min(sizes) + 1) if all(s % d == 0 for s in sizes))


def _build(model: str, overrides: Mapping[str, Any]) -> nn.Module:
    """The zoo model ``model`` on the meta device as its training script trains it (its
    family's :meth:`~modelzoo.family.ModelFamily.build_for_planning`: BERTs with the span-QA
    head), with ``overrides`` replacing fields of the family's configuration."""
    import modelzoo

    entry = modelzoo.registry.get_model_entry(model)  # unknown names: a close-match hint
    with torch.device("meta"):
        family = family_of(entry.builder(), f"profiling {model}")
        return family.build_for_planning(entry.builder, dict(overrides), model)


def _materialize(module: nn.Module) -> None:
    """Give a meta module real (CPU) storage and a fresh initialization."""
    if not any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers())):
        return
    module.to_empty(device="cpu")
    with torch.no_grad():
        for sub in module.modules():
            reset = getattr(sub, "reset_parameters", None)
            own = list(sub.parameters(recurse=False)) + list(sub.buffers(recurse=False))
            if callable(reset) and own:
                reset()
        for p in itertools.chain(module.parameters(), module.buffers()):
            if p.is_floating_point() and not torch.isfinite(p).all():
                p.normal_(0.0, 0.02)


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


def _saved_bytes(run: Callable[[], Any], exclude: set[int]) -> tuple[int, Any]:
    """Bytes autograd saves for the backward while ``run()`` runs (each storage once; storages
    in ``exclude``, the parameters', left out) and ``run()``'s result."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in exclude:
            seen[ptr] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def _tp_layer(block: nn.Module, family: Any) -> str | None:
    """The path in ``block`` of the tensor-parallel layer of ``family`` it holds, if any."""
    if family.tp_plan is None:
        return None
    return next((n for n, m in block.named_modules() if family.is_tensor_parallel_layer(m)), None)


def _local_block(block: nn.Module, path: str, family: Any, degree: int) -> nn.Module:
    """A copy of ``block`` whose tensor-parallel layer at ``path`` has one rank's shapes at
    ``degree``: the column-parallel linears' outputs, the row-parallel linears' inputs and
    the attention heads divided by ``degree`` (the weights are fresh; only shapes matter)."""
    local = copy.deepcopy(block)
    layer = local.get_submodule(path)
    for name, style in family.tp_plan.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = layer.get_submodule(parent_name)
        linear = getattr(parent, leaf)
        bias = linear.bias is not None
        if style == "colwise":
            part = nn.Linear(linear.in_features, linear.out_features // degree, bias=bias)
        else:
            part = nn.Linear(linear.in_features // degree, linear.out_features, bias=bias)
        setattr(parent, leaf, part)
    if family.tp_attention is not None:
        layer.get_submodule(family.tp_attention).num_heads //= degree
    return local


def _sharded_param_bytes(layer: nn.Module, plan: Mapping[str, str]) -> int:
    """Bytes of the parameters tensor parallelism shards in ``layer`` by its family's
    ``plan`` (column-parallel: weight and bias; row-parallel: weight)."""
    total = 0
    for name, style in plan.items():
        linear = layer.get_submodule(name)
        tensors = []
        if style == "colwise":
            tensors = [linear.weight, linear.bias]
        elif style == "rowwise":
            tensors = [linear.weight]
        total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    return total


def _time_block(block: nn.Module, inputs: Sequence[torch.Tensor], repeats: int, warmup: int,
                optimizer: bool) -> dict[str, float]:  # fmt: skip
    """Median forward, backward and AdamW-step seconds of ``block`` on ``inputs``."""
    params = [p for p in block.parameters() if p.requires_grad]
    grads: list[torch.Tensor] | None = None
    forward, backward = [], []
    for r in range(warmup + repeats):
        xs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
        for p in params:
            p.grad = None
        start = time.perf_counter()
        outs = _tensors(block(*xs))
        mid = time.perf_counter()
        diff = [o for o in outs if o.requires_grad]
        if grads is None:
            gen = torch.Generator().manual_seed(0)
            grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in diff]
        torch.autograd.backward(diff, grads)
        end = time.perf_counter()
        if r >= warmup:
            forward.append(mid - start)
            backward.append(end - mid)
    step = copy = 0.0
    if optimizer and params:
        step, copy = _time_update(params, repeats, warmup)
        for p in params:
            p.grad = None
    return {
        "forward_s": statistics.median(forward),
        "backward_s": statistics.median(backward),
        "optimizer_s": step,
        "grad_copy_s": copy,
    }


#: bytes written between timed runs of the memory-bound update to evict the caches. In a step,
#: the forward and backward of the other blocks run between two touches of a block's optimizer
#: state, so its update reads it from memory, not from a warm cache. 64 MiB is more than an AMD
#: EPYC CCX's L3 (32 MiB); on the Intel development VM (an L3 of 260 MiB shared with the host's
#: other tenants) it was enough: the per-block sum then matched the whole model's AdamW step
#: (27.2 ms against 27.1; 21.0 ms without it).
EVICT_BYTES = 64 * 2**20


def _time_update(params: Sequence[torch.Tensor], repeats: int, warmup: int) -> tuple[float, float]:
    """Median seconds, each run after the caches are evicted, of (1) one step of AdamW as the
    trainer builds it (``trainers.optim``'s ``adamw``: torch's default implementation, a loop
    over the tensors on CPU) over ``params`` and (2) the copies data parallelism adds around
    the all-reduce of their gradients: into a flat bucket, the division by the replica count,
    and back (DDP's buckets; a persistent bucket, as DDP keeps)."""
    evict = torch.empty(EVICT_BYTES // 4)
    opt = torch.optim.AdamW(params, lr=1e-8)
    grads = [p.grad for p in params if p.grad is not None]
    bucket = torch.empty(sum(g.numel() for g in grads), dtype=grads[0].dtype) if grads else None
    steps, copies = [], []
    for r in range(warmup + repeats):
        evict.fill_(r)
        start = time.perf_counter()
        opt.step()
        stepped = time.perf_counter() - start
        copied = 0.0
        if bucket is not None:
            evict.fill_(r + 0.5)
            start = time.perf_counter()
            torch.cat([g.reshape(-1) for g in grads], out=bucket)
            bucket.div_(2)  # the mean over (here) two replicas
            offset = 0
            for g in grads:
                g.copy_(bucket[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            copied = time.perf_counter() - start
        if r >= warmup:
            steps.append(stepped)
            copies.append(copied)
    return statistics.median(steps), statistics.median(copies)


def _flops(block: nn.Module, inputs: Sequence[torch.Tensor]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    xs = [t.detach().requires_grad_(t.is_floating_point()) for t in inputs]
    with FlopCounterMode(display=False) as counter:
        outs = [o for o in _tensors(block(*xs)) if o.requires_grad]
        torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
    for p in block.parameters():
        p.grad = None
    return float(counter.get_total_flops())


MAX_TP_RATIO = 100.0  # a sharded layer's time over the whole one's above this: a bad timing


def _fixed_part(t_batch: float, t_fit: float, batch: int, fit: int) -> float:
    """The per-call part of a time measured at ``batch`` and ``fit``: ``t(b) = fixed + slope
    b`` through both points, clipped to ``[0, min(t_fit, t_batch)]``."""
    fixed = (t_fit * batch - t_batch * fit) / (batch - fit)
    return min(max(fixed, 0.0), t_fit, t_batch)


def _first_rows(values: Sequence[torch.Tensor], batch: int, rows: int) -> tuple[torch.Tensor, ...]:
    """``values`` cut to their first ``rows`` samples (tensors whose first dimension is the
    batch; others as they are)."""
    return tuple(t[:rows] if t.dim() and t.shape[0] == batch else t for t in values)


def _sharded_times(block: nn.Module, path: str, family: Any, values: Sequence[torch.Tensor],
                   degrees: Sequence[int], *, batch: int, fit: int, repeats: int,
                   warmup: int, sync: Callable[[], None] | None = None,
                   ) -> dict[str, dict[str, float]] | None:  # fmt: skip
    """Per degree, the forward and backward seconds (and their per-call parts) of ``block``
    with its tensor-parallel layer really sharded (:mod:`._tp_probe`); ``None`` if the probe
    could not run."""
    from trainers.parallel.plan._tp_probe import time_sharded

    fit_values = _first_rows(values, batch, fit) if 1 <= fit < batch else None
    probed = time_sharded(block, path, family.tp_plan, family.tp_attention, values, fit_values,
                          degrees, repeats=repeats, warmup=warmup, sync=sync)  # fmt: skip
    if probed is None:
        return None
    out = {}
    for degree, times in probed.items():
        at = times["batch"]
        entry = {"forward_s": at["forward_s"], "backward_s": at["backward_s"],
                 "forward_fixed_s": 0.0, "backward_fixed_s": 0.0}  # fmt: skip
        if times["fit"] is not None:
            for key in ("forward_s", "backward_s"):
                entry[key.replace("_s", "_fixed_s")] = _fixed_part(
                    at[key], times["fit"][key], batch, fit
                )
        out[degree] = entry
    return out


def _measure(blocks: Sequence[nn.Module], inputs: tuple[torch.Tensor, ...], *, family: Any,
             repeats: int,
             warmup: int, dedupe: bool, full: bool, tp_degree: int,
             time_degrees: Sequence[int] = (), fit: int = 0,
             sync: Callable[[], None] | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Per-block measurements along the chain (``full``: also bytes, FLOPs, the AdamW step;
    for a block around a tensor-parallel layer of ``family`` the sharded bytes at
    ``tp_degree`` and, at each of ``time_degrees``, the times of the block with its layer
    sharded (:mod:`._tp_probe`; ``fit``: the second batch for their per-call parts) and
    their ratio to the whole block's)."""
    results: list[dict[str, float]] = []
    twins: dict[Any, tuple[dict[str, float], tuple[torch.Tensor, ...]]] = {}
    values = inputs
    for block in blocks:
        key = (type(block).__name__, repr(block),
               tuple((tuple(t.shape), t.dtype) for t in values))  # fmt: skip
        if dedupe and key in twins:
            record, outputs = twins[key]
            results.append(dict(record))
            values = outputs
            continue
        was_meta = any(p.is_meta for p in block.parameters())
        _materialize(block)
        block.train()
        if sync is not None:  # every rank times this block at the same time
            sync()
        record = _time_block(block, values, repeats, warmup, optimizer=full)
        if full:
            exclude = {p.untyped_storage().data_ptr() for p in block.parameters()}
            xs = [t.detach().requires_grad_(t.is_floating_point()) for t in values]
            saved, outs = _saved_bytes(lambda xs=xs, block=block: block(*xs), exclude)
            outs = _tensors(outs)
            record["activation_bytes"] = float(saved)
            record["output_bytes"] = float(sum(o.numel() * o.element_size() for o in outs))
            record["flops"] = _flops(block, values)
            path = _tp_layer(block, family)
            if path is not None:
                layer = block.get_submodule(path)
                record["tp_param_bytes"] = float(_sharded_param_bytes(layer, family.tp_plan))
                record["tp_allreduce_bytes"] = float(outs[0].numel() * outs[0].element_size())
                record["tp_activation_bytes"] = 0.0
                if tp_degree > 1:
                    local = _local_block(block, path, family, tp_degree)
                    lex = {p.untyped_storage().data_ptr() for p in local.parameters()}
                    xs = [t.detach().requires_grad_(t.is_floating_point()) for t in values]
                    part, _ = _saved_bytes(lambda xs=xs, local=local: local(*xs), lex)
                    # saved = replicated + sharded / t, at t = 1 and t = tp_degree
                    sharded = (saved - part) * tp_degree / (tp_degree - 1)
                    record["tp_activation_bytes"] = float(min(max(sharded, 0.0), saved))
                whole = record["forward_s"] + record["backward_s"]
                batch = values[0].shape[0] if values and values[0].dim() else 1
                sharded = (
                    _sharded_times(
                        block,
                        path,
                        family,
                        values,
                        time_degrees,
                        batch=batch,
                        fit=fit,
                        repeats=repeats,
                        warmup=warmup,
                        sync=sync,
                    )  # fmt: skip
                    if time_degrees
                    else None
                )
                ratios = {}
                for degree in time_degrees:
                    if sharded is not None:
                        part = sharded[str(degree)]
                    else:  # no fake process group in this torch: the cut copy's time
                        part = _time_block(_local_block(block, path, family, degree), values,
                                           repeats, warmup, optimizer=False)  # fmt: skip
                    ratio = (part["forward_s"] + part["backward_s"]) / whole if whole > 0 else 0
                    # the cut copy's share above 2: too noisy to use; the sharded layer's may
                    # well be (DTensor's per-operation cost dominates a small layer)
                    if 0 < ratio <= (MAX_TP_RATIO if sharded is not None else 2):
                        ratios[str(degree)] = ratio
                record["tp_time_ratio"] = ratios
                record["tp_times"] = {d: t for d, t in (sharded or {}).items() if d in ratios}
        with torch.no_grad():
            outputs = tuple(t.detach() for t in _tensors(block(*values)))
        for p in block.parameters():
            p.grad = None
        if was_meta:
            block.to("meta")
        twins[key] = (record, outputs)
        results.append(dict(record))
        values = outputs
    return results


def profile_model(
    model: str | nn.Module,
    *,
    seq_len: int | None = None,
    image_size: int | None = None,
    batch: int = 4,
    fit_batch: int | None = None,
    repeats: int = 5,
    warmup: int = 2,
    overrides: Mapping[str, Any] | None = None,
    dedupe: bool = True,
    name: str | None = None,
    larger_batches: Sequence[int] = (),
    sync: Callable[[], None] | None = None,
) -> Profile:
    """Measure every block of a zoo model on this machine (see the module docstring).

    Args:
        model: a zoo name (``modelzoo.get_model``; BERTs get the span-QA head) or a model
            :func:`~trainers.parallel.pipeline.model_blocks` cuts.
        seq_len: BERT's sequence length; ``image_size``: ResNeSt's input size.
        batch: the profiling micro-batch ``b0``.
        fit_batch: a second, smaller batch to fit the fixed per-call time (default 2 when
            ``batch > 2``, the least ResNeSt's BatchNorm trains on; ``batch`` itself or 0: no
            fixed part, time linear in the batch).
        repeats: timed runs per block (the median is kept), after ``warmup`` runs.
        overrides: ``BertConfig`` fields replacing the named BERT's (a larger BERT).
        dedupe: measure structurally identical blocks with equally shaped inputs once.
        name: the model's name in the profile (default: ``model`` or its class name).
        larger_batches: micro-batches above ``batch`` to time the forward and backward at too
            (``BlockProfile.batch_times``): the planner then interpolates between the measured
            batches above ``batch`` instead of extrapolating the line through ``fit_batch``
            and ``batch`` (the time per sample grows with the batch once the activations
            leave the caches; measured on a small BERT: -9 % at 2x and -11 % at 4x the
            profile's batch by the line).
        sync: when the ranks of a job profile at once (so that each sees the processes per
            core of the run), a barrier of theirs, e.g. ``torch.distributed.barrier``: called
            at the same points on every rank, before each block is timed and around each
            tensor-parallel probe process (:mod:`._tp_probe`), so that no rank times while
            another starts a process. Every rank must profile the same model and options.

    Zoo models are built on the meta device and each measured block gets real storage only
    while it runs, so profiling a model larger than this machine's memory works when its
    largest block fits.
    """
    if batch < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"profiling needs batch >= 1, repeats >= 1, warmup >= 0; got "
                         f"{batch}, {repeats}, {warmup}")  # fmt: skip
    larger = sorted(set(larger_batches))
    if any(b <= batch for b in larger):
        raise ValueError(f"larger_batches {list(larger_batches)} must all be above the "
                         f"profiling batch {batch}")  # fmt: skip
    overrides = dict(overrides or {})
    if isinstance(model, str):
        label = name or model
        net = _build(model, overrides)
    else:
        if overrides:
            raise ValueError("overrides apply to a zoo model name, not to a built model")
        label, net = name or type(model).__name__, model
    try:
        blocks = model_blocks(net)
    except TypeError as exc:
        raise ValueError(f"profiling {label}: {exc}") from None
    family = family_of(net, f"profiling {label}")
    degrees = _tp_degrees(net, family)
    tp_degree = next((d for d in degrees if d > 1), 1)
    fit = (2 if batch > 2 else 0) if fit_batch is None else fit_batch

    def inputs_of(size: int) -> tuple[torch.Tensor, ...]:
        return family.profile_inputs(net, size, seq_len=seq_len, image_size=image_size,
                                     generator=torch.Generator().manual_seed(0),
                                     owner=f"profiling {label}")  # fmt: skip

    inputs = inputs_of(batch)
    common = dict(family=family, repeats=repeats, warmup=warmup, dedupe=dedupe, sync=sync)
    measured = _measure(blocks, inputs, full=True, tp_degree=tp_degree,
                        time_degrees=[d for d in degrees if d > 1], fit=fit, **common)  # fmt: skip
    small = None
    if 1 <= fit < batch:
        small = _measure(blocks, inputs_of(fit), full=False, tp_degree=1, **common)
    at_larger = {
        m: _measure(blocks, inputs_of(m), full=False, tp_degree=1, **common) for m in larger
    }
    names = family.pipeline_block_names(net, len(blocks))
    records = []
    for k, (block, rec) in enumerate(zip(blocks, measured, strict=True)):
        fixed_f = fixed_b = 0.0
        if small is not None:
            for key in ("forward_s", "backward_s"):
                # t(b) = fixed + slope b through (fit, t_fit) and (batch, t_batch)
                fixed = _fixed_part(rec[key], small[k][key], batch, fit)
                if key == "forward_s":
                    fixed_f = fixed
                else:
                    fixed_b = fixed
        tp_block = "tp_param_bytes" in rec and tp_degree > 1
        records.append(
            BlockProfile(
                name=names[k],
                forward_s=rec["forward_s"],
                backward_s=rec["backward_s"],
                forward_fixed_s=fixed_f,
                backward_fixed_s=fixed_b,
                optimizer_s=rec["optimizer_s"],
                grad_copy_s=rec["grad_copy_s"],
                activation_bytes=rec["activation_bytes"],
                output_bytes=rec["output_bytes"],
                param_bytes=float(sum(p.numel() * p.element_size() for p in block.parameters())),
                tensor_parallel=tp_block,
                tp_param_bytes=rec.get("tp_param_bytes", 0.0) if tp_block else 0.0,
                tp_activation_bytes=rec.get("tp_activation_bytes", 0.0) if tp_block else 0.0,
                tp_allreduce_bytes=rec.get("tp_allreduce_bytes", 0.0) if tp_block else 0.0,
                flops=rec["flops"],
                tp_time_ratio=rec.get("tp_time_ratio", {}) if tp_block else {},
                tp_times=rec.get("tp_times", {}) if tp_block else {},
                batch_times={
                    str(m): {key: times[k][key] for key in ("forward_s", "backward_s")}
                    for m, times in at_larger.items()
                },
            )
        )
    source = {
        "device": "cpu",
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__.split("+")[0],
        "threads": torch.get_num_threads(),
        "batches": [batch] + ([fit] if small is not None else []) + larger,
        "repeats": repeats,
        "warmup": warmup,
        "statistic": "median",
        "dedupe": dedupe,
        "dtype": str(next(iter(net.parameters())).dtype).replace("torch.", ""),
    }
    return Profile(
        model=label,
        batch=batch,
        blocks=tuple(records),
        seq_len=seq_len if family.modality == "text" else None,
        image_size=image_size if family.modality == "image" else None,
        tensor_parallel_degrees=degrees if any(r.tensor_parallel for r in records) else (1,),
        model_config=overrides,
        source=source,
    )
