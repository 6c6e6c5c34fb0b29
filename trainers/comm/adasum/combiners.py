"""``--grad-combine adasum``: the combiner, in gradient mode or delta mode (Horovod's)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...dist import DistEnv
from ..base import GradCombiner, option, register_combiner
from ..flat import broadcast_, restore_optimizer_state
from ..overlap import BackwardBuckets
from .allreduce import DEFAULT_BUCKET_CAP_MB, adasum_allreduce_, adasum_bucket_allreduce_
from .rule import EPS

__all__ = ["ADASUM_MODES", "AdasumCombiner", "AdasumOptions", "resolve_adasum_mode"]

ADASUM_MODES = ("delta", "gradient", "auto")


def resolve_adasum_mode(mode: str, optimizer: torch.optim.Optimizer) -> str:
    """``"delta"`` or ``"gradient"`` (``auto``: by the optimizer).

    ``delta`` (the default) is Horovod's ``DistributedOptimizer(op=Adasum)`` for every
    optimizer. ``auto`` (an explicit choice; this library's earlier default) picks gradient
    mode for ``torch.optim.SGD`` (``--optimizer sgd / nag``) and delta mode for every other
    optimizer. Gradient mode equals delta mode only for plain SGD without momentum and
    without weight decay; with momentum (NAG included) or weight decay the two differ,
    Adasum not being additive.
    """
    if mode not in ADASUM_MODES:
        raise ValueError(f"adasum mode {mode!r}: choose one of {', '.join(ADASUM_MODES)}")
    if mode != "auto":
        return mode
    return "gradient" if isinstance(optimizer, torch.optim.SGD) else "delta"


@dataclass(frozen=True)
class AdasumOptions:
    mode: str = option(
        "delta",
        "combine the optimizer's updates (delta, Horovod's DistributedOptimizer(op=Adasum)) "
        "or the gradients before one ordinary step (gradient); auto: gradient for sgd / nag, "
        "delta otherwise",
        flag="--adasum-mode",
        choices=ADASUM_MODES,
    )
    hierarchical: bool = option(
        False,
        "average inside each node, Adasum across nodes (needs >= 2 nodes)",
        flag="--adasum-hierarchical",
    )
    eps: float = option(
        EPS, "guard on the squared norms (Horovod's sqrt(DBL_MIN))", flag="--adasum-eps"
    )
    bucket_cap_mb: float = option(
        DEFAULT_BUCKET_CAP_MB, "fusion bucket size in MB (Horovod's)", flag="--adasum-bucket-cap-mb"
    )
    overlap: bool = option(
        True,
        "gradient mode: reduce each bucket (in backward order) while the backward computes "
        "the gradients below it; same results as --no-adasum-overlap",
        flag="--adasum-overlap",
    )

    def __post_init__(self) -> None:
        if self.mode not in ADASUM_MODES:
            raise ValueError(f"mode {self.mode!r}: choose one of {', '.join(ADASUM_MODES)}")
        if self.eps < 0 or self.bucket_cap_mb <= 0:
            raise ValueError(
                f"eps must be >= 0 and bucket_cap_mb > 0, got {self.eps} and {self.bucket_cap_mb}"
            )


@register_combiner("adasum", AdasumOptions)
class AdasumCombiner(GradCombiner):
    """Adasum across ranks; the bare module starts from rank 0's weights and buffers.

    **Gradient mode**: ``p.grad`` is Adasum-combined per tensor, then one ordinary optimizer
    step (not Horovod's optimizer path: equal to delta mode only for plain SGD without
    momentum and weight decay). Gradients still carry the fp16 loss scale when they are
    combined; the guard ``eps`` is scaled with it (``eps * scale**2``), so fp16 and
    fp32 runs combine alike, and a non-finite gradient on any rank reaches every rank, which
    then skip the step together. A parameter without a gradient on some ranks counts as zero
    there; one without a gradient anywhere keeps ``grad=None``. The gradients are cut into
    buckets of ``bucket_cap_mb`` in backward order (the reverse of ``model.parameters()``),
    and with ``overlap`` (the default) each bucket is reduced on a worker thread as soon as
    the backward has accumulated its last gradient (:mod:`trainers.comm.overlap`), from the
    second step on: the same buckets, the same arithmetic, the same results as without.

    **Delta mode** (the default; Horovod's ``DistributedOptimizer(op=Adasum)``): every rank runs
    ``optimizer.step()`` (``scaler.step`` under fp16) on its own gradients from the same
    weights ``w_start``; the updates ``w_new - w_start`` are Adasum-combined per tensor and
    every rank sets ``w = w_start + combined``, for every optimizer as Horovod. Optimizer states
    (moments) stay per rank, as in Horovod, and are saved per rank in checkpoints. Gradient
    clipping applies to local gradients. A rank whose fp16 step is skipped (overflow)
    contributes a zero update, which Adasum ignores.

    With one rank nothing is communicated: exactly the plain optimizer. Use the single-worker
    learning rate (Adasum of parallel updates is their mean, of orthogonal ones their sum).
    ``hierarchical``: average inside each node (``local_world_size`` ranks), Adasum across
    nodes; needs at least two nodes.
    """

    summary = "adaptive summation; keep the single-worker learning rate, see docs/adasum.md"

    def __init__(self, options: AdasumOptions | None = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        # "gradient" / "delta"; "auto" is resolved in prepare, where the optimizer is known
        self.mode: str | None = None if self.options.mode == "auto" else self.options.mode
        self.local_size = 1
        self._scaler: torch.amp.GradScaler | None = None
        self._pending_scaler: dict[str, Any] | None = None
        # gradient mode: the parameters in backward order, their buckets and the hooks
        self._overlap: BackwardBuckets | None = None

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.mode = resolve_adasum_mode(self.options.mode, optimizer)
        if not env.distributed:
            return model
        if self.options.hierarchical:
            self.local_size = _check_hierarchy(env)
        # Like DistributedDataParallel: every rank starts from rank 0's weights and buffers.
        broadcast_(list(model.parameters()) + list(model.buffers()))
        if self.mode == "gradient":  # the hooks record the backward order in the first step
            params = [p for p in model.parameters() if p.requires_grad][::-1]
            cap = max(1, int(self.options.bucket_cap_mb * 2**20))
            self._overlap = BackwardBuckets(params, cap, self._reduce_bucket)
        return model

    def _reduce_bucket(self, b: int, grads: list[Tensor]) -> None:
        """One bucket of gradient mode (on the overlap worker, or in ``reduce_gradients``)."""
        eps = self.options.eps
        if self._scaler is not None:  # fp16: the gradients carry the loss scale
            eps *= self._scaler.get_scale() ** 2
        adasum_bucket_allreduce_(grads, local_size=self.local_size, eps=eps)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulation micro-steps: the overlap hooks launch nothing."""
        with self._overlap.paused() if self._overlap is not None else contextlib.nullcontext():
            yield

    def _sync_buffers(self) -> None:
        """Rank 0's buffers (BatchNorm statistics) everywhere, as DDP does before a forward."""
        assert self.model is not None
        broadcast_(list(self.model.buffers()))

    def _allreduce(self, tensors: Sequence[Tensor], eps: float) -> None:
        adasum_allreduce_(
            tensors, local_size=self.local_size, eps=eps, bucket_cap_mb=self.options.bucket_cap_mb
        )

    def _distributed(self) -> bool:
        return self.env is not None and self.env.distributed

    def reduce_gradients(self, scaler: torch.amp.GradScaler | None) -> None:
        if self.mode != "gradient" or not self._distributed():
            return
        assert self.env is not None and self._overlap is not None
        buckets = self._overlap
        params = buckets.params
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.float32)
        for p in params:
            if p.grad is not None and p.grad.is_sparse:
                raise TypeError("Adasum does not support sparse gradients")
        self._scaler = scaler
        buckets.reduce_all()  # the overlapped buckets, or all of them now
        # after the reduction (the overlap worker may have started before every rank knew):
        # a parameter without a gradient on any rank keeps grad=None (its zeros stayed zero)
        has = has.to(self.env.device)
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        for p, anywhere in zip(params, has.tolist(), strict=True):
            if not anywhere:
                p.grad = None
        buckets.end_step(self.options.overlap)  # after the first step: rank 0's order

    def step(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None) -> None:
        if not self._distributed():
            super().step(optimizer, scaler)
            return
        if self.mode == "gradient":
            super().step(optimizer, scaler)
            self._sync_buffers()
            return
        self._scaler = scaler
        if self._pending_scaler is not None and scaler is not None:
            scaler.load_state_dict(self._pending_scaler)
        self._pending_scaler = None
        params = list(dict.fromkeys(p for g in optimizer.param_groups for p in g["params"]))
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
            super().step(optimizer, scaler)
            deltas = [p.detach() for p in params]
            for d, s in zip(deltas, start, strict=True):
                d.sub_(s)  # the parameters now hold the updates
            self._allreduce(deltas, self.options.eps)
            for d, s in zip(deltas, start, strict=True):
                d.add_(s)
        self._sync_buffers()

    def close(self) -> None:
        """End of ``fit``: stop the overlap worker thread (a later step starts it again)."""
        if self._overlap is not None:
            self._overlap.close()

    def state_dict(self) -> dict[str, Any]:
        """Delta mode: this rank's optimizer moments and loss scale (rank 0's are the
        checkpoint's own). Gradient mode: the buckets' order (a resumed run cuts the same
        buckets)."""
        env = self.env
        if env is None or not env.distributed:
            return {}
        if self.mode == "gradient":
            assert self._overlap is not None and self.model is not None
            params = [p for p in self.model.parameters() if p.requires_grad]
            order = self._overlap.layout_state(params)
            return {} if order is None else {"bucket_order": order}
        if self.mode != "delta" or env.is_main:
            return {}
        assert self.optimizer is not None
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict()["state"]}
        if self._scaler is not None:
            state["scaler"] = self._scaler.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The moments now; the loss scale at the next step (the scaler is passed there);
        gradient mode's bucket order."""
        if not state_dict:
            return
        order = state_dict.get("bucket_order")
        if order is not None:
            if self._overlap is not None and self.model is not None:
                params = [p for p in self.model.parameters() if p.requires_grad]
                self._overlap.load_layout(params, order, self.options.overlap)
            return
        assert self.optimizer is not None
        restore_optimizer_state(self.optimizer, state_dict.get("optimizer"))
        self._pending_scaler = state_dict.get("scaler")


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
