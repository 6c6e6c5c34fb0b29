"""Optimizer factory: a name registry plus GluonCV's ``--no-wd`` parameter grouping.

``create_optimizer("nag", model, lr=0.4, weight_decay=1e-4, no_wd=True)`` is what GluonCV's
``train_imagenet.py --optimizer nag --wd 1e-4 --no-wd`` does: SGD with Nesterov momentum,
and no weight decay on biases and normalization parameters (GluonCV sets ``wd_mult = 0`` on
``net.collect_params('.*beta|.*gamma|.*bias')``).

New optimizers register with one decorator, on a class or on a builder function::

    @register_optimizer("lamb")
    class Lamb(torch.optim.Optimizer):
        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01): ...

:func:`create_optimizer` passes each registered callable the common arguments its signature
names (``lr``, ``weight_decay``, ``momentum``, ``betas``, ``eps``; a ``**kwargs`` catch-all
does not count) plus any extra keyword arguments unfiltered, so a misspelled option fails loudly. Parameter groups carry
``"no_wd": True`` where weight decay is off, so LAMB/LANS can skip the trust ratio there.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = [
    "create_optimizer",
    "list_optimizers",
    "optimizer_accepts",
    "param_groups",
    "register_optimizer",
]

OptimizerBuilder = Callable[..., torch.optim.Optimizer]
_B = TypeVar("_B", bound=OptimizerBuilder)

_OPTIMIZERS: dict[str, OptimizerBuilder] = {}

# Every normalization layer with affine parameters: BatchNorm*/SyncBatchNorm/InstanceNorm*
# (all derive from _NormBase, public classes do not share a public base), GroupNorm,
# LayerNorm, RMSNorm.
_NORM_TYPES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.GroupNorm,
    nn.LayerNorm,
) + ((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())


def register_optimizer(name: str) -> Callable[[_B], _B]:
    """Register an optimizer class or builder ``(params, **options) -> Optimizer`` as ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    key = name.lower()

    def decorator(builder: _B) -> _B:
        if key in _OPTIMIZERS:
            raise ValueError(
                f"optimizer {key!r} is already registered (by {_OPTIMIZERS[key]!r}); "
                "pick another name"
            )
        _OPTIMIZERS[key] = builder
        return builder

    return decorator


def list_optimizers() -> list[str]:
    """Names accepted by :func:`create_optimizer`, sorted."""
    return sorted(_OPTIMIZERS)


def _is_no_wd(name: str, param: nn.Parameter, norm_param_ids: set[int]) -> bool:
    return id(param) in norm_param_ids or param.ndim <= 1 or name.rsplit(".", 1)[-1] == "bias"


def param_groups(model: nn.Module, weight_decay: float, no_wd: bool) -> list[dict[str, Any]]:
    """Split the trainable parameters of ``model`` into weight-decay groups.

    Without ``no_wd``: one group with every trainable parameter and ``weight_decay``.
    With ``no_wd``: biases, every parameter of a normalization layer (BatchNorm, SyncBatchNorm,
    InstanceNorm, GroupNorm, LayerNorm, RMSNorm) and any parameter with at most one
    dimension go to a group with weight decay 0 — GluonCV's ``--no-wd``, whose pattern
    ``.*beta|.*gamma|.*bias`` names the same tensors in MXNet. Parameters with
    ``requires_grad=False`` are left out; shared parameters appear once. Empty groups are
    dropped. Each group has a ``"no_wd"`` flag.

    Returns:
        A list of ``{"params", "weight_decay", "no_wd"}`` dicts for a torch optimizer.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not no_wd:
        return [{"params": [p for _, p in named], "weight_decay": weight_decay, "no_wd": False}]
    norm_param_ids = {
        id(p)
        for module in model.modules()
        if isinstance(module, _NORM_TYPES)
        for p in module.parameters(recurse=False)
    }
    decay = [p for n, p in named if not _is_no_wd(n, p, norm_param_ids)]
    plain = [p for n, p in named if _is_no_wd(n, p, norm_param_ids)]
    groups = [
        {"params": decay, "weight_decay": weight_decay, "no_wd": False},
        {"params": plain, "weight_decay": 0.0, "no_wd": True},
    ]
    return [g for g in groups if g["params"]]


def _accepted(builder: OptimizerBuilder, options: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``options`` that ``builder``'s signature names (``**kwargs`` does not count)."""
    target = builder.__init__ if inspect.isclass(builder) else builder
    params = inspect.signature(target).parameters
    named = {
        n
        for n, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {k: v for k, v in options.items() if k in named}


def create_optimizer(
    name: str,
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    momentum: float = 0.9,
    no_wd: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float | None = None,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    """Build the optimizer registered as ``name`` over the trainable parameters of ``model``.

    Args:
        name: ``sgd``, ``nag`` (SGD with Nesterov momentum, GluonCV's default), ``adam``
            (L2 weight decay added to the gradient, as DGL's GNN recipes use), ``adamw``,
            ``lamb``, ``lans``, or any name added with :func:`register_optimizer`
            (case-insensitive).
        model: the module whose parameters to optimize (a DDP wrapper works too: names are
            only used to spot biases).
        lr: learning rate (a schedule overwrites it each step via ``apply_lr``).
        weight_decay: decoupled for ``adamw``, L2 added to the gradient for
            ``sgd``/``nag``/``adam``.
        momentum: momentum of ``sgd``/``nag``.
        no_wd: no weight decay on biases and normalization parameters (GluonCV ``--no-wd``).
        betas: Adam-family betas.
        eps: Adam-family epsilon; ``None`` keeps the optimizer's own default (1e-8 for
            ``adam``/``adamw``, 1e-6 for ``lamb``/``lans``).
        **kwargs: passed to the optimizer as they are.

    Raises:
        ValueError: unknown ``name`` (the message lists the available ones), or a model
            without trainable parameters.
    """
    key = name.lower()
    if key not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(list_optimizers())}")
    groups = param_groups(model, weight_decay, no_wd)
    if not groups or not any(g["params"] for g in groups):
        raise ValueError(
            f"{type(model).__name__} has no parameters with requires_grad=True to optimize"
        )
    builder = _OPTIMIZERS[key]
    common = {
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": momentum,
        "betas": tuple(betas),
    }
    if eps is not None:
        common["eps"] = eps
    return builder(groups, **_accepted(builder, common), **kwargs)


def optimizer_accepts(name: str, option: str) -> bool:
    """Whether the optimizer registered as ``name`` takes the keyword argument ``option``.

    Raises:
        ValueError: unknown ``name``.
    """
    key = name.lower()
    if key not in _OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; available: {', '.join(list_optimizers())}")
    return bool(_accepted(_OPTIMIZERS[key], {option: None}))


@register_optimizer("sgd")
def _sgd(
    params: Any, *, lr: float, momentum: float, weight_decay: float, **kwargs: Any
) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kwargs)


@register_optimizer("nag")
def _nag(
    params: Any, *, lr: float, momentum: float, weight_decay: float, **kwargs: Any
) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        params, lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=True, **kwargs
    )


@register_optimizer("adam")
def _adam(
    params: Any,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float = 1e-8,
    weight_decay: float,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    return torch.optim.Adam(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs
    )


@register_optimizer("adamw")
def _adamw(
    params: Any,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float = 1e-8,
    weight_decay: float,
    **kwargs: Any,
) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs
    )
