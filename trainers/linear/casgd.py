"""Feature-partitioned SGD for generalized linear models, and its s-step unrolled version
(communication-avoiding SGD, CA-SGD), in fp64/fp32 and in mixed precision.

Layout (1-D block columns): the ``d`` features are split into contiguous blocks
(:func:`column_blocks`); rank ``p`` holds the columns ``X_p`` of every example and the
weights ``w_p`` (``(d_p, C)``); labels are on every rank. The margins of a mini-batch ``B``
of ``b`` rows are ``m = Σ_p X_{B,p} w_p``.

**Plain feature-partitioned SGD** (:meth:`FeaturePartitionedSGD.step`): one all-reduce of the
``b x C`` partial margins per mini-batch, then ``r = ℓ'(m, y_B)`` and

.. math::
    w_p \\leftarrow a\\, w_p - \\frac{\\eta}{b} X_{B,p}^\\top r, \\qquad a = 1 - \\eta\\lambda

(``a = 1`` without L2) — exactly mini-batch SGD on ``F(w) = mean ℓ + (λ/2)||w||²``.

**CA-SGD** (:meth:`FeaturePartitionedSGD.unrolled_step`): for ``s`` mini-batches ``Y_0 ..
Y_{s-1}`` (``Y`` their ``s b`` rows stacked), one all-reduce of ``[Y_p Y_p^T, Y_p w_p]`` (the
partial Gram matrix, of which only the strictly block-lower blocks ``G_{ji}, i < j`` are sent,
``s(s-1)/2 · b²`` numbers, and the ``sb x C`` partial margins at the start), after which
every rank runs the same recurrence

.. math::
    m_j = a^j (Y w_0)_j - \\sum_{i<j} a^{j-1-i} \\frac{\\eta}{b_i} G_{ji} r_i, \\qquad
    r_j = \\ell'(m_j, y_j), \\qquad
    w_p \\leftarrow a^s w_p - \\sum_j a^{s-1-j} \\frac{\\eta}{b_j} Y_{j,p}^\\top r_j

with ``G = Σ_p Y_p Y_p^T``: exactly the plain iterates in exact arithmetic, ``s`` times fewer
messages, more flops and bytes per message.

**Mixed precision** (``precision="bf16"`` / ``"fp16"``): the features are stored in the low
precision and the partial margins ``Y_p w_p`` are computed and rounded in it; the Gram
matrix is accumulated in fp32 (products of bf16/fp16 numbers are exact in fp32), and the
communication, the recurrence, ``r`` and the weights are fp32.

Sparse ``X_p`` (``torch.sparse_csr``): the rows of a round are gathered as coordinates over
the union of their non-zero columns and every product (margins, the sparse Gram matrix,
``Y^T r``) costs O(non-zeros), never O(d_p) (except the L2 decay of ``w_p``, which touches
every weight).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .messages import Messenger

__all__ = ["PRECISIONS", "FeaturePartitionedSGD", "column_blocks", "epoch_batches"]

# precision -> (dtype of X and the partial margins, dtype of everything else)
PRECISIONS: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "fp64": (torch.float64, torch.float64),
    "fp32": (torch.float32, torch.float32),
    "bf16": (torch.bfloat16, torch.float32),
    "fp16": (torch.float16, torch.float32),
}

_DENSE_COLUMN = 32  # a sparse column with more entries in a round is multiplied densely
Derivative = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def check_sgd_args(X: torch.Tensor, y: torch.Tensor, lr: float, l2: float, precision: str) -> None:
    """The checks every SGD solver here makes of its data and step (ValueError naming the
    argument)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose one of {sorted(PRECISIONS)}")
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"X has {X.shape[0]} rows but y has {y.shape[0]} labels")
    if lr <= 0 or l2 < 0:
        raise ValueError(f"lr={lr} must be positive and l2={l2} non-negative")


