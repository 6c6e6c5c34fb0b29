"""Graph neural networks: GCN, GraphSAGE, GAT (node classification) and GIN (graphs).

The message-passing layers are ``torch_geometric``'s; the models, their registry entries,
the datasets (:mod:`modelzoo.graph.datasets`) and the neighbour sampler
(:mod:`modelzoo.graph.sampler`) are ours, and so are the node-feature transform of the
weights (:mod:`modelzoo.graph.transforms`), layer-wise inference and the node-classification
pipeline (:mod:`modelzoo.graph.inference`). ``torch_geometric`` takes seconds to import, so
it is imported when a graph model is first built, not by ``import modelzoo``.
"""

from . import family, gat, gcn, gin, graphsage  # noqa: F401  (registration side effect)
from .gat import GAT
from .gcn import GCN
from .gin import GIN
from .graphsage import GraphSAGE

__all__ = ["GAT", "GCN", "GIN", "GraphSAGE"]
