"""Data-parallel L-BFGS, and L-BFGS re-fit on all the data so far as batches arrive.

Every rank holds a shard of the examples. One evaluation of the objective

.. math::
    F(w) = \\frac{1}{N} \\sum_{r} \\sum_{i \\in \\text{shard}_r} \\ell_i(w) + R(w)

is one ``all_reduce(SUM)`` of the buffer ``[L_r, \\nabla L_r]`` (the shard's loss sum and its
gradient), divided by the global example count ``N``; the penalty ``R`` (e.g. ``(λ/2)||w||²``)
is added after the reduction, on identical weights. Every rank then runs the identical
two-loop recursion and (strong-Wolfe) line search of ``torch.optim.LBFGS`` on identical
numbers, so the ranks stay bit-for-bit equal without broadcasting weights, and the P-rank
iterates equal the 1-rank iterates on the concatenated data up to the summation order of
the reduction.

One :meth:`DataParallelLBFGS.step` is one L-BFGS iteration (``max_iter=1``; the history,
step and curvature pairs persist between calls). Its first evaluation is at the point the
previous iteration's line search ended on; the last evaluation is cached, so it costs no
message.

**Batches arriving over time** (:class:`CumulativeBatchLBFGS`): a multi-batch L-BFGS with
full re-evaluation. When batch ``k`` arrives (``n_k`` examples over all ranks) the objective
becomes

.. math::
    F_k(w) = \\frac{\\sum_{j \\le k} \\gamma^{k-j} L_j(w)}{\\sum_{j \\le k} \\gamma^{k-j} n_j} + R(w)

where ``L_j`` is the loss sum over batch ``j`` (``decay`` ``γ = 1``: every example seen so
far counts once, so ``F_k`` is the batch objective on all data so far; ``γ < 1`` forgets old
batches geometrically). The previous weights are the warm start and the L-BFGS curvature
pairs of the earlier objectives are kept (the one pair that would straddle the change of
objective is skipped). Every evaluation of ``F_k`` reads every batch that has arrived, once:
each rank keeps its shards of all of them, and the cost of an iteration grows with the data
seen so far.

This is **not** SA L-BFGS (Purpura et al., "Statistically adaptive learning for a general
class of cost functions (SA L-BFGS)", arXiv:1209.0029), which makes batch L-BFGS near real
time by using "statistical tools to balance the contributions of previous weights, old
training examples, and new training examples". Only the paper's abstract could be read here,
not its update rule, so that method is not implemented; the class was called
``StatisticallyAdjustedLBFGS`` before, a name kept as a deprecated alias.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .messages import Messenger

__all__ = ["CumulativeBatchLBFGS", "DataParallelLBFGS", "LBFGSConfig"]


@dataclass(frozen=True)
class LBFGSConfig:
    """L-BFGS settings (``torch.optim.LBFGS``'s, one iteration per :meth:`step`).

    Attributes:
        lr: step length scale (1 is the quasi-Newton step).
        history_size: curvature pairs kept.
        line_search: ``"strong_wolfe"`` or ``None`` (fixed step ``lr``).
        tolerance_grad: stop when ``max |∇F| <= tolerance_grad``.
        tolerance_change: stop when a step or a loss change is below it.
        max_evals: evaluations one iteration's line search may take.
    """

    lr: float = 1.0
    history_size: int = 10
    line_search: str | None = "strong_wolfe"
    tolerance_grad: float = 1e-7
    tolerance_change: float = 1e-9
    max_evals: int = 25

    def __post_init__(self) -> None:
        if self.line_search not in ("strong_wolfe", None):
            raise ValueError(f"line_search={self.line_search!r}: choose 'strong_wolfe' or None")
        if self.lr <= 0 or self.history_size < 1 or self.max_evals < 1:
            raise ValueError(
                f"lr={self.lr}, history_size={self.history_size} and max_evals={self.max_evals} "
                "must be positive"
            )


@dataclass
class _Evaluation:
    """One evaluation of ``F``: the weights' :meth:`DataParallelLBFGS._versions` it was made at
    and a copy of their values, ``F``, ``∇F`` per parameter (views of ``flat``) and the
    versions of the ``.grad`` tensors that last received a copy of it (``None``: not yet)."""

    weights: tuple[tuple[int, int], ...]
    values: list[torch.Tensor]
    loss: float
    grads: list[torch.Tensor]
    flat: torch.Tensor
    grad_key: tuple[tuple[int, int], ...] | None


class _LBFGS(torch.optim.LBFGS):
    """``torch.optim.LBFGS`` without three copies of the weights or the gradient per line-search
    evaluation; the same iterates to the last bit (``tests/trainers/test_linear.py`` runs both).

    - The flat gradient is the solver's reduced buffer, not a ``cat`` of ``p.grad``, while the
      ``.grad`` tensors hold the copy the solver gave them, unwritten.
    - A trial point of the line search is written once, ``w = x + t d`` (the kernel of torch's
      ``w.add_(d, alpha=t)`` on ``w = x``), and left there: torch restores ``x`` after each
      trial and adds the accepted ``t d`` again, which on the last trial gives back the weights
      it had. Here the accepted step is written only when it is not the last trial.

    Private hooks of torch's class: a torch whose LBFGS lacks them runs its own (slower) code.
    """

    def __init__(self, solver: DataParallelLBFGS, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._solver = solver
        self._trial: tuple[list[torch.Tensor], torch.Tensor, float, tuple] | None = None

    def _gather_flat_grad(self) -> torch.Tensor:
        cache = self._solver._cache
        if cache is not None and cache.grad_key == DataParallelLBFGS._versions(
            [p.grad for p in self._params]
        ):
            return cache.flat
        return super()._gather_flat_grad()

    def _write(self, x: list[torch.Tensor], t: float, d: torch.Tensor) -> None:
        offset = 0
        for p, x0 in zip(self._params, x, strict=True):
            numel = p.numel()
            torch.add(x0, d[offset : offset + numel].view_as(p), alpha=t, out=p)
            offset += numel

    def _directional_evaluate(self, closure, x, t, d):  # noqa: ANN001, ANN202
        with torch.no_grad():
            self._write(x, t, d)
        self._trial = (x, d, t, DataParallelLBFGS._versions(self._params))
        loss = float(closure())
        return loss, self._gather_flat_grad()

    def _add_grad(self, step_size, update) -> None:  # noqa: ANN001
        trial, self._trial = self._trial, None
        if trial is None or trial[1] is not update:  # no line search: the weights are x
            super()._add_grad(step_size, update)
            return
        x, _, t, versions = trial
        if t == step_size and versions == DataParallelLBFGS._versions(self._params):
            return  # the accepted step is the last trial: the weights are x + t d already
        self._write(x, step_size, update)


class DataParallelLBFGS:
    """L-BFGS on a data-parallel objective, one all-reduce per evaluation.

    Args:
        params: the parameters (identical on every rank at the start).
        local_loss_sum: returns this rank's loss *sum* over its shard (autograd graph to
            ``params``), without the penalty.
        num_examples: this rank's example count; the global ``N`` is reduced once here.
        penalty: returns ``R(w)`` (autograd), added after the reduction; optional.
        config: :class:`LBFGSConfig`.
        messenger: the counted all-reduce (default: over the world).

    Example:
        >>> solver = DataParallelLBFGS(model.parameters(),
        ...     lambda: model.loss_sum(X, y), len(y), penalty=lambda: model.penalty(1e-3))
        >>> for _ in range(100):
        ...     loss = solver.step()
        ...     if solver.converged: break
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        local_loss_sum: Callable[[], torch.Tensor],
        num_examples: float,
        *,
        penalty: Callable[[], torch.Tensor] | None = None,
        config: LBFGSConfig | None = None,
        messenger: Messenger | None = None,
    ) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("DataParallelLBFGS got no parameters that require grad")
        self.config = config or LBFGSConfig()
        self.messenger = messenger or Messenger()
        self.penalty = penalty
        self.optimizer = _LBFGS(
            self,
            self.params,
            lr=self.config.lr,
            max_iter=1,
            max_eval=self.config.max_evals + 1,  # + the evaluation at the start of step()
            tolerance_grad=self.config.tolerance_grad,
            tolerance_change=self.config.tolerance_change,
            history_size=self.config.history_size,
            line_search_fn=self.config.line_search,
        )
        self.evaluations = 0  # objective evaluations that sent a message
        self.iterations = 0
        self.converged = False
        # the last evaluation (what :meth:`evaluate` hands back while the weights are its)
        self._cache: _Evaluation | None = None
        self.set_objective(local_loss_sum, num_examples)

    # -- the objective -----------------------------------------------------------------------
    def _global_count(self, num_examples: float) -> float:
        p = self.params[0]
        count = torch.tensor([float(num_examples)], dtype=torch.float64, device=p.device)
        total = float(self.messenger.all_reduce_sum(count))
        if total <= 0:
            raise ValueError(f"the objective has no examples (global count {total})")
        return total

    def set_objective(
        self, local_loss_sum: Callable[[], torch.Tensor], num_examples: float
    ) -> None:
        """Replace the objective (``num_examples`` this rank's, reduced to the global N).

        The curvature pairs are kept; the pair from the last step, which would mix the old
        objective's gradient with the new one's, is skipped.
        """
        self.local_loss_sum = local_loss_sum
        self.num_examples = self._global_count(num_examples)
        self._cache = None
        self.converged = False
        state = self.optimizer.state.get(self.params[0], {})
        if state.get("n_iter", 0) >= 1:
            self.evaluate()
            # y = g_new(w) - prev_flat_grad = 0 at the next iteration: torch skips a pair
            # with y's < 1e-10, so no pair straddles the change of objective.
            state["prev_flat_grad"] = self._flat_grad().clone()

    def _flat_grad(self) -> torch.Tensor:
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def _key(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def _current(self) -> list[torch.Tensor]:
        """The weights as they are (no copy: for comparisons)."""
        return [p.detach() for p in self.params]

    @staticmethod
    def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    @staticmethod
    def _versions(tensors: Sequence[torch.Tensor | None]) -> tuple[tuple[int, int], ...]:
        """Where each tensor's storage is and how often it was written in place: equal keys,
        the same values (every in-place write, ``copy_`` and optimizer updates included, bumps
        a tensor's version; a replaced ``.data`` moves its storage)."""
        return tuple((-1, -1) if t is None else (t.data_ptr(), t._version) for t in tensors)

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped as the parameters, in order."""
        views, offset = [], 0
        for p in self.params:
            views.append(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        return views

    def _cached(self) -> _Evaluation | None:
        """The last evaluation, if the weights are the ones it was made at: not written since
        (their versions), or written back to the same values (a step that rounds to nothing:
        no message for it, as the run logs count)."""
        cache = self._cache
        if cache is None:
            return None
        versions = self._versions(self.params)
        if cache.weights != versions:
            if not self._same(cache.values, self._current()):
                return None
            cache.weights = versions
        return cache

    def _set_grads(self, cache: _Evaluation) -> None:
        """``p.grad`` = a copy of ``∇F`` of ``cache`` (into the existing tensor when it fits: on
        CPU a fresh parameter-sized tensor costs its page faults every call), unless it holds
        that copy already, unwritten. A copy, not a view: a caller's write to ``p.grad`` must
        not reach the kept evaluation."""
        if self._versions([p.grad for p in self.params]) == cache.grad_key:
            return
        for p, g in zip(self.params, cache.grads, strict=True):
            old = p.grad
            if old is not None and old.shape == g.shape and old.dtype == g.dtype:
                old.copy_(g)
            else:
                p.grad = g.clone()
        cache.grad_key = self._versions([p.grad for p in self.params])

    def evaluate(self) -> float:
        """``F(w)`` at the current weights, with ``p.grad = ∇F`` (cached for unchanged w)."""
        cache = self._cached()
        if cache is not None:
            self._set_grads(cache)
            return cache.loss
        weights, values = self._versions(self.params), self._key()
        with torch.enable_grad():
            local = self.local_loss_sum()
            grads = torch.autograd.grad(local, self.params, allow_unused=True)
        grads = [
            torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads, strict=True)
        ]
        dtype = self.params[0].dtype
        buffer = torch.cat([local.detach().reshape(1).to(dtype)] + [g.reshape(-1) for g in grads])
        self.messenger.all_reduce_sum(buffer)  # (1 + numel,): [L, ∇L] summed over ranks
        self.evaluations += 1
        buffer /= self.num_examples
        loss = buffer[0]
        total = self._split(buffer[1:])
        if self.penalty is not None:
            with torch.enable_grad():
                r = self.penalty()
                extra = torch.autograd.grad(r, self.params, allow_unused=True)
            loss = loss + r.detach()
            total = [t if e is None else t.add_(e) for t, e in zip(total, extra, strict=True)]
        value = float(loss)
        self._cache = _Evaluation(weights, values, value, total, buffer[1:], None)
        self._set_grads(self._cache)
        return value

    # -- iterations ---------------------------------------------------------------------------
    def step(self) -> float:
        """One L-BFGS iteration; returns ``F`` at the new weights (and sets ``converged``)."""
        before = self._key()
        self.optimizer.step(self.evaluate)
        self.iterations += 1
        loss = self.evaluate()  # cached when the line search ended here
        grad_max = max(float(torch.linalg.vector_norm(p.grad, float("inf"))) for p in self.params)
        moved = not self._same(before, self._current())
        self.converged = grad_max <= self.config.tolerance_grad or not moved
        return loss

    # -- durable state (elastic restarts, trainers.linear.elastic) ------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything an iteration boundary needs to continue: the weights, torch's L-BFGS
        state (direction, step, curvature pairs, previous gradient and loss), the counters and
        the cached last evaluation (so a resumed run sends no extra message).

        Tensors and plain containers only (``weights_only`` loading). Identical on every rank.
        """
        cache = None
        if self._cached() is not None:  # weights as evaluated: they are the key
            assert self._cache is not None
            cache = {"params": self._key(), "loss": self._cache.loss,
                     "grads": [g.clone() for g in self._cache.grads]}  # fmt: skip
        return {
            "params": self._key(),
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "iterations": self.iterations,
            "evaluations": self.evaluations,
            "converged": self.converged,
            "num_examples": self.num_examples,
            "cache": cache,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (of any world size: the state is the same on every
        rank). The objective (``local_loss_sum``) stays the one this solver was built with."""
        params = state["params"]
        if len(params) != len(self.params) or any(
            p.shape != q.shape for p, q in zip(self.params, params, strict=True)
        ):
            raise ValueError(
                f"the saved L-BFGS state holds weights of shapes {[tuple(q.shape) for q in params]}"
                f", this model {[tuple(p.shape) for p in self.params]}"
            )
        with torch.no_grad():
            for p, q in zip(self.params, params, strict=True):
                p.copy_(q)
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.iterations = int(state["iterations"])
        self.evaluations = int(state["evaluations"])
        self.converged = bool(state["converged"])
        self.num_examples = float(state["num_examples"])
        cache = state["cache"]
        self._cache = None
        for p in self.params:
            p.grad = None
        if cache is not None and self._same(list(cache["params"]), self._current()):
            flat = torch.cat([g.reshape(-1) for g in cache["grads"]])
            self._cache = _Evaluation(
                self._versions(self.params), self._key(), float(cache["loss"]),
                self._split(flat), flat, None,
            )  # fmt: skip
            self._set_grads(self._cache)

    def run(self, max_iter: int, callback: Callable[[int, float], None] | None = None) -> float:
        """Up to ``max_iter`` iterations, stopping at convergence; ``callback(it, loss)``."""
        loss = self.evaluate()
        for it in range(1, max_iter + 1):
            loss = self.step()
            if callback is not None:
                callback(it, loss)
            if self.converged:
                break
        return loss


class CumulativeBatchLBFGS:
    """L-BFGS over batches that arrive one at a time, re-fit on every batch so far.

    After :meth:`add_batch` of batch ``k`` the solver minimises ``F_k`` of the module
    docstring: the count-weighted mean loss over batches ``0..k`` (batch ``j`` weighted by
    ``decay ** (k - j)`` per example) plus the penalty, warm-started at the previous weights
    with the curvature pairs kept. Each evaluation calls ``model.loss_sum`` once on every
    arrived batch (full re-evaluation, not an incremental update): with ``decay=1`` the
    objective after the last batch is the batch objective on all the data.

    Args:
        model: a module with ``loss_sum(X, y)`` (a :class:`modelzoo.linear.GLM`, or any).
        penalty: ``R(w)``; optional.
        decay: ``γ`` in (0, 1]: weight of a batch per later batch.
        config, messenger: as for :class:`DataParallelLBFGS`.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        penalty: Callable[[], torch.Tensor] | None = None,
        decay: float = 1.0,
        config: LBFGSConfig | None = None,
        messenger: Messenger | None = None,
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay={decay} must be in (0, 1]")
        self.model, self.decay = model, decay
        self.penalty, self.config = penalty, config
        self.messenger = messenger or Messenger()
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.solver: DataParallelLBFGS | None = None

    def _weights(self) -> list[float]:
        k = len(self.batches)
        return [self.decay ** (k - 1 - j) for j in range(k)]

    def _local_loss_sum(self) -> torch.Tensor:
        weights = self._weights()
        total = self.model.loss_sum(*self.batches[0]) * weights[0]
        for weight, (X, y) in zip(weights[1:], self.batches[1:], strict=True):
            total = total + weight * self.model.loss_sum(X, y)
        return total

    def add_batch(self, X: torch.Tensor, y: torch.Tensor) -> None:
        """This rank's shard of the new batch (may be empty on some ranks)."""
        self.batches.append((X, y))
        count = sum(w * len(b[1]) for w, b in zip(self._weights(), self.batches, strict=True))
        if self.solver is None:
            self.solver = DataParallelLBFGS(
                self.model.parameters(), self._local_loss_sum, count,
                penalty=self.penalty, config=self.config, messenger=self.messenger,
            )  # fmt: skip
        else:
            self.solver.set_objective(self._local_loss_sum, count)

    def state_dict(self) -> dict[str, Any]:
        """The arrived-batch count, ``decay`` and the solver's :meth:`DataParallelLBFGS.state_dict`
        (the batches themselves are data: the caller re-reads and re-shards them)."""
        return {
            "arrived": len(self.batches),
            "decay": self.decay,
            "solver": None if self.solver is None else self.solver.state_dict(),
        }

    def load_state_dict(
        self, state: Mapping[str, Any], batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Continue from :meth:`state_dict` with ``batches``: this rank's shards of the
        ``state["arrived"]`` batches that had arrived, sharded for the current world (any
        size). A collective (the global example count is reduced once)."""
        if len(batches) != int(state["arrived"]):
            raise ValueError(f"the saved state has {state['arrived']} arrived batches, got "
                             f"{len(batches)} to restore")  # fmt: skip
        if float(state["decay"]) != self.decay:
            raise ValueError(
                f"the saved state has decay {state['decay']}, this solver {self.decay}"
            )
        self.batches = list(batches)
        if state["solver"] is None:
            self.solver = None
            return
        count = sum(w * len(b[1]) for w, b in zip(self._weights(), self.batches, strict=True))
        self.solver = DataParallelLBFGS(
            self.model.parameters(), self._local_loss_sum, count,
            penalty=self.penalty, config=self.config, messenger=self.messenger,
        )  # fmt: skip
        self.solver.load_state_dict(state["solver"])

    def fit_batch(
        self,
        X: torch.Tensor,
        y: torch.Tensor,
        iterations: int,
        callback: Callable[[int, float], None] | None = None,
    ) -> float:
        """:meth:`add_batch`, then up to ``iterations`` L-BFGS iterations on ``F_k``."""
        self.add_batch(X, y)
        assert self.solver is not None
        return self.solver.run(iterations, callback)

    def fit_stream(
        self, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], iterations: int
    ) -> list[float]:
        """Every batch in turn; the objective after each batch."""
        return [self.fit_batch(X, y, iterations) for X, y in batches]


_RENAMED = (
    "StatisticallyAdjustedLBFGS is renamed CumulativeBatchLBFGS (it re-evaluates every arrived "
    "batch; it is not SA L-BFGS): import CumulativeBatchLBFGS"
)


def __getattr__(name: str) -> Any:
    if name == "StatisticallyAdjustedLBFGS":  # the deprecated old name
        warnings.warn(_RENAMED, DeprecationWarning, stacklevel=2)
        return CumulativeBatchLBFGS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
