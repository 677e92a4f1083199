"""Chunks: flat buffers holding many tensors as views, and the manager that moves them."""

from chunks.chunk import Chunk, ChunkState
from chunks.group import ChunkGroup
from chunks.kind import ChunkKind
from chunks.layout import CAPACITY_ALIGN_ELEMENTS, TensorSlot, chunk_capacity, plan_layout
from chunks.ledger import MemoryLedger, fits, missing_bytes
from chunks.manager import ChunkManager, ValueSource, values_of_params
from chunks.shard import Shard
from chunks.search import ChunkSizeSearch, default_search_range, search_chunk_size, waste_for
from chunks.storage import ChunkStorage, StorageObserver, Tier, compute_device
from offload import round_up

__all__ = [
    "CAPACITY_ALIGN_ELEMENTS",
    "Chunk",
    "ChunkGroup",
    "ChunkKind",
    "ChunkManager",
    "ChunkSizeSearch",
    "ChunkState",
    "ChunkStorage",
    "MemoryLedger",
    "Shard",
    "StorageObserver",
    "TensorSlot",
    "Tier",
    "ValueSource",
    "chunk_capacity",
    "compute_device",
    "default_search_range",
    "fits",
    "missing_bytes",
    "plan_layout",
    "round_up",
    "search_chunk_size",
    "values_of_params",
    "waste_for",
]
