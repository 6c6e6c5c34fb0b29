"""Gradient compressors: what one worker sends per step, and the compressed all-reduce.

The three levers of communication-efficient training are: send less per step (this module),
communicate less often (:mod:`trainers.comm.localsgd`), or use the network better (see
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
``topk``        the ``k = ratio n`` largest magnitudes and their int32   sparse allreduce
                indices (8 k)
``sign``        one bit per element plus the scale ``mean |x|``          allgather
                (n / 8 + 4)
``qsgd``        QSGD's stochastic levels as int8 (int32 beyond 127 for   allreduce
                the sum of all workers) plus one shared norm per bucket
``importance``  the ``k`` values of largest ``|x| / (|w| + eps)`` at an   allreduce
                index set one worker chooses and broadcasts (4 k + 4 k)
==============  =======================================================  ==================

*Allreduce-compatible* compressors encode every worker against shared information (the
random block's offset, QSGD's global bucket norms: ``all_reduce(MAX)`` of the local ones),
so the encoded vectors can be summed by a plain ``all_reduce`` and decoded once:
``decode(sum_i q_i) = sum_i decode(q_i)``. ``randblock`` and ``importance`` send values at
an index set every worker shares, so for them a sparse allreduce would be this same
all-reduce of ``k`` values (any sparse algorithm also sends the indices). ``topk``'s index
sets differ between workers: its (index, value) pairs are summed by the sparse allreduce of
:mod:`trainers.comm.sparse` (SparCML's algorithms, chosen by their cost), so its traffic
does not grow as ``(N - 1) k`` with the workers when their supports overlap. ``sign`` is
all-gathered and decoded per worker. QSGD (Alistarh et al., NeurIPS 2017) with ``s`` levels and norm ``m`` rounds
``l = s |x| / m`` up with probability ``l - floor(l)``, so ``E[decode(q)] = x``.

**Combiners** (in :mod:`trainers.comm.ef`, :mod:`trainers.comm.cser`, :mod:`trainers.comm.ddp_hooks`):

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
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..dist import DistEnv
from .sparse import sparse_allreduce

__all__ = [
    "COMPRESSORS",
    "BF16",
    "Compressor",
    "FP16",
    "Identity",
    "Importance",
    "QSGD",
    "RandomBlock",
    "Sign",
    "TopK",
    "compressed_allreduce",
    "compressor_options",
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
    #: encodes against an index set that one worker chooses from its values and the model's
    #: parameters (``weights``) and broadcasts: :meth:`select`, then ``compress(stats=indices)``
    shares_selection = False
    #: sends (index, value) pairs that :func:`~trainers.comm.sparse.sparse_allreduce` sums:
    #: :meth:`sparse_pairs` gives them sorted by index
    sparse = False

    def __init__(self) -> None:
        self.world_size = 1

    def bind(self, world_size: int) -> Compressor:
        """Set the number of workers whose payloads get summed (QSGD sizes its integers)."""
        self.world_size = int(world_size)
        return self

    def shared_stats(self, x: Tensor) -> Tensor | None:
        return None

    def sparse_pairs(self, payload: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """``(indices, values)`` of a sparse payload, indices sorted (``sparse`` compressors)."""
        raise TypeError(f"compressor {self.name!r} does not send (index, value) pairs")

    def select(self, x: Tensor, weights: Tensor) -> Tensor:
        """The index set (int64) every worker will send, chosen from ``x`` and the model's
        parameters ``weights`` (same layout); only for ``shares_selection`` compressors."""
        raise TypeError(f"compressor {self.name!r} does not choose a shared index set")

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
    pairs are summed by the sparse allreduce (:mod:`trainers.comm.sparse`).
    """

    name = "topk"
    sparse = True

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

    def sparse_pairs(self, payload):
        values, indices = payload
        order = torch.argsort(indices)
        return indices[order].long(), values[order]

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


class Importance(Compressor):
    """Importance-weighted pruning (``importance``; Cheng & Xu, arXiv 1901.01544).

    Element ``j``'s importance is ``|x_j| / (|w_j| + eps)`` (``w``: the model's parameter it
    updates; ``eps`` because biases start at 0); the ``k = ratio * n`` most important are kept.
    So that the kept values add up in a plain all-reduce, every worker sends the **same**
    index set each step: one worker, drawn from the generator all workers seed alike, chooses
    it from its own values and broadcasts it; every worker then sends its values there. Pair it
    with error feedback (``--grad-combine ef``). Bytes: ``4 k`` values plus the ``4 k`` int32
    indices the choosing worker broadcasts (counted for every worker: an upper bound).
    """

    name = "importance"
    allreduce_compatible = True
    shares_selection = True

    def __init__(self, ratio: float = 0.01, eps: float = 1e-6) -> None:
        super().__init__()
        self.ratio = _check_ratio(ratio, "importance")
        if not eps > 0:
            raise ValueError(f"importance: eps (in |g| / (|w| + eps)) must be > 0, got {eps}")
        self.eps = float(eps)

    def select(self, x: Tensor, weights: Tensor) -> Tensor:
        if weights.shape != x.shape:
            raise ValueError(
                f"importance: the parameters have {weights.numel()} elements, the vector "
                f"{x.numel()}; pass the flat trainable parameters in the vector's layout"
            )
        score = x.abs() / (weights.to(x.dtype).abs() + self.eps)
        return score.topk(_count(x.numel(), self.ratio), sorted=False).indices

    def compress(self, x, stats=None, *, shared=None, local=None):
        if stats is None:
            raise ValueError(
                "importance: compress needs the shared index set (stats=select(x, weights)); "
                "compressed_allreduce(..., weights=params) chooses and broadcasts it"
            )
        return [x[stats].clone()], Context(x.numel(), x.dtype, stats)

    def decompress(self, payload, ctx):
        out = torch.zeros(ctx.numel, dtype=payload[0].dtype, device=payload[0].device)
        out[ctx.shared] = payload[0]
        return out.to(ctx.dtype)

    def payload_bytes(self, numel: int) -> int:
        return 8 * _count(numel, self.ratio)

    def __repr__(self) -> str:
        return f"Importance(ratio={self.ratio}, eps={self.eps})"


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
    c.name: c for c in (Identity, FP16, BF16, TopK, RandomBlock, Sign, QSGD, Importance)
}


