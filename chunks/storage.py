"""The one place that allocates and frees chunk storage, and tells the ledger of every byte.

Every chunk payload is created by :meth:`ChunkStorage.alloc`, freed by :meth:`ChunkStorage.free`
and moved between tiers by :meth:`ChunkStorage.transfer`; files on NVMe are written and read
through :meth:`ChunkStorage.nvme_write` / :meth:`ChunkStorage.nvme_read` and counted when their
I/O is confirmed. Each of them updates the :class:`chunks.MemoryLedger` in the same call (see
[Note: one ledger] in chunks/ledger.py), so the figures in a memory report are sums of what
really happened, never estimates.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import _disable_current_modes

from chunks.ledger import MemoryLedger
from offload import NvmeStore, PinnedHostPool, Tier
from offload.aligned import outside_inference_mode
from offload.profiling import trace_range

if TYPE_CHECKING:
    from chunks.kind import ChunkKind

logger = logging.getLogger(__name__)

__all__ = ["Tier", "ChunkStorage", "StorageObserver", "compute_device"]


@dataclass
class StorageObserver:
    """Keeps a device-memory monitor right about chunk payloads when the CPU stands in for the device.

    ``quiet()`` is entered around host allocations so the monitor never counts them, and
    ``exclude(payload)`` tells it to ignore the new payload whenever operators touch it.
    """

    quiet: Callable[[], AbstractContextManager]
    exclude: Callable[[torch.Tensor], None]
    # A device payload's storage was resized in place (resize_ bypasses the dispatcher).
    resized: Callable[[torch.Tensor], None] = lambda payload: None
    # Whether a dispatch mode is the monitor's: it still sees the moves, which every other mode
    # does not (see [Note: moves unseen by dispatch modes]).
    counts_in: Callable[[object], bool] = lambda mode: False


# [Note: moves unseen by dispatch modes]
# The engine moves chunks from module hooks, which run inside the user's forward: inside
# whatever TorchDispatchMode is active there, selective activation checkpointing's among them
# (``checkpoint(..., context_fn=partial(create_selective_checkpoint_contexts, policy))``). That
# mode numbers every operator it sees by (operator, how many of it came before) in the forward
# and looks each one up by the same number in the recompute. A move's operators (the device
# payload's allocation, the copy, the parameters' slices and views) depend on where the chunks
# are, which under placements that move them ("cpu", "static", "auto") differs between the
# forward and the recompute, run in backward: a block ending in Dropout is recomputed from its
# mask's node, before the backward hooks of its modules fetched their groups, so the recompute
# fetched and re-pointed more than the forward had ("aten.slice.Tensor invocation index 9
# encountered during backward but not found in storage"); a policy saving such an operator
# would have handed the recompute the forward's result instead of running it. Moves are the
# engine's business, not the model's computation, so they run with the dispatch modes taken
# off the stack; only the CPU stand-in's accounting mode, which measures the device, is put
# back (``StorageObserver.counts_in``).
def dispatch_modes_active() -> bool:
    return torch._C._len_torch_dispatch_stack() > 0 or torch._ops._len_torch_dispatch_stack_pre_dispatch() > 0


@contextlib.contextmanager
def unseen_by_dispatch_modes(counts_in: Callable[[object], bool] = lambda mode: False):
    """Run the body with no dispatch mode active but those ``counts_in`` keeps (see [Note: moves
    unseen by dispatch modes])."""
    if not dispatch_modes_active():
        yield
        return
    with _disable_current_modes() as modes, contextlib.ExitStack() as kept:
        for mode in reversed(modes):  # innermost last, as they were
            if counts_in(mode):
                kept.enter_context(_kept(mode))
        yield
    for mode in modes:
        if counts_in(mode) and hasattr(mode, "leave_if_idle"):
            mode.leave_if_idle()  # its last monitor stopped inside: see [Note: a mode kept through a move]


# [Note: a mode kept through a move]
# A move re-enters the modes it keeps on a stack of its own, and the stack before it comes back
# afterwards. A monitor stopped inside the move (an engine collected by a garbage collection that
# one of the move's allocations set off, whose finalizer discards its monitor) popped the kept mode
# from the move's stack: leaving the move then popped an empty stack, and restoring the stack before
# it put the mode back with no monitor (every later operator of the thread went through it). So a
# kept mode is not left while kept; it leaves, if idle, once the stack is restored.
@contextlib.contextmanager
def _kept(mode) -> Iterator[None]:
    mode.kept_depth = getattr(mode, "kept_depth", 0) + 1
    try:
        with mode:
            yield
    finally:
        mode.kept_depth -= 1


@dataclass
class ChunkStorage:
    """Allocator of chunk payloads on the device and host tiers, and of files on NVMe; each
    byte is counted in :attr:`ledger` as it comes and goes.

    With ``device=cpu`` both tiers are CPU memory, and moves are still real copies into
    separate buffers: the CPU stands in for the accelerator, so every policy and report can be
    exercised without a GPU. Host payloads come from a :class:`PinnedHostPool` (page-locked on
    CUDA, 4 KiB-aligned so the NVMe store reads and writes them directly): a freed host payload
    goes back to the pool and serves the next one of its size, so nothing is pinned per step.
    ``nvme`` is the store for chunks offloaded to files (None: no NVMe tier). Each call names
    the chunk ``kind`` whose bytes it moves, so the ledger counts them per kind.
    """

    device: torch.device
    pin_host: bool = False
    ledger: MemoryLedger = field(default_factory=MemoryLedger)
    observer: StorageObserver | None = None
    nvme: NvmeStore | None = None
    # Wraps every move of chunk data onto or off the device: the step's device meter, and
    # while a warm-up traces, its tracer (each splits its measuring intervals there); set
    # through swap_move_watcher().
    _move_watcher: Callable[[], AbstractContextManager] | None = field(default=None, repr=False)

    def swap_move_watcher(self, move_context: Callable[[], AbstractContextManager] | None
                          ) -> Callable[[], AbstractContextManager] | None:
        """Wrap each later move onto or off the device in ``move_context()`` (None: nothing);
        returns the watcher it replaces, for the caller to put back."""
        previous, self._move_watcher = self._move_watcher, move_context
        return previous

    def move_context(self) -> AbstractContextManager:
        """The context one move runs in: the move watcher's (see :meth:`swap_move_watcher`), and
        within it no dispatch mode but the monitor's (see [Note: moves unseen by dispatch modes])."""
        watcher = self._move_watcher() if self._move_watcher is not None else contextlib.nullcontext()
        if not dispatch_modes_active():  # the common case on a GPU: no generator per move
            return watcher
        return self._unseen(watcher)

    @contextlib.contextmanager
    def _unseen(self, watcher: AbstractContextManager) -> Iterator[None]:
        with watcher, self.unseen():
            yield

    def unseen(self) -> AbstractContextManager:
        """No dispatch mode active but the monitor's: for moves, and the chunk work around them
        (ZeRO-3's gathers), see [Note: moves unseen by dispatch modes]."""
        if not dispatch_modes_active():
            return contextlib.nullcontext()
        return unseen_by_dispatch_modes(self.observer.counts_in if self.observer is not None else lambda mode: False)

    def __post_init__(self) -> None:
        self.device = compute_device(self.device)
        # [Note: host copies on CUDA]
        # Host payloads are page-locked on CUDA so that copies are true DMA and can run on a
        # side stream. A CPU-only torch build cannot pin (pin_memory=True raises there), and
        # with the CPU standing in for the device pinning would mean nothing anyway.
        self.pin_host = self.pin_host and self.device.type == "cuda" and torch.cuda.is_available()
        self._copy_stream = (
            torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        )
        self.pool = PinnedHostPool(pin_memory=self.pin_host, on_reserve=self.ledger.count_pool_reserve)
        # key -> (kind, bytes), for files whose write was confirmed
        self._nvme_files: dict[Hashable, tuple[ChunkKind, int]] = {}

    def tier_device(self, tier: Tier) -> torch.device:
        return self.device if tier is Tier.DEVICE else torch.device("cpu")

    def alloc(
        self, tier: Tier, numel: int, dtype: torch.dtype, *, kind: ChunkKind, zero: bool = False,
        shell: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """A new 1-D payload of ``numel`` elements on ``tier``, counted at once.

        ``shell`` is a device payload freed earlier by :meth:`free`: its storage grows back in
        place, so views of it taken before (autograd's saved tensors) see the new data.
        """
        nbytes = numel * dtype.itemsize
        if shell is not None:
            assert tier is Tier.DEVICE and shell.untyped_storage().nbytes() == 0, "shell must be a freed device payload"
            shell.untyped_storage().resize_(nbytes)
            if zero:
                shell.zero_()
            payload = shell
            if self.observer is not None:
                self.observer.resized(payload)
        elif tier is Tier.HOST:
            with self.observer.quiet() if self.observer is not None else contextlib.nullcontext():
                payload = self.pool.acquire(numel, dtype)
                if zero:
                    payload.zero_()
            if self.observer is not None:
                self.observer.exclude(payload)
        else:
            assert tier is Tier.DEVICE, f"no payloads in memory on {tier}"
            make = torch.zeros if zero else torch.empty
            with outside_inference_mode():  # see [Note: buffers made under inference mode] in offload/aligned.py
                payload = make(numel, dtype=dtype, device=self.device)
        self.ledger.add(tier, kind, nbytes)
        return payload

    def free(self, tier: Tier, payload: torch.Tensor, *, kind: ChunkKind) -> None:
        """Release a payload allocated by :meth:`alloc`.

        [Note: device payloads are freed in place]
        A device payload's storage is resized to zero rather than dropped: autograd may hold
        views of it (``F.linear`` saves ``weight.t()``), which would otherwise keep the memory
        alive after the chunk left the device and hand the backward pass the old copy. Freed
        in place, the memory is really returned, the payload can grow back into the same
        storage (``alloc(shell=...)``), and a view used while the chunk is away fails loudly.
        """
        self.ledger.sub(tier, kind, payload.numel() * payload.element_size())
        if tier is Tier.DEVICE:
            payload.untyped_storage().resize_(0)
            if self.observer is not None:
                self.observer.resized(payload)
        else:
            self.pool.release(payload)

    def transfer(
        self, payload: torch.Tensor, src: Tier, dst: Tier, *, kind: ChunkKind, shell: torch.Tensor | None = None,
        defer_device_wait: bool = False,
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """A copy of ``payload`` (on ``src``) newly allocated on ``dst``; the source is kept.

        Returns the copy and, for an asynchronous copy on CUDA, the event that marks its end
        (see :meth:`copy_`).
        """
        assert src is not dst, f"transfer within {src}"
        out = self.alloc(dst, payload.numel(), payload.dtype, kind=kind, shell=shell)
        return out, self.copy_(out, payload, src=src, dst=dst, defer_device_wait=defer_device_wait)

    def copy_(self, out: torch.Tensor, payload: torch.Tensor, *, src: Tier, dst: Tier,
              defer_device_wait: bool = False) -> torch.cuda.Event | None:
        """Copy ``payload`` into ``out`` across tiers, counting the bytes moved.

        [Note: asynchronous copies on CUDA]
        Between the device and pinned host memory the copy runs on a side stream and the host
        does not wait for it: the copy overlaps whatever the host does next (the CPU Adam of
        another chunk group, the rest of the backward pass). Device-side order is kept by
        stream waits: the side stream first waits for the compute stream (the data to copy
        was produced there), and for host-to-device copies the compute stream then waits for
        the side stream, and ``record_stream`` keeps the allocator from reusing the device
        memory early. Host-side order is the returned event's job: the host copy must not be
        read (device-to-host) or written (host-to-device) before it completes, so the chunk
        keeps the event and synchronizes on it before its host copy is next touched. Copies
        from pageable memory (temporaries) and every copy on the CPU stand-in are synchronous
        and return None.

        [Note: a prefetch overlaps compute]
        A prefetch (``defer_device_wait=True``) copies the next period's parameters while the
        current period computes. Had the compute stream waited for the copy stream at once, as
        above, every kernel launched after it (the current period's) would have waited for the
        copy too, and the prefetch would hide nothing. So the wait is left to the chunk: it
        keeps the returned event and has the compute stream wait for it when its device copy is
        first used (``Chunk.ready_on_device``: before its module's compute, and before any
        other read or move of it). The copy stream is recorded on the new device copy, so that
        a copy evicted before its use is not handed out again while the copy still writes it.
        """
        nbytes = payload.numel() * payload.element_size()
        start = time.perf_counter()
        event = None
        host = payload if src is Tier.HOST else out
        with trace_range("gemini::transfer"), self.move_context():
            if self._copy_stream is not None and src is not dst and host.is_pinned():
                current = torch.cuda.current_stream(self.device)
                self._copy_stream.wait_stream(current)
                with torch.cuda.stream(self._copy_stream):
                    out.copy_(payload, non_blocking=True)
                if dst is Tier.DEVICE and defer_device_wait:
                    out.record_stream(self._copy_stream)  # see [Note: a prefetch overlaps compute]
                elif dst is Tier.DEVICE:
                    current.wait_stream(self._copy_stream)
                    out.record_stream(current)
                else:
                    payload.record_stream(self._copy_stream)
                event = torch.cuda.Event()
                event.record(self._copy_stream)
            else:
                out.copy_(payload)
        self.ledger.count_copy(src, dst, nbytes, time.perf_counter() - start)
        return event

    # ------------------------------------------------------------------------------ NVMe
    def _store(self) -> NvmeStore:
        if self.nvme is None:
            raise RuntimeError("this ChunkStorage has no NVMe store (GeminiConfig.nvme_dir is None)")
        return self.nvme

    def nvme_write(self, key: Hashable, payload: torch.Tensor) -> concurrent.futures.Future:
        """Start writing a host payload to the file of ``key``; the payload must stay unchanged
        until :meth:`nvme_wait` on the future returns."""
        return self._store().write(key, payload)

    def nvme_read(self, key: Hashable, out: torch.Tensor) -> concurrent.futures.Future:
        """Start reading the file of ``key`` into the host payload ``out``."""
        return self._store().read(key, out)

    def nvme_wait(self, future: concurrent.futures.Future, *, key: Hashable, kind: ChunkKind, nbytes: int,
                  write: bool) -> None:
        """Wait for a read or write started above; count its bytes once it is confirmed.

        A failed request raises its error (``NvmeStoreError`` / ``NvmeCorruptionError``, which
        name the file and offset) and counts nothing.
        """
        start = time.perf_counter()
        try:
            with trace_range("gemini::nvme_wait"):
                future.result()
        finally:
            self.ledger.transfers.nvme_wait_seconds += time.perf_counter() - start
        self.ledger.count_nvme_io(nbytes, write=write)
        if write and key not in self._nvme_files:
            self._nvme_files[key] = (kind, nbytes)
            self.ledger.add(Tier.NVME, kind, nbytes)

    def nvme_delete(self, key: Hashable, *, wait: bool = True) -> None:
        """Remove the file of ``key``, if there is one (a chunk released for good).

        ``wait=False``: the removal runs behind whatever comes next (an unlink of a large
        file can take milliseconds, more with online discard); requests on ``key`` made later
        still run after it, and a failure is logged (the file only costs disk)."""
        if key in self._nvme_files:
            future = self._store().delete(key)
            self.ledger.sub(Tier.NVME, *self._nvme_files.pop(key))
            if wait:
                future.result()
            else:
                future.add_done_callback(_log_failed_delete)

    def close_nvme(self) -> None:
        """Delete every file and stop the store's I/O threads."""
        if self.nvme is not None:
            self.nvme.close()
            for kind, nbytes in self._nvme_files.values():
                self.ledger.sub(Tier.NVME, kind, nbytes)
            self._nvme_files.clear()


def compute_device(device: torch.device | str) -> torch.device:
    """``device`` with its index where CUDA is meant: a CUDA tensor's device always has one
    (``cuda:0``), and ``torch.device("cuda") != torch.device("cuda", 0)``, so a comparison
    with an unindexed device fails for every tensor."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _log_failed_delete(future: concurrent.futures.Future) -> None:
    if future.cancelled() or future.exception() is None:
        return
    error = future.exception()
    if isinstance(error, RuntimeError) and "cannot schedule new futures" in str(error):
        # The interpreter is exiting (its thread pools refuse work from then on) with this
        # delete still queued: the store's exit finalizer removes the whole folder instead.
        logger.debug("NVMe file delete left to the store's exit cleanup: %s", error)
        return
    logger.warning("could not delete an NVMe file no longer needed: %s", error)
