"""Adasum: adaptive summation of gradients (or optimizer updates) across ranks.

Paper: Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021
(https://arxiv.org/abs/2006.02924). Semantics follow Horovod's ``op=hvd.Adasum``; the code is
plain ``torch.distributed`` (gloo on CPU, NCCL on GPU).

Two vectors combine with the pairwise rule, applied per tensor (per layer, never to the
flattened model):

.. math::
    \\operatorname{adasum}(a, b) = \\Big(1 - \\frac{a \\cdot b}{2\\lVert a\\rVert^2}\\Big) a
                              + \\Big(1 - \\frac{a \\cdot b}{2\\lVert b\\rVert^2}\\Big) b

which is ``a + b`` for orthogonal vectors, the mean for parallel ones (``b = k a``, any
``k != 0``), ``b`` when ``a = 0``, and symmetric in ``a`` and ``b``. The dot product and squared
norms accumulate in float64; a side whose squared norm is below ``eps`` (Horovod: ``1e-8``)
keeps coefficient 1, so a zero tensor contributes nothing and never divides by zero.

Across ``N`` ranks the result is a binary tree: ranks (0, 1), (2, 3), ... combine, then those
results pairwise, and so on. :func:`adasum_allreduce_` computes it with Horovod's
vector-halving distance-doubling exchange (the bandwidth of a reduce-scatter + allgather): at
level ``l = 1, 2, 4, ...`` rank ``v`` and ``v ^ l`` split their current range in halves, each
keeps one half and receives the partner's copy of it, the per-tensor partial dot/norm sums
are added over the ``2 l`` ranks that share each tensor, and each rank applies the rule to
its half; the halves are then gathered back in reverse order.

**World sizes that are not a power of two** (Horovod refuses them): with ``N = 2^k + r``,
``0 < r < 2^k``, the first ``2 r`` ranks fold in adjacent pairs first — rank ``2i + 1`` sends
its whole buffer to rank ``2i``, which applies the pairwise rule — then the ``2^k`` survivors
(ranks ``0, 2, ..., 2r - 2, 2r, 2r + 1, ..., N - 1``) run the power-of-two tree, and rank
``2i`` sends the result back to ``2i + 1``. The result is the binary tree over the ranks in
order whose first ``r`` adjacent pairs are combined one level early::

    N = 3: adasum(adasum(x0, x1), x2)
    N = 5: adasum(adasum(adasum(x0, x1), x2), adasum(x3, x4))
    N = 6: adasum(adasum(adasum(x0, x1), adasum(x2, x3)), adasum(x4, x5))

The folding ranks send their buffer twice more than the others (as in MPICH's
non-power-of-two allreduce).

**Hierarchical** (``local_size = m > 1``; ranks node-major, as ``torchrun`` assigns them):
the ``m`` ranks of a node average their tensors with a reduce-scatter (each keeps ``1/m`` of
the buffer), Adasum runs across nodes on those shards (the tree above over nodes, dot/norm
sums also added over the node's ranks), and an allgather inside the node restores the full
buffer. The result is the Adasum tree over the nodes' means. It needs at least two nodes: on
one node it would be plain averaging, so that raises instead of silently averaging.

Tensors are fused into buckets (``bucket_cap_mb``) per dtype and device, so thousands of
small tensors cost a handful of messages. fp32, fp64, fp16 and bf16 are supported; fp16 and
bf16 travel as they are and combine in fp32 (dots and norms in fp64).

Two ways to use it with the :class:`~trainers.Trainer` (see :mod:`trainers.combine`):

* :class:`AdasumDeltaCombiner` (Horovod's ``DistributedOptimizer(op=Adasum)``): every rank
  steps its own optimizer on its local gradients from the common weights, the updates
  ``w_new - w_start`` are Adasum-combined and applied. For adaptive optimizers (Adam, AdamW,
  LAMB, LANS), whose update is not linear in the gradient.
* :class:`AdasumGradCombiner`: the gradients are Adasum-combined, then one ordinary step. For
  plain SGD / Nesterov momentum.

With one rank both are exactly the plain optimizer. Use the single-worker learning rate: no
linear scaling with the number of workers (Adasum of parallel updates is their mean, of
orthogonal ones their sum).

Example:
    >>> a = torch.tensor([1.0, 0.0]); b = torch.tensor([0.0, 2.0])
    >>> adasum_pair(a, b)  # orthogonal: the sum
    tensor([1., 2.])
    >>> adasum_pair(a, -3 * a)  # parallel: the mean
    tensor([-1.,  0.])
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .combine import GradCombiner
from .combine import broadcast_ as _broadcast_
from .dist import DistEnv

__all__ = [
    "ADASUM_MODES",
    "AdasumDeltaCombiner",
    "AdasumGradCombiner",
    "adasum_allreduce_",
    "adasum_pair",
    "resolve_adasum_mode",
]

EPS = 1e-8  # Horovod's guard on the squared norms
DEFAULT_BUCKET_CAP_MB = 64.0  # Horovod's default fusion threshold
ADASUM_MODES = ("auto", "delta", "gradient")
GRADIENT_MODE_OPTIMIZERS = frozenset({"sgd", "nag"})  # auto: gradient mode; all others: delta

_SMALL = 4096  # segments shorter than this are reduced together, vectorized
_RUN = 1 << 18  # at most this many elements of small segments per vectorized pass
_CHUNK = 1 << 16  # CPU: elements widened to float64 at once (cache-sized)
_AXPBY_CHUNK = 1 << 19  # CPU: elements of fp16/bf16 widened to fp32 at once
_PIECE = 1 << 20  # elements per message of a level: the grain of communication overlap
_WIDE = 1e30  # coefficients beyond this would overflow fp32 products: use fp64
_SELF: Any = object()  # "a group of one": no communication
# torch 2.13 renamed the single-tensor collectives; older versions only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ================================================================================================
# the pairwise rule
# ================================================================================================
def _coefficients(dot: Tensor, na: Tensor, nb: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Horovod's coefficients of ``a`` and ``b`` (float64); 1 where a squared norm is < eps."""
    one = torch.ones_like(dot)
    ca = torch.where(na >= eps, 1.0 - dot / na * 0.5, one)
    cb = torch.where(nb >= eps, 1.0 - dot / nb * 0.5, one)
    return ca, cb


