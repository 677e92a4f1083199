"""`NvmeTier`: the step's pipeline over the optimizer-state chunk groups that live in NVMe files (which groups:
see [Note: what goes to NVMe] in gemini/policies/nvme_choice.py).

[Note: the NVMe step pipeline]
For the groups on NVMe, the step is a pipeline over groups i = 0, 1, ...: the reads of groups i+1 .. i+depth are
in flight while CPU Adam updates group i, and the writes of groups i-depth .. i-1 drain behind it. The first reads
start when ``step()`` begins, so they overlap the gradient norm and the update of the groups resident in memory.
The pipeline holds at most ``2 * depth + 1`` groups' offloaded chunks in host memory; ``cpu_memory`` budgets it.
Any failure undoes the whole step, the pre-step files having been held: nothing is half-applied, and a retry
reads the same files ([Note: a step is all or nothing] in gemini/engine/transaction.py).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from chunks import Chunk, ChunkGroup, ChunkManager, ChunkState, Tier
from gemini.policies.nvme_choice import (NvmeLayout, choose_nvme_groups, forced_count, offloaded_bytes,
                                         shallower_pipeline, undo_ratio)
from offload import format_size
from offload.profiling import trace_range

if TYPE_CHECKING:
    from gemini.engine.transaction import StepTransaction

logger = logging.getLogger(__name__)

__all__ = ["NvmeTier"]


class NvmeTier:
    """Keeps the chosen groups' offloadable chunks in NVMe files and streams them through the step."""

    def __init__(self, manager: ChunkManager, *, cpu_memory: int | None, fraction: float, depth: int) -> None:
        self.manager = manager
        self.storage = manager.storage
        self.cpu_memory = cpu_memory
        self.fraction = fraction
        self.depth = depth
        self.layout = NvmeLayout(frozenset(), 0, 0, 0, depth)
        self.groups: set[int] = set()  # groups whose offloadable chunks live in files
        self._planned: frozenset[int] = frozenset()  # admitted to NVMe while being registered
        self._spilling: deque[Chunk] = deque()
        self._closed = False
        self._warned_depth = False

    @property
    def available(self) -> bool:
        return self.storage.nvme is not None

    @staticmethod
    def chunks_of(group: ChunkGroup) -> tuple[Chunk, ...]:
        """The chunks of ``group`` that live on NVMe (see [Note: what goes to NVMe] in gemini/policies/nvme_choice.py)."""
        return tuple(c for c in (group.master, group.exp_avg, group.exp_avg_sq) if c is not None)

    def holds(self, group: ChunkGroup) -> bool:
        return group.index in self.groups

    # --------------------------------------------------------------------------- choosing
    def plan(self, os_bytes: Sequence[tuple[int, int]]) -> NvmeLayout:
        layout = choose_nvme_groups(os_bytes, cpu_memory=self.cpu_memory, fraction=self.fraction, depth=self.depth,
                                    nvme_available=self.available, undo_ratio=undo_ratio(self.manager.param_dtype))
        warning = shallower_pipeline(layout, cpu_memory=self.cpu_memory, wanted=self.depth)
        if warning is not None and not self._warned_depth:  # chosen again at every rebalance: said once
            self._warned_depth = True
            logger.warning(warning)
        if os_bytes and self.fraction > 0 and not forced_count(self.fraction, len(os_bytes)):
            logger.warning("GeminiConfig.nvme_offload_fraction=%s of %d chunk group(s) on the host is no whole group: "
                           "none goes to NVMe for it (raise it, or lower chunk_size for more, smaller groups)",
                           self.fraction, len(os_bytes))
        return layout

    def plan_registration(self, layout: Iterable[tuple[list[int], int, int]], *,
                          on_device: Collection[int] = frozenset()) -> None:
        """Before registration: choose from the layout among the trainable groups but ``on_device`` (those whose
        optimizer states the placement keeps on the device from the layout alone: counting them, e.g. under static,
        would refuse host budgets they never use)."""
        layout = list(layout)
        trainable = [i for i, (_, pg, _) in enumerate(layout) if pg >= 0 and i not in on_device]
        self.layout = self.plan(offloaded_bytes(layout, trainable, self.manager.param_dtype, world=self.manager.world))
        self._planned = self.layout.nvme_groups
        self._log()

    def admit(self, group: ChunkGroup) -> None:
        """A group was just built: start writing it out if it was planned for NVMe.

        Writes run behind registration, at most ``3 * depth`` chunks at once, so host memory holds a few groups'
        states at a time however large the model.
        """
        if group.index not in self._planned:
            return
        for chunk in self.chunks_of(group):
            chunk.start_spill()
            self._spilling.append(chunk)
        self.groups.add(group.index)
        while len(self._spilling) > 3 * self.layout.depth:
            self._spilling.popleft().finish_spill()

    def finish_registration(self) -> None:
        while self._spilling:
            self._spilling.popleft().finish_spill()
        self.storage.pool.trim()  # the spilled groups' buffers go back to the system

    def rebalance(self, host_groups: Sequence[ChunkGroup]) -> None:
        """Choose again among the groups whose optimizer states are on the host tier now (after auto's margin or
        static took some onto the device), and move groups between host memory and NVMe to match."""
        if self._closed:
            return
        layout = self.plan([(g.index, sum(c.nbytes for c in self.chunks_of(g))) for g in host_groups])
        self.layout = layout
        for g in self.manager.trainable_groups:
            if g.index in self.groups and g.index not in layout.nvme_groups:
                self.bring_back(g)
        for g in host_groups:
            if g.index in layout.nvme_groups and g.index not in self.groups:
                self._send_out(g)
        self.storage.pool.trim()
        self._log()

    def bring_back(self, group: ChunkGroup) -> None:
        """Read ``group``'s chunks back into host memory for good (it leaves the NVMe tier)."""
        if group.index not in self.groups:
            return
        self._load(group)
        for c in self.chunks_of(group):
            c.delete_files()
        self.groups.discard(group.index)

    def _send_out(self, group: ChunkGroup) -> None:
        # In the tier before the first write: a chunk whose write fails stays in host memory, and the step streams a
        # group whatever mix of file and memory it has.
        self.groups.add(group.index)
        for c in self.chunks_of(group):
            c.move_to(Tier.HOST)
            c.start_spill()
        self._finish_spills(self.chunks_of(group))

    def _log(self) -> None:
        if self.layout.nvme_groups:
            logger.info(
                "NVMe tier: %d chunk groups' optimizer states in files (%s), %s kept in host memory, pipeline "
                "staging up to %s; the step's copies of their parameters: %s", len(self.layout.nvme_groups),
                format_size(self.layout.nvme_bytes), format_size(self.layout.host_bytes),
                format_size(self.layout.staging_bytes),
                f"NVMe files, {format_size(self.layout.undo_bytes)} in host memory at a time"
                if self.layout.undo_on_nvme else f"{format_size(self.layout.undo_bytes)} in host memory",
            )

    # -------------------------------------------------------------------------- streaming
    def _start_load(self, group: ChunkGroup) -> None:
        for c in self.chunks_of(group):
            if c.state is ChunkState.NVME and not c.io_pending:
                c.start_load()

    def _load(self, group: ChunkGroup) -> None:
        """Bring every chunk of ``group`` into host memory (HOST, or HOST_AND_NVME if it was in its file). If one
        read fails, the others end too (none is left in flight) and the group stays in its files."""
        try:
            self._start_load(group)
            for c in self.chunks_of(group):
                c.finish_io()
        except BaseException:
            self._settle((), [group])
            raise

    def begin_step(self, groups: Sequence[ChunkGroup], tx: StepTransaction) -> None:
        """Before a step changes anything: write out chunks an earlier failed write left in host memory, then hold
        every file of ``groups`` until the step ends ([Note: a step is all or nothing] in
        gemini/engine/transaction.py)."""
        self._check_open()
        chunks = [c for g in groups for c in self.chunks_of(g)]
        unwritten = [c for c in chunks if c.state is ChunkState.HOST]
        for c in unwritten:
            c.start_spill()
        try:
            for c in unwritten:
                c.finish_spill()
        finally:
            for c in unwritten:
                if c.io_pending:  # after an error: let the others end, keeping what they leave
                    try:
                        c.finish_spill()
                    except Exception as e:
                        logger.error("NVMe write of %s failed; it stays in host memory: %s", c, e)
        tx.hold_files(chunks)

    def prefetch(self, groups: Sequence[ChunkGroup]) -> None:
        """Start reading the first ``layout.depth`` of ``groups`` (the step calls this first thing)."""
        self._check_open()
        for g in groups[: self.layout.depth]:
            self._start_load(g)

    def stream(self, groups: Sequence[ChunkGroup]) -> Iterator[ChunkGroup]:
        """Yield each of ``groups`` with its states in host memory, free to be modified, and write it back after
        the caller is done with it. See [Note: the NVMe step pipeline]."""
        self._check_open()
        groups = list(groups)
        writing: deque[ChunkGroup] = deque()
        try:
            for k, g in enumerate(groups):
                for ahead in groups[k: k + self.layout.depth + 1]:
                    self._start_load(ahead)
                self._load(g)
                for c in self.chunks_of(g):
                    if c.state is ChunkState.HOST_AND_NVME:
                        c.drop_nvme_copy()  # about to be updated: the file goes stale
                with trace_range("gemini::nvme_update"):
                    yield g
                for c in self.chunks_of(g):
                    c.start_spill()
                writing.append(g)
                while len(writing) > self.layout.depth:
                    self._finish_writes(writing.popleft())
            while writing:
                self._finish_writes(writing.popleft())
        finally:
            # Stopped by an error: let every request in flight end, keeping what it leaves.
            self._settle(writing, groups)

    def _finish_writes(self, group: ChunkGroup) -> None:
        for c in self.chunks_of(group):
            c.finish_io()

    def settle(self, groups: Sequence[ChunkGroup] = ()) -> None:
        """End every request in flight on ``groups``: reads are finished and their host copies dropped (the files
        are current), writes are waited for. Errors are logged, not raised: a chunk whose write failed stays in
        host memory."""
        self._settle((), groups)

    def _settle(self, writing: Iterable[ChunkGroup], groups: Iterable[ChunkGroup]) -> None:
        for g in [*writing, *groups]:
            for c in self.chunks_of(g):
                try:
                    c.finish_io()
                except Exception as e:  # a failed write keeps its host copy, a failed read its file
                    logger.error("NVMe I/O of %s failed (a failed write keeps the chunk in host memory, a failed read "
                                 "changes nothing): %s", c, e)
                if c.state is ChunkState.HOST_AND_NVME:
                    c.drop_host_copy()

    @contextlib.contextmanager
    def resident(self, group: ChunkGroup, *, modify: bool, chunks: Sequence[Chunk] | None = None,
                 overwrite: bool = False) -> Iterator[None]:
        """``group``'s states in host memory for the block (checkpoints); written back after it if ``modify``,
        else just dropped (the files are current). ``chunks``: only these of the group's chunks (save_pretrained
        reads only the masters). ``overwrite``: the block writes every element of ``chunks``, so their files are
        not read (loading a checkpoint over a corrupted file works)."""
        if group.index not in self.groups:
            yield
            return
        self._check_open()
        chunks = self.chunks_of(group) if chunks is None else tuple(chunks)
        try:
            for c in chunks:
                if c.state is ChunkState.NVME and not c.io_pending:
                    if overwrite:
                        c.overwrite_file()
                    else:
                        c.start_load()
            for c in chunks:
                c.finish_io()
        except BaseException:
            self._settle((), [group])  # end the other reads in flight: none is left pending
            raise
        if modify:
            for c in chunks:
                if c.state is ChunkState.HOST_AND_NVME:
                    c.drop_nvme_copy()
        try:
            yield
        finally:
            for c in chunks:
                if c.state is ChunkState.HOST:
                    c.start_spill()
            self._finish_spills(chunks)

    @staticmethod
    def _finish_spills(chunks: Sequence[Chunk]) -> None:
        """Wait for every write of ``chunks`` (a failed one keeps its host copy), then raise the first error: no
        write is left in flight to fail a later, unrelated call."""
        error = None
        for c in chunks:
            try:
                if c.io_pending:
                    c.finish_spill()
                elif c.state is ChunkState.HOST_AND_NVME:
                    c.drop_host_copy()
            except Exception as e:
                error = error or e
        if error is not None:
            raise error

    # ---------------------------------------------------------------------------- closing
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the optimizer was closed: its NVMe files are deleted, with what lived only there (the "
                               "optimizer states, and under bf16/fp16 the fp32 masters state_dict() and save_pretrained "
                               "read). Save before optimizer.close(): model.state_dict(), gemini.save_checkpoint or "
                               "gemini.save_pretrained")

    def close(self) -> None:
        """Delete every file. States that lived only on NVMe are gone after this."""
        if self._closed:
            return
        self._closed = True
        self.settle([self.manager.groups[i] for i in sorted(self.groups)])
        self.storage.close_nvme()
