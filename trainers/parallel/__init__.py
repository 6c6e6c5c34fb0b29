"""Model parallelism on ``torch.distributed.tensor`` (tensor parallelism: ``tensor``)."""

from trainers.parallel.tensor import (
    bert_layers,
    is_tensor_parallel,
    parallelize_bert,
    qkv_permutation,
    sharded_parameter_names,
    tensor_parallel_degree,
)

__all__ = [
    "bert_layers",
    "is_tensor_parallel",
    "parallelize_bert",
    "qkv_permutation",
    "sharded_parameter_names",
    "tensor_parallel_degree",
]
