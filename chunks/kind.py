"""`ChunkKind`: what a chunk holds (parameters, gradients, master weights, Adam's moments, ZeRO shards)."""

from __future__ import annotations

import enum

__all__ = ["ChunkKind"]


class ChunkKind(enum.Enum):
    """What a chunk holds; chunks of one group share a layout."""

    PARAM = "param"  # the compute-precision parameters (the module's params are views of it)
    GRAD = "grad"  # gradients, accumulated over micro-batches until the step
    MASTER = "master"  # fp32 master weights (only when the params are bf16/fp16)
    EXP_AVG = "exp_avg"  # Adam's first moment
    EXP_AVG_SQ = "exp_avg_sq"  # Adam's second moment
    # ZeRO (see [Note: ZeRO shards of a chunk] in chunks/shard.py): this rank's range only.
    GRAD_SHARD = "grad_shard"  # the reduced (averaged over ranks) gradients, until the step
    PARAM_SHARD = "param_shard"  # the parameters, with parameter sharding (ZeRO-3)
