"""`MemoryLedger`: the bytes of chunks on each tier, by kind, and the bytes moved between tiers;
and `fits` / `missing_bytes`, the one answer to "does it fit in the budget".

[Note: one ledger]
:class:`chunks.ChunkStorage` is the one place that allocates, frees and moves chunk payloads
and confirms NVMe files, and it tells the ledger in the same call. So every figure here is a
sum of what happened, never an estimate, and every reader — the memory report, the warm-up
tracer, the auto policy's evictions, :meth:`chunks.ChunkManager.bytes_by_kind` — reads the same
count. Each byte is counted once: a payload on the tier it lies on (a chunk with copies on two
tiers counts on both, since both copies use memory), a file on NVMe when its write is
confirmed. The pinned host pool's reserved bytes are a gauge beside the tiers: they are the
memory behind the host payloads (rounded up to the pool's size classes) plus idle buffers kept
for reuse, so they are never added to the host tier's count. Saved activations waiting in host
memory (``GeminiConfig.offload_activations``, gemini/engine/activations.py) are not model data: they
have their own account beside the tiers, and their copies their own transfer counters.

[Note: fits]
Every budget decision asks :func:`missing_bytes` (or :func:`fits`) with the limit and the
uses it must hold, listed term by term (chunks, buffers, non-model peak, reserve, ...): exactly
at the limit fits, and no limit (None) always fits. Each caller words its own error, with
the number this gives.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from offload import Tier

__all__ = ["MemoryLedger", "TierAccount", "TransferStats", "fits", "missing_bytes"]


def missing_bytes(limit_bytes: int | None, *uses_bytes: int) -> int:
    """How many bytes the ``uses_bytes`` together need beyond ``limit_bytes``: 0 when they fit
    (a total exactly at the limit fits), and always 0 when there is no limit (None)."""
    if limit_bytes is None:
        return 0
    return max(0, sum(uses_bytes) - limit_bytes)


def fits(limit_bytes: int | None, *uses_bytes: int) -> bool:
    """Whether the ``uses_bytes`` together stay within ``limit_bytes`` (see :func:`missing_bytes`)."""
    return missing_bytes(limit_bytes, *uses_bytes) == 0


@dataclass
class TierAccount:
    """Bytes of chunk payloads (or files) on one tier, or of one chunk kind on it."""

    current_bytes: int = 0
    peak_bytes: int = 0
    payloads: int = 0  # live payloads (files on NVMe)

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
    """Bytes and time moved between tiers (and between ranks) since the last reset."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    seconds: float = 0.0  # time spent issuing host <-> device copies
    nvme_read_bytes: int = 0  # confirmed (and verified) reads from NVMe files
    nvme_write_bytes: int = 0  # confirmed writes to NVMe files
    nvme_wait_seconds: float = 0.0  # time the caller waited for NVMe I/O to finish
    grad_reduce_bytes: int = 0  # gradient buckets reduce-scattered across ranks (ZeRO)
    # ZeRO: parameter chunks all-gathered across ranks (ZeRO-3 before compute, prefetches
    # included; ZeRO-1/2 after the step) and their bytes, whole chunks as the gathers fill them.
    param_gathers: int = 0
    param_gather_bytes: int = 0
    activation_d2h_bytes: int = 0  # saved activations copied to host memory
    activation_h2d_bytes: int = 0  # ... and back to the device for backward
    activation_kept_bytes: int = 0  # saved activations the budget kept on the device instead

    def reset(self) -> None:
        self.h2d_bytes = self.d2h_bytes = 0
        self.nvme_read_bytes = self.nvme_write_bytes = 0
        self.grad_reduce_bytes = self.param_gathers = self.param_gather_bytes = 0
        self.activation_d2h_bytes = self.activation_h2d_bytes = self.activation_kept_bytes = 0
        self.seconds = self.nvme_wait_seconds = 0.0