def adasum_pair(a: Tensor, b: Tensor, *, eps: float = EPS) -> Tensor:
    """The Adasum of two tensors (one "layer"): ``(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b``.

    Args:
        a: a floating-point tensor.
        b: a tensor of the same shape and dtype.
        eps: a side whose squared norm is below ``eps`` gets coefficient 1 (Horovod: 1e-8).
            The rule is scale-equivariant except through this guard; ``eps=0`` makes it exact
            at every magnitude (coefficient 1 only for an exactly zero side).

    Returns:
        A new tensor of ``a``'s dtype. Dot product, norms and the linear combination are
        computed in float64 and rounded once.
    """
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(
            f"adasum_pair needs tensors of one shape and dtype, got {tuple(a.shape)} {a.dtype} "
            f"and {tuple(b.shape)} {b.dtype}"
        )
    if not a.is_floating_point():
        raise TypeError(f"adasum_pair needs floating-point tensors, got {a.dtype}")
    a64, b64 = a.detach().reshape(-1).double(), b.detach().reshape(-1).double()
    ca, cb = _coefficients(a64 @ b64, a64 @ a64, b64 @ b64, eps)
    return (ca * a64 + cb * b64).to(a.dtype).reshape(a.shape)


# ================================================================================================
# kernels on one rank's slice of a fused buffer
# ================================================================================================
def _chunk_for(x: Tensor) -> int:
    return _CHUNK if x.device.type == "cpu" else 1 << 62


_BUFFERS: dict[tuple[str, torch.device, torch.dtype], Tensor] = {}


