"""`Chunk`: one flat 1-D buffer holding many tensors as views, and its state machine."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from chunks.chunk_file import ChunkFile
from chunks.edits import ParamEdits
from chunks.kind import ChunkKind
from chunks.layout import TensorSlot
from chunks.state import STATE_OF, ChunkState
from chunks.storage import ChunkStorage, Tier

__all__ = ["ChunkKind", "ChunkState", "TensorSlot", "Chunk"]


def _move(method):
    """Run a move inside the storage's move context (allocation, copy, free and re-point)."""

    @functools.wraps(method)
    def wrapper(self: Chunk, *args, **kwargs):
        with self._storage.move_context():
            return method(self, *args, **kwargs)

    return wrapper


class Chunk:
    """A flat buffer of ``capacity`` elements of one dtype holding tensors as views.

    Moves happen only through the methods below; each checks the current state, does a real
    copy through :class:`ChunkStorage` (which counts the bytes) and records the new state.
    """

    def __init__(self, *, index: int, kind: ChunkKind, capacity: int, dtype: torch.dtype, storage: ChunkStorage,
                 slots: tuple[TensorSlot, ...] = ()) -> None:
        if capacity <= 0:
            raise ValueError(f"{capacity=} must be positive")
        self.index = index
        self.kind = kind
        self.capacity = capacity
        self.dtype = dtype
        self.slots = slots
        self.used_numel = max((s.end for s in slots), default=0)
        # Elements between slots ([Note: aligned slots] in layout.py): zeroed where slots alone write.
        self.has_gaps = sum(s.numel for s in slots) != self.used_numel
        assert self.used_numel <= capacity, f"{self.used_numel=} > {capacity=}"
        self.state = ChunkState.RELEASED
        self._storage = storage
        self._copies: dict[Tier, torch.Tensor] = {}
        # The device payload once freed: its storage grows back in place on the next move to
        # the device (see [Note: device payloads are freed in place] in chunks/storage.py).
        self._device_shell: torch.Tensor | None = None
        # Bumped on every state change: lets callers cache views of the payloads.
        self.version = 0
        # Called after every state change (the manager re-points parameter views).
        self.on_move: Callable[[Chunk], None] | None = None
        # A param chunk's: writes through its parameters (see [Note: writes through the
        # parameters] in chunks/edits.py), looked at on every move.
        self.edits: ParamEdits | None = None
        # Where each copy in memory begins, set at every move: a parameter views its slot in one.
        self.addresses: tuple[int, ...] = ()
        # The NVMe store holds this chunk's current bytes (its file is up to date).
        self._in_file = False
        self._file = ChunkFile(storage, kind, index)
        # An asynchronous copy to or from the host copy still running on CUDA (see [Note:
        # asynchronous copies on CUDA] in chunks/storage.py): waited for before the host copy
        # is touched again.
        self._host_event: torch.cuda.Event | None = None
        # A prefetch still copying to the device ([Note: a prefetch overlaps compute] in storage.py).
        self._device_event: torch.cuda.Event | None = None

    def __repr__(self) -> str:
        return f"Chunk({self.kind.value}#{self.index}, {self.used_numel}/{self.capacity} {self.dtype}, {self.state.value})"

    # ----------------------------------------------------------------------------- queries
    @property
    def nbytes(self) -> int:
        """Bytes of one copy of the payload."""
        return self.capacity * self.dtype.itemsize

    @property
    def tiers(self) -> tuple[Tier, ...]:
        return tuple(self._copies)

    @property
    def key(self) -> tuple[str, int, int]:
        """The name in the NVMe store of the chunk's file (see [Note: file slots] in
        chunks/chunk_file.py)."""
        return self._file.key()

    @property
    def in_file(self) -> bool:
        """The NVMe file holds this chunk's current bytes (NVME or HOST_AND_NVME)."""
        return self._in_file

    @property
    def io_pending(self) -> bool:
        return self._file.pending is not None

    def is_on(self, tier: Tier) -> bool:
        """A copy on ``tier``: a payload in memory, or on NVMe a current file."""
        return self._in_file if tier is Tier.NVME else tier in self._copies

    @property
    def primary_tier(self) -> Tier:
        """The copy that is read by default: the device copy if there is one, else the host's."""
        return Tier.DEVICE if Tier.DEVICE in self._copies else Tier.HOST

    def payload(self, tier: Tier | None = None, *, wait: bool = True) -> torch.Tensor:
        """The whole buffer on ``tier`` (default: :attr:`primary_tier`), the host copy once a copy
        into or out of it has ended (``wait=False``: at once, for views read after :meth:`wait_host`)."""
        if tier is None:
            tier = self.primary_tier
        if tier not in self._copies:
            raise RuntimeError(f"{self.index=} ({self.kind.value}) is {self.state}, no {tier.value} copy")
        if tier is Tier.HOST:
            if wait:  # see [Note: host groups updated as their gradients land] in gemini/optim/adam_batches.py
                self.wait_host()
        else:
            self.ready_on_device()
        return self._copies[tier]

    def copy_in_flight(self, tier: Tier | None) -> bool:
        return tier is Tier.HOST and self._host_event is not None  # an asynchronous copy may use it

    def ready_on_device(self) -> None:
        """Have the compute stream wait for a prefetch into the device copy (if one is running)."""
        if self._device_event is not None:
            self._device_event.wait(torch.cuda.current_stream(self._storage.device))
            self._device_event = None

    def host_copy_pending(self, event: torch.cuda.Event | None) -> None:
        """A copy to or from the host copy made outside the chunk's moves (None: synchronous) is
        waited for before the host copy is next touched, as theirs are."""
        self._host_event = event if event is not None else self._host_event

    def wait_host(self) -> None:
        """Block until a copy into or out of the host copy (if one is running) has ended."""
        if self._host_event is not None:
            self._host_event.synchronize()
            self._host_event = None

    def used(self, tier: Tier | None = None) -> torch.Tensor:
        """The part of the buffer that holds tensors (the padding tail excluded)."""
        return self.payload(tier)[: self.used_numel]

    def view(self, slot: TensorSlot, tier: Tier | None = None) -> torch.Tensor:
        """The tensor of ``slot`` as a view into the payload, in its original shape."""
        return self.payload(tier)[slot.offset : slot.end].view(slot.shape)

    def flat_view(self, slot: TensorSlot, tier: Tier | None = None) -> torch.Tensor:
        return self.payload(tier)[slot.offset : slot.end]

    def write(self, slot: TensorSlot, value: torch.Tensor) -> None:
        """Set ``slot``'s tensor in every copy (keeps HOST_AND_DEVICE copies identical)."""
        self.write_range(slot.offset, value.reshape(-1))

    def write_range(self, offset: int, values: torch.Tensor) -> None:
        """Set ``values.numel()`` elements from ``offset`` in every copy."""
        self._expect(ChunkState.HOST, ChunkState.DEVICE, ChunkState.HOST_AND_DEVICE)
        for payload in self._copies.values():
            payload[offset : offset + values.numel()].copy_(values)

    # ------------------------------------------------------------------------------ moves
    def _expect(self, *allowed: ChunkState) -> None:  # before a move: copies in flight end first
        self.wait_host()
        self.ready_on_device()
        self._expect_state(*allowed)

    def _expect_state(self, *allowed: ChunkState) -> None:  # copies in flight go on: nothing moves
        if self.state not in allowed:
            raise RuntimeError(
                f"chunk {self.kind.value} {self.index=} is {self.state}, expected one of "
                f"{[s.name for s in allowed]}"
            )
        if self._file.pending is not None:
            raise RuntimeError(
                f"chunk {self.kind.value} {self.index=} has an NVMe "
                f"{'write' if self._file.pending.write else 'read'} in flight; finish it first"
            )

    def _set_state(self) -> None:
        self.state = STATE_OF[(Tier.HOST in self._copies, Tier.DEVICE in self._copies, self._in_file)]
        self.version += 1
        self.addresses = tuple(c.data_ptr() for c in self._copies.values())
        if self.on_move is not None:
            self.on_move(self)
        if self.edits is not None:
            self.edits.new()  # carried along by this move (or copied back by keep_edits)

    @_move
    def allocate(self, tier: Tier, *, zero: bool = True) -> None:
        """RELEASED -> HOST or DEVICE: a fresh (zeroed) payload."""
        self._expect(ChunkState.RELEASED)
        shell = self._device_shell if tier is Tier.DEVICE else None
        self._copies[tier] = self._storage.alloc(tier, self.capacity, self.dtype, kind=self.kind, zero=zero,
                                                  shell=shell)
        self._set_state()

    @_move
    def fetch(self, *, keep_host: bool, prefetch: bool = False) -> None:
        """HOST -> HOST_AND_DEVICE (``keep_host``) or DEVICE: copy to the device.

        Keep the host copy when the device copy will only be read (parameters for compute):
        dropping it later then costs no copy back. ``prefetch``: nothing waits for the copy
        until its first use (see [Note: a prefetch overlaps compute] in chunks/storage.py).
        """
        self._expect(ChunkState.HOST)
        host = self._copies[Tier.HOST]
        self._copies[Tier.DEVICE], self._host_event = self._storage.transfer(
            host, Tier.HOST, Tier.DEVICE, kind=self.kind, shell=self._device_shell, defer_device_wait=prefetch
        )
        if not keep_host:
            self._drop(Tier.HOST)
        self._set_state()  # re-points the parameters' views, which reads nothing
        if prefetch:
            self._device_event = self._host_event

    @_move
    def offload(self) -> None:
        """DEVICE -> HOST (copy back) or HOST_AND_DEVICE -> HOST (the host copy is current)."""
        self._expect(ChunkState.DEVICE, ChunkState.HOST_AND_DEVICE)
        if self.state is ChunkState.DEVICE:
            self._copies[Tier.HOST], self._host_event = self._storage.transfer(
                self._copies[Tier.DEVICE], Tier.DEVICE, Tier.HOST, kind=self.kind
            )
        else:
            self.keep_edits(Tier.DEVICE)
        self._drop(Tier.DEVICE)
        self._set_state()

    @_move
    def drop_host_copy(self) -> None:
        """HOST_AND_DEVICE -> DEVICE (the device copy is about to be written), or
        HOST_AND_NVME -> NVME (the file holds the same bytes: nothing to write)."""
        self._expect(ChunkState.HOST_AND_DEVICE, ChunkState.HOST_AND_NVME)
        self._drop(Tier.HOST)
        self._set_state()

    # [Note: NVMe moves are two-phase]
    # A read or write of a chunk's file is started by one call and finished by another, so
    # that a pipeline can keep several in flight while it computes. The state changes only
    # when the request is confirmed: a chunk being written stays HOST (its host copy is still
    # the only sure copy, and must not change), and a chunk being read stays NVME (the buffer
    # it is read into is counted in host memory but is not a copy yet). A failed request
    # leaves the chunk as it was, so a full disk or a corrupted file loses nothing.
    def start_spill(self) -> None:
        """HOST: start writing the host copy to the chunk's file (finish with ``finish_spill``)."""
        self._expect(ChunkState.HOST)
        self._file.start_write(self._copies[Tier.HOST])

    @_move
    def finish_spill(self, *, keep_host: bool = False) -> None:
        """Wait for ``start_spill``'s write: -> NVME, or HOST_AND_NVME with ``keep_host``.

        If the write failed, its error is raised and the chunk stays HOST, its data intact.
        """
        self._file.wait(self._file.take(write=True), nbytes=self.nbytes)
        self._in_file = True
        if not keep_host:
            self._drop(Tier.HOST)
        self._set_state()

    def start_load(self) -> None:
        """NVME: allocate a host payload and start reading the file into it."""
        self._expect(ChunkState.NVME)
        with self._storage.move_context():
            buffer = self._storage.alloc(Tier.HOST, self.capacity, self.dtype, kind=self.kind)
        try:
            self._file.start_read(buffer)
        except BaseException:
            self._storage.free(Tier.HOST, buffer, kind=self.kind)
            raise

    @_move
    def finish_load(self) -> None:
        """Wait for ``start_load``'s read: -> HOST_AND_NVME.

        If the read failed (an I/O error, a checksum mismatch), its error is raised, the
        buffer is freed and the chunk stays NVME.
        """
        pending = self._file.take(write=False)
        try:
            self._file.wait(pending, nbytes=self.nbytes)
        except BaseException:
            self._storage.free(Tier.HOST, pending.buffer, kind=self.kind)
            raise
        self._copies[Tier.HOST] = pending.buffer
        self._set_state()

    @_move
    def overwrite_file(self) -> None:
        """NVME -> HOST without reading the file: a zeroed host payload that the caller fills
        whole (a checkpoint being loaded); the file goes stale. A corrupted file is never read."""
        self._expect(ChunkState.NVME)
        self._copies[Tier.HOST] = self._storage.alloc(Tier.HOST, self.capacity, self.dtype, kind=self.kind, zero=True)
        self._in_file = False
        self._set_state()

    @_move
    def drop_nvme_copy(self) -> None:
        """HOST_AND_NVME -> HOST: the host copy is about to be written, so the file goes stale."""
        self._expect(ChunkState.HOST_AND_NVME)
        self._in_file = False
        self._set_state()

    # A step's files: see [Note: file slots] in chunks/chunk_file.py.
    def hold_file(self) -> None:
        """NVME or HOST_AND_NVME: keep the current file until the step ends."""
        self._expect(ChunkState.NVME, ChunkState.HOST_AND_NVME)
        self._file.hold()

    def release_held_file(self) -> None:
        """The step is complete: delete the held file if a newer one replaced it."""
        self._file.release_held()

    @_move
    def restore_held_file(self) -> None:
        """The step failed: -> NVME, the held file's bytes current again; a newer file and any
        host copy are dropped."""
        held, self._file.held = self._file.held, None
        if held is None:
            return
        self._expect(*ChunkState)  # no request in flight
        self._file.restore(held)
        if Tier.HOST in self._copies:
            self._drop(Tier.HOST)
        self._in_file = True
        self._set_state()

    def finish_io(self) -> None:
        """Finish whichever NVMe request is in flight (nothing if none)."""
        if self._file.pending is not None:
            (self.finish_spill if self._file.pending.write else self.finish_load)()

    @_move
    def drop_device_copy(self) -> None:
        """HOST_AND_DEVICE -> HOST: the host copy is about to be written, or the device needs room
        (what torch code wrote through the parameters is copied back first: :meth:`keep_edits`)."""
        self._expect(ChunkState.HOST_AND_DEVICE)
        self.keep_edits(Tier.DEVICE)
        self._drop(Tier.DEVICE)
        self._set_state()

    def keep_edits(self, viewed: Tier) -> None:
        """HOST_AND_DEVICE, the parameters viewing the copy on ``viewed``: what torch code wrote
        through them since the last move is copied to the other copy too, counted like any
        transfer (see [Note: writes through the parameters] in chunks/edits.py)."""
        if self.state is not ChunkState.HOST_AND_DEVICE or self.edits is None or not self.edits.new():
            return
        self.wait_host()
        self.ready_on_device()
        other = Tier.HOST if viewed is Tier.DEVICE else Tier.DEVICE
        n = self.used_numel
        self.host_copy_pending(self._storage.copy_(self._copies[other][:n], self._copies[viewed][:n], src=viewed,
                                                   dst=other))

    def move_to(self, tier: Tier) -> None:
        """Leave exactly one copy, on ``tier`` (no-op if it already is the only copy)."""
        if tier is Tier.DEVICE:
            if self.state is ChunkState.HOST:
                self.fetch(keep_host=False)
            elif self.state is ChunkState.HOST_AND_DEVICE:
                self.drop_host_copy()
            else:
                self._expect_state(ChunkState.DEVICE)
        else:
            if self.state in (ChunkState.DEVICE, ChunkState.HOST_AND_DEVICE):
                self.offload()
            else:  # already there: a copy into it may still run, and its reader waits for it
                self._expect_state(ChunkState.HOST)

    @_move
    def release(self) -> None:
        """Any state -> RELEASED: free every copy and delete the file."""
        self._expect(*ChunkState)
        for tier in list(self._copies):
            self._drop(tier)
        self.delete_files()

    def delete_files(self) -> None:
        """Delete the chunk's files under both names (a stale one too): it leaves NVMe for good
        (NVME -> RELEASED, HOST_AND_NVME -> HOST)."""
        self._expect(*ChunkState)  # no request in flight
        self._file.delete()
        self._in_file = False
        self._set_state()

    def _drop(self, tier: Tier) -> None:
        if tier is Tier.HOST:
            self.wait_host()  # a DMA may still read it; the pool would hand it out again
        payload = self._copies.pop(tier)
        self._storage.free(tier, payload, kind=self.kind)
        if tier is Tier.DEVICE:
            self._device_shell = payload

