"""Placement policies: where each chunk group lives, one class per ``GeminiConfig.placement``.

- ``base``: ``PlacementPolicy``, the questions every policy answers (a policy decides; the engine's ``Residency``
  makes the moves)
- ``fixed``: ``cuda``, ``cpu`` and ``static``
- ``auto``: ``AutoPlacement``, planned from the warm-up under a device budget
- ``plan``: ``MemoryPlan``, what the warm-up measured, as the auto policy decides with it
- ``footprint``: the bytes a placement needs and the margin rules shared with the planner
- ``nvme_choice``: which optimizer-state groups live in NVMe files

``placement_type`` is the one place a ``GeminiConfig.placement`` name becomes a policy class; ``make_placement``
builds the policy a config names, ``device_groups`` asks its class what it keeps on the device. Policies import
nothing of gemini/engine/, gemini/parallel/ or gemini/tools/.
"""

from __future__ import annotations

from chunks import ChunkManager
from gemini.config import CONFIG_DEFAULTS, GeminiConfig
from gemini.policies.auto import AutoPlacement
from gemini.policies.base import PlacementPolicy
from gemini.policies.fixed import CpuPlacement, CudaPlacement, StaticPlacement
from gemini.policies.footprint import DeviceGroups, Layout

__all__ = ["AutoPlacement", "CpuPlacement", "CudaPlacement", "PlacementPolicy", "StaticPlacement", "check_supported",
           "device_groups", "make_placement", "placement_type"]

# Every placement by its name: the name is looked up here, once; what differs is asked of the class.
_TYPES: dict[str, type[PlacementPolicy]] = {
    cls.name: cls for cls in (CudaPlacement, CpuPlacement, StaticPlacement, AutoPlacement)
}


def placement_type(name: str) -> type[PlacementPolicy]:
    """The policy class of ``GeminiConfig.placement`` value ``name``."""
    try:
        return _TYPES[name]
    except KeyError:
        raise ValueError(f"GeminiConfig.placement={name!r} has no policy; expected cuda, cpu, static or auto") from None


def check_supported(config: GeminiConfig) -> None:
    """Raise if a field only another placement reads is set, rather than ignore it (the planner and ``initialize``
    both ask)."""
    own = placement_type(config.placement)
    for cls in _TYPES.values():
        for name in cls.own_fields:
            value, default = getattr(config, name), CONFIG_DEFAULTS[name]
            if cls is not own and name not in own.own_fields and value != default:
                why = "has no margin" if cls.has_margin else "ignores it"
                raise ValueError(f"GeminiConfig.{name}={value} needs placement={cls.name!r} "
                                 f"(placement={config.placement!r} {why}); use {default} or placement={cls.name!r}")


def make_placement(config: GeminiConfig, manager: ChunkManager, *, budget_bytes: int,
                   fixed_bytes: int) -> PlacementPolicy:
    """The policy ``config.placement`` names, under a device budget of ``budget_bytes`` with ``fixed_bytes`` of
    buffers on the device."""
    return placement_type(config.placement).from_config(config, manager, budget_bytes=budget_bytes,
                                                        fixed_bytes=fixed_bytes)


def device_groups(config: GeminiConfig, layout: Layout) -> DeviceGroups:
    """What ``config.placement`` keeps on the device for good, from the layout alone: everything under "cuda", the
    fractions' groups under "static", nothing under "cpu" (nor under "auto", before its warm-up decides)."""
    return placement_type(config.placement).layout_choice(config, layout)
