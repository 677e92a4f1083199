"""Where bytes live off the compute device: tiers and sizes, a pinned host pool, an NVMe store."""

from offload.aligned import byte_view, round_up
from offload.errors import NvmeCorruptionError, NvmeStoreError
from offload.nvme_store import IoMode, NvmeStats, NvmeStore, NvmeStoreConfig, StoreState
from offload.pinned_pool import PinnedHostPool, PoolStats
from offload.sizes import format_size, parse_size
from offload.tier import Tier

__all__ = [
    "IoMode",
    "NvmeCorruptionError",
    "NvmeStats",
    "NvmeStore",
    "NvmeStoreConfig",
    "NvmeStoreError",
    "PinnedHostPool",
    "PoolStats",
    "StoreState",
    "Tier",
    "byte_view",
    "format_size",
    "parse_size",
    "round_up",
]
