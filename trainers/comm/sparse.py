"""Sparse allreduce: the sum over the workers of vectors given as sorted (index, value) streams.

SparCML (Renggli, Ashkboos, Aghagolzadeh, Alistarh, Hoefler; SC 2019) observes that an
all-gather of every worker's ``k`` (index, value) pairs -- what a top-k compressor sends --
hands every worker ``N k`` pairs, a cost that grows with the number of workers ``N``, while
the *sum* of the workers' vectors usually has far fewer than ``N k`` non-zeros because their
supports overlap. The algorithms here reduce the streams instead of gathering them:

``allgather``
    Every worker all-gathers the others' pairs (padded to the longest stream) and sums them
    in rank order. One collective of ``(N - 1) max_r k_r`` pairs per worker: the baseline.
``recursive_doubling``
    ``log2 N`` rounds; in round ``s`` worker ``r`` swaps its current partial sum with worker
    ``r xor 2^s`` and merges the two sorted streams (latency-optimal: ``log2 N`` messages
    when every worker's stream length is known -- always under ``auto`` -- as each swap is
    then one message padded to the bound on the partner's partial sum; otherwise a length
    message precedes each stream).
    A world size that is not a power of two is folded first: the ``N - p`` workers above the
    largest power of two ``p`` hand their stream to worker ``r - p`` and get the result back.
``split_allgather``
    Worker ``j`` owns the ``j``-th of ``N`` contiguous index ranges. Every worker sends each
    owner its pairs in that range (a sparse reduce-scatter, in ``N - 1`` rounds of one send
    and one receive: round ``s`` to worker ``r + s``, from ``r - s``), the owner sums them in
    rank order, then the owners' summed ranges are all-gathered (a ring all-gather, each range
    padded to the longest). Each pair of the sum crosses the network ``N - 1`` times, never
    ``N (N - 1)`` times (bandwidth-optimal for large ``k``).
``dense``
    Scatter into a dense buffer and ``all_reduce`` it.

**The switch to dense.** A stream of ``nnz`` pairs costs ``nnz (i + v)`` bytes (``i``: the
index width, 4 bytes below 2^31 elements; ``v``: one value, or one row of values), the dense
buffer ``numel v``. Every stream a worker sends -- a partial sum of recursive doubling, a
summed range of split-allgather -- is sent dense once ``nnz (i + v) >= numel v``, i.e. past
the density ``v / (i + v)`` (1/2 for fp32 values with int32 indices), and stays dense:
:func:`dense_threshold` is that count.

**The automatic choice** (``algorithm="auto"``): every worker all-gathers its stream length
(one small message), and :func:`choose_algorithm` evaluates on those lengths, identically on
every worker, a latency-bandwidth cost ``messages * latency + bytes / bandwidth`` of each
algorithm. The size of the sum is what separates the sparse algorithms (recursive doubling
forwards partial sums, split-allgather the final one once): the caller may pass ``union``,
its estimate (the compressors pass the previous step's), else it is bounded by
``min(numel, sum of the lengths)`` (disjoint supports). :class:`CostModel` holds the two constants;
``benchmarks/bench_sparse.py`` measures the algorithms against each other.

**Exactness.** The result is the sum of the workers' vectors, identical on every worker.
``allgather`` and ``split_allgather`` add each index's values in rank order, starting from 0
(exactly what summing the densified vectors in rank order gives, bit for bit);
``recursive_doubling`` adds them in its tree's order (partial sums of rank groups), and
``dense`` in the collective library's order, so these two may differ from the others in the
last bits when three or more workers hold the same index. Two workers' values are always
added in one operation, so at two workers every algorithm gives the same bits.

**Bytes.** :attr:`SparseResult.bytes_sent` is what this worker hands to the network: exact
for the point-to-point messages (headers included), ``(N - 1) B`` for the all-gather of a
``B``-byte stream and ``2 (N - 1) / N B`` for the ``all_reduce`` of a ``B``-byte buffer (the
ring algorithms' volume; the library may use others).

The collectives used -- ``all_gather`` of equal-size tensors, ``isend``/``irecv``,
``all_reduce`` -- exist on gloo and NCCL; every buffer lives on the values' device.

Example (one process: the input comes back)::

    >>> r = sparse_allreduce(torch.tensor([1, 3]), torch.tensor([2.0, -1.0]), 5)
    >>> r.to_dense()
    tensor([ 0.,  2.,  0., -1.,  0.])
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .cost import alpha_beta

__all__ = [
    "ALGORITHMS",
    "CostModel",
    "SparseResult",
    "choose_algorithm",
    "dense_threshold",
    "estimate_costs",
    "estimate_features",
    "fit_nonnegative",
    "measure_compute",
    "sparse_allreduce",
]

ALGORITHMS = ("allgather", "recursive_doubling", "split_allgather", "dense")
CHOICES = ("auto", *ALGORITHMS)
_HEADER_BYTES = 8  # one int64: a stream's length, or -1 for a dense buffer


@dataclass(frozen=True)
class CostModel:
    """One worker's time: ``messages * latency + bytes / bandwidth`` on the network, plus its
    computation, ``merged * merge`` (elements summed through a sort: sparse partial sums),
    ``scanned * scan`` (elements of the dense scratch buffer a large partial sum is found in:
    zeroed, then searched for its non-zeros), ``filled * fill`` (elements of a fresh dense
    buffer: the densified input or result) and ``scattered * scatter`` (elements added or
    written into a dense buffer, or read back from it), the computation multiplied by
    ``cpu_share`` when it is above 1.

    The network defaults (``latency``, ``bandwidth``, ``swap``) are fitted to
    ``benchmarks/bench_sparse.py``'s measurements of gloo between processes on one 2-core
    machine; the computation's (``merge``, ``scan``, ``fill``, ``scatter``) are
    :func:`measure_compute`'s on one thread of the project's Intel Xeon machine (2026-12-07,
    four measurements: 4.1-5.7e-8, 0.54-1.04e-8, 1.8-4.3e-10 and 1.6-4.3e-9 s per element).
    :meth:`measure_compute` measures them on this machine; pass your own network's latency
    and bandwidth (``benchmarks/bench_sparse.py --netlab`` shows how they are measured).

    Attributes:
        cpu_share: workers that compute at once per core of their machine (the sums of every
            algorithm run on all workers at the same moment): 1 on a cluster whose workers have
            a core each, ``workers / cores`` when they share one machine (the lab network).
    """

    latency: float = 1.5e-3  # seconds per message
    bandwidth: float = 1e9  # bytes per second
    merge: float = 40e-9  # seconds per element merged by sorting
    scan: float = 8e-9  # seconds per element of a dense scratch buffer
    #: messages' latency one point-to-point swap (recursive doubling) costs: a swap driven
    #: from Python waits on both directions, about 4 of a collective's ring steps here
    swap: float = 4.0
    fill: float = 3e-10  # seconds per element of a fresh dense buffer
    scatter: float = 2.5e-9  # seconds per element scattered into (or gathered from) a dense buffer
    cpu_share: float = 1.0

    def __post_init__(self) -> None:
        compute = (self.merge, self.scan, self.fill, self.scatter)
        if not (
            self.latency >= 0 and self.bandwidth > 0 and min(compute) >= 0 and self.swap > 0
            and self.cpu_share > 0
        ):  # fmt: skip
            raise ValueError(
                f"CostModel: latency, merge, scan, fill and scatter must be >= 0, bandwidth > 0, "
                f"swap > 0 and cpu_share > 0, got latency={self.latency}, merge={self.merge}, "
                f"scan={self.scan}, fill={self.fill}, scatter={self.scatter}, "
                f"bandwidth={self.bandwidth}, swap={self.swap}, cpu_share={self.cpu_share}"
            )

    def time(self, messages: float, nbytes: float, merged: float = 0, scanned: float = 0,
             filled: float = 0, scattered: float = 0) -> float:  # fmt: skip
        """The network's share by the project's one latency-bandwidth model
        (:func:`trainers.comm.cost.alpha_beta`), plus the computation."""
        wire = alpha_beta(messages, nbytes, latency_s=self.latency, rate=self.bandwidth)
        work = (merged * self.merge + scanned * self.scan + filled * self.fill
                + scattered * self.scatter)  # fmt: skip
        return wire + max(1.0, self.cpu_share) * work

    @classmethod
    def measure_compute(cls, numel: int = 1 << 22, repeats: int = 5, **network) -> CostModel:
        """A model whose four computation constants are measured here, in this process, on the
        module's own sums (:func:`measure_compute`); ``network``: the other fields."""
        return cls(**measure_compute(numel, repeats), **network)


