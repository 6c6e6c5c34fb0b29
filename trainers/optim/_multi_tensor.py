"""Machinery shared by the layer-wise adaptive optimizers (LAMB, LANS).

Both update every parameter tensor with a per-tensor *trust ratio* ``||w|| / ||u||``. Doing
that without one host synchronisation per tensor means: per-tensor norms (:func:`norms`),
stacked into one vector, the ratios computed with ``torch.where`` on the device, and the
per-tensor coefficients handed back to ``torch._foreach_*`` ops as a list of 0-d tensors.
Nothing in a ``step()`` reads a tensor value on the host. Every elementwise step is an
in-place ``torch._foreach_*`` op on the state or on work buffers (:meth:`_scratch`), so a
step allocates no parameter-sized memory on CPU.

Low-precision parameters (bf16/fp16) get fp32 moments and an fp32 master copy of the weight
(``state["master_param"]``): the update is computed and applied in fp32 and the parameter
is the master rounded to its dtype. A parameter changed from outside the optimizer (a
checkpoint loaded into the model, weight averaging) is picked up again: wherever the
parameter no longer equals the rounded master, the master takes the parameter's value.

Tensor-parallel parameters (``DTensor``s sharded by ``trainers.parallel``) are updated on their
local shards, and every per-tensor norm is the norm of the *whole* tensor: each bucket holds
parameters of one placement, and a sharded bucket sums its shards' squared norms over the
mesh in one all-reduce per norm vector (:meth:`Bucket.norms`). The moments are kept as local
shards. A parameter that is a DTensor but not sharded (``Replicate``) is its local copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import reduce
from itertools import chain
from typing import Any

import torch
import torch.distributed as dist

from .._dtensor import is_dtensor

__all__ = [
    "Bucket",
    "LayerwiseAdaptiveOptimizer",
    "common_defaults",
    "norms",
    "parse_bounds",
    "trust_ratio",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)

Bounds = tuple[float | None, float | None]


def common_defaults(
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    max_grad_norm: float | None,
    trust_clamp: Any,
    weight_norm_clamp: Any,
) -> dict[str, Any]:
    """The validated hyperparameters LAMB and LANS share, as ``defaults`` entries."""
    if lr < 0:
        raise ValueError(f"lr must be >= 0, got {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"betas must be in [0, 1), got {betas}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(
            f"max_grad_norm must be positive, got {max_grad_norm}; pass None to disable"
        )
    return dict(
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        bias_correction=bool(bias_correction),
        max_grad_norm=max_grad_norm,
        trust_clamp=parse_bounds(trust_clamp, "trust_clamp"),
        weight_norm_clamp=parse_bounds(weight_norm_clamp, "weight_norm_clamp"),
    )


def parse_bounds(bounds: Any, name: str) -> Bounds | None:
    """Validate an optional ``(low, high)`` pair; either end may be ``None`` (unbounded)."""
    if bounds is None:
        return None
    try:
        low, high = bounds
    except (TypeError, ValueError):
        raise ValueError(
            f"{name} must be a (low, high) pair, e.g. (0.01, 10.0), got {bounds!r}"
        ) from None
    low = None if low is None else float(low)
    high = None if high is None else float(high)
    if (low is not None and low < 0) or (high is not None and high < 0):
        raise ValueError(f"{name} bounds must be >= 0, got {bounds!r}")
    if low is not None and high is not None and low > high:
        raise ValueError(f"{name}: low {low} is above high {high}; swap them")
    return (low, high)


def trust_ratio(
    weight_norm: torch.Tensor,
    update_norm: torch.Tensor,
    *,
    weight_norm_clamp: Bounds | None = None,
    trust_clamp: Bounds | None = None,
) -> torch.Tensor:
    """Per-tensor trust ratios ``phi(||w||) / ||u||`` on the device, no host synchronisation.

    Args:
        weight_norm: ``(N,)`` norms of the N weight tensors.
        update_norm: ``(N,)`` norms of their updates.
        weight_norm_clamp: MXNet LAMB's ``(lower_bound, upper_bound)``: ``phi`` clamps
            ``||w||`` before the division.
        trust_clamp: DeepSpeed's ``(min_coeff, max_coeff)``: clamps the ratio itself
            (``(0.01, 10)`` in DeepSpeed; timm's ``trust_clip`` is ``(None, 1)``).

    Returns:
        ``(N,)`` ratios; 1 where ``phi(||w||)`` or ``||u||`` is 0 (MXNet checks the clamped
        norm, so with a positive lower bound an all-zero weight still adapts). As in
        DeepSpeed, ``trust_clamp`` bounds only a computed ratio: the fallback 1 is not clamped.
    """
    if weight_norm_clamp is not None:
        weight_norm = weight_norm.clamp(*weight_norm_clamp)
    ok = (weight_norm > 0) & (update_norm > 0)
    ratio = weight_norm / update_norm
    if trust_clamp is not None:
        ratio = ratio.clamp(*trust_clamp)
    return torch.where(ok, ratio, 1.0)


def norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``(N,)`` L2 norms of same-device, same-dtype tensors, without host synchronisation.

    On CPU, contiguous float32 tensors use BLAS dot products (``sqrt(x . x)``), which is
    about 1.5x faster there than ``torch._foreach_norm`` (it accumulates in double); the
    result differs by float32 rounding. Elsewhere ``torch._foreach_norm``.
    """
    first = tensors[0]
    if first.device.type != "cpu" or first.dtype != torch.float32:
        return torch.stack(torch._foreach_norm(tensors))
    squares = []
    for t in tensors:
        if t.is_contiguous():
            flat = t.view(-1)
            squares.append(torch.dot(flat, flat))
        else:
            squares.append(torch.linalg.vector_norm(t).square())
    return torch.stack(squares).sqrt_()


@dataclass
class Bucket:
    """Parameters of one group that share device, compute dtype and step count.

    ``weights``/``grads`` are what the update reads and writes in the compute dtype: the
    parameters and their gradients, or for bf16/fp16 parameters the fp32 master copies and
    fp32 copies of the gradients (``grads_owned``: safe to modify in place).
    """

    step: int
    params: list[torch.Tensor] = field(default_factory=list)
    weights: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    exp_avgs: list[torch.Tensor] = field(default_factory=list)
    exp_avg_sqs: list[torch.Tensor] = field(default_factory=list)
    low_precision: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    grads_owned: bool = False
    group: Any = None  # the process group the tensors are sharded over (None: whole tensors)
    _grad_norms: torch.Tensor | None = None

    def norms(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """``(N,)`` norms of whole tensors: of ``tensors``, or for a sharded bucket of the
        tensors its shards ``tensors`` belong to (one all-reduce over the shards' group)."""
        if self.group is None:
            return norms(tensors)
        squares = norms(tensors).square_()
        dist.all_reduce(squares, group=self.group)
        return squares.sqrt_()

    def grad_norms(self) -> torch.Tensor:
        """``(N,)`` norms of ``grads`` as they were when the step began (computed once)."""
        if self._grad_norms is None:
            self._grad_norms = self.norms(self.grads)
        return self._grad_norms

    def write_back(self) -> None:
        """Round the fp32 master weights into their low-precision parameters."""
        if self.low_precision:
            params, masters = zip(*self.low_precision, strict=True)
            torch._foreach_copy_(list(params), list(masters))


def _local(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """``(tensor, grad, group)`` to update: a DTensor's local shard, its gradient's, and the
    process group it is sharded over (None for plain or replicated tensors)."""
    if not is_dtensor(param):
        return param, param.grad, None
    from torch.distributed.tensor import Shard

    grad = param.grad
    if not is_dtensor(grad) or grad.placements != param.placements:
        raise RuntimeError(
            f"a DTensor parameter with placements {param.placements} has a gradient laid out "
            f"as {getattr(grad, 'placements', 'a plain tensor')}; the layer-wise optimizers "
            "update shards in place and need the gradient sharded like its parameter"
        )
    mesh = param.device_mesh
    sharded = [i for i, pl in enumerate(param.placements) if isinstance(pl, Shard)]
    if len(sharded) > 1:
        raise RuntimeError(
            f"a DTensor parameter sharded over {len(sharded)} mesh dimensions "
            f"({param.placements}); the layer-wise optimizers support one"
        )
    if any(not isinstance(pl, Shard) and not pl.is_replicate() for pl in param.placements):
        raise RuntimeError(f"unsupported DTensor parameter placements {param.placements}")
    group = mesh.get_group(sharded[0]) if sharded else None
    return param.to_local(), grad.to_local(), group


class LayerwiseAdaptiveOptimizer(torch.optim.Optimizer):
    """Base class: lazy fp32 state, bucketing, the gradient-norm clip, fp32-safe loading.

    Subclasses put ``max_grad_norm`` and ``adapt_no_wd`` in their defaults and implement
    ``_update(group, bucket, clip)``, where ``clip`` is ``None`` or the 0-d tensor
    ``max(1, (G + clip_eps) / max_grad_norm)`` on the bucket's device: ``G`` is the norm of
    every gradient of the optimizer together (one global clip), or of the group's gradients
    where :meth:`_clips_per_group` says so, and ``clip_eps`` is :meth:`_clip_eps`.
    """

    # The state of a DTensor parameter is kept for its local shard, as plain tensors (read by
    # trainers.parallel.tensor.shard_optimizer_state_ on resume).
    state_on_local_shards = True

    # ---- state ------------------------------------------------------------------------------
    def _buckets(self, group: dict[str, Any]) -> list[Bucket]:
        buckets: dict[tuple[torch.device, torch.dtype, int, Any], Bucket] = {}
        for param in group["params"]:
            if param.grad is None:
                continue
            p, grad, shards = _local(param)
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients; use dense "
                    "embeddings (sparse=False) or torch.optim.SparseAdam for them"
                )
            if torch.is_complex(p):
                raise RuntimeError(
                    f"{type(self).__name__} does not support complex parameters; optimize "
                    "torch.view_as_real(p) instead"
                )
            state = self.state[param]
            low = p.dtype in _LOW_PRECISION
            compute = torch.float32 if low else p.dtype
            if len(state) == 0:
                state["step"] = 0
                zeros = dict(dtype=compute, memory_format=torch.preserve_format)
                state["exp_avg"] = torch.zeros_like(p, **zeros)
                state["exp_avg_sq"] = torch.zeros_like(p, **zeros)
                if low:
                    state["master_param"] = p.detach().to(compute, copy=True)
            state["step"] += 1
            key = (p.device, compute, state["step"], shards)
            bucket = buckets.get(key)
            if bucket is None:
                bucket = buckets[key] = Bucket(step=state["step"], grads_owned=low, group=shards)
            bucket.params.append(p)
            bucket.exp_avgs.append(state["exp_avg"])
            bucket.exp_avg_sqs.append(state["exp_avg_sq"])
            if low:
                master = state["master_param"]
                # Follow writes made to the parameter outside the optimizer.
                master.copy_(torch.where(p == master.to(p.dtype), master, p.to(compute)))
                bucket.weights.append(master)
                bucket.grads.append(grad.to(compute))
                bucket.low_precision.append((p, master))
            else:
                bucket.weights.append(p)
                bucket.grads.append(grad)
        return list(buckets.values())

    def _scratch(self, bucket: Bucket, slot: int) -> list[torch.Tensor]:
        """Work buffers shaped like ``bucket.weights``, kept between steps on CPU.

        On CPU, fresh memory costs a page fault per 4 KiB, so allocating a parameter-sized
        result every step costs as much as a pass over it: there the buffers persist (they
        are not part of the state dict). Elsewhere the caching allocator makes
        ``empty_like`` free and nothing is kept.
        """
        weights = bucket.weights
        if weights[0].device.type != "cpu":
            return [torch.empty_like(w) for w in weights]
        store: dict[torch.Tensor, list[torch.Tensor]] = self.__dict__.setdefault(
            "_scratch_buffers", {}
        )
        out = []
        for p, w in zip(bucket.params, weights, strict=True):
            slots = store.setdefault(p, [])
            while len(slots) <= slot:
                slots.append(torch.empty(0))
            buf = slots[slot]
            if buf.shape != w.shape or buf.dtype != w.dtype or buf.stride() != w.stride():
                buf = slots[slot] = torch.empty_like(w)
            out.append(buf)
        return out

    @staticmethod
    def _grad_norm(buckets: list[Bucket]) -> torch.Tensor:
        """0-d norm of all gradients of ``buckets`` together (fp32 unless they are fp64)."""
        per_bucket = [b.grad_norms() for b in buckets]
        device = per_bucket[0].device
        dtype = reduce(torch.promote_types, (n.dtype for n in per_bucket), torch.float32)
        flat = torch.cat([n.to(device=device, dtype=dtype) for n in per_bucket])
        return torch.linalg.vector_norm(flat)

    @staticmethod
    def _max_grad_norm(groups: list[dict[str, Any]]) -> float | None:
        values = {group["max_grad_norm"] for group in groups}
        if len(values) > 1:
            raise ValueError(
                f"max_grad_norm is one global clip over all parameters, but the param groups "
                f"have {sorted(values, key=str)}; give every group the same value"
            )
        return values.pop() if values else None

    def _clips_per_group(self, group: dict[str, Any]) -> bool:
        """Whether ``group`` is clipped by its own gradient norm (default: the global one)."""
        return False

    def _clip_eps(self, group: dict[str, Any]) -> float:
        """The constant added to the gradient norm before it is compared with the bound."""
        return 0.0

    def _clip_coefficients(
        self, per_group: list[tuple[dict[str, Any], list[Bucket]]]
    ) -> list[torch.Tensor | None]:
        """Each group's ``clip`` argument of :meth:`_update` (see the class docstring)."""
        all_buckets = [b for _, buckets in per_group for b in buckets]
        global_groups = [g for g, _ in per_group if not self._clips_per_group(g)]
        global_max = self._max_grad_norm(global_groups)
        global_norm = None
        clips: list[torch.Tensor | None] = []
        for group, buckets in per_group:
            if self._clips_per_group(group):
                max_norm, scope = group["max_grad_norm"], buckets
            else:
                max_norm, scope = global_max, all_buckets
            if max_norm is None or not buckets:
                clips.append(None)
                continue
            if scope is all_buckets:
                if global_norm is None:
                    global_norm = self._grad_norm(all_buckets)
                norm = global_norm
            else:
                norm = self._grad_norm(scope)
            clips.append(torch.clamp((norm + self._clip_eps(group)) / max_norm, min=1.0))
        return clips

    # ---- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Perform one optimization step.

        Args:
            closure: re-evaluates the model and returns the loss (optional).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        per_group = [(group, self._buckets(group)) for group in self.param_groups]
        clips = self._clip_coefficients(per_group)
        for (group, buckets), clip in zip(per_group, clips, strict=True):
            for bucket in buckets:
                coef = None if clip is None else clip.to(bucket.grads[0].device)
                self._update(group, bucket, coef)
                bucket.write_back()
        return loss

    def _update(self, group: dict[str, Any], bucket: Bucket, clip: torch.Tensor | None) -> None:
        raise NotImplementedError

    @staticmethod
    def _adapts(group: dict[str, Any], *, decays: bool) -> bool:
        """Whether the trust ratio applies to ``group`` (no_wd groups only with adapt_no_wd)."""
        if group.get("no_wd", False) and not group["adapt_no_wd"]:
            return False
        return decays

    @staticmethod
    def _weight_decay(group: dict[str, Any]) -> float:
        return 0.0 if group.get("no_wd", False) else float(group["weight_decay"])

    # ---- checkpoints ------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping fp32 moments and masters fp32 for bf16/fp16 parameters.

        ``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its
        parameter's dtype, which would round the fp32 state of a bf16 parameter to bf16.
        """
        super().load_state_dict(state_dict)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params, strict=True):
            if p.dtype not in _LOW_PRECISION or saved_id not in state_dict["state"]:
                continue
            saved = state_dict["state"][saved_id]
            for key, value in saved.items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32, copy=True)
