"""Training engines: FSDP2 sharding, forward passes and optimizer steps of trainable roles."""

from lightning_rlhf.engines.train.forward import forward_response, sequence_inputs
from lightning_rlhf.engines.train.fsdp import clip_grad_norm, full_tensors, move_optimizer_state, shard_model

__all__ = [
    "clip_grad_norm",
    "forward_response",
    "full_tensors",
    "move_optimizer_state",
    "sequence_inputs",
    "shard_model",
]