@dataclass
class SparseResult:
    """The sum over the workers: sorted unique ``indices`` and their ``values``, or (when the
    sum was sent dense) ``indices is None`` and ``values`` the whole ``(numel, *row)`` buffer.

    Attributes:
        algorithm: the algorithm that ran (``"local"`` in a world of one).
        bytes_sent: bytes this worker handed to the network (module docstring).
        messages: the messages this worker sent (a collective counts as its ring steps).
    """

    numel: int
    indices: Tensor | None
    values: Tensor
    algorithm: str
    bytes_sent: int = 0
    messages: int = 0

    @property
    def dense(self) -> bool:
        return self.indices is None

    @property
    def nnz(self) -> int:
        """Rows of the sum that were sent (``numel`` when dense)."""
        return self.numel if self.indices is None else int(self.indices.numel())

    def to_dense(self) -> Tensor:
        if self.indices is None:
            return self.values
        out = self.values.new_zeros((self.numel, *self.values.shape[1:]))
        out[self.indices] = self.values
        return out


# ---------------------------------------------------------------------------------- helpers
def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel <= 2**31 - 1 else torch.int64


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def dense_threshold(numel: int, row_bytes: int, index_bytes: int | None = None) -> int:
    """The stream length from which a dense buffer is no larger: the smallest ``nnz`` with
    ``nnz (index_bytes + row_bytes) >= numel row_bytes``."""
    i = index_bytes if index_bytes is not None else _index_dtype(numel).itemsize
    return math.ceil(numel * row_bytes / (i + row_bytes))


