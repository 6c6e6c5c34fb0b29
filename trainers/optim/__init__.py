"""Optimizers for the shared trainer: a registry-backed factory, no-weight-decay groups, and
the large-batch optimizers LAMB and LANS (registered as ``"lamb"`` and ``"lans"``), and
GluonNLP's BERTAdam (``"bertadam"``); :class:`OptimizerOptions` describes the options only some
of them take (and their flags)."""

from .bertadam import BertAdam
from .factory import (
    create_optimizer,
    list_optimizers,
    optimizer_accepts,
    param_groups,
    register_optimizer,
)
from .lamb import Lamb, LambVariant
from .lans import Lans, LansVariant
from .options import OptimizerOptions, OptionField, option_fields

__all__ = [
    "BertAdam",
    "Lamb",
    "LambVariant",
    "Lans",
    "LansVariant",
    "OptimizerOptions",
    "OptionField",
    "create_optimizer",
    "list_optimizers",
    "optimizer_accepts",
    "option_fields",
    "param_groups",
    "register_optimizer",
]
