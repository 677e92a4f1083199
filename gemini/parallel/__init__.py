"""Data parallelism: ZeRO sharding of gradients, optimizer states and parameters.

- ``zero``: the gradient reduce-scatter, the parameter all-gather, sharded norms
- ``collectives``: torch.distributed calls with the staging copies gloo needs
"""

__all__ = ["collectives", "zero"]
