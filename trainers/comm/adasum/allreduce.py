"""The Adasum allreduce: the binary tree by vector-halving distance-doubling (see the package)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .kernels import _BUFFERS, _accumulate_dots, _apply_, _workspace
from .rule import EPS, _coefficient_pair

__all__ = ["DEFAULT_BUCKET_CAP_MB", "adasum_allreduce_", "adasum_bucket_allreduce_"]

DEFAULT_BUCKET_CAP_MB = 64.0  # Horovod's default fusion threshold
_PIECE = 1 << 20  # elements per message of a level: the grain of communication overlap
_PACK_BELOW = 1 << 14  # smaller tensors travel packed together; larger ones from their memory
_SELF: Any = object()  # "a group of one": no communication
# torch 2.13 renamed the single-tensor collectives; older versions only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _coefficient_lists(
    part: Tensor, group: Any, left: bool, eps: float
) -> tuple[list[float], list[float]]:
    """Sum the partial dots over ``group``; per tensor: (this side's, the other's) coefficient."""
    if group is not _SELF:
        dist.all_reduce(part, group=group)
    pairs = [_coefficient_pair(*row, eps) for row in part.tolist()]  # one host sync
    mine, other = (0, 1) if left else (1, 0)
    return [c[mine] for c in pairs], [c[other] for c in pairs]


def _combine_(
    x: _Segments, b: Tensor, lo: int, bounds: Sequence[int], left: bool, group: Any, eps: float
) -> None:
    """``x = adasum(x, b)`` per tensor on this rank's slice (dots summed over ``group``)."""
    part = torch.zeros(len(bounds) - 1, 3, dtype=torch.float64, device=b.device)
    frags = x.frags(0, x.numel)
    for s, e, a in frags:
        _accumulate_dots(a, b[s:e], lo + s, bounds, left, part)
    mine, other = _coefficient_lists(part, group, left, eps)
    for s, e, a in frags:
        _apply_(a, b[s:e], lo + s, bounds, mine, other)


_EARLY_RULE = True  # combine a rank's own tensors as their dots complete (False: after all)


def _own(bounds: Sequence[int], lo: int, hi: int) -> list[int]:
    """The tensors lying wholly inside the global range [lo, hi): no other rank of a level's
    group holds a part of them, so their dot sums are complete on this rank alone (the
    group's allreduce adds exact zeros to them)."""
    first = bisect.bisect_left(bounds, lo)
    last = bisect.bisect_right(bounds, hi) - 1  # bounds[first] >= lo, bounds[last] <= hi
    return list(range(first, last)) if last > first else []


def _fill(mine: list[float], other: list[float], t0: int, m: list[float], o: list[float]) -> None:
    mine[t0 : t0 + len(m)] = m
    other[t0 : t0 + len(o)] = o


def _apply_range_(
    x: _Segments, theirs: Tensor, k0: int, lo: int, bounds: Sequence[int], s0: int, e0: int,
    mine: list[float], other: list[float],
) -> None:  # fmt: skip
    """The rule on ``x[s0:e0]`` (``theirs`` holds the partner's data from ``k0`` on)."""
    for s, e, a in x.frags(s0, e0):
        _apply_(a, theirs[s - k0 : e - k0], lo + s, bounds, mine, other)


# ================================================================================================
# the buffer: a bucket's tensors as one range of elements, left where they live
# ================================================================================================
class _Segments:
    """A bucket's fused range ``[0, numel)`` as contiguous pieces of memory (segments).

    The exchange sees one flat buffer; the memory behind it is each large tensor itself (no
    copy in or out) and one packed buffer for the small ones (one message instead of many).
    Segment boundaries depend only on the tensors' sizes, so every rank cuts a range into
    the same messages.
    """

    def __init__(self, starts: list[int], mems: list[Tensor]) -> None:
        self.starts = starts  # global start of each segment, then the end
        self.mems = mems  # 1-D, contiguous, len starts[i + 1] - starts[i]
        self.numel = starts[-1]
        self.dtype = mems[0].dtype
        self.device = mems[0].device

    @classmethod
    def flat(cls, x: Tensor) -> _Segments:
        return cls([0, x.numel()], [x])

    def frags(self, begin: int, end: int) -> list[tuple[int, int, Tensor]]:
        """``(start, end, memory)`` of every segment's part of the range [begin, end)."""
        out = []
        i = max(bisect.bisect_right(self.starts, begin) - 1, 0)
        while i < len(self.mems) and self.starts[i] < end:
            s, e = max(begin, self.starts[i]), min(end, self.starts[i + 1])
            if e > s:
                out.append((s, e, self.mems[i][s - self.starts[i] : e - self.starts[i]]))
            i += 1
        return out

    def pieces(self, begin: int, end: int) -> list[tuple[int, int, Tensor]]:
        """:meth:`frags`, each cut into messages of at most ``_PIECE`` elements."""
        out = []
        for s, e, mem in self.frags(begin, end):
            for k in range(s, e, _PIECE):
                out.append((k, min(k + _PIECE, e), mem[k - s : min(k + _PIECE, e) - s]))
        return out


