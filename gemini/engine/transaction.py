"""`StepTransaction`: the last good copies of what an optimizer step changes, kept until the whole step succeeded.

[Note: a step is all or nothing]
An optimizer step changes the parameters, Adam's m and v and the step counts of every chunk group, and for groups
whose states live on NVMe it reads and writes files as it goes. A read error, a full disk or a failed allocation
part-way must not leave some groups stepped and others not (a retry would step the first ones twice). So the step
runs in an order where everything that can fail either happens before anything changes, or can be undone:

1. Checks and moves that change no value: the budget checks, every group's chunks brought to the tier of its
   update, the gradient norm, and every temporary the in-memory update needs (see gemini/optim/adam_batches.py).
2. The groups on NVMe, streamed (gemini/engine/nvme_tier.py). Their pre-step files are held, new bytes going to
   a second file ([Note: file slots] in chunks/chunk_file.py). Before a group is updated, its parameter chunk (the
   only in-memory data its update changes: under fp32 the master, under bf16/fp16 the low-precision copy cast from
   the master) and its step counts are copied aside in host memory. Any error here, or in phase 1 once the first
   reads are in flight, restores those copies and the held files (a request still in flight ends first), so every
   group is as before the step.
3. The groups in memory, updated only once every NVMe write is confirmed. Nothing here allocates or does I/O, so
   it cannot fail part-way; a Ctrl-C is held until the step completes
   ([Note: Ctrl-C during the in-memory update] in gemini/engine/interrupts.py).
4. Commit: the held files and the copies aside are dropped.

The copies aside use host memory (the parameter bytes of the groups on NVMe) for the step's length, counted in the
ledger under the kind ``"step_undo"``. Where ``cpu_memory`` cannot hold them next to everything else, they go to
NVMe files instead, one in memory at a time (``NvmeLayout.undo_on_nvme``), read back only to undo a failed step.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from chunks import Chunk, ChunkGroup, ChunkStorage, Tier
from gemini.engine.interrupts import HeldInterrupt

logger = logging.getLogger(__name__)

__all__ = ["UNDO_KIND", "StepTransaction"]

UNDO_KIND = "step_undo"  # the ledger's kind for the copies aside


class StepTransaction:
    """What one step must be able to put back; see [Note: a step is all or nothing].

    ``undo_on_nvme``: the copies aside go to NVMe files (``cpu_memory`` cannot hold them all, see
    :class:`gemini.policies.nvme_choice.NvmeLayout`): one is in host memory at a time, while its write runs behind
    the group's update; the files are read only to undo a failed step.
    """

    def __init__(self, storage: ChunkStorage, *, undo_on_nvme: bool = False) -> None:
        self._storage = storage
        self._undo_on_nvme = undo_on_nvme
        self._held: list[Chunk] = []
        self._saved: list[_Saved] = []  # copies aside in host memory
        self._writing: tuple[_Saved, object] | None = None  # a copy being written, and its future
        self._on_disk: list[_Saved] = []  # copies in files (their ``copy`` is None)
        self._steps: list[tuple[ChunkGroup, torch.Tensor, bool]] = []
        self._undo: list[Callable[[], None]] = []  # small state (loss scaler, counters), restored last first
        self._open = True

    # ------------------------------------------------------------------------- recording
    def hold_files(self, chunks: Iterable[Chunk]) -> None:
        """Keep the files of ``chunks`` (on NVMe) as they are until the step ends."""
        for c in chunks:
            c.hold_file()
            self._held.append(c)

    def save_values(self, group: ChunkGroup, chunk: Chunk, start: int, numel: int) -> None:
        """Before ``group`` is updated, copy aside its step counts and elements ``start`` .. ``start + numel`` of
        ``chunk`` (in memory: what the update changes there)."""
        observer = self._storage.observer  # host memory (see [Note: step counts are where the states are])
        with observer.quiet() if observer is not None else contextlib.nullcontext():
            self._steps.append((group, group.steps.clone(), group.steps_uniform))
        self._finish_write()  # the previous copy is in its file: its memory goes first
        storage = self._storage
        copy = storage.alloc(Tier.HOST, numel, chunk.dtype, kind=UNDO_KIND)
        try:
            if chunk.is_on(Tier.HOST):
                copy.copy_(chunk.payload(Tier.HOST)[start:start + numel])
            else:
                event = storage.copy_(copy, chunk.payload(Tier.DEVICE)[start:start + numel], src=Tier.DEVICE,
                                      dst=Tier.HOST)
                if event is not None:
                    event.synchronize()  # the update must not overwrite it before it is read
        except BaseException:
            storage.free(Tier.HOST, copy, kind=UNDO_KIND)
            raise
        saved = _Saved(chunk, start, numel, copy)
        if self._undo_on_nvme:
            self._writing = (saved, storage.nvme_write(saved.key, copy))
        else:
            self._saved.append(saved)

    def _finish_write(self) -> None:
        """Wait for the copy being written; on success its memory is freed, on failure it stays a copy in memory
        and the error is raised (the step fails, and undoes itself from it)."""
        if self._writing is None:
            return
        saved, future = self._writing
        self._writing = None
        try:
            self._storage.nvme_wait(future, key=saved.key, kind=UNDO_KIND, nbytes=saved.nbytes, write=True)
        except BaseException:
            self._saved.append(saved)
            raise
        self._storage.free(Tier.HOST, saved.copy, kind=UNDO_KIND)
        saved.copy = None
        self._on_disk.append(saved)

    def on_rollback(self, restore: Callable[[], None]) -> None:
        """Run ``restore`` if the step fails (after the chunks are put back)."""
        self._undo.append(restore)

    # --------------------------------------------------------------------------- ending
    def commit(self) -> None:
        """The whole step succeeded: drop the held files and the copies aside."""
        self._check_open()
        try:
            self._finish_write()
        except Exception as e:  # the step has landed: the copy is no longer needed
            logger.warning("writing a copy of parameters aside failed after the step landed: %s", e)
        self._free_saved()
        for c in self._held:
            try:
                c.release_held_file()
            except Exception as e:  # the step has landed: an old file left behind costs only disk
                logger.warning("could not delete the pre-step NVMe file of %s: %s", c, e)
        self._held.clear()

    def rollback(self) -> None:
        """The step failed: every recorded value and file back as it was before the step.

        Raises only if a copy aside in a file cannot be read back (a second fault): then that chunk's parameters
        are not restored, and the error says so. A Ctrl-C meanwhile waits until everything is back
        ([Note: Ctrl-C during an undo] in gemini/engine/interrupts.py)."""
        self._check_open()
        interrupt = HeldInterrupt(said="received while a failed optimizer step or load was being undone: the undo "
                                       "was completed first (everything is as before it)")
        interrupt.hold()
        try:
            self._restore()
        except BaseException:
            interrupt.release(deliver=False)
            raise
        interrupt.release()

    def _restore(self) -> None:
        with contextlib.suppress(Exception):  # its copy stays in memory either way
            self._finish_write()
        for saved in reversed(self._saved):
            self._write_back(saved, saved.copy)
        lost = []
        for saved in reversed(self._on_disk):
            buffer = self._storage.alloc(Tier.HOST, saved.numel, saved.chunk.dtype, kind=UNDO_KIND)
            try:
                future = self._storage.nvme_read(saved.key, buffer)
                self._storage.nvme_wait(future, key=saved.key, kind=UNDO_KIND, nbytes=saved.nbytes, write=False)
                self._write_back(saved, buffer)
            except Exception as e:
                lost.append((saved.chunk, e))
            finally:
                self._storage.free(Tier.HOST, buffer, kind=UNDO_KIND)
        for group, steps, uniform in reversed(self._steps):
            group.steps = steps
            group.steps_uniform = uniform
        self._free_saved()
        self._on_disk.clear()
        for c in self._held:
            # A request the failed step left in flight (a prefetch before the stream began, a write behind it) ends
            # first; whatever it read or wrote is dropped with the new file.
            with contextlib.suppress(Exception):
                c.finish_io()
            c.restore_held_file()
        self._held.clear()
        for restore in reversed(self._undo):
            restore()
        if lost:
            raise RuntimeError(
                f"the failed step could not be undone for {len(lost)} chunk(s): their parameters could not be read "
                f"back ({lost[0][0]}: {lost[0][1]}); they hold the failed step's values: load the last checkpoint"
            ) from lost[0][1]

    def _write_back(self, saved: _Saved, values: torch.Tensor) -> None:
        chunk, start, n = saved.chunk, saved.start, saved.numel
        for tier in chunk.tiers:
            if tier is Tier.HOST:
                chunk.payload(Tier.HOST)[start:start + n].copy_(values)
            else:
                event = self._storage.copy_(chunk.payload(tier)[start:start + n], values, src=Tier.HOST, dst=tier)
                if event is not None:
                    event.synchronize()  # before the copy goes back to the pool

    def _free_saved(self) -> None:
        for saved in self._saved:
            self._storage.free(Tier.HOST, saved.copy, kind=UNDO_KIND)
        self._saved.clear()
        self._steps.clear()

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("this StepTransaction has already been committed or rolled back")
        self._open = False


@dataclass
class _Saved:
    """A range of a chunk copied aside: in host memory (``copy``) or in its NVMe file."""

    chunk: Chunk
    start: int
    numel: int
    copy: torch.Tensor | None

    @property
    def key(self) -> tuple[str, str, int]:
        return (UNDO_KIND, self.chunk.kind.value, self.chunk.index)

    @property
    def nbytes(self) -> int:
        return self.numel * self.chunk.dtype.itemsize
