"""The engine's iteration state machine (GeminiRuntime moves it, only through guarded moves)."""

from __future__ import annotations

import enum

__all__ = ["IterationState"]


class IterationState(enum.Enum):
    """Where the engine is in learning what the model needs besides its own data.

    - ``FIXED``: the placement needs no warm-up (cuda, cpu, static); every iteration is alike.
    - ``UNTRACED``: auto before its first forward: nothing measured, nothing planned.
    - ``TRACING``: auto's warm-up iteration runs under the tracer; chunks move as under "cpu"; a backward that
      raises gives the trace up (back to ``UNTRACED``).
    - ``PLANNED``: the warm-up's plan drives placement (the margin's groups on the device, eviction in the traced
      order); inputs no kept plan covers send it back to ``TRACING``, inputs an earlier kept plan covers bring
      that plan back (through ``ADOPTING``).
    - ``UNPLANNED``: the warm-up overran the budget (DeviceBudgetError) and made no plan; chunks keep moving as in
      the warm-up until new input shapes trace again or a kept plan covers them.
    - ``ADOPTING``: a plan is adopted and being moved to: the next forward runs ``PLANNED``, unless moving the
      groups failed part-way (an NVMe read error): then the next step or forward moves them again.
    """

    FIXED = "fixed"
    UNTRACED = "untraced"
    TRACING = "tracing"
    PLANNED = "planned"
    UNPLANNED = "unplanned"
    ADOPTING = "adopting"