def _start_level(
    x: _Segments, recv: Tensor, keep: tuple[int, int], give: tuple[int, int], peer: int
) -> list[tuple[tuple[int, int, Tensor] | None, list[Any]]]:
    """Post one level's transfers piece by piece: send ``x[give]``, receive into ``recv``.

    Both sides cut their ranges the same way, so send ``i`` meets receive ``i``; each pair
    is one batch (NCCL needs the send and the receive of a pair grouped).
    """
    sends, recvs = x.pieces(*give), x.pieces(*keep)
    posted = []
    for i in range(max(len(sends), len(recvs))):
        ops = []
        if i < len(sends):
            ops.append(dist.P2POp(dist.isend, sends[i][2], peer, tag=i))
        piece = recvs[i] if i < len(recvs) else None
        if piece is not None:
            r = recv[piece[0] - keep[0] : piece[1] - keep[0]]
            ops.append(dist.P2POp(dist.irecv, r, peer, tag=i))
        posted.append((piece, dist.batch_isend_irecv(ops)))
    return posted


def _exchange(sends: Sequence[Tensor], recvs: Sequence[Tensor], peer: int) -> None:
    """Send ``sends`` to and receive ``recvs`` from rank ``peer`` concurrently, in one batch.

    Message ``i`` of one side meets message ``i`` of the other (empty ones are skipped).
    """
    ops = [dist.P2POp(dist.isend, t, peer, tag=i) for i, t in enumerate(sends) if t.numel()]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=i) for i, t in enumerate(recvs) if t.numel()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _mems(frags: list[tuple[int, int, Tensor]]) -> list[Tensor]:
    return [mem for _, _, mem in frags]


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
def _tree_(x: _Segments, lo: int, bounds: Sequence[int], plan: _Plan, eps: float) -> None:
    """This rank's slice ``x`` (global offset ``lo``) becomes the Adasum over the units.

    Communication overlaps the arithmetic: a level's halves travel in pieces and the dots of
    a piece are computed as soon as it arrives; after the coefficients are known, the part
    of the result the next level sends is computed first and its transfer starts while the
    rest is computed.
    """
    n = x.numel
    half = n - n // 2
    fold = n if plan.fold_keeper else 0
    recv = _workspace("recv", max(fold, half + half // 2 + 1), x.dtype, x.device)
    regions = (recv[:half], recv[half:])  # levels alternate: one receives, one is read
    if plan.fold_peer is not None:
        whole = x.frags(0, n)
        if not plan.fold_keeper:  # hand over, wait for the result
            _exchange(_mems(whole), [], plan.fold_peer)
            _exchange([], _mems(whole), plan.fold_peer)
            return
        _exchange([], [recv[s:e] for s, e, _ in whole], plan.fold_peer)
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
        mine, other = [1.0] * (len(bounds) - 1), [1.0] * (len(bounds) - 1)
        own = _own(bounds, lo + k0, lo + k1) if _EARLY_RULE else []
        done = 0  # own[:done] are combined
        for piece, works in posted:
            for work in works:
                work.wait()
            if piece is None:
                continue
            s, e, a = piece
            _accumulate_dots(a, theirs[s - k0 : e - k0], lo + s, bounds, level.left, part)
            ready = done
            while ready < len(own) and bounds[own[ready] + 1] <= lo + e:
                ready += 1
            if ready > done:  # their dots are complete: combine them while the data is warm
                t0, t1 = own[done], own[ready - 1] + 1
                _fill(mine, other, t0, *_coefficient_lists(part[t0:t1], _SELF, level.left, eps))
                _apply_range_(
                    x, theirs, k0, lo, bounds, bounds[t0] - lo, bounds[t1] - lo, mine, other
                )
                done = ready
        _fill(mine, other, 0, *_coefficient_lists(part, level.group, level.left, eps))
        # what is left: the tensors this rank shares with another one of the group
        rest = [(k0, bounds[own[0]] - lo), (bounds[own[-1] + 1] - lo, k1)] if own else [(k0, k1)]
        last = i + 1 == len(plan.levels)  # else: next level's outgoing half first, start it
        order = [(k0, k1)] if last else [splits[i + 1][1], splits[i + 1][0]]
        for j, (s0, e0) in enumerate(order):
            for r0, r1 in rest:
                if min(e0, r1) > max(s0, r0):
                    _apply_range_(x, theirs, k0, lo, bounds, max(s0, r0), min(e0, r1), mine, other)
            if j == 0 and len(order) == 2:
                posted = _start_level(x, regions[(i + 1) % 2], *splits[i + 1], plan.levels[i + 1].peer)  # fmt: skip

    for level, (keep, give) in zip(reversed(plan.levels), reversed(splits), strict=True):
        _exchange(_mems(x.frags(*keep)), _mems(x.frags(*give)), level.peer)  # allgather

    if plan.fold_peer is not None:
        _exchange(_mems(x.frags(0, n)), [], plan.fold_peer)


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
    shared = _overlapping(tensors) if local_size == 1 else set()
    for bucket in _buckets(tensors, cap):
        _allreduce_bucket([tensors[i] for i in bucket], plan, eps, shared)
    return tensors


@torch.no_grad()
def adasum_bucket_allreduce_(
    tensors: Sequence[Tensor], *, local_size: int = 1, eps: float = EPS
) -> None:
    """:func:`adasum_allreduce_` of ``tensors`` as **one** bucket, whatever their size (the
    caller cut the buckets: the overlapped gradient mode, :mod:`trainers.comm.overlap`).
    Same collective rules; the tensors share one device and dtype."""
    if not tensors or not dist.is_available() or not dist.is_initialized():
        return
    if dist.get_world_size() == 1:
        return
    kinds = {(t.device, t.dtype) for t in tensors}
    if len(kinds) > 1 or not all(t.is_floating_point() and not t.is_sparse for t in tensors):
        raise TypeError(f"one bucket needs dense floating-point tensors of one kind, got {kinds}")
    plan = _get_plan(local_size, tensors[0].device)
    shared = _overlapping(tensors) if local_size == 1 else set()
    _allreduce_bucket(list(tensors), plan, eps, shared)


def _allreduce_bucket(tensors: list[Tensor], plan: _Plan, eps: float, shared: set[int]) -> None:
    m = plan.local_size
    if m == 1:
        _allreduce_in_place(tensors, plan, eps, shared)
        return
    bounds = _bounds(tensors)
    n = bounds[-1]
    if n == 0:
        return
    shard_len = -(-n // m)  # hierarchical: each rank of a node owns one shard
    flat = _workspace("flat", shard_len * m, tensors[0].dtype, tensors[0].device)
    torch.cat([t.reshape(-1) for t in tensors], out=flat[:n])
    flat[n:].zero_()
    shard = _workspace("shard", shard_len, flat.dtype, flat.device)
    _reduce_scatter(shard, flat, op=dist.ReduceOp.SUM, group=plan.node_group)
    shard.div_(m)
    _tree_(_Segments.flat(shard), plan.position * shard_len, bounds, plan, eps)
    _all_gather(flat, shard, group=plan.node_group)
    for t, lo, hi in zip(tensors, bounds[:-1], bounds[1:], strict=True):
        t.copy_(flat[lo:hi].view_as(t))


def _bounds(tensors: Sequence[Tensor]) -> list[int]:
    bounds = [0]
    for t in tensors:
        bounds.append(bounds[-1] + t.numel())
    return bounds


def _allreduce_in_place(tensors: list[Tensor], plan: _Plan, eps: float, shared: set[int]) -> None:
    """The flat tree on the bucket's tensors where they are (no fusion copy for large ones).

    The fused range holds the small tensors first (packed into one buffer: one message), then
    the large ones, each a segment of its own, in the given order. The split points differ
    from those of the given order, which changes only the order in which the partial dot
    sums add up. A large tensor that is not contiguous, or shares memory with another tensor
    of the call (``id`` in ``shared``), goes through the packed buffer too; copies go back in
    the given order, as from a fusion buffer.
    """
    small = [i for i, t in enumerate(tensors) if t.numel() < _PACK_BELOW]
    large = [i for i, t in enumerate(tensors) if t.numel() >= _PACK_BELOW]
    order = small + large
    bounds = _bounds([tensors[i] for i in order])
    if bounds[-1] == 0:
        return
    in_place = {i for i in large if tensors[i].is_contiguous() and id(tensors[i]) not in shared}
    n_small = bounds[len(small)]
    stage = _workspace(
        "flat",
        bounds[-1] - sum(tensors[i].numel() for i in in_place),
        tensors[0].dtype,
        tensors[0].device,
    )
    if n_small:
        torch.cat([tensors[i].reshape(-1) for i in small], out=stage[:n_small])
    starts, mems = ([0, n_small], [stage[:n_small]]) if n_small else ([0], [])
    back = [(i, stage[lo:hi]) for i, lo, hi in zip(small, bounds, bounds[1:], strict=False)]
    offset = n_small
    for i in large:
        t = tensors[i]
        if i in in_place:
            mem = t.view(-1)
        else:
            mem = stage[offset : offset + t.numel()]
            mem.view(t.shape).copy_(t)
            back.append((i, mem))
            offset += t.numel()
        starts.append(starts[-1] + t.numel())
        mems.append(mem)
    _tree_(_Segments(starts, mems), 0, bounds, plan, eps)
    for i, mem in sorted(back, key=lambda item: item[0]):
        tensors[i].copy_(mem.view(tensors[i].shape))


def _overlapping(tensors: Sequence[Tensor]) -> set[int]:
    """``id`` of every tensor whose memory overlaps another's (those must not be updated in
    place one after the other)."""
    spans = []
    for t in tensors:
        if t.numel():
            extent = 1 + sum(
                (size - 1) * stride for size, stride in zip(t.shape, t.stride(), strict=True)
            )
            start = t.data_ptr()
            spans.append((start, start + extent * t.element_size(), id(t)))
    spans.sort()
    shared: set[int] = set()
    reach, holder = -1, None
    for start, end, key in spans:
        if start < reach:
            shared.update((key, holder))
        if end > reach:
            reach, holder = end, key
    return shared
