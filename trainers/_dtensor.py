"""DTensor checks that do not import ``torch.distributed.tensor`` (about 2 s at start-up).

No tensor can be a DTensor before that module is imported, so the checks look it up in
``sys.modules`` and answer False when it is absent; the tensor-parallel code imports it.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "PIPELINE_ATTR",
    "TP_ATTR",
    "is_dtensor",
    "is_pipeline_parallel",
    "is_tensor_parallel",
    "local_tensor",
]

TP_ATTR = "_modelzoo_tensor_parallel"  # set on a model's root module: its tp mesh


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(tensor: Any) -> Any:
    """A DTensor's local shard, any other tensor itself. Under ``torch.no_grad()`` the shard
    shares the DTensor's storage (in-place updates reach it), not an autograd view."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def is_tensor_parallel(model: Any) -> bool:
    """Whether ``trainers.parallel.parallelize_bert`` laid ``model`` out."""
    return getattr(model, TP_ATTR, None) is not None


PIPELINE_ATTR = "is_pipeline_stage"  # True on trainers.parallel.pipeline.PipelinedModel


def is_pipeline_parallel(model: Any) -> bool:
    """Whether ``model`` is a :class:`trainers.parallel.pipeline.PipelinedModel`."""
    return bool(getattr(model, PIPELINE_ATTR, False))
