"""Placement policies: where each chunk group lives, one class per ``GeminiConfig.placement``.

- ``base``: ``PlacementPolicy``, the questions every policy answers (a policy decides; the
  engine's ``Residency`` makes the moves)
- ``fixed``: ``cuda``, ``cpu`` and ``static``
- ``auto``: ``AutoPlacement``, planned from the warm-up under a device budget
- ``plan``: ``MemoryPlan``, what the warm-up measured, as the auto policy decides with it
- ``footprint``: the bytes a placement needs and the margin rules shared with the planner
- ``nvme_choice``: which optimizer-state groups live in NVMe files

``make_placement`` builds the policy a config names. Policies import nothing of the engine
(gemini/engine/) or of data parallelism (gemini/parallel/).
"""

from __future__ import annotations

from chunks import ChunkManager
from gemini.policies.auto import AutoPlacement
from gemini.policies.base import PlacementPolicy
from gemini.policies.fixed import CpuPlacement, CudaPlacement, StaticPlacement

__all__ = ["AutoPlacement", "CpuPlacement", "CudaPlacement", "PlacementPolicy", "StaticPlacement", "make_placement"]


def make_placement(config, manager: ChunkManager, *, budget_bytes: int, fixed_bytes: int) -> PlacementPolicy:
    """The policy ``config.placement`` names, under a device budget of ``budget_bytes`` with
    ``fixed_bytes`` of buffers on the device."""
    name = config.placement
    if name == "cuda":
        return CudaPlacement(manager)
    if name == "cpu":
        return CpuPlacement(manager)
    if name == "static":
        return StaticPlacement(
            manager,
            param_device_fraction=config.static_param_device_fraction,
            optimizer_offload_fraction=config.static_optimizer_offload_fraction,
        )
    if name == "auto":
        return AutoPlacement(manager, budget_bytes=budget_bytes, margin_ratio=config.gpu_margin_mem_ratio,
                             fixed_bytes=fixed_bytes)
    raise ValueError(f"GeminiConfig.placement={name!r} has no policy; expected cuda, cpu, static or auto")
