"""Optimizers for the shared trainer: a registry-backed factory and no-weight-decay groups."""

from .factory import create_optimizer, list_optimizers, param_groups, register_optimizer

__all__ = ["create_optimizer", "list_optimizers", "param_groups", "register_optimizer"]
