"""What the GluonCV converters share: a state dict assembled from Gluon parameter arrays by a
name map, every problem listed in one error.

Each converter (:mod:`.gluoncv_resnest`, :mod:`.gluoncv_resnet`) knows its family's names;
:func:`assemble_state_dict` does the rest: names no rule maps, names mapped twice, model keys
left without a value and shapes that disagree are all reported together (the classifier's
tensors may differ in shape: a model built for another number of classes), and the arrays
become tensors in the model's key order. BatchNorm's ``num_batches_tracked`` buffers, which
MXNet does not have, are set to 0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import numpy as np
import torch
from torch import nn


def map_resnet_names(
    names: list[str],
    target_keys: list[str] | Mapping[str, object],
    *,
    flat: re.Pattern[str],
    flat_target: Callable[[re.Match[str], bool, bool], str | None],
    structural_target: Callable[[str], str | None],
    what: str,
    prefix_example: str,
) -> dict[str, str | None]:
    """Gluon names of a ResNet-shaped network -> our keys (``None`` where no rule applies).

    Structural names (``layer1.0.conv1.weight``, Gluon's ``save_parameters``) go through
    ``structural_target``; flat ones (``collect_params().save()``) must match ``flat`` (with a
    ``prefix`` group) and go through ``flat_target(match, deep_stem, avg_down)``, where the
    target keys tell a deep stem (``conv1.0.weight``) and average-pool shortcuts
    (``layer*.0.downsample.2.weight``) apart.

    Raises:
        ValueError: Flat names that do not share one prefix (``what``: the family's name).
    """
    target = set(target_keys)
    if names and all("." in n for n in names):
        return {n: structural_target(n) for n in names}
    deep_stem = "conv1.0.weight" in target
    avg_down = any(re.fullmatch(r"layer\d+\.0\.downsample\.2\.weight", k) for k in target)
    out: dict[str, str | None] = {}
    prefixes = set()
    for name in names:
        match = flat.match(name)
        if match is None:
            out[name] = None
            continue
        prefixes.add(match["prefix"])
        out[name] = flat_target(match, deep_stem, avg_down)
    if len(prefixes) > 1:
        raise ValueError(
            f"GluonCV {what} names use several prefixes {sorted(prefixes)}; expected one "
            f"network's parameters (e.g. all starting with {prefix_example!r})"
        )
    return out


def listing(items: list[str], limit: int = 12) -> str:
    """The first ``limit`` items, and how many more."""
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")


def assemble_state_dict(
    params: Mapping[str, np.ndarray],
    model: nn.Module,
    key_map: Mapping[str, str | None],
    *,
    classifier: str,
    what: str,
    hint: str,
) -> dict[str, torch.Tensor]:
    """``model``'s state dict from the Gluon ``params`` mapped by ``key_map`` (Gluon name ->
    our key, ``None`` where no rule applies).

    Raises:
        ValueError: ``what`` (e.g. "GluonCV ResNet parameters") does not fit the model: every
            offending name is listed, then ``hint`` (what to check).
    """
    target = model.state_dict()
    unmapped = [n for n, k in key_map.items() if k is None or k not in target]
    sources: dict[str, str] = {}
    duplicated = []
    for name, key in key_map.items():
        if key is None or key not in target:
            continue
        if key in sources:
            duplicated.append(f"{sources[key]} and {name} -> {key}")
        sources[key] = name
    missing = [k for k in target if k not in sources and not k.endswith("num_batches_tracked")]
    mismatched = [
        f"{name} {tuple(params[name].shape)} -> {key} {tuple(target[key].shape)}"
        for key, name in sources.items()
        if tuple(params[name].shape) != tuple(target[key].shape)
        and not key.startswith(classifier + ".")
    ]
    problems = []
    if unmapped:
        problems.append(f"GluonCV names with no counterpart in the model: {listing(unmapped)}")
    if duplicated:
        problems.append(f"mapped twice: {listing(duplicated)}")
    if missing:
        problems.append(f"model keys the file does not provide: {listing(missing)}")
    if mismatched:
        problems.append(f"shape mismatches: {listing(mismatched)}")
    if problems:
        raise ValueError(
            f"{what} ({len(params)} arrays) do not fit {type(model).__name__} "
            f"({len(target)} keys): " + "; ".join(problems) + f". {hint}"
        )
    state: dict[str, torch.Tensor] = {}
    for key, value in target.items():
        if key in sources:
            array = np.ascontiguousarray(params[sources[key]])
            if not array.flags.writeable:  # torch.from_numpy needs a writable array
                array = array.copy()
            state[key] = torch.from_numpy(array)
        else:  # num_batches_tracked: MXNet keeps no such counter
            state[key] = torch.zeros((), dtype=value.dtype)
    return state
