"""The optimizer: HybridAdam over chunk groups and the pieces of a step.

- ``hybrid_adam``: HybridAdam, the step's phases over chunk groups and the state_dict API
- ``adam_batches``: the step's fused Adam calls, prepared before any runs
- ``adam``: the Adam update as a pure function over flat tensors
- ``state_dict``: the two checkpoint formats (full and sharded)
- ``group_specs``: the param_groups initialize takes, checked and split for the chunk layout
- ``param_groups``: what param_groups may become after initialize (checked at each step and load)
- ``loss_scaler``: fp16's dynamic loss scaler and the step's checks of it
- ``clipping``: the global gradient norm and clipping
"""

__all__ = ["adam", "adam_batches", "clipping", "group_specs", "hybrid_adam", "loss_scaler", "param_groups", "state_dict"]