def _workspace(name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A persistent buffer of at least ``numel`` elements (fusion / receive / widening).

    Kept between calls, like Horovod's fusion buffer: allocating (and first touching) tens
    of megabytes per step costs as much as the arithmetic.
    """
    key = (name, device, dtype)
    buf = _BUFFERS.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype, device=device)
        _BUFFERS[key] = buf
    return buf[:numel]


def _dots(x: Tensor, y: Tensor, out: Tensor) -> None:
    """``out = (x.y, x.x, y.y)`` accumulated in float64.

    One Gram product of the widened pair per chunk: the chunk is converted once into a
    cache-sized float64 buffer and read once by the matrix product. (Views are made once:
    at this grain, creating views costs as much as the arithmetic.)
    """
    step = min(_chunk_for(x), x.numel())
    wide = _workspace("wide", 2 * step, torch.float64, x.device).view(2, step)
    w0, w1, wt = wide[0], wide[1], wide.T
    gram = torch.zeros(2, 2, dtype=torch.float64, device=x.device)
    for xc, yc in zip(x.split(step), y.split(step), strict=True):
        if xc.numel() == step:
            w0.copy_(xc)
            w1.copy_(yc)
            gram.addmm_(wide, wt)
        else:
            w = wide[:, : xc.numel()]
            w[0].copy_(xc)
            w[1].copy_(yc)
            gram.addmm_(w, w.T)
    out[0], out[1], out[2] = gram[0, 1], gram[0, 0], gram[1, 1]


def _segment_dots(a: Tensor, b: Tensor, spans: list[tuple[int, int]]) -> Tensor:
    """Per span ``(start, end)`` of ``a``/``b``: ``(a.b, a.a, b.b)`` in float64, shape (k, 3).

    Spans are consecutive. Long ones are reduced one by one; runs of short ones in one
    vectorized pass (``segment_reduce``), so thousands of small tensors stay cheap.
    """
    out = torch.zeros(len(spans), 3, dtype=torch.float64, device=a.device)
    i = 0
    while i < len(spans):
        j = _run_end(spans, i)
        start, end = spans[i][0], spans[j - 1][1]
        if j - i == 1:
            _dots(a[start:end], b[start:end], out[i])
        else:
            lengths = torch.tensor([e - s for s, e in spans[i:j]], device=a.device)
            ad, bd = a[start:end].double(), b[start:end].double()
            for col, prod in enumerate((ad * bd, ad * ad, bd * bd)):
                out[i:j, col] = torch.segment_reduce(prod, "sum", lengths=lengths)
        i = j
    return out


def _run_end(spans: list[tuple[int, int]], i: int) -> int:
    """End (exclusive) of the run of short spans starting at ``i`` (``i + 1`` for a long one)."""
    if spans[i][1] - spans[i][0] >= _SMALL:
        return i + 1
    j, total = i, 0
    while j < len(spans) and spans[j][1] - spans[j][0] < _SMALL and total < _RUN:
        total += spans[j][1] - spans[j][0]
        j += 1
    return j


def _axpby_(x: Tensor, y: Tensor, p: float, q: float) -> None:
    """``x = p x + q y`` in place; fp32 arithmetic for fp32/fp16/bf16, fp64 when needed."""
    wide = x.dtype == torch.float64 or max(abs(p), abs(q)) > _WIDE
    compute = torch.float64 if wide else torch.float32
    if x.dtype == compute:
        x.mul_(p).add_(y, alpha=q)
        return
    step = _AXPBY_CHUNK if x.device.type == "cpu" else 1 << 62
    for k in range(0, x.numel(), step):
        xk, yk = x[k : k + step], y[k : k + step]
        xk.copy_(xk.to(compute).mul_(p).add_(yk.to(compute), alpha=q))


def _segment_axpby_(
    a: Tensor, b: Tensor, spans: list[tuple[int, int]], p: list[float], q: list[float]
) -> None:
    """Per span: ``a = p[i] a + q[i] b`` (the same runs as :func:`_segment_dots`)."""
    i = 0
    while i < len(spans):
        j = _run_end(spans, i)
        start, end = spans[i][0], spans[j - 1][1]
        wide = a.dtype == torch.float64 or max(map(abs, p[i:j] + q[i:j])) > _WIDE
        if j - i == 1 or wide:
            for k in range(i, j):
                s, e = spans[k]
                _axpby_(a[s:e], b[s:e], p[k], q[k])
        else:
            lengths = torch.tensor([e - s for s, e in spans[i:j]], device=a.device)
            pe = torch.tensor(p[i:j], dtype=torch.float32, device=a.device)
            qe = torch.tensor(q[i:j], dtype=torch.float32, device=a.device)
            pe = torch.repeat_interleave(pe, lengths)
            qe = torch.repeat_interleave(qe, lengths)
            x, y = a[start:end], b[start:end]
            if x.dtype == torch.float32:
                x.mul_(pe).addcmul_(y, qe)
            else:
                x.copy_(x.float().mul_(pe).addcmul_(y.float(), qe))
        i = j


def _spans(bounds: Sequence[int], lo: int, hi: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Tensors (ids) meeting the global range [lo, hi) and their spans relative to ``lo``."""
    ids, spans = [], []
    i = max(bisect.bisect_right(bounds, lo) - 1, 0)
    while i < len(bounds) - 1 and bounds[i] < hi:
        s, e = max(bounds[i], lo), min(bounds[i + 1], hi)
        if e > s:
            ids.append(i)
            spans.append((s - lo, e - lo))
        i += 1
    return ids, spans


def _accumulate_dots(
    a: Tensor, b: Tensor, lo: int, bounds: Sequence[int], left: bool, part: Tensor
) -> None:
    """Add this slice's per-tensor ``(a.b, |left|^2, |right|^2)`` into ``part`` (T, 3).

    ``a`` is this rank's data on the global range [lo, lo + len(a)), ``b`` the partner's;
    ``left``: ``a`` belongs to the lower-numbered side of the pair.
    """
    ids, spans = _spans(bounds, lo, lo + a.numel())
    if spans:
        dots = _segment_dots(a, b, spans)  # (a.b, a.a, b.b)
        if not left:
            dots = dots[:, [0, 2, 1]]
        part.index_add_(0, torch.tensor(ids, device=a.device), dots)


def _coefficient_lists(
    part: Tensor, group: Any, left: bool, eps: float
) -> tuple[list[float], list[float]]:
    """Sum the partial dots over ``group``; per tensor: (this side's, the other's) coefficient."""
    if group is not _SELF:
        dist.all_reduce(part, group=group)
    c_left, c_right = _coefficients(part[:, 0], part[:, 1], part[:, 2], eps)
    mine, other = (c_left, c_right) if left else (c_right, c_left)
    both = torch.stack([mine, other]).tolist()  # one host sync per level
    return both[0], both[1]


def _apply_(
    a: Tensor, b: Tensor, lo: int, bounds: Sequence[int], mine: list[float], other: list[float]
) -> None:
    """``a = mine[t] a + other[t] b`` for every tensor ``t`` meeting [lo, lo + len(a))."""
    ids, spans = _spans(bounds, lo, lo + a.numel())
    if spans:
        _segment_axpby_(a, b, spans, [mine[i] for i in ids], [other[i] for i in ids])


def _combine_(
    a: Tensor, b: Tensor, lo: int, bounds: Sequence[int], left: bool, group: Any, eps: float
) -> None:
    """``a = adasum(a, b)`` per tensor on this rank's slice (dots summed over ``group``)."""
    part = torch.zeros(len(bounds) - 1, 3, dtype=torch.float64, device=a.device)
    _accumulate_dots(a, b, lo, bounds, left, part)
    mine, other = _coefficient_lists(part, group, left, eps)
    _apply_(a, b, lo, bounds, mine, other)


def _pieces(begin: int, end: int) -> list[tuple[int, int]]:
    return [(s, min(s + _PIECE, end)) for s in range(begin, end, _PIECE)]


def _start_level(
    x: Tensor, recv: Tensor, keep: tuple[int, int], give: tuple[int, int], peer: int
) -> list[tuple[tuple[int, int] | None, list[Any]]]:
    """Post one level's transfers piece by piece: send ``x[give]``, receive into ``recv``.

    Both sides cut their ranges the same way, so send ``i`` meets receive ``i``; each pair
    is one batch (NCCL needs the send and the receive of a pair grouped).
    """
    sends, recvs = _pieces(*give), _pieces(*keep)
    posted = []
    for i in range(max(len(sends), len(recvs))):
        ops = []
        if i < len(sends):
            ops.append(dist.P2POp(dist.isend, x[sends[i][0] : sends[i][1]], peer, tag=i))
        piece = recvs[i] if i < len(recvs) else None
        if piece is not None:
            r = recv[piece[0] - keep[0] : piece[1] - keep[0]]
            ops.append(dist.P2POp(dist.irecv, r, peer, tag=i))
        posted.append((piece, dist.batch_isend_irecv(ops)))
    return posted


def _exchange(send: Tensor | None, recv: Tensor | None, peer: int) -> None:
    """Send ``send`` to and receive ``recv`` from rank ``peer`` concurrently (empty: skipped)."""
    ops = []
    if send is not None and send.numel():
        ops.append(dist.P2POp(dist.isend, send, peer))
    if recv is not None and recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, peer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


# ================================================================================================
# the plan: who talks to whom (built once per world and local size)
# ================================================================================================
@dataclass(frozen=True)
class _Level:
    peer: int  # global rank of the partner at this level
    group: Any  # the ranks whose partial dot/norm sums are added (None: the world)
    left: bool  # this rank holds the lower-numbered side


@dataclass(frozen=True)
class _Plan:
    world: Any  # the default process group this plan belongs to
    local_size: int
    position: int  # index within the node (0 when flat)
    node_group: Any  # the node's ranks (None when flat)
    fold_peer: int | None  # the partner of the non-power-of-two fold
    fold_keeper: bool  # True: receives and combines; False: sends and waits
    fold_group: Any
    levels: tuple[_Level, ...]


_PLANS: dict[int, _Plan] = {}
_GROUPS: dict[tuple[int, ...], Any] = {}


def _group(ranks: Sequence[int], world_size: int) -> Any:
    """A process group of ``ranks``; every rank must call this in the same order."""
    key = tuple(ranks)
    if len(key) == 1:
        return _SELF
    if len(key) == world_size:
        return None  # the default group
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(key))
    return _GROUPS[key]


