"""Training engines: FSDP2 sharding, deferred loading, micro-batched forwards and optimizer steps of role models."""

from lightning_rlhf.engines.train.engine import (
    LossFn,
    MetricAccumulator,
    TrainEngine,
    check_compute_dtype,
    global_token_count,
    make_optimizer,
    minibatches,
    resolve_dtype,
    world,
)
from lightning_rlhf.engines.train.forward import RESPONSE_INPUTS, forward_response, sequence_inputs
from lightning_rlhf.engines.train.fsdp import (
    clip_grad_norm,
    full_tensors,
    move_optimizer_state,
    shard_model,
)
from lightning_rlhf.engines.train.loading import LoadReport, deferred_loading, load_pretrained, materialize

__all__ = [
    "RESPONSE_INPUTS",
    "LoadReport",
    "LossFn",
    "MetricAccumulator",
    "TrainEngine",
    "check_compute_dtype",
    "clip_grad_norm",
    "deferred_loading",
    "forward_response",
    "full_tensors",
    "global_token_count",
    "load_pretrained",
    "make_optimizer",
    "materialize",
    "minibatches",
    "move_optimizer_state",
    "resolve_dtype",
    "sequence_inputs",
    "shard_model",
    "world",
]
