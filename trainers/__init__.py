"""trainers: the shared distributed training loop of modelzoo's scripts.

``DistEnv`` reads torchrun's environment, ``Trainer`` runs the loop (accumulation, mixed
precision, clipping, gradient combining, evaluation, checkpoints, run logs). Of ``modelzoo``
this package imports only the model-family protocol (``modelzoo.family``: model parallelism
asks a model's family for its blocks and layers) and two shared utilities (atomic writes, the
C-kernel loader); ``tests/test_imports.py`` checks it.
"""

from . import comm, optim, schedules
from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .comm import (
    AverageCombiner,
    GradCombiner,
    create_combiner,
    list_combiners,
    register_combiner,
    unwrap_model,
)
from .data import SeededDataset, ShardedSampler, derive_seed
from .dist import DistEnv
from .ema import EMAConfig, ModelEMA
from .fingerprint import apply_portable_mode
from .logs import PhasedRunLogger, RunLogger, format_metrics, make_header, progress_bar
from .tensorboard import TensorBoardSink
from .trainer import Trainer, TrainerConfig

apply_portable_mode()  # MODELZOO_PORTABLE (scripts/publish.py --portable): oneDNN off, IEEE sqrt


def __getattr__(name: str) -> object:
    # trainers.elastic on first use: imported eagerly, `python -m trainers.elastic` (the
    # store, the launchers) would run a second copy of the module (runpy's RuntimeWarning).
    if name == "elastic":
        import importlib  # noqa: PLC0415

        return importlib.import_module(".elastic", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "comm",
    "elastic",
    "optim",
    "schedules",
    "AverageCombiner",
    "CheckpointError",
    "DistEnv",
    "EMAConfig",
    "GradCombiner",
    "ModelEMA",
    "PhasedRunLogger",
    "RunLogger",
    "SeededDataset",
    "ShardedSampler",
    "TensorBoardSink",
    "Trainer",
    "TrainerConfig",
    "create_combiner",
    "derive_seed",
    "format_metrics",
    "list_combiners",
    "load_checkpoint",
    "make_header",
    "progress_bar",
    "register_combiner",
    "save_checkpoint",
    "unwrap_model",
]
