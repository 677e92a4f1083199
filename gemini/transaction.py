"""`StepTransaction`: the last good copies of what an optimizer step changes, kept until the
whole step has succeeded.

[Note: a step is all or nothing]
An optimizer step changes parameters, Adam's m and v and the step counts of every chunk group,
and for groups whose states live on NVMe it reads and writes files while it goes. A read error,
a full disk or an allocation that fails part-way must not leave some groups stepped and others
not (a retry would step the first ones twice). So the step runs in an order where everything
that can fail either happens before anything changes, or can be undone:

1. Checks and moves that change no value: the budget checks, every group's chunks brought
   to the tier of its update, the gradient norm, and every temporary the in-memory update
   needs (see ``HybridAdam._prepare``).
2. The groups on NVMe, streamed (gemini/nvme_tier.py). Their files from before the step are
   held (see [Note: file slots] in chunks/chunk.py): new bytes go to a second file. Before a
   group is updated, its parameter chunk (the only in-memory data its update changes: under
   fp32 the master, under bf16/fp16 the low-precision copy cast from the master) and its step
   counts are copied aside in host memory. Any error here restores those copies and the held
   files, so every group is as before the step.
3. The groups in memory, updated only once every NVMe write has been confirmed. Nothing in
   this phase allocates or does I/O, so it cannot fail part-way.
4. Commit: the held files and the copies aside are dropped.

The copies aside use host memory (the parameter bytes of the groups on NVMe) for the length of
the step; the ledger counts them under the kind ``"step_undo"``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import torch

from chunks import Chunk, ChunkGroup, ChunkStorage, Tier

logger = logging.getLogger(__name__)

__all__ = ["UNDO_KIND", "StepTransaction"]

UNDO_KIND = "step_undo"  # the ledger's kind for the copies aside


class StepTransaction:
    """What one step must be able to put back; see [Note: a step is all or nothing]."""

    def __init__(self, storage: ChunkStorage) -> None:
        self._storage = storage
        self._held: list[Chunk] = []
        self._saved: list[tuple[Chunk, torch.Tensor]] = []  # (chunk, host copy of its used part)
        self._steps: list[tuple[ChunkGroup, torch.Tensor, bool]] = []
        self._undo: list[Callable[[], None]] = []  # small state (loss scaler, counters), restored last first
        self._open = True

    # ------------------------------------------------------------------------- recording
    def hold_files(self, chunks: Iterable[Chunk]) -> None:
        """Keep the files of ``chunks`` (on NVMe) as they are until the step ends."""
        for c in chunks:
            c.hold_file()
            self._held.append(c)

    def save_values(self, group: ChunkGroup, chunks: Iterable[Chunk]) -> None:
        """Before ``group`` is updated: copy its step counts and ``chunks`` (in memory) aside."""
        self._steps.append((group, group.steps.clone(), group.steps_uniform))
        storage = self._storage
        for c in chunks:
            n = c.used_numel
            copy = storage.alloc(Tier.HOST, n, c.dtype, kind=UNDO_KIND)
            try:
                if c.is_on(Tier.HOST):
                    copy.copy_(c.used(Tier.HOST))
                else:
                    event = storage.copy_(copy, c.used(Tier.DEVICE), src=Tier.DEVICE, dst=Tier.HOST)
                    if event is not None:
                        event.synchronize()  # the update must not overwrite it before it is read
            except BaseException:
                storage.free(Tier.HOST, copy, kind=UNDO_KIND)
                raise
            self._saved.append((c, copy))

    def on_rollback(self, restore: Callable[[], None]) -> None:
        """Run ``restore`` if the step fails (after the chunks are put back)."""
        self._undo.append(restore)

    # --------------------------------------------------------------------------- ending
    def commit(self) -> None:
        """The whole step succeeded: drop the held files and the copies aside."""
        self._check_open()
        self._free_saved()
        for c in self._held:
            try:
                c.release_held_file()
            except Exception as e:  # the step has landed: an old file left behind costs only disk
                logger.warning("could not delete the pre-step NVMe file of %s: %s", c, e)
        self._held.clear()

    def rollback(self) -> None:
        """The step failed: every recorded value and file back as it was before the step."""
        self._check_open()
        for c, copy in reversed(self._saved):
            n = c.used_numel
            for tier in c.tiers:
                if tier is Tier.HOST:
                    c.payload(Tier.HOST)[:n].copy_(copy)
                else:
                    event = self._storage.copy_(c.payload(tier)[:n], copy, src=Tier.HOST, dst=tier)
                    if event is not None:
                        event.synchronize()  # before the copy goes back to the pool
        for group, steps, uniform in reversed(self._steps):
            group.steps = steps
            group.steps_uniform = uniform
        self._free_saved()
        for c in self._held:
            c.restore_held_file()
        self._held.clear()
        for restore in reversed(self._undo):
            restore()

    def _free_saved(self) -> None:
        for c, copy in self._saved:
            self._storage.free(Tier.HOST, copy, kind=UNDO_KIND)
        self._saved.clear()
        self._steps.clear()

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError("this StepTransaction has already been committed or rolled back")
        self._open = False