def _row_bytes(values: Tensor, acc: torch.dtype) -> int:
    return acc.itemsize * math.prod(values.shape[1:])


class _Stream:
    """A partial sum: sorted unique indices + values, or a dense buffer (``idx is None``)."""

    __slots__ = ("idx", "val")

    def __init__(self, idx: Tensor | None, val: Tensor) -> None:
        self.idx, self.val = idx, val

    @property
    def count(self) -> int:
        return -1 if self.idx is None else int(self.idx.numel())

    def densify(self, numel: int) -> _Stream:
        if self.idx is None:
            return self
        out = self.val.new_zeros((numel, *self.val.shape[1:]))
        out[self.idx] = self.val
        return _Stream(None, out)


def _sum_in_order(
    streams: Sequence[_Stream], numel: int, lo: int = 0, dense: bool = False
) -> _Stream:
    """The sum of ``streams`` (sparse indices in ``[lo, lo + numel)``; dense ones of
    ``numel`` rows) with each index's values added in the given order, from 0; ``dense``:
    returned as a dense buffer."""
    ref = streams[0].val
    if dense or any(s.idx is None for s in streams):
        out = ref.new_zeros((numel, *ref.shape[1:]))
        for s in streams:
            if s.idx is None:
                out += s.val
            elif s.idx.numel():
                out.index_add_(0, s.idx - lo if lo else s.idx, s.val)
        return _Stream(None, out)
    total = sum(int(s.idx.numel()) for s in streams)
    if total * 8 >= numel:  # a dense scratch buffer: O(numel + total), no sort
        acc = ref.new_zeros((numel, *ref.shape[1:]))
        seen = torch.zeros(numel, dtype=torch.bool, device=ref.device)
        for s in streams:  # one index_add per stream: no index repeats within a call
            if s.idx.numel():
                local = s.idx - lo if lo else s.idx
                acc.index_add_(0, local, s.val)
                seen[local] = True
        where = seen.nonzero().squeeze(1)
        return _Stream(where + lo if lo else where, acc[where])
    # the union by one stable sort of the concatenated indices; each stream is then added at
    # its positions in the union, stream by stream (rank order, deterministic on any device)
    cat = torch.cat([s.idx for s in streams])
    if cat.numel() == 0:
        return _Stream(cat, ref.new_zeros((0, *ref.shape[1:])))
    ordered, perm = torch.sort(cat, stable=True)
    new = torch.ones_like(ordered, dtype=torch.bool)
    new[1:] = ordered[1:] != ordered[:-1]
    union = ordered[new]
    position = torch.empty_like(cat)
    position[perm] = torch.cumsum(new, 0) - 1
    out = ref.new_zeros((union.numel(), *ref.shape[1:]))
    start = 0
    for s in streams:
        n = int(s.idx.numel())
        if n:
            out.index_add_(0, position[start : start + n], s.val)
        start += n
    return _Stream(union, out)


def _maybe_densify(s: _Stream, numel: int, threshold: int) -> _Stream:
    return s.densify(numel) if s.idx is not None and s.idx.numel() >= threshold else s


def _pack(s: _Stream, index_dtype: torch.dtype) -> Tensor:
    """One uint8 buffer: the values, then the indices (``index_dtype``); dense: the values.
    Values first, so that both parts stay aligned for fp32/fp64 values and int32 indices."""
    val = s.val.contiguous().reshape(-1).view(torch.uint8)
    if s.idx is None:
        return val
    return torch.cat([val, s.idx.to(index_dtype).view(torch.uint8)])


def _unpack(buf: Tensor, count: int, shape: tuple[int, ...], dtype: torch.dtype,
            index_dtype: torch.dtype, numel: int) -> _Stream:  # fmt: skip
    row = math.prod(shape)
    if count < 0:
        return _Stream(None, buf[: numel * row * dtype.itemsize].view(dtype).reshape(numel, *shape))
    cut = count * row * dtype.itemsize
    val = buf[:cut].view(dtype).reshape(count, *shape)
    raw = buf[cut : cut + count * index_dtype.itemsize]
    if cut % index_dtype.itemsize:  # int64 indices after an odd number of fp32 values
        raw = raw.clone()
    return _Stream(raw.view(index_dtype).long(), val)


def _packed_bytes(count: int, numel: int, row_bytes: int, index_bytes: int) -> int:
    return numel * row_bytes if count < 0 else count * (index_bytes + row_bytes)