def compressor_options(name: str) -> tuple[str, ...]:
    """The keyword options a compressor takes (``topk``: ``ratio``)."""
    key = name.lower()
    if key not in COMPRESSORS:
        raise ValueError(f"compressor {name!r}: choose one of {', '.join(COMPRESSORS)}")
    params = inspect.signature(COMPRESSORS[key].__init__).parameters
    return tuple(p for p in params if p != "self")


def create_compressor(name: str, **options: object) -> Compressor:
    """A compressor by name, with its own defaults for the options not given.

    Raises:
        ValueError: an unknown name, or an option the compressor does not take.
    """
    key = name.lower()
    accepted = compressor_options(key)
    for option in options:
        if option not in accepted:
            takers = [c for c in COMPRESSORS if option in compressor_options(c)]
            raise ValueError(
                f"option {option!r} is not one of compressor {key!r}'s "
                f"({', '.join(accepted) or 'it takes none'}); it applies to "
                f"{' / '.join(takers) or 'no compressor'}"
            )
    return COMPRESSORS[key](**options)  # type: ignore[arg-type]


def compressed_allreduce(
    compressor: Compressor,
    x: Tensor,
    env: DistEnv,
    *,
    shared: torch.Generator | None = None,
    local: torch.Generator | None = None,
    weights: Tensor | None = None,
    sparse_algorithm: str = "auto",
    union: int | None = None,
    report: dict[str, Any] | None = None,
) -> tuple[Tensor, Tensor, int]:
    """Average ``compressor(x)`` over the workers.

    ``weights``: the model's flat parameters in ``x``'s layout, for compressors that choose a
    shared index set from them (``importance``): the worker drawn from ``shared`` (rank 0
    without it) chooses, and broadcasts its choice.

    Sparse compressors (``topk``) are summed by :func:`~trainers.comm.sparse.sparse_allreduce`
    with ``sparse_algorithm`` (``auto``: its cost model, with ``union`` the expected
    non-zeros of the sum, e.g. the last step's). ``report``, when given, receives
    ``collective`` (the collective or sparse algorithm that ran), ``wire_bytes`` (what this
    worker handed to the network) and, for sparse compressors under ``auto``, ``nnz``
    (non-zeros of the sum).

    Returns:
        ``(mean of the workers' decoded vectors, this worker's decoded vector, bytes sent)``.
    """
    if compressor.shares_selection:
        if weights is None:
            raise ValueError(
                f"compressor {compressor.name!r} chooses its index set from the parameters: "
                "pass weights= (the flat trainable parameters)"
            )
        stats = compressor.select(x, weights)
        if env.distributed:
            chooser = (
                int(torch.randint(env.world_size, (), generator=shared))
                if shared is not None
                else 0
            )
            dist.broadcast(stats, src=chooser)
    else:
        stats = compressor.shared_stats(x)
        if stats is not None and env.distributed:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    payload, ctx = compressor.compress(x, stats, shared=shared, local=local)
    own = compressor.decompress(payload, ctx)
    if any(own.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in payload):
        own = own.clone()  # the payload is reduced in place below; this worker's part is kept
    sent = compressor.payload_bytes(x.numel())
    n = env.world_size
    report = report if report is not None else {}
    if not env.distributed:
        report.update(collective="local", wire_bytes=0)
        return own.clone(), own, sent
    nbytes = sum(t.numel() * t.element_size() for t in payload)
    if compressor.allreduce_compatible:
        for t in payload:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        report.update(collective="allreduce", wire_bytes=round(2 * (n - 1) / n * nbytes))
        return compressor.decompress(payload, ctx).div_(n), own, sent
    acc = torch.float64 if own.dtype == torch.float64 else torch.float32
    if compressor.sparse:
        indices, values = compressor.sparse_pairs(payload)
        result = sparse_allreduce(
            indices, values.to(acc), ctx.numel, algorithm=sparse_algorithm, union=union,
            dense_output=True, counts=[indices.numel()] * n,  # k on every worker
        )  # fmt: skip
        total = result.to_dense()
        report.update(collective=result.algorithm, wire_bytes=result.bytes_sent)
        if sparse_algorithm == "auto":  # the next step's union estimate: only auto reads it
            report["nnz"] = int(torch.count_nonzero(total))
        return total.div_(n).to(own.dtype), own, sent
    # the sum in fp32 (fp64 for fp64 inputs, so that float64 runs keep their precision)
    total = torch.zeros_like(own, dtype=acc)
    gathered = [[torch.empty_like(t) for _ in range(n)] for t in payload]
    for t, out in zip(payload, gathered, strict=True):
        dist.all_gather(out, t.contiguous())
    for r in range(n):
        total += compressor.decompress([g[r] for g in gathered], ctx).to(acc)
    report.update(collective="allgather", wire_bytes=(n - 1) * nbytes)
    return total.div_(n).to(own.dtype), own, sent
