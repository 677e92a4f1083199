"""Byte budgets per memory tier: one ledger that every placement decision consults.

The chunk manager, the pinned host pool and the NVMe store all move bytes between tiers;
``TierBudgets`` is where those bytes are counted, so that a limit such as
``device_memory="512MiB"`` is enforced in one place and a report can read the current use
and the peak of each tier without asking every component.
"""

from __future__ import annotations

import enum
import re
import threading
from dataclasses import dataclass
from typing import Mapping

__all__ = ["Tier", "TierBudgets", "TierUsage", "BudgetExceededError", "parse_size", "format_size"]


class Tier(enum.Enum):
    """Where a chunk's bytes can live."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    # Members are singletons compared by identity: hash them by identity too, in C, since
    # payload lookups by tier sit on the optimizer step's hot path.
    __hash__ = object.__hash__

    @classmethod
    def coerce(cls, value: "Tier | str") -> "Tier":
        """Accept a Tier or its name ("device", "host", "nvme"; case-insensitive)."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        accepted = ", ".join(repr(t.value) for t in cls)
        raise ValueError(f"tier={value!r} is not a tier; accepted: {accepted} or a Tier member")


# [Note: size units]
# "KB"/"MB"/... are decimal (10**3 steps) and "KiB"/"MiB"/... binary (2**10 steps), as the SI
# and IEC define them; users who write "8GB" for a GPU's 8 GiB get 7% less budget, which is
# the safe direction for a budget. Matching is case-insensitive ("512mib" works), and a
# fractional number is allowed as long as the result is a whole number of bytes
# ("1.5GiB" is fine, "0.3B" is not).
_UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_ACCEPTED_SIZES = (
    "a non-negative int of bytes or a string like '4096', '512MiB', '1.5 GiB', '8GB' "
    "(units B, KB, KiB, MB, MiB, GB, GiB, TB, TiB; case-insensitive)"
)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, field: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    ``field`` names the setting in the error message, so that a config can say which of its
    fields was wrong: ``parse_size(cfg.cpu_memory, field="cpu_memory")``.
    """
    if isinstance(value, bool):  # bool is an int subclass; True bytes is a mistake
        raise ValueError(f"{field}={value!r} is not a size; accepted: {_ACCEPTED_SIZES}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}={value!r} is negative; accepted: {_ACCEPTED_SIZES}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"{field}={value!r} ({type(value).__name__}) is not a size; accepted: {_ACCEPTED_SIZES}"
        )
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(f"{field}={value!r} is not a size; accepted: {_ACCEPTED_SIZES}")
    number_text, unit_text = match.groups()
    unit = unit_text.lower() or "b"
    if unit not in _UNIT_BYTES:
        raise ValueError(
            f"{field}={value!r} has unknown unit {unit_text!r}; accepted: {_ACCEPTED_SIZES}"
        )
    scale = _UNIT_BYTES[unit]
    if "." in number_text:
        # Exact decimal arithmetic: float("1.1") * 10**9 is not a whole number of bytes.
        whole, _, frac = number_text.partition(".")
        numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
        denominator = 10 ** len(frac)
        total, remainder = divmod(numerator * scale, denominator)
        if remainder:
            raise ValueError(
                f"{field}={value!r} is not a whole number of bytes; accepted: {_ACCEPTED_SIZES}"
            )
        return total
    return int(number_text) * scale


def format_size(nbytes: int) -> str:
    """Human-readable binary size for messages: 1536 -> '1.50 KiB'."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


class BudgetExceededError(MemoryError):
    """A reservation would take a tier over its limit.

    Carries the numbers so that callers (placement, the margin tuner) can react to how much
    is missing rather than parse the message.
    """

    def __init__(self, tier: Tier, *, requested_bytes: int, used_bytes: int, limit_bytes: int,
                 what: str = "") -> None:
        self.tier = tier
        self.requested_bytes = requested_bytes
        self.used_bytes = used_bytes
        self.limit_bytes = limit_bytes
        self.missing_bytes = used_bytes + requested_bytes - limit_bytes
        purpose = f" for {what}" if what else ""
        super().__init__(
            f"{tier.value} budget exceeded: reserving {requested_bytes} bytes"
            f" ({format_size(requested_bytes)}){purpose} with {used_bytes} bytes in use and a"
            f" limit of {limit_bytes} bytes ({format_size(limit_bytes)}) is"
            f" {self.missing_bytes} bytes ({format_size(self.missing_bytes)}) short"
        )


@dataclass(frozen=True, kw_only=True)
class TierUsage:
    """A snapshot of one tier's ledger."""

    tier: Tier
    used_bytes: int
    peak_bytes: int
    limit_bytes: int | None

    @property
    def available_bytes(self) -> int | None:
        return None if self.limit_bytes is None else self.limit_bytes - self.used_bytes


class _TierAccount:
    """The mutable counters of one tier; guarded by the ledger's lock."""

    __slots__ = ("limit_bytes", "used_bytes", "peak_bytes")

    def __init__(self, limit_bytes: int | None) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.peak_bytes = 0


