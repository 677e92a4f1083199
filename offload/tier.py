"""`Tier`: where a chunk's bytes can live — the compute device, host memory or NVMe files."""

from __future__ import annotations

import enum

__all__ = ["Tier"]


class Tier(enum.Enum):
    """Where a chunk's bytes can live."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    # Members are singletons compared by identity: hash them by identity too, in C, since
    # payload lookups by tier sit on the optimizer step's hot path.
    __hash__ = object.__hash__
