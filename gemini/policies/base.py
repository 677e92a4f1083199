"""`PlacementPolicy`: what a placement decides; the engine makes every move.

One class per ``GeminiConfig.placement`` value (cuda, cpu and static in fixed.py, auto in auto.py; ``placement_type``
looks one up by ``name``, ``make_placement`` builds it). A policy answers the engine's questions (where a chunk starts,
where a group's optimizer states live, what stays on the device, what to evict and prefetch) from the chunk layout,
the memory ledger and, for auto, the warm-up's plan; :class:`gemini.engine.residency.Residency` follows the iteration
and moves the chunks. A policy moves nothing.

Policies import nothing of gemini/engine/ or gemini/parallel/: the engine drives ZeRO's collectives and the NVMe tier,
and asks the policy only where things go (``gathers_params`` says that ZeRO-3 gathers parameters around each call).
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from chunks import ChunkGroup, ChunkKind, ChunkManager, Tier
from gemini.config import GeminiConfig
from gemini.policies.footprint import DeviceGroups, Layout
from tracer import Boundary

__all__ = ["PlacementPolicy"]


class PlacementPolicy:
    """The questions every policy answers; subclasses decide tiers (and auto, eviction)."""

    name = "base"
    # Whether the engine announces period boundaries to on_boundary (auto, under pressure).
    track_periods = False
    # Whether victims() can name any group (the engine asks only then).
    evicts = False
    # What to change when a measured peak overran the budget (DeviceBudgetError's advice).
    budget_advice = "use placement='auto' (chunks evicted under pressure) or 'cpu', or a smaller batch"
    # Whether its warm-up plans from measured memory, so the device is measured even without a budget (on the CPU
    # stand-in a dispatch mode; on CUDA the allocator's counters).
    plans_from_measurement = False
    # Whether it keeps optimizer states in the warm-up's margin (GeminiConfig.gpu_margin_mem_ratio).
    has_margin = False
    # GeminiConfig fields only this policy reads: set under another placement they would be silently ignored, so
    # ``check_supported`` refuses that.
    own_fields: tuple[str, ...] = ()
    # Whether every chunk lives on the device from registration on (initialize then checks the budget before
    # allocating anything).
    keeps_every_chunk_on_device = False

    def __init__(self, manager: ChunkManager) -> None:
        self.manager = manager
        # ZeRO-3 gathers each module's parameters around its call (set by initialize).
        self.gathers_params = False
        # Under ZeRO-3, room for one prefetched group's gathered parameters (set by initialize; a budgeted policy
        # counts it), and the groups gathered ahead of their use now (the gatherer's own set, read live: a group in
        # it is using the reserve).
        self.prefetch_reserve_bytes = 0
        self.prefetched: Collection[int] = frozenset()

    @classmethod
    def from_config(cls, config: GeminiConfig, manager: ChunkManager, *, budget_bytes: int,
                    fixed_bytes: int) -> PlacementPolicy:
        """This policy, as ``config`` sets it, over ``manager``'s chunks, under a device budget of ``budget_bytes``
        with ``fixed_bytes`` of buffers (which only a policy that plans reads)."""
        return cls(manager)

    @classmethod
    def layout_choice(cls, config: GeminiConfig, layout: Layout) -> DeviceGroups:
        """The groups this placement keeps on the device for good, from the chunk layout alone (before any chunk
        exists, so the planner and ``initialize``'s budget check apply the policy's own rule: see [Note: the footprint
        of a placement] in footprint.py). None by default: chunks start on the host, and auto decides after its
        warm-up."""
        return DeviceGroups()

    def check_budget(self, budget_bytes: int, fixed_bytes: int) -> None:
        """Once the chunks are registered, before any goes to the device: raise
        :class:`gemini.errors.DeviceBudgetError` if what this policy keeps on the device for good cannot fit
        ``budget_bytes`` next to ``fixed_bytes`` of buffers. Nothing by default: cuda is checked before allocating
        (``keeps_every_chunk_on_device``), and cpu and auto keep nothing for good before a plan."""

    def setup(self) -> None:
        """Once after registration: make the choices ``pinned_groups`` and ``resident_params`` report (the engine
        then moves the groups)."""

    @property
    def follows_modules(self) -> bool:
        """Whether chunks move around module calls, so each module owning parameters needs the hooks that drive them
        (gemini/engine/hooks.py). A policy keeping every chunk on the device for good needs none: the hooks would cost
        a few microseconds a module call for nothing."""
        return True

    # ------------------------------------------------------------------------------ tiers
    def initial_tier(self, kind: ChunkKind) -> Tier:
        raise NotImplementedError

    def optimizer_tier(self, group: ChunkGroup) -> Tier:
        """Where the optimizer-state chunks of ``group`` live, and so where Adam updates them."""
        raise NotImplementedError

    def keep_params_on_device(self, group: ChunkGroup) -> bool:
        """Whether a param chunk stays on the device after compute."""
        raise NotImplementedError

    def keep_grads_on_device(self, group: ChunkGroup) -> bool:
        return self.optimizer_tier(group) is Tier.DEVICE

    def pinned_groups(self) -> set[int]:
        """Groups kept whole on the device (their optimizer states update there)."""
        return set()

    def resident_params(self) -> set[int]:
        """Other groups whose parameters stay on the device for good (fetched back after a step that updated them on
        the host)."""
        return set()

    def resident_grads(self) -> set[int]:
        """Groups updated on the host whose gradients may stay on the device from their backward until the step
        ([Note: accumulated gradients stay on the device] in gemini/engine/step_moves.py)."""
        return set()

    def track_backward_uses(self, groups: list[ChunkGroup]) -> bool:
        """Whether releasing ``groups`` between uses in backward can free anything (see [Note: a group between its
        uses in backward] in gemini/engine/residency.py)."""
        return any(not self.keep_params_on_device(g) for g in groups)

    # ------------------------------------------------- the iteration, for policies that plan
    def begin_forward(self) -> None:
        """The root module's forward begins."""

    def end_forward(self) -> None:
        """The root module's forward is over (after the groups it left behind were dropped)."""

    def end_backward(self) -> None:
        """A backward pass is over."""

    def accessed(self, groups: list[ChunkGroup]) -> None:
        """A module call's compute (forward or backward) is about to use ``groups``."""

    def read_outside(self, group_index: int) -> None:
        """A parameter of the group was read outside its modules' calls too (see [Note: read twice] in
        gemini/engine/backward_hooks.py)."""

    def mark(self) -> None:
        """A decision point inside a period: a group's first gradient arrives, or a module's backward is done (see
        [Note: segments of a period] in tracer/runtime.py)."""

    def on_boundary(self, boundary: Boundary) -> set[int] | None:
        """A period of a planned iteration begins: the groups it needs, evicted only when nothing else makes room for
        it (None: not planned)."""
        return None

    def prefetch(self) -> list[int]:
        """Groups to fetch ahead now (after ``on_boundary``): the next period's, if they fit."""
        return []

    def needed_now(self) -> set[int] | None:
        """At a decision inside a period (a mark): what the period needs, evicted only when nothing else makes room
        for the rest of it (None: make no room)."""
        return None

    def victims(self, nbytes: int, *, keep: set[int], in_use: Callable[[], set[int]],
                wanted: set[int] = frozenset()) -> list[int]:
        """Groups to evict before ``nbytes`` more land on the device: never ``keep`` nor those ``in_use()`` returns,
        and ``wanted`` ones only when the others cannot make room. Raises DeviceBudgetError when nothing makes room."""
        return []

    @staticmethod
    def group_device_bytes(g: ChunkGroup) -> int:
        """Bytes of every flavour of ``g`` (the cost of keeping the whole group on the device)."""
        return sum(c.nbytes for c in g.chunks)
