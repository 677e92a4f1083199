"""The optimizer: HybridAdam over chunk groups and the pieces of a step.

- ``hybrid_adam``: HybridAdam
- ``adam``: the Adam update as a pure function over flat tensors
- ``loss_scaler``: fp16's dynamic loss scaler
- ``clipping``: the global gradient norm and clipping
"""

__all__ = ["adam", "clipping", "hybrid_adam", "loss_scaler"]
