"""What error feedback and CSER share: the compressor options and the combiner base."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..data import derive_seed
from ..dist import DistEnv
from .base import CountingCombiner, option
from .compressors import COMPRESSORS, Compressor, compressed_allreduce, create_compressor
from .flat import flatten
from .sparse import CHOICES as SPARSE_CHOICES

__all__ = ["CompressedCombiner", "CompressorOptions", "no_loss_scaling"]


def _compressor_names() -> list[str]:
    return list(COMPRESSORS)


@dataclass(frozen=True)
class CompressorOptions:
    """A compressor by name and its options (``None``: the compressor's own default)."""

    compressor: str | Compressor = option("topk", "the compressor", choices=_compressor_names)
    ratio: float | None = option(
        None,
        "topk / randblock / importance: fraction of the entries sent (default: the compressor's)",
        flag="--compress-ratio",
    )
    levels: int | None = option(
        None,
        "qsgd: levels s (default: the most for which the sum of all workers fits int8)",
        flag="--qsgd-levels",
    )
    bucket_size: int | None = option(
        None, "qsgd: elements per shared norm (default: the compressor's)", flag="--qsgd-bucket"
    )
    eps: float | None = option(
        None, "importance: eps of |g| / (|w| + eps) (default: the compressor's)",
        flag="--importance-eps",
    )  # fmt: skip
    sparse_allreduce: str = option(
        "auto",
        "topk: how the (index, value) pairs are summed (auto: SparCML's cost model, "
        "docs/communication.md)",
        choices=SPARSE_CHOICES,
    )

    def __post_init__(self) -> None:
        self.build_compressor()  # validates the name and the options it takes
        if self.sparse_allreduce not in SPARSE_CHOICES:
            raise ValueError(
                f"sparse_allreduce {self.sparse_allreduce!r}: choose one of "
                f"{', '.join(SPARSE_CHOICES)}"
            )

    def build_compressor(self) -> Compressor:
        given = {
            k: getattr(self, k)
            for k in ("ratio", "levels", "bucket_size", "eps")
            if getattr(self, k) is not None
        }
        if isinstance(self.compressor, Compressor):
            if given:
                raise ValueError(
                    f"options {', '.join(given)} configure a compressor given by name; the "
                    f"instance {self.compressor!r} was built with its own"
                )
            return self.compressor
        return create_compressor(self.compressor, **given)


def no_loss_scaling(scaler: torch.amp.GradScaler | None, mode: str) -> None:
    if scaler is not None:
        raise ValueError(
            f"combiner {mode!r} keeps residuals across steps, which fp16 loss scaling would "
            "corrupt; train in bfloat16 or float32 precision"
        )


class CompressedCombiner(CountingCombiner):
    """Bare module with rank 0's weights, a compressor, per-step generators, byte counting."""

    Options = CompressorOptions

    def __init__(self, options: Any = None, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        self.compressor = self.options.build_compressor()
        self.steps = 0  # optimizer steps taken (seeds the generators)
        self.union: dict[int, int] = {}  # per salt: non-zeros of the last sparse sum

    def prepare(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv
    ) -> nn.Module:
        super().prepare(model, optimizer, env)
        self.compressor.bind(env.world_size)
        self.start_replicas(model, env)
        return model

    def _generators(self, salt: int) -> tuple[torch.Generator, torch.Generator]:
        assert self.env is not None
        shared = torch.Generator().manual_seed(derive_seed(self.seed, self.steps, salt))
        local = torch.Generator().manual_seed(
            derive_seed(self.seed, self.steps, salt, 1 + self.env.rank)
        )
        return shared, local

    def _reduce(
        self, x: Tensor, compressor: Compressor, salt: int, params: list[Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """``x`` is laid out as the flat ``params`` (default: the trainable parameters), what
        ``importance`` weighs."""
        assert self.env is not None and self.model is not None
        shared, local = self._generators(salt)
        weights = None
        if compressor.shares_selection:
            if params is None:
                params = [p for p in self.model.parameters() if p.requires_grad]
            weights = flatten(params, x.dtype)
        report: dict[str, Any] = {}
        mean, own, sent = compressed_allreduce(
            compressor, x, self.env, shared=shared, local=local, weights=weights,
            sparse_algorithm=self.options.sparse_allreduce, union=self.union.get(salt),
            report=report,
        )  # fmt: skip
        if "nnz" in report:
            self.union[salt] = int(report["nnz"])
        self.counter.add(sent if self.env.distributed else 0)
        if self.env.distributed:
            self.counter.add_wire(report["wire_bytes"], report["collective"])
        return mean, own

    def _reduce_per_tensor(
        self, x: Tensor, compressor: Compressor, params: list[Tensor]
    ) -> tuple[Tensor, Tensor]:
        """Like :meth:`_reduce`, with every tensor of ``params`` (``x`` is laid out as their
        flat concatenation) compressed on its own, tensor ``i`` drawing from generators salted
        with ``i``: ``ratio`` of each tensor is sent, as the DEF authors' random-block reducer
        sends one block per tensor. Compressors whose payloads add up in a plain all-reduce
        and that need no shared statistics send every tensor's payload in **one** all-reduce
        (one message per step, as their reducer does); the others run one collective per
        tensor."""
        assert self.env is not None
        sizes = [p.numel() for p in params]
        if sum(sizes) != x.numel():
            raise ValueError(f"{x.numel()} elements for parameters of {sum(sizes)} in all")
        segments = x.split(sizes)
        needs_stats = type(compressor).shared_stats is not Compressor.shared_stats  # qsgd
        batched = (
            compressor.allreduce_compatible and not compressor.shares_selection and not needs_stats
        )
        payloads: list[list[Tensor]] = []
        contexts = []
        if batched:
            for i, seg in enumerate(segments):
                shared, local = self._generators(salt=i)
                payload, ctx = compressor.compress(seg, None, shared=shared, local=local)
                payloads.append(payload)
                contexts.append(ctx)
            flat_payload = [t for payload in payloads for t in payload]
            batched = len({t.dtype for t in flat_payload}) == 1
        if not batched:  # one collective per tensor
            means, owns = [], []
            for i, (seg, p) in enumerate(zip(segments, params, strict=True)):
                mean, own = self._reduce(seg, compressor, salt=i, params=[p])
                means.append(mean)
                owns.append(own)
            return torch.cat(means), torch.cat(owns)
        owns = [
            compressor.decompress(payload, ctx)
            for payload, ctx in zip(payloads, contexts, strict=True)
        ]
        if not self.env.distributed:
            own = torch.cat(owns)
            return own.clone(), own
        self.counter.add(sum(compressor.payload_bytes(n) for n in sizes))
        counts = [t.numel() for t in flat_payload]
        buffer = torch.cat([t.reshape(-1) for t in flat_payload])
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        n = self.env.world_size
        nbytes = buffer.numel() * buffer.element_size()
        self.counter.add_wire(round(2 * (n - 1) / n * nbytes), "allreduce")
        pieces = iter(buffer.split(counts))
        means = []
        for payload, ctx in zip(payloads, contexts, strict=True):
            summed = [next(pieces).view_as(t) for t in payload]
            means.append(compressor.decompress(summed, ctx).div_(n))
        return torch.cat(means), torch.cat(owns)

    def metrics(self) -> dict[str, float]:
        return self.counter.metrics()

    def state_dict(self) -> dict[str, Any]:
        # the union estimates steer the sparse algorithm's choice: kept for exact resumption
        return {"steps": self.steps, "union": dict(self.union)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = int(state_dict["steps"])
        self.union = {int(k): int(v) for k, v in state_dict.get("union", {}).items()}
