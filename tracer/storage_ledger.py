"""Live storage bytes: each storage counted once, dropped the moment it is freed.

The ledger is the bookkeeping half of the tensor-accounting monitor: it knows nothing about
dispatch modes or devices, only storages, their sizes and whether they still exist.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

logger = logging.getLogger(__name__)

__all__ = ["StorageLedger", "storages_of"]


def storages_of(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The untyped storages holding ``tensor``'s bytes.

    Looks through traceable wrapper subclasses (whose own storage is empty) to the tensors
    they wrap, and through sparse layouts to their index and value tensors.
    """
    pending = [tensor]
    while pending:
        t = pending.pop()
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            pending.extend(v for v in (getattr(t, a) for a in attrs) if isinstance(v, torch.Tensor))
        elif t.layout is torch.strided:
            yield t.untyped_storage()
        elif t.layout is torch.sparse_coo:
            pending.extend((t._indices(), t._values()))
        elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
            pending.extend((t.crow_indices(), t.col_indices(), t.values()))
        elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
            pending.extend((t.ccol_indices(), t.row_indices(), t.values()))
        else:
            # mkldnn and other opaque layouts expose no storage to count.
            logger.debug("storages_of: layout %s has no countable storage", t.layout)


@dataclass(slots=True)
class _Entry:
    ref: weakref.ref
    nbytes: int
    counted: bool


class StorageLedger:
    """Sum of the bytes of live storages that were added, with a resettable peak.

    Thread-safe: storages die on whatever thread drops their last reference (a CUDA
    backward runs on the device's autograd thread), so the free callbacks take the lock.
    """

    def __init__(self) -> None:
        # Re-entrant: dropping a storage reference inside a locked section (a temporary
        # from `untyped_storage()`, say) can run a free callback on this same thread.
        self._lock = threading.RLock()
        self._entries: dict[int, _Entry] = {}
        self._current_bytes = 0
        self._peak_bytes = 0

    # [Note: keying by storage identity]
    # Entries are keyed by id() of the storage's Python object, not by its data_ptr.
    # PyTorch preserves a storage's Python object for as long as the C++ storage lives
    # (`t.untyped_storage() is t.untyped_storage()`, for every view of it), so the object's
    # identity is the storage's identity, and a weakref to it fires exactly when the storage
    # is freed. data_ptr would be a worse key: every empty storage has data_ptr 0, a storage
    # resized in place moves to a new pointer, and across threads a freed pointer can be
    # handed to a new storage before the old one's Python finalizer has run. An id can only
    # be reused after its object died, and the death removes the entry first (the callback
    # checks that the entry is still its own, in case it was replaced meanwhile).

    def add(self, storage: torch.UntypedStorage) -> int:
        """Count ``storage`` if it is new; re-read its size if it is known. Returns the change."""
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.ref() is storage:
                if not entry.counted or entry.nbytes == nbytes:
                    entry.nbytes = nbytes
                    return 0
                delta = nbytes - entry.nbytes
                entry.nbytes = nbytes
            else:
                self._entries[key] = self._new_entry(storage, key, nbytes, counted=True)
                delta = nbytes
            self._current_bytes += delta
            if self._current_bytes > self._peak_bytes:
                self._peak_bytes = self._current_bytes
            return delta

    def exclude(self, storage: torch.UntypedStorage) -> None:
        """Never count ``storage`` while it lives, even if it is added later."""
        key = id(storage)
        nbytes = storage.nbytes()
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry.ref() is storage:
                if entry.counted:
                    self._current_bytes -= entry.nbytes
                    entry.counted = False
                entry.nbytes = nbytes
            else:
                self._entries[key] = self._new_entry(storage, key, nbytes, counted=False)

    def refresh(self) -> int:
        """Re-read the size of every live counted storage; returns the change in bytes.

        ``UntypedStorage.resize_`` bypasses the dispatcher, so a storage resized in place is
        only seen here (or when it shows up again as an operator's input or output).
        """
        with self._lock:
            delta = 0
            for entry in self._entries.values():
                storage = entry.ref()
                if storage is None or not entry.counted:
                    continue
                nbytes = storage.nbytes()
                delta += nbytes - entry.nbytes
                entry.nbytes = nbytes
            self._current_bytes += delta
            self._peak_bytes = max(self._peak_bytes, self._current_bytes)
            return delta

    def reset_peak(self) -> None:
        with self._lock:
            self._peak_bytes = self._current_bytes

    def clear(self) -> None:
        """Forget every storage (their free callbacks die with the dropped weakrefs)."""
        with self._lock:
            self._entries.clear()
            self._current_bytes = 0
            self._peak_bytes = 0

    @property
    def current_bytes(self) -> int:
        return self._current_bytes

    @property
    def peak_bytes(self) -> int:
        return self._peak_bytes

    def __len__(self) -> int:
        """Number of live storages counted."""
        with self._lock:
            return sum(1 for e in self._entries.values() if e.counted)

    def __contains__(self, storage: object) -> bool:
        """Whether ``storage`` is counted right now."""
        entry = self._entries.get(id(storage))
        return entry is not None and entry.counted and entry.ref() is storage

    def _new_entry(self, storage: torch.UntypedStorage, key: int, nbytes: int, *, counted: bool) -> _Entry:
        ref = weakref.ref(storage, functools.partial(self._on_free, key))
        return _Entry(ref=ref, nbytes=nbytes, counted=counted)

    def _on_free(self, key: int, ref: weakref.ref) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or entry.ref is not ref:
                return  # replaced by a newer storage with the same id, or cleared
            del self._entries[key]
            if entry.counted:
                self._current_bytes -= entry.nbytes
                assert self._current_bytes >= 0, f"ledger went negative: {self._current_bytes}"
