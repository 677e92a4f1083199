"""The placements that need no warm-up: ``cuda`` (everything on the device), ``cpu`` (everything on the host) and
``static`` (fixed fractions)."""

from __future__ import annotations

from chunks import ChunkGroup, ChunkKind, ChunkManager, Tier, missing_bytes
from gemini.config import GeminiConfig
from gemini.errors import DeviceBudgetError
from gemini.policies.base import PlacementPolicy
from gemini.policies.footprint import DeviceGroups, Layout, chunk_bytes, static_choice

__all__ = ["CpuPlacement", "CudaPlacement", "StaticPlacement"]


class CudaPlacement(PlacementPolicy):
    """Everything on the device: parameters, gradients, masters and Adam states."""

    name = "cuda"
    keeps_every_chunk_on_device = True

    @classmethod
    def layout_choice(cls, config: GeminiConfig, layout: Layout) -> DeviceGroups:
        return DeviceGroups(whole=frozenset(range(len(layout))))

    @property
    def follows_modules(self) -> bool:
        return self.gathers_params  # ZeRO-3 gathers each module's parameters around its call

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.DEVICE

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.DEVICE

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        return True


class CpuPlacement(PlacementPolicy):
    """Everything on the host; parameters visit the device for compute, CPU Adam steps.

    The device holds only the param chunks of the running modules and the gradient chunks the backward is filling.
    """

    name = "cpu"
    # Only the running modules' chunks are on the device: what is left to cut is that working set and non-model memory.
    budget_advice = ("try a smaller chunk_size (fewer parameter bytes fetched per module), a smaller batch or "
                     "sequence, activation checkpointing (less activation memory), or offload_activations=True "
                     "(saved activations wait in host memory)")

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.HOST

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.HOST

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        return False


class StaticPlacement(PlacementPolicy):
    """Fixed fractions, no warm-up heuristics.

    The first ``param_device_fraction`` of the chunk groups keep their parameters on the device for good; the last
    ``optimizer_offload_fraction`` of the trainable groups keep their optimizer states on the host (CPU Adam), and the
    others keep theirs, and so the whole group, on the device.
    """

    name = "static"
    own_fields = ("static_param_device_fraction", "static_optimizer_offload_fraction")
    budget_advice = ("lower static_param_device_fraction or raise static_optimizer_offload_fraction (fewer chunks "
                     "kept on the device), use placement='auto' (chunks evicted under pressure), or a smaller batch")

    def __init__(self, manager: ChunkManager, *, param_device_fraction: float, optimizer_offload_fraction: float) -> None:
        super().__init__(manager)
        self.param_device_fraction = param_device_fraction
        self.optimizer_offload_fraction = optimizer_offload_fraction
        self.params_on_device: set[int] = set()
        self.os_on_device: set[int] = set()

    @classmethod
    def from_config(cls, config: GeminiConfig, manager: ChunkManager, *, budget_bytes: int,
                    fixed_bytes: int) -> StaticPlacement:
        return cls(manager, param_device_fraction=config.static_param_device_fraction,
                   optimizer_offload_fraction=config.static_optimizer_offload_fraction)

    @classmethod
    def layout_choice(cls, config: GeminiConfig, layout: Layout) -> DeviceGroups:
        params, states = static_choice(list(range(len(layout))), [i for i, (_, pg, _) in enumerate(layout) if pg >= 0],
                                       param_device_fraction=config.static_param_device_fraction,
                                       optimizer_offload_fraction=config.static_optimizer_offload_fraction)
        return DeviceGroups(whole=frozenset(states), params=frozenset(params))

    def initial_tier(self, kind: ChunkKind) -> Tier:
        return Tier.HOST

    def _choose(self) -> None:
        self.params_on_device, self.os_on_device = static_choice(
            [g.index for g in self.manager.groups], [g.index for g in self.manager.trainable_groups],
            param_device_fraction=self.param_device_fraction,
            optimizer_offload_fraction=self.optimizer_offload_fraction,
        )

    def setup(self) -> None:
        self._choose()

    def pinned_groups(self) -> set[int]:
        return self.os_on_device

    def resident_params(self) -> set[int]:
        return self.params_on_device

    def pinned_bytes(self) -> int:
        """Chunk bytes this policy keeps on the device for good (at the end of every step)."""
        self._choose()
        m = self.manager
        layout = [(range(len(g.slots)), g.param_group, g.param.capacity) for g in m.groups]
        choice = DeviceGroups(whole=frozenset(self.os_on_device), params=frozenset(self.params_on_device))
        return sum(chunk_bytes(layout, choice, param_dtype=m.param_dtype, world=m.world,
                               shard_params=m.shard_params)[Tier.DEVICE].values())

    def check_budget(self, budget_bytes: int, fixed_bytes: int) -> None:
        pinned = self.pinned_bytes()
        missing = missing_bytes(budget_bytes, pinned, fixed_bytes)
        if missing:
            raise DeviceBudgetError(
                f"placement='static' keeps {pinned} bytes of chunks on the device for good but "
                f"GeminiConfig.device_memory leaves {budget_bytes - fixed_bytes} for them: {missing} bytes are "
                f"missing; lower static_param_device_fraction, raise static_optimizer_offload_fraction or "
                f"device_memory, or use placement='auto'",
                missing_bytes=missing,
            )

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        return Tier.DEVICE if group.index in self.os_on_device else Tier.HOST

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        return group.index in self.params_on_device or group.index in self.os_on_device
