"""Model parallelism: tensor parallelism on ``torch.distributed.tensor`` (``tensor``) and
pipeline stages on ``torch.distributed.pipelining`` (``pipeline``)."""

from trainers.parallel.pipeline import (
    PIPELINE_SCHEDULES,
    Pipeline,
    PipelinedModel,
    PipelineStageModule,
    balanced_boundaries,
    build_pipeline,
    check_boundaries,
    model_blocks,
)
from trainers.parallel.tensor import (
    bert_layers,
    clip_grad_norm_,
    gather_optimizer_state,
    is_tensor_parallel,
    parallelize_bert,
    qkv_permutation,
    shard_optimizer_state_,
    sharded_parameter_names,
    unsplit_model,
)

__all__ = [
    "PIPELINE_SCHEDULES",
    "Pipeline",
    "PipelineStageModule",
    "PipelinedModel",
    "balanced_boundaries",
    "bert_layers",
    "build_pipeline",
    "check_boundaries",
    "clip_grad_norm_",
    "gather_optimizer_state",
    "is_tensor_parallel",
    "model_blocks",
    "parallelize_bert",
    "qkv_permutation",
    "shard_optimizer_state_",
    "sharded_parameter_names",
    "unsplit_model",
]