class MemoryLedger:
    """Current and peak bytes per tier and per (tier, chunk kind), live payloads, transfers,
    and the pinned host pool's reserved bytes. See [Note: one ledger].

    Kinds are :class:`chunks.ChunkKind` members (any hashable key works). Not thread-safe:
    chunk storage is allocated, freed and moved on the training thread only.
    """

    def __init__(self) -> None:
        self._tiers = {tier: TierAccount() for tier in Tier}
        self._kinds: dict[tuple[Tier, Hashable], TierAccount] = {}
        self.transfers = TransferStats()
        self.host_pool_bytes = 0  # host buffers the pinned pool holds, in use or idle
        self.activations = TierAccount()  # offloaded saved activations held in host memory

    # --------------------------------------------------------------------------- counting
    def add(self, tier: Tier, kind: Hashable, nbytes: int) -> None:
        """A payload (a confirmed file, on NVMe) of ``nbytes`` of ``kind`` now exists on ``tier``."""
        self._tiers[tier].add(nbytes)
        account = self._kinds.get((tier, kind))
        if account is None:
            account = self._kinds[(tier, kind)] = TierAccount()
        account.add(nbytes)

    def sub(self, tier: Tier, kind: Hashable, nbytes: int) -> None:
        """A payload counted by :meth:`add` is gone."""
        self._tiers[tier].sub(nbytes)
        self._kinds[(tier, kind)].sub(nbytes)

    def count_copy(self, src: Tier, dst: Tier, nbytes: int, seconds: float) -> None:
        """A copy of ``nbytes`` from ``src`` to ``dst`` was issued in ``seconds``."""
        self.transfers.seconds += seconds
        if src is Tier.HOST and dst is Tier.DEVICE:
            self.transfers.h2d_bytes += nbytes
        elif src is Tier.DEVICE and dst is Tier.HOST:
            self.transfers.d2h_bytes += nbytes

    def count_gather(self, nbytes: int) -> None:
        """A parameter chunk of ``nbytes`` was all-gathered across ranks (ZeRO)."""
        self.transfers.param_gathers += 1
        self.transfers.param_gather_bytes += nbytes

    def count_nvme_io(self, nbytes: int, *, write: bool) -> None:
        """A read (or write) of ``nbytes`` from (to) an NVMe file was confirmed."""
        if write:
            self.transfers.nvme_write_bytes += nbytes
        else:
            self.transfers.nvme_read_bytes += nbytes

    def count_pool_reserve(self, delta_bytes: int) -> None:
        """The pinned host pool's reserved bytes changed (its ``on_reserve`` hook)."""
        self.host_pool_bytes += delta_bytes
        assert self.host_pool_bytes >= 0, f"{self.host_pool_bytes=} went negative"

    # ---------------------------------------------------------------------------- reading
    def bytes_on(self, tier: Tier) -> int:
        return self._tiers[tier].current_bytes

    def peak_bytes(self, tier: Tier) -> int:
        """The most bytes ``tier`` held at once since the last :meth:`reset_peaks`."""
        return self._tiers[tier].peak_bytes

    def payloads(self, tier: Tier) -> int:
        return self._tiers[tier].payloads

    def kind_bytes(self, tier: Tier, kind: Hashable) -> int:
        account = self._kinds.get((tier, kind))
        return account.current_bytes if account is not None else 0

    def kind_peak_bytes(self, tier: Tier, kind: Hashable) -> int:
        account = self._kinds.get((tier, kind))
        return account.peak_bytes if account is not None else 0

    # -------------------------------------------------------------------------- resetting
    def reset_peaks(self, *tiers: Tier) -> None:
        """Restart the peaks of ``tiers`` (default: every tier) from what they hold now."""
        chosen = set(tiers or Tier)
        for tier in chosen:
            self._tiers[tier].peak_bytes = self._tiers[tier].current_bytes
        for (tier, _), account in self._kinds.items():
            if tier in chosen:
                account.peak_bytes = account.current_bytes
        if Tier.HOST in chosen:
            self.activations.peak_bytes = self.activations.current_bytes

    def start_step(self) -> None:
        """A new step: peaks restart from now and the transfer counters from zero."""
        self.reset_peaks()
        self.transfers.reset()

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t.value}={a.current_bytes} (peak {a.peak_bytes})" for t, a in self._tiers.items())
        return f"MemoryLedger({tiers}, host pool {self.host_pool_bytes})"
