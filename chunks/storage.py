"""The one place that allocates and frees chunk storage and counts every byte.

Every chunk payload is created by :meth:`ChunkStorage.alloc`, freed by :meth:`ChunkStorage.free`
and moved between tiers by :meth:`ChunkStorage.transfer`; each of them updates the per-tier
byte counts and the transfer counters in the same call, so the figures in a memory report are
sums of what really happened, never estimates.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

__all__ = ["Tier", "TierStats", "ChunkStorage", "StorageObserver"]


class Tier(enum.Enum):
    """Where a chunk payload lives."""

    DEVICE = "device"  # the compute device; counted against `device_memory`
    HOST = "host"  # host memory (pinned when the device is CUDA)

    # Members are singletons compared by identity: hash them by identity too, in C, since
    # payload lookups by tier sit on the optimizer step's hot path.
    __hash__ = object.__hash__


@dataclass
class TierStats:
    """Byte counters of one tier."""

    current_bytes: int = 0
    peak_bytes: int = 0
    payloads: int = 0  # live payloads on the tier

    def add(self, nbytes: int) -> None:
        self.current_bytes += nbytes
        self.payloads += 1
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def sub(self, nbytes: int) -> None:
        self.current_bytes -= nbytes
        self.payloads -= 1
        assert self.current_bytes >= 0 and self.payloads >= 0, f"{self.current_bytes=} {self.payloads=} went negative"


@dataclass
class TransferStats:
    """Bytes and time moved between tiers since the last reset."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.h2d_bytes = self.d2h_bytes = 0
        self.seconds = 0.0


@dataclass
class StorageObserver:
    """Keeps a device-memory monitor right about chunk payloads when the CPU stands in for the device.

    ``quiet()`` is entered around host allocations so the monitor never counts them, and
    ``exclude(payload)`` tells it to ignore the new payload whenever operators touch it.
    """

    quiet: Callable[[], AbstractContextManager]
    exclude: Callable[[torch.Tensor], None]
    # A device payload's storage was resized in place (resize_ bypasses the dispatcher).
    resized: Callable[[torch.Tensor], None] = lambda payload: None


@dataclass
class ChunkStorage:
    """Allocator and ledger for chunk payloads on the device and host tiers.

    With ``device=cpu`` both tiers are CPU memory, and moves are still real copies into
    separate buffers: the CPU stands in for the accelerator, so every policy and report can be
    exercised without a GPU.
    """

    device: torch.device
    pin_host: bool = False
    stats: dict[Tier, TierStats] = field(default_factory=lambda: {t: TierStats() for t in Tier})
    transfers: TransferStats = field(default_factory=TransferStats)
    observer: StorageObserver | None = None
    # Called around every move of chunk data onto or off the device (the warm-up tracer
    # splits its measuring intervals there).
    move_context: Callable[[], AbstractContextManager] = contextlib.nullcontext

    def __post_init__(self) -> None:
        self.device = torch.device(self.device)
        # [Note: host copies on CUDA]
        # Host payloads are page-locked on CUDA so that copies are true DMA and can run on a
        # side stream. A CPU-only torch build cannot pin (pin_memory=True raises there), and
        # with the CPU standing in for the device pinning would mean nothing anyway.
        self.pin_host = self.pin_host and self.device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = (
            torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        )

    def tier_device(self, tier: Tier) -> torch.device:
        return self.device if tier is Tier.DEVICE else torch.device("cpu")

    def alloc(
        self, tier: Tier, numel: int, dtype: torch.dtype, *, zero: bool = False, shell: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A new 1-D payload of ``numel`` elements on ``tier``, counted at once.

        ``shell`` is a device payload freed earlier by :meth:`free`: its storage grows back in
        place, so views of it taken before (autograd's saved tensors) see the new data.
        """
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if shell is not None:
            assert tier is Tier.DEVICE and shell.untyped_storage().nbytes() == 0, "shell must be a freed device payload"
            shell.untyped_storage().resize_(nbytes)
            if zero:
                shell.zero_()
            payload = shell
            if self.observer is not None:
                self.observer.resized(payload)
        else:
            pin = self.pin_host and tier is Tier.HOST
            make = torch.zeros if zero else torch.empty
            if tier is Tier.HOST and self.observer is not None:
                with self.observer.quiet():
                    payload = make(numel, dtype=dtype, device=self.tier_device(tier), pin_memory=pin)
                self.observer.exclude(payload)
            else:
                payload = make(numel, dtype=dtype, device=self.tier_device(tier), pin_memory=pin)
        self.stats[tier].add(nbytes)
        return payload

    def free(self, tier: Tier, payload: torch.Tensor) -> None:
        """Release a payload allocated by :meth:`alloc`.

        [Note: device payloads are freed in place]
        A device payload's storage is resized to zero rather than dropped: autograd may hold
        views of it (``F.linear`` saves ``weight.t()``), which would otherwise keep the memory
        alive after the chunk left the device and hand the backward pass the old copy. Freed
        in place, the memory is really returned, the payload can grow back into the same
        storage (``alloc(shell=...)``), and a view used while the chunk is away fails loudly.
        """
        self.stats[tier].sub(payload.numel() * payload.element_size())
        if tier is Tier.DEVICE:
            payload.untyped_storage().resize_(0)
            if self.observer is not None:
                self.observer.resized(payload)

    def transfer(self, payload: torch.Tensor, src: Tier, dst: Tier, *, shell: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of ``payload`` (on ``src``) newly allocated on ``dst``; the source is kept."""
        assert src is not dst, f"transfer within {src}"
        out = self.alloc(dst, payload.numel(), payload.dtype, shell=shell)
        self.copy_(out, payload, src=src, dst=dst)
        return out

    def copy_(self, out: torch.Tensor, payload: torch.Tensor, *, src: Tier, dst: Tier) -> None:
        """Copy ``payload`` into ``out`` across tiers, counting the bytes moved."""
        nbytes = payload.numel() * payload.element_size()
        start = time.perf_counter()
        with torch.profiler.record_function("gemini::transfer"), self.move_context():
            if self._copy_stream is not None and dst is Tier.DEVICE and src is Tier.HOST:
                # Host-to-device on the side stream; compute waits on it before using `out`.
                self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._copy_stream):
                    out.copy_(payload, non_blocking=self.pin_host)
                torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)
                out.record_stream(torch.cuda.current_stream(self.device))
            else:
                # Device-to-host is synchronous: the host side (CPU Adam, checkpoints) reads
                # it right after, and a pinned buffer is not safe to read before the copy ends.
                out.copy_(payload)
        self.transfers.seconds += time.perf_counter() - start
        if src is Tier.HOST and dst is Tier.DEVICE:
            self.transfers.h2d_bytes += nbytes
        elif src is Tier.DEVICE and dst is Tier.HOST:
            self.transfers.d2h_bytes += nbytes

    def bytes_on(self, tier: Tier) -> int:
        return self.stats[tier].current_bytes

    def reset_peaks(self) -> None:
        for s in self.stats.values():
            s.peak_bytes = s.current_bytes
