"""The device memory budget: how much there is, how it is measured, and the error when short."""

from __future__ import annotations

import contextlib
import logging
import math
import re
from collections.abc import Callable, Iterator

import psutil
import torch
from torch.utils._python_dispatch import _disable_current_modes

from chunks import ChunkManager, StorageObserver, Tier, fits
from gemini.errors import DeviceBudgetError  # here too, where it was first defined
from tracer import CudaAllocatorMonitor, MemoryMonitor, MonitorState, PeriodMeter, TensorAccountingMonitor

logger = logging.getLogger(__name__)

__all__ = ["DeviceBudgetError", "DeviceMemory", "model_tensors_on", "planned_reserve_bytes"]

_STEP_TEMPORARIES_BYTES = 64 * 1024  # see [Note: the safety reserve]
# The request in torch's out-of-memory message ("Tried to allocate 20.00 MiB").
_TRIED = re.compile(r"Tried to allocate ([0-9.]+) (bytes|B|KiB|MiB|GiB|TiB)")
_UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


class DeviceMemory:
    """The compute device's budget and its measurement.

    On CUDA the allocator's statistics measure the device, and a budget below the card's memory is enforced with
    ``set_per_process_memory_fraction``, so an overshoot is a real out-of-memory error, not a silent pass. On the
    CPU stand-in a tensor-accounting monitor (a dispatch mode counting live storages) measures it when ``measure``
    is set: host-tier payloads are CPU tensors too, so they are allocated with the monitor quiet and excluded from
    it (see :class:`chunks.StorageObserver`).
    """

    def __init__(self, device: torch.device, budget_bytes: int | None, *, measure: bool) -> None:
        self.device = device
        self.total_bytes = _device_total_bytes(device)
        self.budget_bytes = budget_bytes if budget_bytes is not None else self.total_bytes
        self.budgeted = budget_bytes is not None
        self.monitor: MemoryMonitor | None = None
        self._accounting: TensorAccountingMonitor | None = None
        self._capped = False  # this budget holds a cap on the process's allocator (CUDA)
        if device.type == "cuda":
            self.monitor = CudaAllocatorMonitor(device)
        elif measure:
            self._accounting = TensorAccountingMonitor(device)
            self.monitor = self._accounting
        # The window's intervals between model-data moves (see [Note: the step's non-model peak]).
        self._meter: PeriodMeter | None = None
        self._model_bytes: Callable[[], int] = lambda: 0
        self._moving = False

    # ---------------------------------------------------------------------------- set-up
    def observer(self) -> StorageObserver | None:
        if self._accounting is None:
            return None
        return StorageObserver(quiet=self.quiet, exclude=self._accounting.exclude, resized=self._accounting.resized,
                               counts_in=self._accounting.counts_in)

    def start(self, tracked: list[torch.Tensor], model_bytes: Callable[[], int]) -> None:
        """Start measuring; ``tracked`` are device tensors that already exist (buffers, chunks), ``model_bytes()``
        says how many bytes of the device are model data now."""
        # A device larger than the budget: cap the allocator at the budget (once: every iteration's window starts here).
        if not self._capped and self.device.type == "cuda" and not fits(self.budget_bytes, self.total_bytes):
            fraction = _CAPS.hold(self.device, id(self), self.budget_bytes / self.total_bytes)
            self._capped = True
            logger.info("device budget %d bytes: the allocator's memory fraction is %.4f", self.budget_bytes, fraction)
        if self.monitor is not None:
            if tracked and self._accounting is not None:
                self._accounting.track(tracked)
            self.monitor.start()
            self.monitor.reset_peak()  # a new window's peak starts at what lives now
            self._model_bytes = model_bytes
            self._meter = PeriodMeter(model_bytes_at_start=model_bytes())

    def close(self) -> None:
        """Lift the allocator cap this budget set: it is process-wide and would outlive the engine (a later one
        with a larger budget, or none, would stay capped). Left alone if something else changed it since; another
        live engine's budget keeps capping it ([Note: one allocator cap for several budgets]). The CPU stand-in's
        monitor stops counting."""
        if self._capped:
            self._capped = False
            _CAPS.release(self.device, id(self))
        if self._accounting is not None:  # an engine closed or collected with its window open
            self._accounting.discard()

    @property
    def measuring(self) -> bool:
        return self.monitor is not None

    @property
    def counts_tensors(self) -> bool:
        """Whether the measurement counts tensors it is given (the CPU stand-in's monitor; the CUDA allocator sees
        every byte by itself)."""
        return self._accounting is not None

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Work on host memory that the CPU stand-in's monitor must not count."""
        if self._accounting is None or not self._accounting.running:
            yield
            return
        with _disable_current_modes():
            yield

    def to_host(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A copy of ``t`` in host memory, for the user (``state_dict()``'s values). On the CPU stand-in it is made
        with the monitor quiet and left out of it while it lives, as host memory beside a GPU would be, so a
        state_dict() taken inside a measured window (between backward and step, or across a step GradScaler
        skipped) does not count as device memory."""
        with self.quiet():
            out = t.detach().to("cpu", dtype, copy=True)
        if self._accounting is not None:
            self._accounting.exclude(out)
        return out

    # [Note: the step's non-model peak]
    # A report's device_non_model_peak_bytes is the most the device held besides model data (chunks and buffers) at
    # any time in the step. The monitor sees all bytes, and the model's share is constant only between two
    # model-data moves; so each move onto or off the device (the storage's move watcher; a warm-up's trace cuts its
    # own intervals the same way) closes an interval, counting its peak less the model bytes held during it
    # ([Note: subtracting model data] in tracer/period.py; a PeriodMeter does the arithmetic), and restarts the
    # monitor's peak. The cost is a peak read and reset per move, not per operator or hook.

    @contextlib.contextmanager
    def model_data_move(self) -> Iterator[None]:
        """Wrap a move of model data onto or off the device (see [Note: the step's non-model peak])."""
        if self._meter is None or self._moving or not self.monitor.running:
            yield
            return
        self._moving = True
        self._cut(moving=False)
        try:
            yield
        finally:
            self._moving = False
            if self.monitor.running:
                self._cut(moving=True)

    def _cut(self, *, moving: bool) -> None:
        self._meter.close_interval(peak_bytes=self.monitor.peak_bytes(), model_bytes_now=self._model_bytes(),
                                   moving=moving)
        self.monitor.reset_peak()

    # ---------------------------------------------------------------------------- readings
    def peak_bytes(self) -> int | None:
        """The measured peak; None when nothing measures or nothing was measured yet (a step before any forward:
        torch's AdamW takes it as a no-op, and so does the report)."""
        if self.monitor is None or self.monitor.state is MonitorState.NEW:
            return None
        peak = self.monitor.peak_bytes()
        return peak if self._meter is None else max(peak, self._meter.peak_bytes)

    def non_model_peak_bytes(self) -> int | None:
        """The most the device held besides model data since the window began; None when nothing measures
        ([Note: the step's non-model peak])."""
        if self._meter is None or self.monitor.state is MonitorState.NEW:
            return None
        # The interval still open ends here (closing it again later only repeats its peak).
        self._meter.close_interval(peak_bytes=self.monitor.peak_bytes(), model_bytes_now=self._model_bytes(),
                                   moving=False)
        return max(0, self._meter.non_model_peak_bytes)

    def reset_peak(self) -> None:
        """Restart the peak (a stopped monitor restarts it when its next window begins)."""
        if self.monitor is not None and self.monitor.running:
            self.monitor.reset_peak()
            self._meter = PeriodMeter(model_bytes_at_start=self._model_bytes())

    def budget_error(self, error: torch.OutOfMemoryError, *, what: str, chunk_bytes: int,
                     advice: str) -> DeviceBudgetError | None:
        """``error``, raised inside ``what`` (the forward pass, ...), as the budget's own error where a budget is
        set: on CUDA the budget caps the allocator, so an allocation beyond it fails there, and the user is owed
        the missing bytes in the budget's terms. None without a budget (torch's error states the card's limit)."""
        if not self.budgeted:
            return None
        held = ""
        if self.device.type == "cuda":
            allocated = torch.cuda.memory_allocated(self.device)
            # The cap counts the allocator's segments, not the tensors in them: what it held (its free cached blocks
            # already given back by its retry) is what the request met, and counting tensors understates it.
            reserved = max(allocated, torch.cuda.memory_reserved(self.device))
            if reserved > allocated:
                held = (f"; the allocator held {reserved} in segments, {reserved - allocated} of them free blocks "
                        f"too small or split for it (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets it "
                        f"grow segments instead)")
            cap = _CAPS.smallest(self.device)
            if cap is not None and cap < self.budget_bytes / self.total_bytes:  # as hold() was given it
                held += (f"; another engine still alive caps the allocator at {int(cap * self.total_bytes)} bytes, "
                         f"below this budget: close() it, or drop it and let it be collected "
                         f"(see [Note: one allocator cap for several budgets])")
        elif self.monitor is not None and self.monitor.running:
            allocated = reserved = self.monitor.current_bytes()
        else:
            allocated = reserved = chunk_bytes
        found = _TRIED.search(str(error))
        requested = int(float(found[1]) * _UNIT_BYTES[found[2]]) if found else 0
        segment = _cuda_segment_bytes(requested) if self.device.type == "cuda" else requested
        missing = max(1, reserved + segment - self.budget_bytes)
        asked = f"{requested} bytes" + (f" (a new segment of {segment})" if segment != requested else "")
        return DeviceBudgetError(
            f"{what} ran out of the device budget: an operator asked for {asked} with {allocated} allocated "
            f"(chunks {chunk_bytes}; the rest is activations, workspaces and buffers{held}) but "
            f"GeminiConfig.device_memory is {self.budget_bytes}: about {missing} bytes are missing. Nothing was "
            f"updated. Raise device_memory, or {advice}.", missing_bytes=missing)

    def restart_slack(self) -> None:
        """A warm-up begins: :meth:`allocator_slack_bytes` counts from here, over the segments this iteration uses.
        The cache others left (a larger batch's evaluation before initialize) is given back first: its free
        segments count as reserved and would be taken for slack (the allocator frees them before failing anyway)."""
        if isinstance(self.monitor, CudaAllocatorMonitor):
            torch.cuda.empty_cache()
            self.monitor.restart_reserved_peak()

    def allocator_slack_bytes(self, peak_bytes: int) -> int:
        """Bytes the CUDA caching allocator held beyond live tensors (rounded blocks, fragmentation) at the
        warm-up's peak of ``peak_bytes`` allocated: its reserved peak since :meth:`restart_slack` less that. Torch's
        reserved and allocated figures cannot be read together at the end: each period's peak reset clears both,
        and afterwards reserved less allocated is the cache of everything the backward freed."""
        if not isinstance(self.monitor, CudaAllocatorMonitor):
            return 0
        return max(0, self.monitor.reserved_peak_bytes() - peak_bytes)

    def reserve_bytes(self, max_non_model_bytes: int, peak_bytes: int) -> int:
        """The safety reserve kept free under the budget, after a warm-up whose device peak was ``peak_bytes``
        (allocated) and largest non-model peak ``max_non_model_bytes``.

        [Note: the safety reserve]
        The plan rests on warm-up measurements, so the reserve covers what they do not see:
        - the CUDA caching allocator's slack (rounded blocks, fragmentation), measured during warm-up as peak
          reserved minus peak allocated: the per-process fraction caps *reserved* memory, so this is what stands
          between the plan and a real OOM;
        - variation of non-model memory between iterations of the same shapes: on CUDA (workspaces, algorithm
          choices) 5% of the largest non-model peak; none on the CPU stand-in, whose monitor counts every live
          storage exactly (a share there would refuse budgets that train);
        - 64 KiB for scalars, per-parameter norms and other small step-time tensors (the one large one, an fp32
          copy of a bf16/fp16 gradient chunk updated on the device, is charged by auto when it puts optimizer
          states there).
        Whatever the reserve misses, every step's measured peak is still checked against the budget
        (``GeminiRuntime.check_step_peak``): an error before any update, never a silent overshoot. A fixed share
        (Colossal-AI: 20% in warm-up, 90% after) is too large for big devices and too small under fragmentation.
        """
        return self.allocator_slack_bytes(peak_bytes) + planned_reserve_bytes(max_non_model_bytes, self.device)


def planned_reserve_bytes(max_non_model_bytes: int, device: torch.device) -> int:
    """The safety reserve less the allocator's slack (which only a run measures): what a plan made before any run
    keeps free (see [Note: the safety reserve])."""
    return _allocator_variation_bytes(max_non_model_bytes, device) + _STEP_TEMPORARIES_BYTES


def planned_slack_bytes(max_non_model_bytes: int, device: torch.device) -> int:
    """What the planner keeps free for a placement without auto's warm-up (whose steps are checked against the
    budget itself, no reserve): the allocator's variation, and 1% of the non-model peak for where the meta-device
    run's prediction differs from a real run."""
    return _allocator_variation_bytes(max_non_model_bytes, device) + math.ceil(0.01 * max_non_model_bytes)


# [Note: the allocator's new segment]
# When no cached block can serve a request, torch's CUDA caching allocator reserves a new segment, and the
# per-process cap (the budget) is checked against that segment, not the request: 2 MiB for requests up to 1 MiB,
# 20 MiB for those under 10 MiB, larger ones rounded up to 2 MiB (``get_allocation_size`` in
# c10/cuda/CUDACachingAllocator.cpp). Counted by the request, the missing bytes reported would be too few, and a
# budget raised by them would fail again. With expandable segments the allocator maps pages of the same sizes, so
# the figure is an upper bound.
def _cuda_segment_bytes(requested: int) -> int:
    MiB = 2**20
    if requested <= MiB:
        return 2 * MiB
    if requested < 10 * MiB:
        return 20 * MiB
    return -(-requested // (2 * MiB)) * 2 * MiB


def _allocator_variation_bytes(max_non_model_bytes: int, device: torch.device) -> int:
    return math.ceil(0.05 * max_non_model_bytes) if device.type == "cuda" else 0


# [Note: one allocator cap for several budgets]
# torch caps the CUDA allocator per process, and a process may train several engines (a GAN's generator and
# discriminator, RLHF's actor and critic). Engines each setting their own cap and restoring the previous one at
# close would replace each other's caps, and the first to close would lift a cap the other still relies on. Each
# engine measures the whole device while its iterations run, and those overlap, so the cap is the smallest budget
# of the live engines, set again whenever they change; the cap from before the first returns when the last
# closes. A cap someone else set meanwhile stays.
class _AllocatorCaps:
    def __init__(self) -> None:
        self._held: dict[torch.device, dict[int, float]] = {}  # device -> holder -> its fraction
        self._before: dict[torch.device, float] = {}  # the cap before the first holder
        self._set: dict[torch.device, float] = {}  # the cap as the allocator reports it, set here last

    def hold(self, device: torch.device, holder: int, fraction: float) -> float:
        """Cap ``device`` at ``fraction`` or less while ``holder`` lives; the cap set."""
        held = self._held.setdefault(device, {})
        if not held:
            before = _allocator_fraction(device)
            self._before[device] = 1.0 if before is None else before
        held[holder] = fraction
        return self._apply(device, min(held.values()))

    def smallest(self, device: torch.device) -> float | None:
        """The cap the live holders set on ``device`` (None: none)."""
        held = self._held.get(device)
        return min(held.values()) if held else None

    def release(self, device: torch.device, holder: int) -> None:
        held = self._held.get(device, {})
        if held.pop(holder, None) is None:
            return
        if _allocator_fraction(device) not in (self._set.get(device), None):  # changed by someone else
            if not held:
                self._before.pop(device, None)
            return
        if held:
            self._apply(device, min(held.values()))
        else:
            self._apply(device, self._before.pop(device))

    def _apply(self, device: torch.device, fraction: float) -> float:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        now = _allocator_fraction(device)  # the allocator keeps whole bytes, and reports the cap from them
        self._set[device] = fraction if now is None else now
        return self._set[device]


_CAPS = _AllocatorCaps()


def _allocator_fraction(device: torch.device) -> float | None:
    """The CUDA allocator's per-process cap; None where this torch cannot say."""
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return getter(device) if getter is not None else None


def _device_total_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return psutil.virtual_memory().total


def model_tensors_on(device: torch.device, module: torch.nn.Module, manager: ChunkManager) -> list[torch.Tensor]:
    """Model data on the device: buffers, chunk payloads and the step counts of states there (for the accounting
    monitor; [Note: step counts are where the states are])."""
    out = [b for b in module.buffers() if b.device.type == device.type]
    out += [c.payload(Tier.DEVICE) for c in manager.chunks() if c.is_on(Tier.DEVICE)]
    out += [g.steps for g in manager.trainable_groups if g.exp_avg.is_on(Tier.DEVICE)]
    return out
