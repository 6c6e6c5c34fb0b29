"""modelzoo: pretrained ResNeSt, BERT and GNN models behind one registry.

>>> from modelzoo import get_model, list_models, pipeline
>>> list_models("resnest5*")  # doctest: +SKIP
>>> pipeline("image-classification", "resnest50")("cat.jpg")  # doctest: +SKIP
"""

# Importing the families (graph, nlp.bert, vision.resnest, vision.resnet) registers their builders;
# graph.datasets and nlp.squad register their public data sets (modelzoo.data).
from . import graph  # noqa: F401  (registration side effect)
from .artifact import load_artifact, save_artifact
from .features import FeatureInfo, create_features
from .nlp import bert, squad  # noqa: F401  (registration side effect)
from .pipelines import pipeline
from .registry import get_model, get_weights, list_models, register_model
from .store import purge
from .vision import resnest, resnet  # noqa: F401  (registration side effect)
from .weights import Weights

__version__ = "0.1.0"

__all__ = [
    "FeatureInfo",
    "Weights",
    "__version__",
    "create_features",
    "get_model",
    "get_weights",
    "list_models",
    "load_artifact",
    "pipeline",
    "purge",
    "register_model",
    "save_artifact",
]
