"""`LoadTransaction`: a checkpoint load that lands whole or not at all.

[Note: a load is all or nothing]
A load writes the masters (so the parameters), m, v and step counts of every chunk group, the module's buffers and
the param groups' values. Every check (shapes, layout, flags) runs before anything is written, but writes of
groups whose states live on NVMe can still fail part-way (a full disk, an I/O error). So a load runs in the step's
order, with its machinery ([Note: a step is all or nothing] in gemini/engine/transaction.py):

1. The groups on NVMe are written now (``write``), each after its files are held and what it keeps in memory (step
   counts, the parameter chunk: under fp32 the masters) is copied aside. A chunk the load overwrites whole is not
   read first, so loading over a lost or corrupted file repairs it. Any failure puts back the copies and the held
   files: nothing was loaded.
2. Only once every file write is confirmed: everything in memory (other groups, buffers, hyper-state: registered
   with ``later``), which cannot fail part-way; a Ctrl-C meanwhile is held until it is done. Then the held files
   and the copies aside are dropped.

``load_checkpoint`` runs the model's and the optimizer's loads in one transaction, so an optimizer part that
cannot be written leaves the model as it was too. The copies aside cost what a step's do, for the load's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from chunks import Chunk, ChunkGroup, ChunkState
from gemini.engine.interrupts import HeldInterrupt
from gemini.engine.transaction import StepTransaction

if TYPE_CHECKING:
    from gemini.engine.runtime import GeminiRuntime

__all__ = ["LoadTransaction"]


class LoadTransaction:
    """A context for one load: see [Note: a load is all or nothing]."""

    def __init__(self, rt: GeminiRuntime) -> None:
        nvme = rt.nvme
        self._nvme = nvme if nvme is not None and nvme.groups else None
        self._tx = StepTransaction(rt.storage, undo_on_nvme=self._nvme is not None and nvme.layout.undo_on_nvme)
        self._guarded: set[int] = set()  # NVMe groups whose files are held and memory copied aside
        self._later: list[Callable[[], None]] = []

    def write(self, group: ChunkGroup, write: Callable[[], None], *, chunks: Sequence[Chunk] | None = None,
              overwrite: bool = False) -> None:
        """``write()`` writes values of ``group``: now if the group lives on NVMe, with ``chunks`` of its NVMe
        states in host memory (``overwrite``: ``write`` sets all their elements, so their files are not read);
        else in phase 2."""
        if self._nvme is None or not self._nvme.holds(group):
            self._later.append(write)
            return
        if group.index not in self._guarded:
            self._guarded.add(group.index)
            self._nvme.begin_step([group], self._tx)  # its files held (unwritten chunks written first)
            for chunk in (group.param, group.param_shard):
                if chunk is not None and chunk.state is not ChunkState.RELEASED and not chunk.in_file:
                    self._tx.save_values(group, chunk, 0, chunk.used_numel)
        with self._nvme.resident(group, modify=True, chunks=chunks, overwrite=overwrite):
            write()

    def later(self, write: Callable[[], None]) -> None:
        """``write()`` writes memory only: it runs in phase 2."""
        self._later.append(write)

    def __enter__(self) -> LoadTransaction:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            self._tx.rollback()
            return False
        interrupt = HeldInterrupt()
        interrupt.hold()
        try:
            for write in self._later:
                write()
        finally:
            self._tx.commit()  # the files written are the groups' now
            interrupt.release()
        return False
