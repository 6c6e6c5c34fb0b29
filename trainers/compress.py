"""Gradient compression: compressors, error feedback, CSER, and PyTorch's DDP hooks.

The three levers of communication-efficient training are: send less per step (this module),
communicate less often (:mod:`trainers.localsgd`), or use the network better (see
``scripts/scaling_whatif.py``). See ``docs/communication.md`` for when to use which.

**Compressors** work on one flat vector (the whole model's gradient or update, so a step is
one message) and report what they send:

==============  =======================================================  ==================
name            what one worker sends for ``n`` fp32 elements            collective
==============  =======================================================  ==================
``none``        the vector (4 n bytes)                                   allreduce
``fp16``        the vector cast to fp16 (2 n)                            allreduce
``bf16``        the vector cast to bf16 (2 n)                            allreduce
``randblock``   ``k = ratio n`` contiguous values at a shared random     allreduce
                offset (4 k)
``topk``        the ``k = ratio n`` largest magnitudes and their int32   allgather
                indices (8 k)
``sign``        one bit per element plus the scale ``mean |x|``          allgather
                (n / 8 + 4)
``qsgd``        QSGD's stochastic levels as int8 (int32 beyond 127 for   allreduce
                the sum of all workers) plus one shared norm per bucket
==============  =======================================================  ==================

*Allreduce-compatible* compressors encode every worker against shared information (the
random block's offset, QSGD's global bucket norms: ``all_reduce(MAX)`` of the local ones),
so the encoded vectors can be summed by a plain ``all_reduce`` and decoded once:
``decode(sum_i q_i) = sum_i decode(q_i)``. The others are all-gathered and decoded per
worker. QSGD (Alistarh et al., NeurIPS 2017) with ``s`` levels and norm ``m`` rounds
``l = s |x| / m`` up with probability ``l - floor(l)``, so ``E[decode(q)] = x``.

**Combiners** (see :mod:`trainers.combine` for the hooks the trainer calls):

* :class:`ErrorFeedbackCombiner` — each worker keeps a residual ``e``; it compresses
  ``c = C(g + e)``, the workers average ``c``, and it keeps ``e = g + e - c``
  (Seide et al. 2014; Karimireddy et al. 2019). Works with any compressor.
* :class:`CSERCombiner` — Communication-efficient SGD with Error Reset (Xie et al., NeurIPS
  2020). Every step each worker runs its own optimizer step from its own model, giving the
  update ``u``; the compressed part ``C1(u)`` is averaged over the workers, the rest
  ``u - C1(u)`` is applied locally and added to the residual ``e`` (the local models drift
  apart by their residuals: ``x_i = xbar + e_i``). Every ``H`` steps the residuals are reset:
  ``x_i <- x_i - e_i + mean_j C2(e_j)``, ``e_i <- 0``, after which every replica is equal
  (``C2 = none``: an exact reset). With ``C1 = none`` and ``H = 1`` it is synchronous SGD
  with the same optimizer (momentum is linear in the gradient).
* :class:`DDPHookCombiner` — DistributedDataParallel with one of PyTorch's communication
  hooks (``torch.distributed.algorithms.ddp_comm_hooks``): PowerSGD (Vogels et al. 2019,
  with its own error feedback), or the fp16 / bf16 casts. Not rewritten here.

Every combiner reports ``bytes_sent`` (what one worker sends per optimizer step, averaged
over the log interval), ``grad_bytes`` (the dense fp32 gradient) and ``compression_ratio``
(their ratio) in the step records.

Example:
    >>> c = TopK(ratio=0.25)
    >>> payload, ctx = c.compress(torch.tensor([0.1, -3.0, 0.2, 2.0]))
    >>> c.decompress(payload, ctx)
    tensor([ 0., -3.,  0.,  0.])
"""

from __future__ import annotations

import abc
import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from .combine import (
    CommCounter,
    GradCombiner,
    broadcast_,
    flat_grads,
    model_tensors,
    restore_optimizer_state,
)
from .data import derive_seed
from .dist import DistEnv

