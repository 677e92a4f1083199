"""Where bytes live off the compute device: tier budgets, a pinned host pool, an NVMe store."""

from offload.aligned import byte_view
from offload.budgets import BudgetExceededError, Tier, TierBudgets, TierUsage, format_size, parse_size
from offload.errors import NvmeCorruptionError, NvmeStoreError
from offload.nvme_store import IoMode, NvmeStats, NvmeStore, NvmeStoreConfig, StoreState
from offload.pinned_pool import PinnedHostPool, PoolStats

__all__ = [
    "BudgetExceededError",
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
    "TierBudgets",
    "TierUsage",
    "byte_view",
    "format_size",
    "parse_size",
]
