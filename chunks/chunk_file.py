"""`ChunkFile`: a chunk's file in the NVMe store — its two names, which one holds the chunk's
bytes, and the read or write of it in flight.

It names files and issues requests only; :class:`chunks.chunk.Chunk` decides when, and its
state machine guards every call (see [Note: NVMe moves are two-phase] in chunks/chunk.py).
"""

from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from chunks.kind import ChunkKind
from chunks.storage import ChunkStorage

__all__ = ["ChunkFile", "PendingIo"]


@dataclass
class PendingIo:
    future: Future
    write: bool
    buffer: torch.Tensor  # the host payload being written, or being read into
    slot: int = 0  # the file slot written to or read from (see [Note: file slots])


# [Note: file slots]
# A chunk has two names in the NVMe store, (kind, index, 0) and (kind, index, 1). Outside a
# step every write replaces the file under the current name (the store swaps the file in
# only once the write is complete, so a failed write keeps the old one). A step that must
# be all or nothing (see [Note: a step is all or nothing] in
# gemini/engine/transaction.py) first calls
# ``hold_file()``: its write then goes to the other name, and the held file keeps the bytes
# from before the step until ``release_held_file()`` (the step is complete: the held file
# is deleted) or ``restore_held_file()`` (it failed: the chunk goes back to the held file,
# whatever was read, updated or written since). Disk use is 2x for the chunks written in
# a step until it ends.
class ChunkFile:
    """The file of chunk ``index`` of ``kind`` (see [Note: file slots])."""

    def __init__(self, storage: ChunkStorage, kind: ChunkKind, index: int) -> None:
        self._storage = storage
        self._kind = kind
        self._index = index
        # Which of the two names holds the chunk's bytes, and the one a step keeps until it
        # commits (None outside a step).
        self.slot = 0
        self.held: int | None = None
        self.pending: PendingIo | None = None

    def key(self, slot: int | None = None) -> tuple[str, int, int]:
        """The name in the NVMe store of ``slot`` (default: the current one)."""
        return (self._kind.value, self._index, self.slot if slot is None else slot)

    def start_write(self, buffer: torch.Tensor) -> None:
        # A held file must survive: the first write after hold() goes to the other name.
        slot = 1 - self.slot if self.held == self.slot else self.slot
        future = self._storage.nvme_write(self.key(slot), buffer)
        self.pending = PendingIo(future, write=True, buffer=buffer, slot=slot)

    def start_read(self, buffer: torch.Tensor) -> None:
        future = self._storage.nvme_read(self.key(), buffer)
        self.pending = PendingIo(future, write=False, buffer=buffer, slot=self.slot)

    def take(self, *, write: bool) -> PendingIo:
        """The request in flight, taken off :attr:`pending`; it must be a write (``write``) or a read."""
        pending = self.pending
        if pending is None or pending.write != write:
            # Worded as the chunk's other errors (chunks/chunk.py: ``{self.index=}``).
            what = "write" if write else "read"
            raise RuntimeError(f"chunk {self._kind.value} self.index={self._index} has no NVMe {what} in flight")
        self.pending = None
        return pending

    def wait(self, pending: PendingIo, *, nbytes: int) -> None:
        """Wait for ``pending`` (taken off :attr:`pending`), raising its error; a written name
        becomes the current one."""
        try:
            self._storage.nvme_wait(pending.future, key=self.key(pending.slot), kind=self._kind, nbytes=nbytes,
                                    write=pending.write)
        except BaseException:
            if not pending.future.done():
                # Interrupted (Ctrl-C) while the request runs: it still reads into or writes
                # from the buffer, which the caller frees or changes next. Let it end first.
                concurrent.futures.wait([pending.future])
            raise
        if pending.write:
            self.slot = pending.slot

    def hold(self) -> None:
        self.held = self.slot

    def release_held(self) -> None:
        """Stop holding; delete the held file if a newer one replaced it."""
        held, self.held = self.held, None
        if held is not None and held != self.slot:
            self._storage.nvme_delete(self.key(held), wait=False)  # behind the next forward

    def restore(self, held: int) -> None:
        """Make ``held`` (taken off :attr:`held`) the current name again, deleting a newer file."""
        if held != self.slot:
            self._storage.nvme_delete(self.key())
            self.slot = held

    def delete(self) -> None:
        """Delete the files under both names (a stale one too)."""
        for slot in (0, 1):
            self._storage.nvme_delete(self.key(slot))
        self.held = None