def _get_plan(local_size: int, device: torch.device) -> _Plan:
    world = dist.group.WORLD
    plan = _PLANS.get(local_size)
    if plan is not None and plan.world is world:
        return plan
    if any(p.world is not world for p in _PLANS.values()):  # a new default process group
        _PLANS.clear()
        _GROUPS.clear()
        _BUFFERS.clear()
    # Every rank takes part in one collective before the first point-to-point transfer
    # (NCCL creates its communicator there; a partial first call is undefined behaviour).
    dist.all_reduce(torch.zeros(1, device=device))
    plan = _build_plan(world, dist.get_world_size(), dist.get_rank(), local_size)
    _PLANS[local_size] = plan
    return plan


def _build_plan(world: Any, size: int, rank: int, m: int) -> _Plan:
    """Partners and dot-sum groups; identical group creation order on every rank."""
    units = size // m  # nodes (or ranks when m == 1)
    unit, position = divmod(rank, m)

    def ranks_of(units_: Sequence[int]) -> list[int]:
        return [u * m + j for u in units_ for j in range(m)]

    node_groups = [_group(ranks_of([u]), size) for u in range(units)] if m > 1 else None
    node_group = node_groups[unit] if node_groups is not None else None

    p2 = 1 << (units.bit_length() - 1)  # the largest power of two <= units
    extra = units - p2

    def real(v: int) -> int:  # virtual unit of the power-of-two tree -> unit
        return 2 * v if v < extra else v + extra

    fold_peer, keeper, fold_group = None, False, _SELF
    if unit < 2 * extra:
        keeper = unit % 2 == 0
        fold_peer = (unit ^ 1) * m + position
        if keeper and node_groups is not None:
            fold_group = node_group
    v = (unit // 2 if keeper else None) if unit < 2 * extra else unit - extra

    levels = []
    level = 1
    while level < p2:
        blocks = [range(b, b + 2 * level) for b in range(0, p2, 2 * level)]
        groups = [_group(ranks_of([real(w) for w in blk]), size) for blk in blocks]
        if v is not None:
            peer = real(v ^ level) * m + position
            levels.append(_Level(peer, groups[v // (2 * level)], v & level == 0))
        level *= 2
    return _Plan(world, m, position, node_group, fold_peer, keeper, fold_group, tuple(levels))


# ================================================================================================
# the allreduce
# ================================================================================================
def _tree_(x: Tensor, lo: int, bounds: Sequence[int], plan: _Plan, eps: float) -> None:
    """This rank's slice ``x`` (global offset ``lo``) becomes the Adasum over the units.

    Communication overlaps the arithmetic: a level's halves travel in pieces and the dots of
    a piece are computed as soon as it arrives; after the coefficients are known, the part
    of the result the next level sends is computed first and its transfer starts while the
    rest is computed.
    """
    n = x.numel()
    half = n - n // 2
    fold = n if plan.fold_keeper else 0
    recv = _workspace("recv", max(fold, half + half // 2 + 1), x.dtype, x.device)
    regions = (recv[:half], recv[half:])  # levels alternate: one receives, one is read
    if plan.fold_peer is not None:
        if not plan.fold_keeper:  # hand over, wait for the result
            _exchange(x, None, plan.fold_peer)
            _exchange(None, x, plan.fold_peer)
            return
        _exchange(None, recv[:n], plan.fold_peer)
        _combine_(x, recv[:n], lo, bounds, True, plan.fold_group, eps)

    splits = []  # vector halving: (keep, give) per level
    begin, end = 0, n
    for level in plan.levels:
        mid = begin + (end - begin) // 2
        keep, give = ((begin, mid), (mid, end)) if level.left else ((mid, end), (begin, mid))
        splits.append((keep, give))
        begin, end = keep

    if plan.levels:
        posted = _start_level(x, regions[0], *splits[0], plan.levels[0].peer)
    for i, level in enumerate(plan.levels):  # distance doubling
        (k0, k1), _ = splits[i]
        theirs = regions[i % 2]
        part = torch.zeros(len(bounds) - 1, 3, dtype=torch.float64, device=x.device)
        for piece, works in posted:
            for work in works:
                work.wait()
            if piece is not None:
                s, e = piece
                _accumulate_dots(x[s:e], theirs[s - k0 : e - k0], lo + s, bounds, level.left, part)
        mine, other = _coefficient_lists(part, level.group, level.left, eps)
        last = i + 1 == len(plan.levels)  # else: next level's outgoing half first, start it
        order = [(k0, k1)] if last else [splits[i + 1][1], splits[i + 1][0]]
        for j, (s, e) in enumerate(order):
            _apply_(x[s:e], theirs[s - k0 : e - k0], lo + s, bounds, mine, other)
            if j == 0 and len(order) == 2:
                posted = _start_level(x, regions[(i + 1) % 2], *splits[i + 1], plan.levels[i + 1].peer)  # fmt: skip

    for level, (keep, give) in zip(reversed(plan.levels), reversed(splits), strict=True):
        _exchange(x[keep[0] : keep[1]], x[give[0] : give[1]], level.peer)  # allgather

    if plan.fold_peer is not None:
        _exchange(x, None, plan.fold_peer)


def _buckets(tensors: Sequence[Tensor], cap_bytes: int) -> list[list[int]]:
    """Indices of ``tensors`` fused per (device, dtype), each bucket at most ``cap_bytes``."""
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.device, t.dtype), []).append(i)
    buckets: list[list[int]] = []
    for indices in by_kind.values():
        current: list[int] = []
        size = 0
        for i in indices:
            nbytes = tensors[i].numel() * tensors[i].element_size()
            if current and size + nbytes > cap_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(i)
            size += nbytes
        if current:
            buckets.append(current)
    return buckets


@torch.no_grad()
def adasum_allreduce_(
    tensors: Sequence[Tensor],
    *,
    local_size: int = 1,
    eps: float = EPS,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> Sequence[Tensor]:
    """Replace every rank's tensors, in place, by the Adasum over ranks (per tensor).

    A collective over the default process group: every rank calls it with tensors of the
    same shapes, dtypes and order. The result is identical on every rank. Without a process
    group, or with one rank, the tensors are returned untouched.

    Args:
        tensors: floating-point tensors (fp32, fp64, fp16, bf16), on CPU (gloo) or the
            rank's GPU (NCCL).
        local_size: ranks per node for hierarchical Adasum (average inside each node, Adasum
            across nodes); ranks must be node-major (rank // local_size is the node), as
            ``torchrun`` assigns them. 1 (default): flat Adasum over all ranks.
        eps: the guard on squared norms (see :func:`adasum_pair`).
        bucket_cap_mb: tensors are fused into buckets of at most this size (a larger tensor
            gets a bucket of its own); each bucket costs ``2 log2(N)`` messages plus one small
            dot/norm allreduce per level.

    Returns:
        ``tensors``.

    Raises:
        ValueError: ``local_size`` does not divide the world size, or equals it (one node:
            that would be plain averaging).
        TypeError: a tensor is not floating point.
    """
    if not tensors or not dist.is_available() or not dist.is_initialized():
        return tensors
    if dist.get_world_size() == 1:
        return tensors
    size = dist.get_world_size()
    if local_size < 1 or size % local_size:
        raise ValueError(
            f"local_size={local_size} must divide the world size {size} (ranks per node)"
        )
    if local_size == size:
        raise ValueError(
            f"local_size={local_size} equals the world size: hierarchical Adasum on a single "
            "node is plain averaging; use local_size=1 for Adasum between these ranks"
        )
    for t in tensors:
        if not t.is_floating_point() or t.is_sparse:
            raise TypeError(f"Adasum needs dense floating-point tensors, got {t.dtype} {t.layout}")
    plan = _get_plan(local_size, tensors[0].device)
    cap = max(1, int(bucket_cap_mb * 2**20))
    for bucket in _buckets(tensors, cap):
        _allreduce_bucket([tensors[i] for i in bucket], plan, eps)
    return tensors


def _allreduce_bucket(tensors: list[Tensor], plan: _Plan, eps: float) -> None:
    bounds = [0]
    for t in tensors:
        bounds.append(bounds[-1] + t.numel())
    n, m = bounds[-1], plan.local_size
    if n == 0:
        return
    shard_len = -(-n // m)  # hierarchical: each rank of a node owns one shard
    in_place = m == 1 and len(tensors) == 1 and tensors[0].is_contiguous()
    if in_place:
        flat = tensors[0].view(-1)
    else:
        flat = _workspace("flat", shard_len * m, tensors[0].dtype, tensors[0].device)
        torch.cat([t.reshape(-1) for t in tensors], out=flat[:n])
        flat[n:].zero_()
    if m == 1:
        _tree_(flat, 0, bounds, plan, eps)
    else:
        shard = _workspace("shard", shard_len, flat.dtype, flat.device)
        _reduce_scatter(shard, flat, op=dist.ReduceOp.SUM, group=plan.node_group)
        shard.div_(m)
        _tree_(shard, plan.position * shard_len, bounds, plan, eps)
        _all_gather(flat, shard, group=plan.node_group)
    if not in_place:
        for t, lo, hi in zip(tensors, bounds[:-1], bounds[1:], strict=True):
            t.copy_(flat[lo:hi].view_as(t))


# ================================================================================================
# the combiners
# ================================================================================================
def resolve_adasum_mode(mode: str, optimizer: str | None) -> str:
    """``"delta"`` or ``"gradient"`` for ``--adasum-mode`` (``auto``: by optimizer name).

    ``auto`` picks gradient mode for plain SGD / Nesterov momentum (``sgd``, ``nag``) and
    delta mode for everything else (Adam, AdamW, LAMB, LANS, ...: their update is not linear
    in the gradient, so Horovod combines updates).
    """
    mode = mode.lower()
    if mode not in ADASUM_MODES:
        raise ValueError(f"adasum mode {mode!r}: choose one of {', '.join(ADASUM_MODES)}")
    if mode != "auto":
        return mode
    if optimizer is None:
        raise ValueError("--adasum-mode auto needs the optimizer's name; pass delta or gradient")
    return "gradient" if optimizer.lower() in GRADIENT_MODE_OPTIMIZERS else "delta"


class _AdasumCombiner(GradCombiner):
    """What both modes share: bare module, rank 0's weights and buffers, hierarchy checks."""

    def __init__(
        self,
        *,
        hierarchical: bool = False,
        eps: float = EPS,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
    ) -> None:
        super().__init__()
        self.hierarchical = hierarchical
        self.eps = eps
        self.bucket_cap_mb = bucket_cap_mb
        self.local_size = 1

    def prepare(self, model: nn.Module, env: DistEnv) -> nn.Module:
        super().prepare(model, env)
        if not env.distributed:
            return model
        if self.hierarchical:
            self.local_size = _check_hierarchy(env)
        # Like DistributedDataParallel: every rank starts from rank 0's weights and buffers.
        _broadcast_(list(model.parameters()) + list(model.buffers()))
        return model

    def _sync_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm statistics) everywhere, as DDP does before a forward."""
        assert self.model is not None
        _broadcast_(list(self.model.buffers()))

    def _allreduce(self, tensors: Sequence[Tensor], eps: float) -> None:
        adasum_allreduce_(
            tensors, local_size=self.local_size, eps=eps, bucket_cap_mb=self.bucket_cap_mb
        )


class AdasumGradCombiner(_AdasumCombiner):
    """Gradient mode: Adasum-combine ``p.grad`` per tensor, then one ordinary optimizer step.

    For plain SGD / Nesterov momentum. Gradients still carry the fp16 loss scale when they
    are combined; the guard ``eps`` is scaled with it (``eps * scale**2``), so fp16 and fp32
    runs combine alike, and a non-finite gradient on any rank reaches every rank, which then
    skip the step together. A parameter without a gradient on some ranks counts as zero
    there; one without a gradient anywhere keeps ``grad=None``. With one rank nothing is
    communicated: exactly the plain optimizer.

    Args:
        hierarchical: average inside each node (``local_world_size`` ranks), Adasum across
            nodes. Needs at least two nodes.
        eps: the guard on squared norms (Horovod: 1e-8).
        bucket_cap_mb: fusion bucket size.
    """

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        env = self.env
        if env is None or not env.distributed:
            return
        assert self.model is not None
        params = [p for p in self.model.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        has = has.to(env.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)  # tiny; keeps the ranks agreed
        grads = []
        for p, anywhere in zip(params, has.tolist(), strict=True):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                if p.grad.is_sparse:
                    raise TypeError("Adasum does not support sparse gradients")
                grads.append(p.grad)
        eps = self.eps * scaler.get_scale() ** 2 if scaler is not None else self.eps
        self._allreduce(grads, eps)

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        super().step(optimizer, scaler)
        if self.env is not None and self.env.distributed:
            self._sync_buffers()


class AdasumDeltaCombiner(_AdasumCombiner):
    """Delta mode (Horovod's semantics): local step, then Adasum of the per-tensor updates.

    Every rank runs ``optimizer.step()`` (``scaler.step`` under fp16) on its own gradients
    from the same weights ``w_start``; the updates ``w_new - w_start`` are Adasum-combined per
    tensor and every rank sets ``w = w_start + combined``. For adaptive optimizers (Adam,
    AdamW, LAMB, LANS). Optimizer states (moments) stay per rank, as in Horovod; they are
    saved per rank in checkpoints (:meth:`state_dict`), so a resumed run with the same world
    size continues where it stopped. Gradient clipping applies to local gradients. A rank
    whose fp16 step is skipped (overflow) contributes a zero update, which Adasum ignores.
    With one rank nothing is communicated: exactly the plain optimizer.

    Args:
        hierarchical: average the updates inside each node, Adasum across nodes.
        eps: the guard on squared norms of the updates (Horovod: 1e-8).
        bucket_cap_mb: fusion bucket size.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._optimizer: torch.optim.Optimizer | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._pending: dict[str, Any] | None = None

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        env = self.env
        if env is None or not env.distributed:
            super().step(optimizer, scaler)
            return
        self._optimizer, self._scaler = optimizer, scaler
        if self._pending is not None:
            self._restore_pending(optimizer, scaler)
        params = list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
            super().step(optimizer, scaler)
            deltas = [p.detach() for p in params]
            for d, s in zip(deltas, start, strict=True):
                d.sub_(s)  # the parameters now hold the updates
            self._allreduce(deltas, self.eps)
            for d, s in zip(deltas, start, strict=True):
                d.add_(s)
        self._sync_buffers()

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer moments and loss scale (rank 0's are the checkpoint's own)."""
        env = self.env
        if env is None or not env.distributed or env.is_main or self._optimizer is None:
            return {}
        state: dict[str, Any] = {"optimizer": self._optimizer.state_dict()["state"]}
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Applied at the next step (the optimizer is not known before)."""
        self._pending = dict(state_dict) if state_dict else None

    def _restore_pending(
        self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None
    ) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None
        if "optimizer" in pending:
            full = optimizer.state_dict()  # keeps the current param groups (learning rates)
            full["state"] = pending["optimizer"]
            optimizer.load_state_dict(full)
        if scaler is not None and "scaler" in pending:
            scaler.load_state_dict(pending["scaler"])


# ================================================================================================
# helpers
# ================================================================================================
def _check_hierarchy(env: DistEnv) -> int:
    """``local_world_size`` after checking that ranks are node-major and there are >= 2 nodes."""
    local = env.local_world_size
    if env.world_size == local:
        raise ValueError(
            f"hierarchical Adasum on a single node ({env.world_size} ranks, local_world_size "
            f"{local}) would be plain averaging; drop --adasum-hierarchical to run Adasum "
            "between these ranks, or use --grad-combine average"
        )
    if local < 1 or env.world_size % local:
        raise ValueError(
            f"hierarchical Adasum needs the same number of ranks on every node: world size "
            f"{env.world_size} is not a multiple of local_world_size {local}"
        )
    layout = env.all_gather_object((env.rank, env.local_rank))
    bad = [(r, lr) for r, lr in layout if lr != r % local]
    if bad:
        raise ValueError(
            f"hierarchical Adasum needs node-major ranks (local_rank == rank % {local}, as "
            f"torchrun assigns them); got (rank, local_rank) {bad[:4]}"
        )
    return local
