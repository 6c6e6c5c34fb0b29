"""Row-partitioned (data-parallel) SGD for the linear learners, with three combiners.

Every rank holds the whole weight matrix ``w`` (``(d, C)``) and reads its own mini-batches
of the common sequence (:func:`~trainers.linear.casgd.epoch_batches`). A *round* is ``N R``
consecutive mini-batches (``N`` ranks, ``R = round_batches``); worker ``i`` takes the
mini-batches ``[i R, (i + 1) R)`` of the round, in order (:func:`round_partition`). The
*sequential reference* is one process running the same mini-batches in order; each step is
the rule of :meth:`~trainers.linear.casgd.FeaturePartitionedSGD.step`,

.. math::
    w \\leftarrow (1 - \\eta\\lambda)\\, w - \\frac{\\eta}{b} X_B^\\top \\ell'(X_B w, y_B),

mini-batch SGD on ``F(w) = mean ℓ + (λ/2)||w||²``. In a world of one every combiner is
exactly that. The combiners:

``allreduce``
    Synchronous data-parallel mini-batch SGD (``R = 1``): every worker computes the loss
    gradient sum ``X_iᵀ ℓ'(X_i w, y_i)`` of its mini-batch, a row-sparse ``d x C`` matrix
    on sparse data (only the features of the batch), summed over the workers with
    :func:`trainers.comm.sparse.sparse_allreduce`; then one step with the global batch
    (the union of the round's mini-batches), the L2 decay applied on every rank alike.
``average``
    Each worker runs sequential SGD over its ``R`` mini-batches from the common model
    ``w_g``; the models are averaged (one all-reduce of ``d C`` numbers): parallel SGD
    (model averaging).
``symsgd``
    SymSGD (Maleki, Musuvathi, Mytkowicz, "Parallel Stochastic Gradient Descent with Sound
    Combiners", `arXiv:1705.08030 <https://arxiv.org/abs/1705.08030>`_). A worker's local
    map from ``w_g`` is affine for the squared loss (and linearised for the others):
    ``S_i(w) = S_i(w_g) + M_i (w - w_g)``, one step contributing
    ``M = (1 - ηλ) I - (η/b) X_Bᵀ D X_B``, ``D = diag(ℓ''(X_B w))``. The worker keeps
    ``N_i = (M_i - I) A_i`` for a Rademacher projection ``A_i`` (``d x k``, entries
    ``±1/√k``, ``E[A Aᵀ] = I``, seeded by ``(seed, round, rank)``), through

    .. math::
        (M_t M_{t-1} - I) A = M_t (M_{t-1} - I) A + (M_t - I) A,

    and the ranks all-gather ``(Δ_i = S_i(w_g) - w_g, N_i)``; every rank then applies the
    *sound combiner* in rank order, :func:`sound_combine`: ``w ← S_0(w_g)``, then
    ``w ← S_i(w_g) + M̂_i (w - w_g)`` with ``M̂_i = I + N_i A_iᵀ`` (unbiased for ``M_i``).
    With ``exact=True`` (small ``d``, tests) ``A = I``: ``N_i = M_i - I`` exactly, and on
    least squares the combination *is* sequential SGD over the round.

Cost of SymSGD's bookkeeping: ``X_B (N + A)`` and ``X_Bᵀ D (·)`` touch only the batch's
features, ``O(nnz k)`` on CSR data; the ``(1 - ηλ)`` scaling of ``N`` is kept as two scalars
(``N = α Ñ + β A``), so no step costs ``O(d k)``; assembling ``N`` once per round, drawing
the projections and the combination cost ``O(N d k)`` per round on every rank.

Second derivatives (:data:`CURVATURES`): squared 1 (``ℓ' = m - y``), logistic ``σ(m)(1 -
σ(m))``, squared hinge ``2·[t m < 1]`` and hinge 0, both almost everywhere (the hinge map is
then linearised as pure decay: the combiner adds the decayed updates). The multinomial loss
has ``C`` margins per example and no scalar curvature: SymSGD refuses it.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist

from trainers.comm.sparse import ALGORITHMS as SPARSE_ALGORITHMS
from trainers.comm.sparse import sparse_allreduce

from .casgd import PRECISIONS, Derivative, _Block, _Rows, check_sgd_args
from .messages import Messenger

__all__ = [
    "COMBINERS",
    "CURVATURES",
    "DEFAULT_ROUND_BATCHES",
    "RowParallelSGD",
    "rademacher",
    "round_partition",
    "sound_combine",
]

COMBINERS = ("allreduce", "average", "symsgd")
DEFAULT_ROUND_BATCHES = {"allreduce": 1, "average": 8, "symsgd": 8}
EXACT_LIMIT = 2048  # exact=True keeps d x d matrices (and all-gathers N of them)


# ------------------------------------------------------------------------ second derivatives
def _squared_curvature(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(m)  # ℓ = (m - y)² / 2


def _logistic_curvature(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    p = torch.sigmoid(m)
    return p * (1.0 - p)


def _hinge_curvature(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(m)  # piecewise linear: 0 almost everywhere


def _squared_hinge_curvature(m: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    t = 2.0 * y.to(m.dtype) - 1.0
    return 2.0 * (t * m < 1.0).to(m.dtype)  # ℓ = max(0, 1 - t m)², t² = 1


# loss name (modelzoo.linear.LOSSES) -> ℓ''(m, y) for the losses with a scalar margin
CURVATURES: dict[str, Derivative] = {
    "squared": _squared_curvature,
    "logistic": _logistic_curvature,
    "hinge": _hinge_curvature,
    "squared_hinge": _squared_hinge_curvature,
}


# ------------------------------------------------------------------------ pure pieces
def round_partition(
    batches: Sequence[torch.Tensor], world_size: int, round_batches: int
) -> list[list[torch.Tensor]]:
    """Worker ``i``'s mini-batches of one round: ``batches[i R : (i + 1) R]`` (a short last
    round of an epoch leaves the last workers fewer, or none)."""
    R = round_batches
    return [list(batches[i * R : (i + 1) * R]) for i in range(world_size)]


def _seed(seed: int, round_index: int, rank: int) -> int:
    digest = hashlib.blake2b(f"symsgd:{seed}:{round_index}:{rank}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & ((1 << 63) - 1)


def rademacher(
    d: int, k: int, *, seed: int, round_index: int, rank: int, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """The projection ``A`` (``(d, k)``) of worker ``rank`` in round ``round_index``: entries
    ``±1/√k`` with equal probability, so ``E[A Aᵀ] = I``; the same on every rank."""
    g = torch.Generator().manual_seed(_seed(seed, round_index, rank))
    signs = torch.randint(0, 2, (d, k), generator=g, dtype=torch.int8)
    return (signs.to(dtype) * 2.0 - 1.0) * (1.0 / math.sqrt(k))


def sound_combine(
    deltas: Sequence[torch.Tensor],
    curvatures: Sequence[torch.Tensor | None],
    projection: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """SymSGD's combination of the workers' local maps, in rank order; returns ``w - w_g``.

    .. math::
        u_0 = Δ_0, \\qquad u_i = Δ_i + \\hat M_i u_{i-1} = Δ_i + u_{i-1} + N_i A_i^\\top u_{i-1}

    Args:
        deltas: ``Δ_i = S_i(w_g) - w_g``, ``(d, C)`` each.
        curvatures: ``N_i = (M_i - I) A_i`` (``(d, k)``), or ``M_i - I`` (``(d, d)``) when
            ``projection`` is None; worker 0's is not used; None: the identity map.
        projection: ``i -> A_i`` (``(d, k)``), called once for each worker ``i ≥ 1`` with a
            curvature; None for the exact maps.

    Returns:
        ``(d, C)``: the combined model minus ``w_g``.
    """
    u = deltas[0].clone()
    for i in range(1, len(deltas)):
        N = curvatures[i]
        if N is None:
            u = u + deltas[i]
            continue
        Au = u if projection is None else projection(i).t() @ u  # (k, C)
        u = deltas[i] + u + N @ Au
    return u


# ------------------------------------------------------------------------ the solver
class RowParallelSGD:
    """Row-partitioned SGD with every rank holding ``w``; one round at a time.

    Args:
        X: ``(n, d)`` the training rows, dense or ``torch.sparse_csr`` (every rank holds
            them all and reads only its mini-batches).
        y: ``(n,)`` labels.
        derivative: ``ℓ'(m, y)`` per example (``modelzoo.linear.LOSSES[...].derivative``).
        combine: one of :data:`COMBINERS`.
        lr: ``η``.
        l2: ``λ`` (decays every weight, an intercept column included, as in CA-SGD).
        num_outputs: margins per example ``C`` (SymSGD: 1).
        loss_value: ``ℓ(m, y)``; when given, :meth:`mean_round_loss` is the mean loss of the
            last round's mini-batches at the margins they were updated with.
        curvature: ``ℓ''(m, y)`` (:data:`CURVATURES`); needed by ``symsgd``.
        round_batches: ``R``, mini-batches per worker per round (default
            :data:`DEFAULT_ROUND_BATCHES`; ``allreduce`` takes only 1).
        sparse_algorithm: ``allreduce``'s :func:`~trainers.comm.sparse.sparse_allreduce`
            algorithm: ``auto`` or one of its algorithms.
        symsgd_rank: SymSGD's projection size ``k``.
        exact: SymSGD with the exact ``d x d`` maps (``A = I``; ``d`` at most
            :data:`EXACT_LIMIT`).
        seed: seeds the projections with the round and the rank.
        precision: a key of :data:`~trainers.linear.casgd.PRECISIONS`.
        messenger: carries the group and the injected latency, and counts one message per
            round's collective (also in a world of one) and, in ``bytes``, the bytes this
            rank sends (see :attr:`bytes_sent`).
    """

    def __init__(
        self,
        X: torch.Tensor,
        y: torch.Tensor,
        derivative: Derivative,
        *,
        combine: str,
        lr: float,
        l2: float = 0.0,
        num_outputs: int = 1,
        loss_value: Derivative | None = None,
        curvature: Derivative | None = None,
        round_batches: int | None = None,
        sparse_algorithm: str = "auto",
        symsgd_rank: int = 16,
        exact: bool = False,
        seed: int = 0,
        precision: str = "fp32",
        messenger: Messenger | None = None,
    ) -> None:
        if combine not in COMBINERS:
            raise ValueError(f"combine={combine!r}: choose one of {', '.join(COMBINERS)}")
        check_sgd_args(X, y, lr, l2, precision)
        R = DEFAULT_ROUND_BATCHES[combine] if round_batches is None else int(round_batches)
        if R < 1:
            raise ValueError(f"round_batches={R} must be at least 1")
        if combine == "allreduce" and R != 1:
            raise ValueError(
                f"combine='allreduce' takes one step per round with the global batch, so "
                f"round_batches must be 1 (got {R}); use 'average' or 'symsgd' for several "
                "local mini-batches per round"
            )
        if sparse_algorithm not in ("auto", *SPARSE_ALGORITHMS):
            raise ValueError(f"sparse_algorithm={sparse_algorithm!r}: choose one of "
                             f"{', '.join(('auto', *SPARSE_ALGORITHMS))}")  # fmt: skip
        d = X.shape[1]
        if combine == "symsgd":
            if num_outputs != 1 or curvature is None:
                raise ValueError(
                    "combine='symsgd' needs a loss with one margin per example and its second "
                    f"derivative ({', '.join(sorted(CURVATURES))}); the multinomial loss "
                    "has C margins: use combine='allreduce' or 'average'"
                )
            if symsgd_rank < 1:
                raise ValueError(f"symsgd_rank={symsgd_rank}: the projection needs k >= 1 "
                                 "columns")  # fmt: skip
            if lr * l2 >= 1.0:
                raise ValueError(f"lr * l2 = {lr * l2} must be below 1 for symsgd (the decay "
                                 "1 - lr * l2 is kept as a positive scale)")  # fmt: skip
            if exact and d > EXACT_LIMIT:
                raise ValueError(
                    f"exact=True keeps {d} x {d} matrices; above {EXACT_LIMIT} features use "
                    "the projection (exact=False, symsgd_rank=k)"
                )
        self.low, self.high = PRECISIONS[precision]
        self.precision = precision
        self.rows = _Rows(X, self.low)
        self.y = y
        self.derivative, self.loss_value, self.curvature = derivative, loss_value, curvature
        self.combine = combine
        self.num_outputs = num_outputs
        self.lr, self.l2 = float(lr), float(l2)
        self.decay = 1.0 - self.lr * self.l2
        self.round_batches = R
        self.sparse_algorithm = sparse_algorithm
        self.k = d if exact else int(symsgd_rank)
        self.exact = bool(exact)
        self.seed = int(seed)
        self.messenger = messenger or Messenger()
        self.world_size, self.rank = self.messenger.world_size, self.messenger.rank
        self.w = torch.zeros(d, num_outputs, dtype=self.high)  # (d, C), the same on every rank
        self.steps = 0  # mini-batches applied, over all workers
        self.rounds = 0
        self.bytes_sent = 0  # what this rank handed to the network, all rounds
        self.round_bytes = 0  # ... in the last round
        self.last_algorithm: str | None = None  # allreduce: what sparse_allreduce ran
        self._loss = (0.0, 0)  # this rank's loss sum and rows in the last round

    @property
    def batches_per_round(self) -> int:
        """``N R``: the mini-batches of one round."""
        return self.world_size * self.round_batches

    # -- local pieces (no communication) -------------------------------------------------------
    def _r(self, m: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``ℓ'(m, y)`` as ``(b, C)``."""
        y = self.y[rows]
        if self.num_outputs == 1:
            return self.derivative(m[:, 0], y).reshape(-1, 1).to(self.high)
        return self.derivative(m, y).to(self.high)

    def _loss_sum(self, m: torch.Tensor, rows: torch.Tensor) -> float:
        if self.loss_value is None:
            return 0.0
        m = m[:, 0] if self.num_outputs == 1 else m
        return float(self.loss_value(m, self.y[rows]).double().sum())

    def _times(self, block: _Block, P: torch.Tensor) -> torch.Tensor:
        """``Y P`` (``(rows, k)``) for ``P`` the rows of a matrix at ``block.cols``."""
        if block.dense is not None:
            return block.dense.to(P.dtype) @ P
        row_ids, col_ids, values, n_rows = block.coo
        out = torch.zeros(n_rows, P.shape[1], dtype=P.dtype)
        return out.index_add_(0, row_ids, values.to(P.dtype)[:, None] * P[col_ids])

    def local_sgd(
        self, w: torch.Tensor, batches: Iterable[torch.Tensor], A: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, float, int]:
        """Sequential SGD from ``w`` over ``batches``; with ``A`` (``(d, k)``) also SymSGD's
        ``N = (M - I) A`` of the (linearised) map, each step linearised at the margins it
        used.

        Returns:
            the final weights (a new tensor), ``N`` (None without ``A``), the loss sum and the
            number of rows.
        """
        w = w.clone()
        Nt, alpha, beta = None, 1.0, 0.0  # N = α Ñ + β A: the decay as two scalars
        if A is not None:
            Nt = torch.zeros_like(A)
        loss_sum, count = 0.0, 0
        for rows in batches:
            b = int(rows.numel())
            block = self.rows.gather(rows)
            m = block.margins(w, self.low)  # (b, C)
            r = self._r(m, rows)
            loss_sum += self._loss_sum(m, rows)
            count += b
            step = self.lr / b
            if Nt is not None:
                h = self.curvature(m[:, 0], self.y[rows]).to(self.high)  # (b,) ℓ''
                cols = block.cols
                if cols is None:
                    P = alpha * Nt + (beta + 1.0) * A  # (d, k) = N + A = M_prev A
                else:
                    P = alpha * Nt[cols] + (beta + 1.0) * A[cols]  # (u, k)
                G = block.transpose_times(h[:, None] * self._times(block, P))  # Yᵀ D Y P
                alpha, beta = self.decay * alpha, self.decay * beta + self.decay - 1.0
                if cols is None:
                    Nt.add_(G, alpha=-step / alpha)
                else:
                    Nt.index_add_(0, cols, G, alpha=-step / alpha)
            if self.decay != 1.0:
                w *= self.decay
            update = block.transpose_times(r * step)  # (u, C)
            if block.cols is None:
                w -= update
            else:
                w.index_add_(0, block.cols, update, alpha=-1.0)
        N = None
        if Nt is not None:
            N = Nt if alpha == 1.0 else Nt * alpha
            if beta != 0.0:
                N = N + beta * A
        return w, N, loss_sum, count

    def gradient_sum(
        self, rows: torch.Tensor, scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``scale`` times the loss gradient sum ``X_Bᵀ ℓ'(X_B w, y_B)`` of a mini-batch at the
        current ``w``, row-sparse: its feature indices (sorted, unique), the ``(u, C)`` rows,
        and the loss sum."""
        block = self.rows.gather(rows)
        m = block.margins(self.w, self.low)
        r = self._r(m, rows)
        g = block.transpose_times(r * scale)  # (u, C)
        cols = block.cols if block.cols is not None else torch.arange(self.w.shape[0])
        return cols, g, self._loss_sum(m, rows)

    # -- one round -------------------------------------------------------------------------
    def _sent(self, nbytes: int) -> None:
        self.messenger.messages += 1
        self.messenger.bytes += nbytes
        self.bytes_sent += nbytes
        self.round_bytes = nbytes

    def _wait(self) -> None:
        if self.world_size > 1 and self.messenger.latency > 0:
            time.sleep(self.messenger.latency)

    def round(self, batches: Sequence[torch.Tensor], index: int) -> None:
        """Apply one round: ``batches`` are its (at most ``N R``) mini-batches, ``index`` the
        round's number in the run (it seeds SymSGD's projections)."""
        if len(batches) > self.batches_per_round:
            raise ValueError(f"a round has at most {self.batches_per_round} mini-batches, got "
                             f"{len(batches)}")  # fmt: skip
        parts = round_partition(batches, self.world_size, self.round_batches)
        mine = parts[self.rank]
        if self.combine == "allreduce":
            self._allreduce_round(parts)
        elif self.combine == "average":
            self._average_round(parts, mine)
        else:
            self._symsgd_round(parts, mine, index)
        self.steps += len(batches)
        self.rounds += 1

    def _allreduce_round(self, parts: list[list[torch.Tensor]]) -> None:
        d, C = self.w.shape
        mine = parts[self.rank]
        total = sum(int(p[0].numel()) for p in parts if p)  # the global batch
        if mine:  # (η / B) X_iᵀ ℓ': the sum over workers is the global batch's step
            cols, g, loss_sum = self.gradient_sum(mine[0], self.lr / total)
            self._loss = (loss_sum, int(mine[0].numel()))
        else:  # a short last round: nothing to add
            cols, g = torch.zeros(0, dtype=torch.int64), torch.zeros(0, C, dtype=self.high)
            self._loss = (0.0, 0)
        self._wait()
        result = sparse_allreduce(cols, g, d, algorithm=self.sparse_algorithm,
                                  group=self.messenger.group)  # fmt: skip
        self.last_algorithm = result.algorithm
        self._sent(int(result.bytes_sent))
        if self.decay != 1.0:
            self.w *= self.decay
        values = result.values.to(self.high)
        if result.indices is None:
            self.w -= values
        else:
            self.w.index_add_(0, result.indices, values, alpha=-1.0)

    def _average_round(self, parts: list[list[torch.Tensor]], mine: list[torch.Tensor]) -> None:
        w_local, _, loss_sum, count = self.local_sgd(self.w, mine)
        self._loss = (loss_sum, count)
        delta = (w_local - self.w).reshape(-1)  # (d C,); zero for a worker without batches
        active = sum(1 for p in parts if p)
        n = self.world_size
        if n == 1:  # the average of one model
            self.w = w_local
            self._sent(0)
            return
        self._wait()
        dist.all_reduce(delta, op=dist.ReduceOp.SUM, group=self.messenger.group)
        # ring all-reduce volume, as trainers.comm.sparse counts it
        self._sent(2 * (n - 1) * delta.numel() * delta.element_size() // n)
        self.w += delta.view_as(self.w) / active

    def _symsgd_round(
        self, parts: list[list[torch.Tensor]], mine: list[torch.Tensor], index: int
    ) -> None:
        d, C = self.w.shape
        n, k = self.world_size, self.k
        if n == 1:  # S_0 is the whole combination: nothing to track
            self.w, _, loss_sum, count = self.local_sgd(self.w, mine)
            self._loss = (loss_sum, count)
            self._sent(0)
            return
        A = self._projection(index, self.rank)
        w_local, N, loss_sum, count = self.local_sgd(self.w, mine, A)
        self._loss = (loss_sum, count)
        assert N is not None
        send = torch.cat([(w_local - self.w).reshape(-1), N.reshape(-1)])  # d (C + k)
        gathered = [torch.empty_like(send) for _ in range(n)]
        self._wait()
        dist.all_gather(gathered, send, group=self.messenger.group)
        self._sent((n - 1) * send.numel() * send.element_size())  # ring all-gather volume
        deltas = [g[: d * C].view(d, C) for g in gathered]
        curvatures = [g[d * C :].view(d, k) if parts[i] else None for i, g in enumerate(gathered)]

        def projection(i: int) -> torch.Tensor:
            return A if i == self.rank else self._projection(index, i)

        self.w = self.w + sound_combine(deltas, curvatures, None if self.exact else projection)

    def _projection(self, index: int, rank: int) -> torch.Tensor:
        d = self.w.shape[0]
        if self.exact:
            return torch.eye(d, dtype=self.high)
        return rademacher(d, self.k, seed=self.seed, round_index=index, rank=rank,
                          dtype=self.high)  # fmt: skip

    def run(self, batches: Sequence[torch.Tensor], first_round: int = 0) -> None:
        """Every mini-batch, in rounds of ``N R`` (the last may be shorter); rounds are
        numbered from ``first_round``."""
        for j, group in enumerate(_rounds(batches, self.batches_per_round)):
            self.round(group, first_round + j)

    # -- records and evaluation --------------------------------------------------------------
    def mean_round_loss(self) -> float:
        """The mean loss of the last round's mini-batches at the margins they were updated
        with, over all workers. A collective (every rank calls it) that is not counted in
        the messages: it is for the run log."""
        buf = torch.tensor(self._loss, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.messenger.group)
        return float(buf[0] / buf[1]) if buf[1] > 0 else float("nan")

    def margins(self, X: torch.Tensor | None = None) -> torch.Tensor:
        """``X w`` (``(n, C)``) of ``X`` (default: the training rows); local, every rank has
        ``w``."""
        rows = self.rows if X is None else _Rows(X, self.low)
        return torch.cat([
            rows.gather(chunk).margins(self.w, self.low)
            for chunk in torch.arange(rows.n_rows).split(4096)
        ])  # fmt: skip

    def objective(self, loss_value: Derivative) -> float:
        """``mean ℓ(m, y) + (λ/2) ||w||²`` on the training rows (local)."""
        m = self.margins()
        values = loss_value(m[:, 0] if self.num_outputs == 1 else m, self.y)
        sq = float((self.w.double() ** 2).sum())
        return float(values.double().mean()) + 0.5 * self.l2 * sq


def _rounds(batches: Sequence[torch.Tensor], size: int) -> Iterator[list[torch.Tensor]]:
    for start in range(0, len(batches), size):
        yield list(batches[start : start + size])
