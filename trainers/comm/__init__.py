"""Every way ranks combine their work: one registered class per ``--grad-combine`` mode.

See :mod:`trainers.comm.base` for the protocol the trainer drives and the registry
(:func:`register_combiner`, :func:`create_combiner`, :func:`list_combiners`). Modes:

=================  =============================================================  ===============
mode               what travels                                                   module
=================  =============================================================  ===============
``average``        gradients, all-reduced by DDP during the backward              ``average``
``adasum``         gradients or updates, combined by the Adasum tree              ``adasum/``
``ef``             compressed gradients, with error feedback                      ``ef``
``cser``           models on a random block every step, a larger one every H      ``cser``
``cser-pl``        models on a random block every H steps (CSER-PL)               ``cser``
``cser-update``    compressed updates, residuals reset every H steps              ``cser``
``def``            compressed updates, local models detached by the error         ``detached_ef``
``coded``          gradient sums up a tree, the first of each group (CodedReduce) ``coded``
``powersgd``       low-rank factors (PyTorch's DDP hook)                          ``ddp_hooks``
``fp16``/``bf16``  gradients cast to 16 bits (PyTorch's DDP hooks)                ``ddp_hooks``
``localsgd``       models, every H steps (post-local SGD)                         ``localsgd``
``slowmo``         models every H steps, a slow momentum step every H' steps      ``localsgd``
``local-adaalter`` models and AdaGrad accumulators, every H steps                 ``localsgd``
``adpsgd``         models, pairwise with one peer (async / sync rounds; H-ADPSGD) ``adpsgd``
``pipesgd``        gradients, all-reduced while the next step computes (delay 1)  ``pipesgd``
``sgp``            models, push-sum to one peer per step (exponential graph)      ``sgp``
=================  =============================================================  ===============

Compressors (``compressors``) and the flatten/collective helpers (``flat``) are shared.
"""

# Importing the modules registers their combiners (registration order = list order).
from . import average, adasum, ef, cser, ddp_hooks, localsgd  # noqa: F401, I001
import importlib as _importlib
import pkgutil as _pkgutil

from .adasum import AdasumCombiner, AdasumOptions, adasum_allreduce_, adasum_pair
from .average import AverageCombiner, AverageOptions
from .base import (
    CommCounter,
    CountingCombiner,
    GradCombiner,
    NoOptions,
    combiner_class,
    create_combiner,
    list_combiners,
    option,
    register_combiner,
    unwrap_model,
)
from .compressed import CompressorOptions
from .compressors import (
    BF16,
    COMPRESSORS,
    FP16,
    QSGD,
    Compressor,
    Identity,
    Importance,
    RandomBlock,
    Sign,
    TopK,
    compressed_allreduce,
    create_compressor,
)
from .cser import (
    CSERCombiner,
    CSEROptions,
    CSERPLCombiner,
    CSERPLOptions,
    CSERUpdateCombiner,
    CSERUpdateOptions,
)
from .ddp_hooks import BF16Combiner, FP16Combiner, PowerSGDCombiner, PowerSGDOptions
from .ef import ErrorFeedbackCombiner
from .flat import (
    allreduce_mean_,
    average_buffers_,
    average_models_,
    broadcast_,
    flat_grads,
    flatten,
    model_tensors,
    restore_optimizer_state,
    unflatten_,
)
from .localsgd import (
    LocalAdaAlterCombiner,
    LocalAdaAlterOptions,
    LocalSGDCombiner,
    LocalSGDOptions,
    SlowMoCombiner,
    SlowMoOptions,
)
from .wrap import DistributedOptimizer

__all__ = [
    "BF16",
    "BF16Combiner",
    "COMPRESSORS",
    "CSERCombiner",
    "CSEROptions",
    "CSERPLCombiner",
    "CSERPLOptions",
    "CSERUpdateCombiner",
    "CSERUpdateOptions",
    "AdasumCombiner",
    "AdasumOptions",
    "AverageCombiner",
    "AverageOptions",
    "CommCounter",
    "CountingCombiner",
    "DistributedOptimizer",
    "Compressor",
    "CompressorOptions",
    "ErrorFeedbackCombiner",
    "FP16",
    "FP16Combiner",
    "GradCombiner",
    "Identity",
    "Importance",
    "LocalAdaAlterCombiner",
    "LocalAdaAlterOptions",
    "LocalSGDCombiner",
    "LocalSGDOptions",
    "NoOptions",
    "PowerSGDCombiner",
    "PowerSGDOptions",
    "QSGD",
    "RandomBlock",
    "Sign",
    "SlowMoCombiner",
    "SlowMoOptions",
    "TopK",
    "adasum_allreduce_",
    "adasum_pair",
    "allreduce_mean_",
    "average_buffers_",
    "average_models_",
    "broadcast_",
    "combiner_class",
    "compressed_allreduce",
    "create_combiner",
    "create_compressor",
    "flat_grads",
    "flatten",
    "list_combiners",
    "model_tensors",
    "option",
    "register_combiner",
    "restore_optimizer_state",
    "unflatten_",
    "unwrap_model",
]

# Every other module of the package registers its modes too (alphabetical order), so a new
# mode is one new file, trainers/comm/<mode>.py with a @register_combiner class (import its
# classes from that module: trainers.comm.sgp.SGPCombiner).
for _module in _pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        _importlib.import_module(f"{__name__}.{_module.name}")