class _Comm:
    """Point-to-point and collective calls on ``group``, counting what this worker sends."""

    def __init__(self, group: object | None, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.bytes = 0
        self.messages = 0

    def _sent(self, nbytes: int, messages: int) -> None:
        """Count what a call handed to the network (benchmarks/bench_sparse.py wraps this to
        inject a link's per-byte delay)."""
        self.bytes += int(nbytes)
        self.messages += int(messages)

    def _global(self, r: int) -> int:
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def swap(self, peer: int, send: Tensor, recv: Tensor) -> None:
        """Send ``send`` to ``peer`` and receive ``recv`` from it.

        The receive is posted first: with the send first, gloo often lets one direction
        finish before the other starts, and a swap over a real link took twice the
        one-way time (0.66 s instead of 0.34 s for 4 MB at 100 Mbit, docs/communication.md)."""
        ops = [dist.P2POp(dist.irecv, recv, self._global(peer), self.group),
               dist.P2POp(dist.isend, send, self._global(peer), self.group)]  # fmt: skip
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        self._sent(send.numel() * send.element_size(), 1)

    def exchange(self, sends: dict[int, Tensor], recvs: dict[int, Tensor]) -> None:
        """Send ``sends[peer]`` to each peer and receive ``recvs[peer]`` from each, in
        ``size - 1`` rounds: in round ``s`` this worker sends to ``rank + s`` and receives from
        ``rank - s`` (mod ``size``), so that every worker receives from one peer at a time.

        Posting every transfer at once makes all peers send to each worker together, and on a
        capped link that incast overflows the queue: at 100 Mbit on the lab network it cost
        tens of thousands of TCP retransmissions and up to 2x the time
        (docs/communication.md)."""
        for step in range(1, self.size):
            to, frm = (self.rank + step) % self.size, (self.rank - step) % self.size
            # the receive first, as in swap()
            ops = []
            if frm in recvs:
                ops.append(dist.P2POp(dist.irecv, recvs[frm], self._global(frm), self.group))
            if to in sends:
                ops.append(dist.P2POp(dist.isend, sends[to], self._global(to), self.group))
            if ops:
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
        self._sent(sum(t.numel() * t.element_size() for t in sends.values()), len(sends))

    def send(self, peer: int, t: Tensor) -> None:
        dist.send(t, self._global(peer), self.group)
        self._sent(t.numel() * t.element_size(), 1)

    def recv(self, peer: int, t: Tensor) -> None:
        dist.recv(t, self._global(peer), self.group)

    def all_gather(self, t: Tensor) -> list[Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        self._sent((self.size - 1) * t.numel() * t.element_size(), self.size - 1)
        return out

    def all_reduce(self, t: Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        self._sent(round(2 * (self.size - 1) / self.size * t.numel() * t.element_size()),
                   2 * (self.size - 1))  # fmt: skip

    def header(self, count: int) -> Tensor:
        return torch.tensor([count], dtype=torch.int64, device=self.device)


# ------------------------------------------------------------------------------- cost model
def range_bounds(numel: int, parts: int) -> list[int]:
    """``parts + 1`` boundaries of contiguous index ranges whose sizes differ by at most 1."""
    base, extra = divmod(numel, parts)
    bounds = [0]
    for j in range(parts):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return bounds


def estimate_features(
    counts: Sequence[int], numel: int, row_bytes: int, index_bytes: int | None = None,
    union: int | None = None, swap: float = CostModel.swap, dense_output: bool = False,
) -> dict[str, tuple[float, float, float, float, float, float]]:  # fmt: skip
    """Per algorithm, one worker's ``(messages, bytes, merged, scanned, filled, scattered)``
    (see :class:`CostModel`) for streams of ``counts`` pairs, one per worker. ``union``: the
    expected non-zeros of the sum (e.g. the last call's); without it, the bound
    ``min(numel, sum(counts))`` (disjoint supports). ``dense_output``: the sum is wanted as a
    dense buffer (:func:`sparse_allreduce`'s argument).

    The bytes are exact (frames are padded to bounds both sides know); the computation counts
    the elements each step of the algorithms touches, with the partial sums of recursive
    doubling estimated from ``union`` as a support all workers share plus draws of their own
    (``g`` workers' partial sum: ``c + g (k - c)``, ``c`` such that ``N`` workers give
    ``union``)."""
    n = len(counts)
    i = index_bytes if index_bytes is not None else _index_dtype(numel).itemsize
    pair = i + row_bytes
    total = min(numel, sum(counts)) if union is None else min(numel, max(union, max(counts)))
    k = max(counts)
    common = max(0.0, (n * k - total) / (n - 1)) if n > 1 else float(k)

    def grown(group: int) -> float:  # estimated non-zeros of ``group`` workers' partial sum
        return min(float(numel), common + group * (k - common), float(total))

    def stream(nnz: float, length: float = numel) -> float:  # bytes of a stream, dense-capped
        return min(nnz * pair, length * row_bytes)

    def summed(elements: float, length: float, out: float) -> tuple[float, float, float, float]:
        """(merged, scanned, filled, scattered) of one rank-order sum of ``elements`` pairs
        into ``out`` non-zeros: a sort, or a dense scratch buffer past 1/8 of ``length``."""
        if elements * 8 >= length:  # index_add and mark each element, gather the non-zeros
            return (0.0, float(length), 0.0, 2.0 * elements + out)
        return (float(elements), 0.0, 0.0, float(elements))

    def densified(nnz: float) -> tuple[float, float, float, float]:  # a stream made dense
        return (0.0, 0.0, float(numel), float(nnz))

    def add(*parts: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(map(sum, zip(*parts, strict=True)))

    threshold = dense_threshold(numel, row_bytes, i)
    out = {
        "dense": (2 * (n - 1), 2 * (n - 1) / n * numel * row_bytes, *densified(k)),
        # the lengths are known (given, or all-gathered for ``auto`` before it chooses): one
        # ring all-gather of the streams padded to the longest
        "allgather": (
            n - 1, (n - 1) * k * pair,
            *(densified(sum(counts)) if dense_output else summed(sum(counts), numel, total)),
        ),
    }  # fmt: skip
    # recursive doubling: fold, then log2(p) swaps of header + stream (the largest partial sum)
    p = 1 << (n.bit_length() - 1)
    folded = [counts[r] + (counts[r + p] if r + p < n else 0) for r in range(p)]
    msgs = nbytes = 0.0
    work: tuple[float, ...] = (0.0,) * 4
    dense_now = k >= threshold
    if dense_now:
        work = densified(k)
    # a framed swap is one message each way, priced as ``swap`` ring steps (CostModel)
    if p < n:  # to r - p and back (the result's frame: padded to the sum of the lengths)
        msgs += 2 * swap
        nbytes += 8 + stream(max(counts[p:])) + 8 + stream(min(numel, sum(counts)))
        work = add(work, summed(2 * k, numel, grown(2)))
    group = 1
    while group < p:
        # the frame is padded to the bound on the partner's partial sum (not to ``total``)
        partial = min(numel, max(sum(folded[g : g + group]) for g in range(0, p, group)))
        msgs += swap
        nbytes += 8 + stream(partial)
        if dense_now or partial * pair >= numel * row_bytes:
            work = add(work, (0.0, 0.0, float(numel), 0.0))  # dense + dense: one add
        else:
            ours, merged = grown(group * n / p), grown(2 * group * n / p)
            work = add(work, summed(2 * ours, numel, merged))
            if merged >= threshold:  # sent dense from here on
                dense_now = True
                work = add(work, densified(merged))
        group *= 2
    if dense_output and not dense_now:
        work = add(work, densified(total))
    out["recursive_doubling"] = (msgs, nbytes, *work)
    # split-allgather: counts, the reduce-scatter (a swap with each peer in turn), the owned
    # range's sum, headers, the ring all-gather of the owned ranges (padded to the longest)
    share = numel / n
    owned = summed(sum(counts) / n, share, total / n)
    assembled = densified(total) if dense_output else (0.0, 0.0, 0.0, float(total))
    out["split_allgather"] = (
        3 * (n - 1) + (n - 1) * swap,
        (n - 1) * 8 * n + k * pair * (n - 1) / n + (n - 1) * 8
        + (n - 1) * stream(total / n, share),
        *add(owned, assembled),
    )  # fmt: skip
    return out


def measure_compute(numel: int = 1 << 22, repeats: int = 5) -> dict[str, float]:
    """:class:`CostModel`'s computation constants (``merge``, ``scan``, ``fill``,
    ``scatter``), measured in this process with its threads: the module's own rank-order sums
    by sorting and in a dense scratch buffer, and densified streams, each timed ``repeats``
    times (median) on random streams over ``numel`` elements, the four constants fitted to
    those times by least squares on relative error, kept >= 0.

    A machine's constants, not a network's: ``benchmarks/bench_sparse.py --netlab`` prices the
    algorithms with them and the lab link's latency and bandwidth."""
    import time  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)

    def streams(workers: int, k: int) -> list[_Stream]:
        return [_Stream(torch.randperm(numel, generator=gen)[:k].sort().values,
                        torch.randn(k, generator=gen)) for _ in range(workers)]  # fmt: skip

    def median_time(fn) -> float:
        fn()  # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    rows, times = [], []
    for workers, density in ((2, 0.002), (2, 0.01), (4, 0.01), (2, 0.05), (4, 0.1), (2, 0.3),
                             (8, 0.1)):  # fmt: skip
        k = max(1, round(density * numel))
        parts = streams(workers, k)
        total = workers * k
        result = _sum_in_order(parts, numel)
        if total * 8 >= numel:  # the dense scratch buffer
            rows.append((0.0, numel, 0.0, 2.0 * total + result.count))
        else:
            rows.append((total, 0.0, 0.0, total))
        times.append(median_time(lambda p=parts: _sum_in_order(p, numel)))
    for density in (0.001, 0.05, 0.3):
        (part,) = streams(1, max(1, round(density * numel)))
        rows.append((0.0, 0.0, numel, part.count))
        times.append(median_time(lambda s=part: s.densify(numel)))
    full = fit_nonnegative(rows, times)
    return dict(zip(("merge", "scan", "fill", "scatter"), full, strict=True))


def fit_nonnegative(rows: Sequence[Sequence[float]], times: Sequence[float]) -> list[float]:
    """Coefficients ``x >= 0`` of ``times ~ rows @ x``, least squares on relative error
    (each equation divided by its time): solved unconstrained, then with the most negative
    term dropped, until none is negative (a term dropped is 0). Fits the cost model's
    constants to measured times (:func:`measure_compute`, ``benchmarks/bench_sparse.py``)."""
    a = torch.tensor(rows, dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64)
    weight = 1 / b
    active = list(range(a.shape[1]))
    while True:
        sol = torch.linalg.lstsq(a[:, active] * weight[:, None], (b * weight)[:, None]).solution
        sol = sol[:, 0]
        if (sol >= 0).all() or len(active) == 1:
            break
        active.pop(int(torch.argmin(sol)))
    full = [0.0] * a.shape[1]
    for j, v in zip(active, sol.tolist(), strict=True):
        full[j] = max(v, 0.0)
    return full


def estimate_costs(
    counts: Sequence[int], numel: int, row_bytes: int, index_bytes: int | None = None,
    cost: CostModel | None = None, union: int | None = None, dense_output: bool = False,
) -> dict[str, float]:  # fmt: skip
    """Each algorithm's estimated time (seconds): :func:`estimate_features` priced by
    ``cost`` (default :class:`CostModel`)."""
    cost = cost or CostModel()
    features = estimate_features(counts, numel, row_bytes, index_bytes, union, cost.swap,
                                 dense_output)  # fmt: skip
    return {name: cost.time(*f) for name, f in features.items()}


def choose_algorithm(
    counts: Sequence[int], numel: int, row_bytes: int, index_bytes: int | None = None,
    cost: CostModel | None = None, union: int | None = None, dense_output: bool = False,
) -> str:  # fmt: skip
    """The algorithm of least :func:`estimate_costs` (ties: the order of :data:`ALGORITHMS`)."""
    costs = estimate_costs(counts, numel, row_bytes, index_bytes, cost, union, dense_output)
    return min(ALGORITHMS, key=lambda a: costs[a])


# ------------------------------------------------------------------------------- algorithms
def _check(indices: Tensor, values: Tensor, numel: int) -> None:
    if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(
            f"sparse_allreduce: indices must be a 1-D integer tensor, got {indices.dtype} "
            f"of shape {tuple(indices.shape)}"
        )
    if values.dim() < 1 or values.shape[0] != indices.numel():
        raise ValueError(
            f"sparse_allreduce: values must have one row per index ({indices.numel()}), got "
            f"shape {tuple(values.shape)}"
        )
    if not values.dtype.is_floating_point:
        raise ValueError(f"sparse_allreduce: values must be floating point, got {values.dtype}")
    if numel < 1:
        raise ValueError(f"sparse_allreduce: numel must be >= 1, got {numel}")
    if indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        if lo < 0 or hi >= numel:
            raise ValueError(
                f"sparse_allreduce: indices must lie in [0, {numel}), got [{lo}, {hi}]"
            )
        if indices.numel() > 1 and not bool((indices[1:] > indices[:-1]).all()):
            raise ValueError(
                "sparse_allreduce: indices must be sorted and unique (torch.sort / "
                "torch.unique them, summing repeated indices' values)"
            )


def _allgather(comm: _Comm, s: _Stream, counts: list[int], numel: int, shape, acc, idt, dense):
    row = math.prod(shape) * acc.itemsize
    longest = max(_packed_bytes(c, numel, row, idt.itemsize) for c in counts)
    buf = _pack(s, idt)
    padded = torch.zeros(longest, dtype=torch.uint8, device=buf.device)
    padded[: buf.numel()] = buf
    gathered = comm.all_gather(padded)
    streams = [_unpack(g, c, shape, acc, idt, numel) for g, c in zip(gathered, counts, strict=True)]
    return _sum_in_order(streams, numel, dense=dense)


def _swap_stream(comm: _Comm, peer: int, s: _Stream, numel: int, shape, acc, idt) -> _Stream:
    mine = comm.header(s.count)
    theirs = torch.empty_like(mine)
    comm.swap(peer, mine, theirs)
    count = int(theirs.item())
    row = math.prod(shape) * acc.itemsize
    recv = torch.empty(_packed_bytes(count, numel, row, idt.itemsize), dtype=torch.uint8,
                       device=s.val.device)  # fmt: skip
    comm.swap(peer, _pack(s, idt), recv)
    return _unpack(recv, count, shape, acc, idt, numel)


def _send_stream(comm: _Comm, peer: int, s: _Stream, idt) -> None:
    comm.send(peer, comm.header(s.count))
    comm.send(peer, _pack(s, idt))


def _recv_stream(comm: _Comm, peer: int, numel: int, shape, acc, idt, device) -> _Stream:
    head = comm.header(0)
    comm.recv(peer, head)
    count = int(head.item())
    row = math.prod(shape) * acc.itemsize
    buf = torch.empty(_packed_bytes(count, numel, row, idt.itemsize), dtype=torch.uint8,
                      device=device)  # fmt: skip
    comm.recv(peer, buf)
    return _unpack(buf, count, shape, acc, idt, numel)


class _Framed:
    """Streams sent as one message: an int64 length (-1: dense) then the packed stream,
    padded to a size both sides compute from the known lengths (no header message)."""

    def __init__(self, comm: _Comm, numel: int, shape, acc, idt) -> None:
        self.comm, self.numel, self.shape, self.acc, self.idt = comm, numel, shape, acc, idt
        self.row = math.prod(shape) * acc.itemsize
        self.pair = idt.itemsize + self.row

    def size(self, bound: int) -> int:
        """Frame bytes for a stream of at most ``bound`` pairs (sent dense past the switch)."""
        return _HEADER_BYTES + min(bound * self.pair, self.numel * self.row)

    def frame(self, s: _Stream, bound: int) -> Tensor:
        packed = _pack(s, self.idt)
        out = torch.zeros(self.size(bound), dtype=torch.uint8, device=s.val.device)
        out[:_HEADER_BYTES] = (
            torch.tensor([s.count], dtype=torch.int64).view(torch.uint8).to(out.device)
        )
        out[_HEADER_BYTES : _HEADER_BYTES + packed.numel()] = packed
        return out

    def unframe(self, buf: Tensor) -> _Stream:
        count = int(buf[:_HEADER_BYTES].view(torch.int64).item())
        return _unpack(buf[_HEADER_BYTES:], count, self.shape, self.acc, self.idt, self.numel)


def _recursive_doubling(comm: _Comm, s: _Stream, numel: int, shape, acc, idt, threshold,
                        counts: list[int] | None = None):  # fmt: skip
    """``counts`` (every worker's length, known alike everywhere): each swap is one framed
    message sized by the bound on the partner's partial sum, instead of a length message
    and then the stream."""
    n, r = comm.size, comm.rank
    p = 1 << (n.bit_length() - 1)
    device = s.val.device
    framed = _Framed(comm, numel, shape, acc, idt) if counts is not None else None
    folded = None
    if counts is not None:
        folded = [counts[q] + (counts[q + p] if q + p < n else 0) for q in range(p)]
    s = _maybe_densify(s, numel, threshold)
    if r >= p:  # folded: hand the stream to r - p, get the sum back
        if framed is None:
            _send_stream(comm, r - p, s, idt)
            return _recv_stream(comm, r - p, numel, shape, acc, idt, device)
        comm.send(r - p, framed.frame(s, counts[r]))
        buf = torch.empty(framed.size(min(numel, sum(counts))), dtype=torch.uint8, device=device)
        comm.recv(r - p, buf)
        return framed.unframe(buf)
    if r + p < n:
        if framed is None:
            extra = _recv_stream(comm, r + p, numel, shape, acc, idt, device)
        else:
            buf = torch.empty(framed.size(counts[r + p]), dtype=torch.uint8, device=device)
            comm.recv(r + p, buf)
            extra = framed.unframe(buf)
        s = _maybe_densify(_sum_in_order([s, extra], numel), numel, threshold)
    step = 1
    while step < p:
        peer = r ^ step
        if framed is None:
            other = _swap_stream(comm, peer, s, numel, shape, acc, idt)
        else:
            mine = min(numel, sum(folded[(r // step) * step : (r // step + 1) * step]))
            theirs = min(numel, sum(folded[(peer // step) * step : (peer // step + 1) * step]))
            recv = torch.empty(framed.size(theirs), dtype=torch.uint8, device=device)
            comm.swap(peer, framed.frame(s, mine), recv)
            other = framed.unframe(recv)
        pair = [s, other] if r < peer else [other, s]  # the lower group first, on both sides
        s = _maybe_densify(_sum_in_order(pair, numel), numel, threshold)
        step *= 2
    if r + p < n:
        if framed is None:
            _send_stream(comm, r + p, s, idt)
        else:
            comm.send(r + p, framed.frame(s, min(numel, sum(counts))))
    return s


def _split_allgather(comm: _Comm, s: _Stream, numel: int, shape, acc, idt,
                     dest_counts: list[list[int]] | None, dense_out: bool):  # fmt: skip
    n, r = comm.size, comm.rank
    bounds = range_bounds(numel, n)
    device = s.val.device
    row = math.prod(shape) * acc.itemsize
    cuts = torch.searchsorted(s.idx, torch.tensor(bounds, device=device)).tolist()
    mine = [cuts[j + 1] - cuts[j] for j in range(n)]
    if dest_counts is None:
        dest_counts = [t.tolist() for t in comm.all_gather(torch.tensor(mine, device=device))]
    # sparse reduce-scatter: range j's pairs to its owner j
    parts = [_Stream(s.idx[cuts[j] : cuts[j + 1]], s.val[cuts[j] : cuts[j + 1]]) for j in range(n)]
    sends = {j: _pack(parts[j], idt) for j in range(n) if j != r}
    recvs = {j: torch.empty(dest_counts[j][r] * (idt.itemsize + row), dtype=torch.uint8,
                            device=device) for j in range(n) if j != r}  # fmt: skip
    comm.exchange(sends, recvs)
    lo, hi = bounds[r], bounds[r + 1]
    streams = [parts[r] if j == r else _unpack(recvs[j], dest_counts[j][r], shape, acc, idt, numel)
               for j in range(n)]  # fmt: skip
    width = hi - lo
    owned = _sum_in_order(streams, width, lo)  # rank order
    if owned.idx is not None and owned.idx.numel() >= dense_threshold(width, row, idt.itemsize):
        dense = owned.val.new_zeros((width, *shape))
        dense[owned.idx - lo] = owned.val
        owned = _Stream(None, dense)
    # all-gather of the owned ranges: their lengths, then the streams padded to the longest in
    # one ring all-gather (each worker receives from one neighbour at a time, on connections
    # that stay in use: see _Comm.exchange for what an all-to-all costs on a capped link)
    heads = [int(t.item()) for t in comm.all_gather(comm.header(owned.count))]
    sizes = [_packed_bytes(heads[j], bounds[j + 1] - bounds[j], row, idt.itemsize)
             for j in range(n)]  # fmt: skip
    packed = _pack(owned, idt)
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: packed.numel()] = packed
    gathered = comm.all_gather(padded)
    ranges = []
    for j in range(n):
        width_j = bounds[j + 1] - bounds[j]
        got = owned if j == r else _unpack(gathered[j][: sizes[j]], heads[j], shape, acc, idt,
                                           width_j)  # fmt: skip
        ranges.append((j, got))  # sparse ranges carry global indices
    if not dense_out and all(g.idx is not None for _, g in ranges):
        return _Stream(torch.cat([g.idx for _, g in ranges]), torch.cat([g.val for _, g in ranges]))
    out = s.val.new_zeros((numel, *shape)).to(acc)
    for j, g in ranges:
        if g.idx is None:
            out[bounds[j] : bounds[j + 1]] = g.val
        elif g.idx.numel():
            out[g.idx] = g.val
    return _Stream(None, out)


def sparse_allreduce(
    indices: Tensor,
    values: Tensor,
    numel: int,
    *,
    algorithm: str = "auto",
    group: object | None = None,
    cost: CostModel | None = None,
    union: int | None = None,
    dense_output: bool = False,
    counts: Sequence[int] | None = None,
) -> SparseResult:
    """Sum a sparse vector (or row-sparse matrix) over the workers of ``group``.

    Args:
        indices: this worker's non-zero positions, 1-D, sorted and unique, in ``[0, numel)``.
        values: their values, ``(len(indices), *row)`` (a row per index for a row-sparse
            ``(numel, *row)`` matrix). Summed in fp32 (fp64 for fp64 values).
        numel: the length of the dense vector (rows of the matrix).
        algorithm: ``auto`` or one of :data:`ALGORITHMS` (module docstring).
        group: the process group (default: the world).
        cost: the cost model of ``auto`` (default :class:`CostModel`).
        union: ``auto``'s estimate of the sum's non-zeros, the same on every worker (e.g.
            the previous call's ``result.nnz``); default: the disjoint-supports bound.
        dense_output: return the sum as a dense buffer (``indices`` None) and skip finding
            its support -- for callers that densify it anyway (``topk``).
        counts: every worker's stream length, the same list on every worker, when the caller
            knows them (``topk``: ``k`` everywhere): ``auto`` and ``allgather`` then skip the
            exchange of the lengths (one all-gather, ``N - 1`` messages).

    Returns:
        A :class:`SparseResult`, the same on every worker.

    Raises:
        ValueError: bad indices/values, or an unknown algorithm.
    """
    if algorithm not in CHOICES:
        raise ValueError(
            f"sparse allreduce algorithm {algorithm!r}: choose one of {', '.join(CHOICES)}"
        )
    _check(indices, values, numel)
    acc = _acc_dtype(values.dtype)
    shape = tuple(values.shape[1:])
    s = _Stream(indices.long(), values.to(acc))
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return SparseResult(numel, s.idx, s.val.clone(), "local")
    comm = _Comm(group, values.device)
    idt = _index_dtype(numel)
    row = _row_bytes(values, acc)
    threshold = dense_threshold(numel, row, idt.itemsize)
    dest_counts = None
    if counts is not None:
        counts = [int(c) for c in counts]
        if len(counts) != comm.size or counts[comm.rank] != s.count:
            raise ValueError(
                f"sparse_allreduce: counts must list every worker's stream length ({comm.size} "
                f"entries, this worker's = {s.count}), got {counts}"
            )
    if algorithm == "auto":
        if counts is None:  # per-range counts: split-allgather reuses them
            bounds = torch.tensor(range_bounds(numel, comm.size), device=values.device)
            cuts = torch.searchsorted(s.idx, bounds).tolist()
            mine = torch.tensor([cuts[j + 1] - cuts[j] for j in range(comm.size)],
                                device=values.device)  # fmt: skip
            dest_counts = [t.tolist() for t in comm.all_gather(mine)]
            counts = [sum(c) for c in dest_counts]
        algorithm = choose_algorithm(counts, numel, row, idt.itemsize, cost, union,
                                     dense_output)  # fmt: skip
    elif algorithm == "allgather" and counts is None:
        counts = [int(t.item()) for t in comm.all_gather(comm.header(s.count))]
    if algorithm == "dense":
        buf = s.densify(numel).val
        if buf is s.val:
            buf = buf.clone()
        comm.all_reduce(buf)
        out = _Stream(None, buf)
    elif algorithm == "allgather":
        assert counts is not None
        out = _allgather(comm, s, counts, numel, shape, acc, idt, dense_output)
    elif algorithm == "recursive_doubling":
        out = _recursive_doubling(comm, s, numel, shape, acc, idt, threshold, counts)
    else:
        out = _split_allgather(comm, s, numel, shape, acc, idt, dest_counts, dense_output)
    if dense_output:
        out = out.densify(numel)
    return SparseResult(numel, out.idx, out.val, algorithm, comm.bytes, comm.messages)
