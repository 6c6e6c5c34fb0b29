"""trainers: the shared distributed training loop of modelzoo's scripts.

``DistEnv`` reads torchrun's environment, ``Trainer`` runs the loop (accumulation, mixed
precision, clipping, gradient combining, evaluation, checkpoints, run logs). This package
never imports ``modelzoo``.
"""

from . import adasum, compress, elastic, localsgd, optim, schedules
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .combine import AverageCombiner, GradCombiner, unwrap_model
from .data import SeededDataset, ShardedSampler, derive_seed
from .dist import DistEnv
from .logs import RunLogger, format_metrics, make_header, progress_bar
from .trainer import Trainer, TrainerConfig

__all__ = [
    "adasum",
    "compress",
    "elastic",
    "localsgd",
    "optim",
    "schedules",
    "AverageCombiner",
    "CheckpointError",
    "DistEnv",
    "GradCombiner",
    "RunLogger",
    "SeededDataset",
    "ShardedSampler",
    "Trainer",
    "TrainerConfig",
    "derive_seed",
    "format_metrics",
    "load_checkpoint",
    "make_header",
    "progress_bar",
    "save_checkpoint",
    "unwrap_model",
]