def column_blocks(n_features: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` column ranges, one per rank, sizes differing by at most 1."""
    if world_size < 1 or n_features < world_size:
        raise ValueError(
            f"cannot split {n_features} features over {world_size} ranks (need at least one "
            "feature per rank)"
        )
    base, extra = divmod(n_features, world_size)
    bounds, start = [], 0
    for p in range(world_size):
        stop = start + base + (1 if p < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def epoch_batches(n: int, batch_size: int, *, seed: int, epoch: int) -> list[torch.Tensor]:
    """The mini-batches of one epoch: a permutation of ``range(n)`` seeded by
    ``(seed, epoch)``, cut into ``batch_size`` pieces (the last one may be smaller). Every
    rank computes the same sequence."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be positive")
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return list(torch.randperm(n, generator=g).split(batch_size))


class _Block:
    """Rows of ``X_p`` for one step or round, over the union ``cols`` of their non-zero
    columns (all columns for dense ``X_p``), with the three products the solvers need.

    Values are the low-precision ones, promoted to the high precision for every product, so
    products are exact and accumulate in the high precision."""

    def __init__(
        self, dense: torch.Tensor | None, coo: tuple | None, cols: torch.Tensor | None
    ) -> None:
        self.dense, self.coo, self.cols = dense, coo, cols  # coo: (row_ids, col_ids, values)

    def margins(self, w: torch.Tensor, low: torch.dtype) -> torch.Tensor:
        """``Y w`` (``(rows, C)``) from low-precision ``Y`` and ``w``, rounded to ``low``."""
        high = w.dtype
        wl = (w if self.cols is None else w[self.cols]).to(low).to(high)
        if self.dense is not None:
            z = self.dense.to(high) @ wl
        else:
            row_ids, col_ids, values, n_rows = self.coo
            z = torch.zeros(n_rows, w.shape[1], dtype=high)
            z.index_add_(0, row_ids, values.to(high)[:, None] * wl[col_ids])
        return z.to(low).to(high)

    def gram(self, high: torch.dtype) -> torch.Tensor:
        """``Y Y^T`` (``(rows, rows)``), accumulated in ``high``."""
        if self.dense is not None:
            Yh = self.dense.to(high)
            return Yh @ Yh.t()
        # columns with many entries (an intercept column) as a dense matmul; the others as
        # every pair of entries that share a column: O(Σ_col k_col²), k_col its entries
        row_ids, col_ids, values, n_rows = self.coo
        order = torch.argsort(col_ids, stable=True)
        rows, cols, vals = row_ids[order], col_ids[order], values[order].to(high)
        uniq, counts = torch.unique_consecutive(cols, return_counts=True)
        heavy = torch.repeat_interleave(counts > _DENSE_COLUMN, counts)  # per entry
        G = torch.zeros(n_rows, n_rows, dtype=high)
        if bool(heavy.any()):
            heavy_cols, slot = torch.unique(cols[heavy], return_inverse=True)
            D = torch.zeros(n_rows, heavy_cols.numel(), dtype=high)
            D.index_put_((rows[heavy], slot), vals[heavy], accumulate=True)
            G += D @ D.t()
            light = ~heavy
            rows, cols, vals = rows[light], cols[light], vals[light]
            counts = counts[counts <= _DENSE_COLUMN]
        starts = torch.cumsum(counts, 0) - counts
        k = torch.repeat_interleave(counts, counts)  # per entry: entries of its column
        first = torch.repeat_interleave(starts, counts)  # per entry: its column's first entry
        a = torch.repeat_interleave(torch.arange(rows.numel()), k)
        within = torch.arange(a.numel()) - torch.repeat_interleave(torch.cumsum(k, 0) - k, k)
        b = torch.repeat_interleave(first, k) + within
        G.index_put_((rows[a], rows[b]), vals[a] * vals[b], accumulate=True)
        return G

    def transpose_times(self, R: torch.Tensor) -> torch.Tensor:
        """``Y^T R`` (``(u, C)``) in ``R``'s dtype."""
        if self.dense is not None:
            return self.dense.to(R.dtype).t() @ R
        row_ids, col_ids, values, _ = self.coo
        out = torch.zeros(int(self.cols.numel()), R.shape[1], dtype=R.dtype)
        out.index_add_(0, col_ids, values.to(R.dtype)[:, None] * R[row_ids])
        return out


class _Rows:
    """Row access to dense or CSR ``X_p`` (values kept in the low precision)."""

    def __init__(self, X: torch.Tensor, dtype: torch.dtype) -> None:
        self.sparse = X.layout == torch.sparse_csr
        if self.sparse:
            self.crow = X.crow_indices()
            self.col = X.col_indices()
            self.val = X.values().to(dtype)
        else:
            self.X = X.to(dtype)
        self.n_rows, self.n_cols = X.shape

    def gather(self, rows: torch.Tensor) -> _Block:
        """The block of ``X[rows]``."""
        if not self.sparse:
            return _Block(self.X[rows], None, None)
        starts, stops = self.crow[rows], self.crow[rows + 1]
        lengths = stops - starts
        total = int(lengths.sum())
        offsets = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(total) - torch.repeat_interleave(offsets, lengths)
        pos = torch.repeat_interleave(starts, lengths) + within
        cols, inverse = torch.unique(self.col[pos], return_inverse=True)
        row_ids = torch.repeat_interleave(torch.arange(rows.numel()), lengths)
        return _Block(None, (row_ids, inverse, self.val[pos], rows.numel()), cols)


class FeaturePartitionedSGD:
    """SGD on this rank's feature block ``X_p``; plain steps or ``s``-step unrolled rounds.

    Args:
        X: ``(n, d_p)`` this rank's columns, dense or ``torch.sparse_csr``.
        y: ``(n,)`` labels, the same on every rank.
        derivative: ``ℓ'(m, y)`` per example (e.g. ``modelzoo.linear.LOSSES[...].derivative``);
            ``m`` is ``(b,)`` when ``num_outputs == 1``, else ``(b, C)``.
        num_outputs: margins per example ``C``.
        lr: ``η``.
        l2: ``λ`` (decays every weight of the block, an intercept column included).
        precision: a key of :data:`PRECISIONS`.
        messenger: the counted all-reduce over the feature-partition group.
        loss_value: ``ℓ(m, y)`` per example; when given, :attr:`last_loss` is the mean loss
            of the last step's or round's mini-batches at the margins they were updated
            with (the usual SGD training loss).
    """

    def __init__(
        self,
        X: torch.Tensor,
        y: torch.Tensor,
        derivative: Derivative,
        *,
        loss_value: Derivative | None = None,
        num_outputs: int = 1,
        lr: float,
        l2: float = 0.0,
        precision: str = "fp32",
        messenger: Messenger | None = None,
    ) -> None:
        check_sgd_args(X, y, lr, l2, precision)
        self.low, self.high = PRECISIONS[precision]
        self.precision = precision
        self.rows = _Rows(X, self.low)
        self.y = y
        self.derivative = derivative
        self.num_outputs = num_outputs
        self.lr, self.l2 = float(lr), float(l2)
        self.decay = 1.0 - self.lr * self.l2
        self.messenger = messenger or Messenger()
        self.w = torch.zeros(self.rows.n_cols, num_outputs, dtype=self.high)  # (d_p, C)
        self.steps = 0  # mini-batches applied
        self.loss_value = loss_value
        self.last_loss = float("nan")

    # -- helpers -------------------------------------------------------------------------------
    def _apply(self, block: _Block, R: torch.Tensor) -> None:
        """``w[cols] -= Y^T R`` (``R`` already scaled), in the high precision."""
        update = block.transpose_times(R)  # (u, C)
        if block.cols is None:
            self.w -= update
        else:
            self.w.index_add_(0, block.cols, update, alpha=-1.0)

    def _record(self, margins: list[torch.Tensor], rows: torch.Tensor) -> None:
        if self.loss_value is not None:
            m = torch.cat(margins)
            m = m[:, 0] if self.num_outputs == 1 else m
            self.last_loss = float(self.loss_value(m, self.y[rows]).double().mean())

    def _r(self, m: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``ℓ'(m, y)`` as ``(b, C)``."""
        y = self.y[rows]
        if self.num_outputs == 1:
            return self.derivative(m[:, 0], y).reshape(-1, 1).to(self.high)
        return self.derivative(m, y).to(self.high)

    # -- plain SGD -----------------------------------------------------------------------------
    def step(self, rows: torch.Tensor) -> None:
        """One mini-batch: one all-reduce of the ``b x C`` partial margins."""
        block = self.rows.gather(rows)
        m = self.messenger.all_reduce_sum(block.margins(self.w, self.low))  # (b, C)
        r = self._r(m, rows)
        self._record([m], rows)
        if self.decay != 1.0:
            self.w *= self.decay
        self._apply(block, r * (self.lr / rows.numel()))
        self.steps += 1

    # -- CA-SGD ------------------------------------------------------------------------------
    def unrolled_step(self, batches: Sequence[torch.Tensor]) -> None:
        """``len(batches)`` mini-batches with one all-reduce of ``[Y Y^T, Y w]``."""
        sizes = [int(b.numel()) for b in batches]
        rows = torch.cat(list(batches))
        block = self.rows.gather(rows)  # (sb, u)
        n, C = rows.numel(), self.num_outputs
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        gram = block.gram(self.high)  # (sb, sb), accumulated in the high precision
        z = block.margins(self.w, self.low)  # (sb, C)
        # only the strictly block-lower part G[j, <j] is used: send just those rows' prefixes
        lower = [gram[st : st + sz, :st].reshape(-1) for st, sz in zip(starts, sizes, strict=True)]
        buffer = torch.cat([*lower, z.reshape(-1)])
        self.messenger.all_reduce_sum(buffer)
        G = torch.zeros(n, n, dtype=self.high)
        offset = 0
        for st, sz in zip(starts, sizes, strict=True):
            G[st : st + sz, :st] = buffer[offset : offset + sz * st].view(sz, st)
            offset += sz * st
        z = buffer[offset:].view(n, C)
        a = self.decay
        scaled: list[torch.Tensor] = []  # (η / b_i) r_i
        margins: list[torch.Tensor] = []
        for j, (start, size) in enumerate(zip(starts, sizes, strict=True)):
            m = (a**j) * z[start : start + size]
            for i in range(j):
                si, bi = starts[i], sizes[i]
                m = m - (a ** (j - 1 - i)) * (G[start : start + size, si : si + bi] @ scaled[i])
            r = self._r(m, rows[start : start + size])
            margins.append(m)
            scaled.append(r * (self.lr / size))
        self._record(margins, rows)
        s = len(sizes)
        if a != 1.0:
            self.w *= a**s
        R = torch.cat([(a ** (s - 1 - j)) * scaled[j] for j in range(s)])  # (sb, C)
        self._apply(block, R)
        self.steps += s

    def run(self, batches: Iterable[torch.Tensor], s: int = 0) -> None:
        """Every batch: plain steps when ``s == 0``, else rounds of ``s`` (the last may be
        shorter)."""
        if s < 0:
            raise ValueError(f"s={s} must be 0 (plain SGD) or positive")
        if s == 0:
            for rows in batches:
                self.step(rows)
            return
        for group in _groups(batches, s):
            self.unrolled_step(group)

    # -- durable state (elastic restarts, trainers.linear.elastic) ------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's block ``w_p``, the mini-batch count and the last loss. The full ``w``
        of a world is the blocks stacked in rank order (:func:`trainers.linear.elastic.
        gather_rows`); a new world takes its own blocks of it (:func:`column_blocks`)."""
        return {"w": self.w.clone(), "steps": self.steps, "last_loss": self.last_loss}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (``w`` this rank's block, in the high precision)."""
        w = state["w"]
        if tuple(w.shape) != tuple(self.w.shape):
            raise ValueError(f"the saved weight block has shape {tuple(w.shape)}, this rank's "
                             f"block {tuple(self.w.shape)}")  # fmt: skip
        self.w = w.to(self.high).clone()
        self.steps = int(state["steps"])
        self.last_loss = float(state["last_loss"])

    # -- evaluation (counted apart from the training messages) ----------------------------------
    def margins(
        self, X: torch.Tensor | None = None, messenger: Messenger | None = None
    ) -> torch.Tensor:
        """Full margins ``Σ_p X_p w_p`` (``(n, C)``) of ``X`` (default: the training rows),
        reduced through ``messenger`` (default: a separate one, so that evaluation never adds
        to the training messages)."""
        messenger = messenger or Messenger(self.messenger.group)
        rows = self.rows if X is None else _Rows(X, self.low)
        z = torch.cat([
            rows.gather(chunk).margins(self.w, self.low)
            for chunk in torch.arange(rows.n_rows).split(4096)
        ])  # fmt: skip
        return messenger.all_reduce_sum(z)

    def objective(self, loss_value: Derivative, messenger: Messenger | None = None) -> float:
        """``mean ℓ(m, y) + (λ/2) ||w||²`` on the training rows, in the high precision."""
        messenger = messenger or Messenger(self.messenger.group)
        m = self.margins(messenger=messenger)
        sq = messenger.all_reduce_sum((self.w.double() ** 2).sum().reshape(1))
        values = loss_value(m[:, 0] if self.num_outputs == 1 else m, self.y)
        return float(values.double().mean()) + 0.5 * self.l2 * float(sq)


def _groups(batches: Iterable[torch.Tensor], s: int) -> Iterator[list[torch.Tensor]]:
    group: list[torch.Tensor] = []
    for rows in batches:
        group.append(rows)
        if len(group) == s:
            yield group
            group = []
    if group:
        yield group
