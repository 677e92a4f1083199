"""Placement policies: where each chunk group lives, one class per ``GeminiConfig.placement``.

- ``base``: ``PlacementPolicy``, the mechanics every policy shares, and the protocols through
  which ZeRO is plugged in
- ``fixed``: ``cuda``, ``cpu`` and ``static``
- ``auto``: ``AutoPlacement``, planned from the warm-up under a device budget
- ``footprint``: the bytes a placement needs and the margin rules shared with the planner
- ``nvme_choice``: which optimizer-state groups live in NVMe files

``make_placement`` builds the policy a config names.
"""

from __future__ import annotations

from chunks import ChunkManager
from gemini.engine.memory import DeviceMemory
from gemini.policies.auto import AutoPlacement
from gemini.policies.base import PlacementPolicy
from gemini.policies.fixed import CpuPlacement, CudaPlacement, StaticPlacement

__all__ = ["AutoPlacement", "CpuPlacement", "CudaPlacement", "PlacementPolicy", "StaticPlacement", "make_placement"]


def make_placement(config, manager: ChunkManager, *, memory: DeviceMemory, fixed_bytes: int) -> PlacementPolicy:
    name = config.placement
    if name == "cuda":
        return CudaPlacement(manager, quiet=memory.quiet)
    if name == "cpu":
        return CpuPlacement(manager, quiet=memory.quiet)
    if name == "static":
        return StaticPlacement(
            manager,
            param_device_fraction=config.static_param_device_fraction,
            optimizer_offload_fraction=config.static_optimizer_offload_fraction,
            quiet=memory.quiet,
        )
    if name == "auto":
        return AutoPlacement(manager, memory=memory, margin_ratio=config.gpu_margin_mem_ratio, fixed_bytes=fixed_bytes)
    raise ValueError(f"GeminiConfig.placement={name!r} has no policy; expected cuda, cpu, static or auto")