class TierBudgets:
    """Thread-safe ledger of bytes reserved per tier, with optional limits.

    ``None`` as a limit means unlimited (the tier is still counted).
    """

    def __init__(self, *, device_bytes: int | str | None = None, host_bytes: int | str | None = None,
                 nvme_bytes: int | str | None = None) -> None:
        limits = {Tier.DEVICE: (device_bytes, "device_bytes"), Tier.HOST: (host_bytes, "host_bytes"),
                  Tier.NVME: (nvme_bytes, "nvme_bytes")}
        self._accounts = {
            tier: _TierAccount(None if limit is None else parse_size(limit, field=name))
            for tier, (limit, name) in limits.items()
        }
        self._lock = threading.Lock()

    @classmethod
    def from_mapping(cls, limits: Mapping[Tier | str, int | str | None]) -> "TierBudgets":
        """Build from ``{"device": "8GiB", Tier.HOST: None, ...}``."""
        kwargs: dict[str, int | str | None] = {}
        for key, limit in limits.items():
            kwargs[f"{Tier.coerce(key).value}_bytes"] = limit
        return cls(**kwargs)  # type: ignore[arg-type]

    def reserve(self, tier: Tier | str, nbytes: int, *, what: str = "") -> None:
        """Count ``nbytes`` more on ``tier``; raise BudgetExceededError (counting nothing) if over."""
        tier = Tier.coerce(tier)
        nbytes = _checked_nbytes(nbytes)
        with self._lock:
            account = self._accounts[tier]
            if account.limit_bytes is not None and account.used_bytes + nbytes > account.limit_bytes:
                raise BudgetExceededError(tier, requested_bytes=nbytes, used_bytes=account.used_bytes,
                                          limit_bytes=account.limit_bytes, what=what)
            account.used_bytes += nbytes
            account.peak_bytes = max(account.peak_bytes, account.used_bytes)

    def try_reserve(self, tier: Tier | str, nbytes: int) -> bool:
        """Like reserve, but return False instead of raising when over the limit."""
        try:
            self.reserve(tier, nbytes)
        except BudgetExceededError:
            return False
        return True

    def release(self, tier: Tier | str, nbytes: int) -> None:
        """Give back bytes reserved earlier; releasing more than is reserved is a bug, so it raises."""
        tier = Tier.coerce(tier)
        nbytes = _checked_nbytes(nbytes)
        with self._lock:
            account = self._accounts[tier]
            if nbytes > account.used_bytes:
                raise ValueError(
                    f"releasing {nbytes} bytes from tier {tier.value!r} which has only"
                    f" {account.used_bytes} bytes reserved (double release?)"
                )
            account.used_bytes -= nbytes

    def used(self, tier: Tier | str) -> int:
        return self._accounts[Tier.coerce(tier)].used_bytes

    def peak(self, tier: Tier | str) -> int:
        return self._accounts[Tier.coerce(tier)].peak_bytes

    def limit(self, tier: Tier | str) -> int | None:
        return self._accounts[Tier.coerce(tier)].limit_bytes

    def available(self, tier: Tier | str) -> int | None:
        """Bytes that can still be reserved, or None when the tier has no limit."""
        tier = Tier.coerce(tier)
        with self._lock:
            account = self._accounts[tier]
            return None if account.limit_bytes is None else account.limit_bytes - account.used_bytes

    def set_limit(self, tier: Tier | str, limit_bytes: int | str | None) -> None:
        """Change a limit. Lowering it below current use is allowed: later reservations fail."""
        tier = Tier.coerce(tier)
        limit = None if limit_bytes is None else parse_size(limit_bytes, field=f"{tier.value}_bytes")
        with self._lock:
            self._accounts[tier].limit_bytes = limit

    def reset_peak(self, tier: Tier | str | None = None) -> None:
        """Restart peak tracking from current use (all tiers when ``tier`` is None)."""
        tiers = list(Tier) if tier is None else [Tier.coerce(tier)]
        with self._lock:
            for t in tiers:
                self._accounts[t].peak_bytes = self._accounts[t].used_bytes

    def usage(self, tier: Tier | str) -> TierUsage:
        tier = Tier.coerce(tier)
        with self._lock:
            a = self._accounts[tier]
            return TierUsage(tier=tier, used_bytes=a.used_bytes, peak_bytes=a.peak_bytes,
                             limit_bytes=a.limit_bytes)

    def snapshot(self) -> dict[Tier, TierUsage]:
        return {tier: self.usage(tier) for tier in Tier}

    def __repr__(self) -> str:
        parts = []
        for tier in Tier:
            u = self.usage(tier)
            limit = "unlimited" if u.limit_bytes is None else format_size(u.limit_bytes)
            parts.append(f"{tier.value}={format_size(u.used_bytes)}/{limit}")
        return f"TierBudgets({', '.join(parts)})"


def _checked_nbytes(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r} must be a non-negative int")
    return nbytes