__all__ = [
    "COMPRESSORS",
    "BF16",
    "CSERCombiner",
    "Compressor",
    "DDPHookCombiner",
    "ErrorFeedbackCombiner",
    "FP16",
    "Identity",
    "QSGD",
    "RandomBlock",
    "Sign",
    "TopK",
    "compressed_allreduce",
    "create_compressor",
]


# ================================================================================================
# compressors
# ================================================================================================
@dataclass(frozen=True)
class Context:
    """What decoding needs besides the payload, identical on every worker."""

    numel: int
    dtype: torch.dtype
    shared: Any = None  # the random block's offset, QSGD's bucket norms


class Compressor(abc.ABC):
    """Encode a flat vector into the tensors one worker sends; decode them back.

    Subclasses set ``name`` and ``allreduce_compatible`` and implement :meth:`compress`,
    :meth:`decompress` and :meth:`payload_bytes`. ``shared_stats`` returns a small tensor that
    the workers ``all_reduce(MAX)`` before encoding (``None``: nothing shared).
    """

    name = "base"
    allreduce_compatible = False

    def __init__(self) -> None:
        self.world_size = 1

    def bind(self, world_size: int) -> Compressor:
        """Set the number of workers whose payloads get summed (QSGD sizes its integers)."""
        self.world_size = int(world_size)
        return self

    def shared_stats(self, x: Tensor) -> Tensor | None:
        return None

    @abc.abstractmethod
    def compress(
        self,
        x: Tensor,
        stats: Tensor | None = None,
        *,
        shared: torch.Generator | None = None,
        local: torch.Generator | None = None,
    ) -> tuple[list[Tensor], Context]:
        """``(payload tensors, context)``. ``stats``: the MAX-reduced :meth:`shared_stats`;
        ``shared``: a generator seeded alike on every worker; ``local``: this worker's own."""

    @abc.abstractmethod
    def decompress(self, payload: Sequence[Tensor], ctx: Context) -> Tensor:
        """The decoded vector (``ctx.dtype``); linear in ``payload`` when allreduce-compatible."""

    @abc.abstractmethod
    def payload_bytes(self, numel: int) -> int:
        """Bytes one worker sends for ``numel`` elements (shared statistics included)."""

    def compression_ratio(self, numel: int, element_size: int = 4) -> float:
        """Dense bytes over sent bytes."""
        return numel * element_size / self.payload_bytes(numel)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Identity(Compressor):
    """No compression (``none``): the exact average."""

    name = "none"
    allreduce_compatible = True

    def compress(self, x, stats=None, *, shared=None, local=None):
        return [x.clone()], Context(x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        return payload[0].to(ctx.dtype)

    def payload_bytes(self, numel: int) -> int:
        return 4 * numel


class _Cast(Compressor):
    allreduce_compatible = True
    wire_dtype = torch.float16

    def compress(self, x, stats=None, *, shared=None, local=None):
        return [x.to(self.wire_dtype)], Context(x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        return payload[0].to(ctx.dtype)

    def payload_bytes(self, numel: int) -> int:
        return 2 * numel


class FP16(_Cast):
    """Cast to IEEE half precision (``fp16``); sums travel in fp16."""

    name = "fp16"
    wire_dtype = torch.float16


class BF16(_Cast):
    """Cast to bfloat16 (``bf16``): fp32's range, 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = torch.bfloat16


def _count(numel: int, ratio: float) -> int:
    return min(numel, max(1, round(numel * ratio)))


def _check_ratio(ratio: float, name: str) -> float:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name}: ratio (fraction kept) must be in (0, 1], got {ratio}")
    return float(ratio)


class TopK(Compressor):
    """Top-k sparsification (``topk``): the ``k = ratio * n`` entries of largest magnitude.

    Sends the values (fp32) and their int32 indices; workers' index sets differ, so the
    payloads are all-gathered.
    """

    name = "topk"

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        self.ratio = _check_ratio(ratio, "topk")

    def compress(self, x, stats=None, *, shared=None, local=None):
        k = _count(x.numel(), self.ratio)
        indices = x.abs().topk(k, sorted=False).indices
        return [x[indices].float(), indices.to(torch.int32)], Context(x.numel(), x.dtype)

    def decompress(self, payload, ctx):
        values, indices = payload
        out = torch.zeros(ctx.numel, dtype=torch.float32, device=values.device)
        out.index_add_(0, indices.long(), values)
        return out.to(ctx.dtype)

    def payload_bytes(self, numel: int) -> int:
        return 8 * _count(numel, self.ratio)

    def __repr__(self) -> str:
        return f"TopK(ratio={self.ratio})"


class RandomBlock(Compressor):
    """Random-block sparsification (``randblock``): ``k = ratio * n`` contiguous entries.

    The block starts at an offset drawn from the generator every worker seeds alike, so all
    workers send the same coordinates (no indices) and a plain ``all_reduce`` sums them; the
    block wraps around the end of the vector.
    """

    name = "randblock"
    allreduce_compatible = True

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        self.ratio = _check_ratio(ratio, "randblock")

    def _index(self, numel: int, offset: int, device: torch.device) -> Tensor:
        k = _count(numel, self.ratio)
        return (torch.arange(k, device=device) + offset) % numel

    def compress(self, x, stats=None, *, shared=None, local=None):
        n = x.numel()
        offset = int(torch.randint(n, (), generator=shared)) if n else 0
        return [x[self._index(n, offset, x.device)].clone()], Context(n, x.dtype, offset)

    def decompress(self, payload, ctx):
        out = torch.zeros(ctx.numel, dtype=payload[0].dtype, device=payload[0].device)
        out[self._index(ctx.numel, ctx.shared, out.device)] = payload[0]
        return out.to(ctx.dtype)

    def payload_bytes(self, numel: int) -> int:
        return 4 * _count(numel, self.ratio)

    def __repr__(self) -> str:
        return f"RandomBlock(ratio={self.ratio})"


_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


class Sign(Compressor):
    """Scaled sign (``sign``, 1-bit SGD): ``mean|x| * sign(x)``, packed 8 signs per byte.

    The scale ``||x||_1 / n`` is the one of EF-signSGD (Karimireddy et al. 2019); zeros are
    sent as ``+``.
    """

    name = "sign"

    def compress(self, x, stats=None, *, shared=None, local=None):
        n = x.numel()
        scale = x.abs().float().mean().reshape(1) if n else torch.zeros(1, device=x.device)
        bits = (x >= 0).to(torch.uint8)
        pad = (-n) % 8
        if pad:
            bits = torch.cat([bits, bits.new_zeros(pad)])
        packed = (bits.view(-1, 8) * _BIT_WEIGHTS.to(x.device)).sum(1, dtype=torch.uint8)
        return [packed, scale], Context(n, x.dtype)

    def decompress(self, payload, ctx):
        packed, scale = payload
        bits = packed[:, None].bitwise_and(_BIT_WEIGHTS.to(packed.device)).ne(0).reshape(-1)
        signs = bits[: ctx.numel].float() * 2 - 1
        return (signs * scale).to(ctx.dtype)

    def payload_bytes(self, numel: int) -> int:
        return math.ceil(numel / 8) + 4


class QSGD(Compressor):
    """QSGD stochastic quantization with shared bucket norms (``qsgd``): allreduce-compatible.

    The vector is cut into buckets of ``bucket_size``; each bucket's norm is the maximum of
    the workers' L2 norms of that bucket (``shared_stats`` + ``all_reduce(MAX)``), so every
    worker quantizes against the same norm ``m``. Entry ``x`` gets level ``l = s |x| / m``
    (``<= s``), rounded up with probability ``l - floor(l)``; the signed integer levels of all
    workers are summed by a plain ``all_reduce`` and decoded once as ``m / s * sum``.

    Args:
        levels: ``s``, the number of positive levels. ``None``: the largest with which the
            sum over all workers fits int8 (``127 // world_size``).
        bucket_size: elements per norm (QSGD's ``d``; 512 as in the paper's experiments).
    """

    name = "qsgd"
    allreduce_compatible = True

    def __init__(self, levels: int | None = None, bucket_size: int = 512) -> None:
        super().__init__()
        if levels is not None and levels < 1:
            raise ValueError(f"qsgd: levels must be >= 1, got {levels}")
        if bucket_size < 1:
            raise ValueError(f"qsgd: bucket_size must be >= 1, got {bucket_size}")
        self.levels_arg = levels
        self.bucket_size = int(bucket_size)

    @property
    def levels(self) -> int:
        return self.levels_arg if self.levels_arg is not None else max(1, 127 // self.world_size)

    @property
    def wire_dtype(self) -> torch.dtype:
        return torch.int8 if self.levels * self.world_size <= 127 else torch.int32

    def _buckets(self, x: Tensor) -> Tensor:
        n = x.numel()
        pad = (-n) % self.bucket_size
        flat = x.float()
        if pad:
            flat = torch.cat([flat, flat.new_zeros(pad)])
        return flat.view(-1, self.bucket_size)

    def shared_stats(self, x: Tensor) -> Tensor:
        return self._buckets(x).norm(dim=1)

    def compress(self, x, stats=None, *, shared=None, local=None):
        buckets = self._buckets(x)  # (B, d)
        norms = buckets.norm(dim=1) if stats is None else stats
        s = self.levels
        safe = torch.where(norms > 0, norms, torch.ones_like(norms))
        level = (buckets.abs() * (s / safe)[:, None]).clamp_(max=s)
        low = level.floor()
        up = torch.rand(level.shape, generator=local, device=level.device) < (level - low)
        q = (low + up.float()) * buckets.sign()
        q = q.reshape(-1)[: x.numel()].to(self.wire_dtype)
        return [q], Context(x.numel(), x.dtype, norms)

    def decompress(self, payload, ctx):
        q = payload[0].float()
        pad = (-ctx.numel) % self.bucket_size
        if pad:
            q = torch.cat([q, q.new_zeros(pad)])
        out = q.view(-1, self.bucket_size) * (ctx.shared / self.levels)[:, None]
        return out.reshape(-1)[: ctx.numel].to(ctx.dtype)

    def payload_bytes(self, numel: int) -> int:
        per = 1 if self.wire_dtype == torch.int8 else 4
        return per * numel + 4 * math.ceil(numel / self.bucket_size)

    def __repr__(self) -> str:
        return f"QSGD(levels={self.levels}, bucket_size={self.bucket_size})"


COMPRESSORS: dict[str, type[Compressor]] = {
    c.name: c for c in (Identity, FP16, BF16, TopK, RandomBlock, Sign, QSGD)
}


def create_compressor(
    name: str, *, ratio: float = 0.01, levels: int | None = None, bucket_size: int = 512
) -> Compressor:
    """A compressor by name (``--compressor``); ``ratio`` is the fraction kept by sparsifiers."""
    key = name.lower()
    if key not in COMPRESSORS:
        raise ValueError(f"compressor {name!r}: choose one of {', '.join(COMPRESSORS)}")
    if key in ("topk", "randblock"):
        return COMPRESSORS[key](ratio=ratio)  # type: ignore[call-arg]
    if key == "qsgd":
        return QSGD(levels=levels, bucket_size=bucket_size)
    return COMPRESSORS[key]()


def compressed_allreduce(
    compressor: Compressor,
    x: Tensor,
    env: DistEnv,
    *,
    shared: torch.Generator | None = None,
    local: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Average ``compressor(x)`` over the workers.

    Returns:
        ``(mean of the workers' decoded vectors, this worker's decoded vector, bytes sent)``.
    """
    stats = compressor.shared_stats(x)
    if stats is not None and env.distributed:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    payload, ctx = compressor.compress(x, stats, shared=shared, local=local)
    own = compressor.decompress(payload, ctx)
    sent = compressor.payload_bytes(x.numel())
    n = env.world_size
    if not env.distributed:
        return own.clone(), own, sent
    if compressor.allreduce_compatible:
        for t in payload:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return compressor.decompress(payload, ctx).div_(n), own, sent
    total = torch.zeros_like(own, dtype=torch.float32)
    gathered = [[torch.empty_like(t) for _ in range(n)] for t in payload]
    for t, out in zip(payload, gathered, strict=True):
        dist.all_gather(out, t.contiguous())
    for r in range(n):
        total += compressor.decompress([g[r] for g in gathered], ctx).float()
    return total.div_(n).to(own.dtype), own, sent


# ================================================================================================
# combiners
# ================================================================================================
def _no_loss_scaling(scaler: torch.amp.GradScaler | None, mode: str) -> None:
    if scaler is not None:
        raise ValueError(
            f"--grad-combine {mode} keeps residuals across steps, which fp16 loss scaling "
            "would corrupt; train with --dtype bfloat16 or float32"
        )


class _CompressedCombiner(GradCombiner):
    """Bare module with rank 0's weights, a compressor, per-step generators, byte counting."""

    mode = "compressed"

    def __init__(self, compressor: Compressor, *, seed: int = 0) -> None:
        super().__init__()
        self.compressor = compressor
        self.seed = int(seed)
        self.steps = 0  # optimizer steps taken (seeds the generators)
        self.counter = CommCounter()

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        super().prepare(model, env)
        self.compressor.bind(env.world_size)
        self.counter.grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if env.distributed:
            broadcast_(model_tensors(model))
        return model

    def _generators(self, salt: int) -> tuple[torch.Generator, torch.Generator]:
        assert self.env is not None
        shared = torch.Generator().manual_seed(derive_seed(self.seed, self.steps, salt))
        local = torch.Generator().manual_seed(
            derive_seed(self.seed, self.steps, salt, 1 + self.env.rank)
        )
        return shared, local

    def _reduce(self, x: Tensor, compressor: Compressor, salt: int) -> tuple[Tensor, Tensor]:
        assert self.env is not None
        shared, local = self._generators(salt)
        mean, own, sent = compressed_allreduce(compressor, x, self.env, shared=shared, local=local)
        self.counter.add(sent if self.env.distributed else 0)
        return mean, own

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])


class ErrorFeedbackCombiner(_CompressedCombiner):
    """Compressed gradient averaging with error feedback (``--grad-combine ef``).

    Per step, on each worker: ``p = g + e``; ``c = C(p)``; the workers' ``c`` are averaged
    into every ``p.grad``; ``e = p - c``. The optimizer then steps on the average, so the
    replicas stay identical (rank 0's buffers are broadcast after each step, as DDP does).
    Gradient clipping applies to the averaged gradient.

    Args:
        compressor: any :class:`Compressor`.
        seed: seeds the per-step generators (random block offsets, QSGD rounding).
    """

    mode = "ef"

    def __init__(self, compressor: Compressor, *, seed: int = 0) -> None:
        super().__init__(compressor, seed=seed)
        self.residual: Tensor | None = None

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        _no_loss_scaling(scaler, self.mode)
        assert self.model is not None and self.env is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        with torch.no_grad():
            g = flat_grads(params)
            if self.residual is None:
                self.residual = torch.zeros_like(g)
            p = g + self.residual
            mean, own = self._reduce(p, self.compressor, salt=0)
            self.residual = p - own
            self.counter.step()
            offset = 0
            for param in params:
                n = param.numel()
                param.grad = mean[offset : offset + n].view_as(param).to(param.dtype).clone()
                offset += n

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        self.steps += 1
        if self.env is not None and self.env.distributed:
            assert self.model is not None
            broadcast_(list(self.model.buffers()))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self.residual is not None:
            state["residual"] = self.residual.clone()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        residual = state_dict.get("residual")
        self.residual = residual.clone() if residual is not None else None


class CSERCombiner(_CompressedCombiner):
    """CSER: partial synchronisation with ``C1`` every step, error reset with ``C2`` every H.

    See the module docstring for the rule. Each worker keeps its own optimizer state
    (momentum) and model ``x_i = xbar + e_i``: the synchronised part ``xbar`` (the same on
    every worker: it only ever changes by all-reduced amounts) plus its residual. Evaluation
    (:meth:`synchronize`) and every ``period``-th step reset the residuals, after which every
    replica is exactly ``xbar``. Floating-point buffers (BatchNorm statistics) stay local and
    are averaged at the resets.

    Args:
        compressor: ``C1``, applied to each step's update.
        period: ``H``, optimizer steps between error resets (1: reset every step).
        reset_compressor: ``C2``, applied to the residuals at a reset (default
            :class:`Identity`: an exact reset).
        seed: seeds the per-step generators.
    """

    mode = "cser"

    def __init__(
        self,
        compressor: Compressor,
        *,
        period: int = 8,
        reset_compressor: Compressor | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(compressor, seed=seed)
        if period < 1:
            raise ValueError(f"--cser-period must be >= 1, got {period}")
        self.period = int(period)
        self.reset_compressor = reset_compressor if reset_compressor is not None else Identity()
        self.synced: Tensor | None = None  # xbar, flat fp32
        self.residual: Tensor | None = None  # e_i, flat fp32
        self._optimizer: torch.optim.Optimizer | None = None
        self._pending: Any = None

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        model = super().prepare(model, env)
        self.reset_compressor.bind(env.world_size)
        self.synced = _flat(self._params())
        self.residual = torch.zeros_like(self.synced)
        return model

    def _params(self) -> list[Tensor]:
        assert self.model is not None
        return [p for p in self.model.parameters() if p.requires_grad]

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        _no_loss_scaling(scaler, self.mode)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        self._optimizer = optimizer
        restore_optimizer_state(optimizer, self._pending)
        self._pending = None
        assert self.synced is not None and self.residual is not None
        params = self._params()
        with torch.no_grad():
            start = _flat(params)
            super().step(optimizer, scaler)
            update = _flat(params) - start
            mean, own = self._reduce(update, self.compressor, salt=0)
            self.synced += mean  # the averaged compressed part
            self.residual += update - own  # the rest: applied locally, remembered
            _write(params, self.synced + self.residual)
        self.counter.step()
        self.steps += 1
        if self.steps % self.period == 0:
            self._reset()

    def _reset(self) -> None:
        """``xbar += mean_j C2(e_j)``; ``e_i <- 0``; ``x_i <- xbar``; buffers averaged."""
        assert self.model is not None and self.env is not None
        assert self.synced is not None and self.residual is not None
        with torch.no_grad():
            mean, _ = self._reduce(self.residual, self.reset_compressor, salt=1)
            self.synced += mean
            self.residual.zero_()
            _write(self._params(), self.synced)
        self.counter.add(average_buffers_(self.model, self.env))

    def synchronize(self) -> None:
        """An error reset (before evaluation), so the evaluated replicas are equal."""
        if self.env is not None and self.env.distributed:
            self._reset()

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        assert self.synced is not None and self.residual is not None
        state["synced"] = self.synced.clone()
        state["residual"] = self.residual.clone()
        state["params"] = [p.detach().clone() for p in self._params()]
        if self._optimizer is not None:
            state["optimizer"] = self._optimizer.state_dict()["state"]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.synced = state_dict["synced"].clone()
        self.residual = state_dict["residual"].clone()
        with torch.no_grad():
            for p, saved in zip(self._params(), state_dict["params"], strict=True):
                p.copy_(saved)
        self._pending = state_dict.get("optimizer")


def _flat(params: Sequence[Tensor]) -> Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _write(params: Sequence[Tensor], flat: Tensor) -> None:
    offset = 0
    for p in params:
        n = p.numel()
        p.detach().copy_(flat[offset : offset + n].view_as(p))
        offset += n


def average_buffers_(model: nn.Module, env: DistEnv) -> int:
    """Average the floating-point buffers (BatchNorm statistics) over the workers; bytes sent."""
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if not buffers or not env.distributed:
        return 0
    with torch.no_grad():
        flat = torch.cat([b.reshape(-1).float() for b in buffers])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat /= env.world_size
        offset = 0
        for b in buffers:
            b.copy_(flat[offset : offset + b.numel()].view_as(b))
            offset += b.numel()
    return 4 * flat.numel()


# ================================================================================================
# PyTorch's DDP communication hooks
# ================================================================================================
DDP_HOOKS = ("powersgd", "fp16", "bf16")


class DDPHookCombiner(GradCombiner):
    """DistributedDataParallel with one of PyTorch's communication hooks.

    * ``powersgd``: :func:`torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook.
      powerSGD_hook` with a :class:`PowerSGDState` (rank ``rank``, plain all-reduce for the
      first ``start_iter`` steps, error feedback and warm start on). Matrices whose
      compression saves less than ``min_compression_rate`` — and all 1-D tensors — travel
      uncompressed, by PyTorch's own rule.
    * ``fp16`` / ``bf16``: ``default_hooks.fp16_compress_hook`` / ``bf16_compress_hook``.

    ``bytes_sent`` counts, per bucket, what the hook sends: the P and Q factors of each
    compressed matrix plus the uncompressed tensors (PowerSGD), half the bytes (casts).
    """

    def __init__(
        self,
        hook: str,
        *,
        rank: int = 2,
        start_iter: int = 10,
        min_compression_rate: float = 2.0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if hook not in DDP_HOOKS:
            raise ValueError(f"DDP hook {hook!r}: choose one of {', '.join(DDP_HOOKS)}")
        if hook == "powersgd" and (rank < 1 or start_iter < 2):
            raise ValueError(
                f"powersgd needs --powersgd-rank >= 1 and --powersgd-start-iter >= 2 (PyTorch's "
                f"minimum with error feedback), got {rank} and {start_iter}"
            )
        self.hook = hook
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)
        self.ddp: DistributedDataParallel | None = None
        self.state: Any = None
        self.counter = CommCounter()

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        super().prepare(model, env)
        self.counter.grad_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
        if not env.distributed:
            return model
        device_ids = [env.device.index] if env.device.type == "cuda" else None
        self.ddp = DistributedDataParallel(model, device_ids=device_ids)
        if self.hook == "powersgd":
            self.state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=self.rank,
                start_powerSGD_iter=self.start_iter,
                min_compression_rate=self.min_compression_rate,
                random_seed=self.seed,
            )
            inner = powerSGD_hook.powerSGD_hook
        else:
            inner = (
                default_hooks.fp16_compress_hook
                if self.hook == "fp16"
                else default_hooks.bf16_compress_hook
            )
        self.ddp.register_comm_hook(self.state, self._counting(inner))
        return self.ddp

    def _counting(self, inner: Any) -> Any:
        # No annotations: DDP checks them, and this module's are strings (PEP 563).
        def hook(state, bucket):  # noqa: ANN001, ANN202
            self.counter.add(self._bucket_bytes(bucket))
            future = inner(state, bucket)
            if self.hook != "powersgd":
                return future
            # PowerSGD chains its second all-reduce in a callback thread; with gloo the
            # buckets' collectives can then interleave differently on different ranks (a
            # mismatch). Finishing each bucket before the next one starts keeps them in order.
            done: torch.futures.Future[Tensor] = torch.futures.Future()
            done.set_result(future.wait())
            return done

        return hook

    def _bucket_bytes(self, bucket: dist.GradBucket) -> int:
        if self.hook != "powersgd":
            return 2 * bucket.buffer().numel()
        if self.state.iter < self.state.start_powerSGD_iter:
            return 4 * bucket.buffer().numel()
        sent = 0
        for g in bucket.gradients():
            if g.ndim > 1:
                rows, cols = g.shape[0], g.numel() // g.shape[0]
                r = min(rows, cols, self.rank)
                if powerSGD_hook._should_compress(rows, cols, r, self.min_compression_rate)[0]:
                    sent += 4 * (rows + cols) * r
                    continue
            sent += 4 * g.numel()
        return sent

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if self.ddp is None:
            yield
        else:
            with self.ddp.no_sync():
                yield

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        self.counter.step()

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics()
