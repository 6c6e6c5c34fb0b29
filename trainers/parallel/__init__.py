"""Model parallelism on ``torch.distributed.tensor`` (tensor parallelism: ``tensor``)."""

from trainers.parallel.tensor import (
    bert_layers,
    clip_grad_norm_,
    gather_optimizer_state,
    is_tensor_parallel,
    parallelize_bert,
    qkv_permutation,
    shard_optimizer_state_,
    sharded_parameter_names,
    tensor_parallel_degree,
    unsplit_model,
)

__all__ = [
    "bert_layers",
    "clip_grad_norm_",
    "gather_optimizer_state",
    "is_tensor_parallel",
    "parallelize_bert",
    "qkv_permutation",
    "shard_optimizer_state_",
    "sharded_parameter_names",
    "tensor_parallel_degree",
    "unsplit_model",
]
