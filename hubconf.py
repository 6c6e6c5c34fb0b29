"""torch.hub entry points: one per registered vision model of :mod:`modelzoo`.

>>> import torch
>>> net = torch.hub.load("/path/to/repo", "resnest50", source="local", pretrained=True)
>>> backbone = torch.hub.load(
...     "/path/to/repo", "resnest50", source="local", features_only=True, out_indices=(1, 2, 3, 4)
... )

Each entry is ``modelzoo.get_model(name, ...)`` with its ``pretrained``, ``num_classes``,
``features_only``, ``out_indices`` and builder options. The entries are generated from the
registry, so every vision model registered in ``modelzoo.vision`` has one.
"""

# Every module-level name but the entries starts with "_": torch.hub lists each public
# callable of this file as an entry point.
from collections.abc import Callable as _Callable
from collections.abc import Sequence as _Sequence
from typing import Any as _Any

from torch import nn as _nn

import modelzoo as _modelzoo
from modelzoo import registry as _registry

# torch.hub checks these are importable before calling an entry (weights download and
# verification need filelock and tqdm; GluonCV .params files are read with numpy).
dependencies = ["torch", "numpy", "filelock", "tqdm"]

_VISION_PACKAGE = "modelzoo.vision."


def _entrypoint(name: str) -> _Callable[..., _nn.Module]:
    def entry(
        *,
        pretrained: bool | str = False,
        num_classes: int | None = None,
        features_only: bool = False,
        out_indices: _Sequence[int] | None = None,
        **kwargs: _Any,
    ) -> _nn.Module:
        return _modelzoo.get_model(
            name,
            pretrained=pretrained,
            num_classes=num_classes,
            features_only=features_only,
            out_indices=out_indices,
            **kwargs,
        )

    builder = _registry.get_model_entry(name).builder
    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = (
        f"{(builder.__doc__ or name).strip()}\n\n"
        f"torch.hub entry for ``modelzoo.get_model({name!r}, ...)``: ``pretrained`` (False, "
        f"True or a weights tag: {sorted(_registry.get_model_entry(name).weights)}), "
        f"``num_classes``, ``features_only``, ``out_indices`` and builder options."
    )
    return entry


def _vision_models() -> list[str]:
    return [
        name
        for name in _modelzoo.list_models()
        if _registry.get_model_entry(name).builder.__module__.startswith(_VISION_PACKAGE)
    ]


globals().update({_name: _entrypoint(_name) for _name in _vision_models()})
