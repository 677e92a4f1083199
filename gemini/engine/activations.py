"""Activation offload: tensors autograd saves for backward wait in host memory, not on the device.

[Note: activation offload]
Gemini moves model data only; between forward and backward the device also holds the saved activations.
``GeminiConfig(offload_activations=True)`` installs ``torch.autograd.graph.saved_tensors_hooks`` around the root
module's forward: each saved tensor of at least ``activation_offload_min_bytes`` (not a parameter or a view of one:
chunk data, which the placement moves) is copied to a host buffer when saved, its device memory freed once nothing
else holds it, and copied back when backward unpacks it.

- Host buffers come from the chunk storage's pinned pool, recycled by size class (nothing is pinned per tensor), and
  return to it when autograd drops the saved tensor.
- On CUDA both copies run on one side stream: forward compute never waits for a copy out (``record_stream`` keeps a
  tensor's memory from reuse until its copy is done), and copies of a recycled buffer stay in order. Later
  iterations copy the next tensor back (in the traced unpack order) while the current one is in use, budget allowing.
- See [Note: one host copy per saved value] and [Note: host copies die with their graph].
- The budget decides, not a size heuristic: the warm-up offloads every eligible tensor and measures that peak. Under
  placement "auto", the margin share ``gpu_margin_mem_ratio`` leaves to activations keeps the *last* saved tensors on
  the device (backward needs them first, so their round trip buys least), as many as fit; auto then plans every
  period with those bytes added.
- On the CPU stand-in host buffers are hidden from the device monitor (like host chunk payloads), so the measured
  peak is what a GPU would hold; copies are synchronous and nothing is prefetched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import weakref
from collections import deque

import torch
from torch import nn

from chunks import ChunkStorage
from gemini.policies.plan import MemoryPlan
from offload.profiling import trace_range

logger = logging.getLogger(__name__)

__all__ = ["ActivationOffload", "kept_on_device"]


def kept_on_device(sizes: tuple[int, ...], room_bytes: int, *, prefetch: bool) -> tuple[int, int, bool]:
    """The plan for saved tensors of ``sizes`` (in save order) and ``room_bytes`` of device room: (the index of the
    first one kept, the bytes committed, whether to prefetch). With ``prefetch`` (CUDA, more than one unpack) room
    for the largest tensor comes first; then the last saved tensors stay, as many as fit. Pure: the planner uses it
    too."""
    committed = 0
    prefetching = prefetch and bool(sizes) and max(sizes) <= room_bytes
    if prefetching:
        committed = max(sizes)
    keep_from = len(sizes)
    while keep_from > 0 and committed + sizes[keep_from - 1] <= room_bytes:
        keep_from -= 1
        committed += sizes[keep_from]
    return keep_from, committed, prefetching


# [Note: one host copy per saved value]
# Autograd may save one tensor several times (x * x saves x twice): repeats share the first save's handle, so one
# copy out, buffer and copy back. A repeat must be the same tensor *with the same values*, or backward silently reads
# stale ones. The key holds ``t._version`` (bumped by every in-place write, through any view or ``detach()``) and the
# storage's address, offset, shape, strides and dtype (``t.data = other`` bumps no version); the handle holds its
# source by weak reference and only that very object matches (not a new tensor reusing freed memory or an id).
# Writes through ``t.data`` change no key: as with ``torch.autograd.graph.save_on_cpu``, the copy has the values of
# the moment it was saved. Tensors the plan keeps on the device are in the (weak) table too, so their repeats do not
# count as new saved tensors, as in the warm-up; else the sizes stop matching the trace and all later ones offload.
#
# [Note: host copies die with their graph]
# Only the graph that saved a handle holds it (we keep weak references): when the graph goes (backward ran, or its
# output was dropped), the handle's finalizer gives the buffer back to the pool and the ledger counts it out. An
# iteration (pack order, matching against the trace, de-duplication) ends with a backward or, at the next root
# forward, once nothing it saved is alive, so a dropped graph (an evaluation loop with grad on) does not derail the
# next iteration's plan. Kept tensors are saved through ``_Kept`` so their graph's life is visible too. The check
# runs only at a root forward not preceded by a backward; a training loop never pays it.


# [Note: a saved output held without its graph]
# An operator that saves its own output (tanh, softmax) hands the pack hook that very tensor, grad_fn and all.
# Holding it closes a cycle through C++ (output -> grad_fn -> saved variable -> packed object -> output) the garbage
# collector cannot see, so a graph that never runs backward (an evaluation forward with grad on) would leak with
# everything upstream. Like autograd without hooks, we hold a detached alias (same memory and version counter), and
# autograd reattaches the grad_fn on unpack. Cost: about 1 us per saved tensor not offloaded.
def _without_graph(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a pack hook may hold it (see [Note: a saved output held without its graph])."""
    return t if t.grad_fn is None else t.detach()


class _Kept:
    """A saved tensor the plan keeps on the device: held only to see when its graph goes."""

    __slots__ = ("tensor", "source", "__weakref__")

    def __init__(self, tensor: torch.Tensor, source: torch.Tensor) -> None:
        self.tensor = tensor
        self.source = weakref.ref(source)  # the tensor saved (see [Note: one host copy per saved value])


class _Offloaded:
    """A saved tensor in host memory: its buffer, its shape, and its device copy while one lives."""

    __slots__ = ("index", "host", "shape", "stride", "dtype", "nbytes", "device_copy", "event", "source",
                 "__weakref__")

    def __init__(self, index: int, host: torch.Tensor, shape: torch.Size, stride: tuple[int, ...],
                 dtype: torch.dtype, nbytes: int) -> None:
        self.index = index  # position in its iteration's pack order
        self.source: weakref.ref | None = None  # the tensor saved (see [Note: one host copy per saved value])
        self.host = host  # the pool's 1-D buffer
        self.shape = shape
        self.stride = stride
        self.dtype = dtype
        self.nbytes = nbytes
        self.device_copy: weakref.ref | torch.Tensor | None = None  # a tensor while prefetched
        self.event: torch.cuda.Event | None = None


class ActivationOffload:
    """Offloads saved activations of one model; see [Note: activation offload]."""

    def __init__(self, storage: ChunkStorage, *, min_bytes: int) -> None:
        self.storage = storage
        self.device = storage.device
        self.min_bytes = min_bytes
        self.ledger = storage.ledger  # counts what is offloaded, held and copied (see chunks/ledger.py)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._releasing: deque[tuple[torch.cuda.Event, torch.Tensor, int]] = deque()  # see _release
        self._releasing_lock = threading.Lock()
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self._depth = 0  # root forwards entered and not left
        self._iteration_over = True  # a backward ended since the last forward began
        # This iteration: eligible sizes in pack order, offloaded handles by index, kept ones, backward's unpack
        # order, and de-duplication of repeated saves. Handles are held weakly only: see [Note: host copies die with
        # their graph].
        self._sizes: list[int] = []
        self._packed: dict[int, weakref.ref] = {}
        self._kept: list[weakref.ref] = []
        self._unpack_order: list[int] = []
        self._seen: weakref.WeakValueDictionary[tuple, _Offloaded] = weakref.WeakValueDictionary()
        # The traced iteration's eligible sizes and unpack order, and the plan made from them.
        self.traced_sizes: tuple[int, ...] | None = None
        self.traced_unpack_order: tuple[int, ...] = ()
        self.keep_from: int | None = None  # eligible tensors from this index on stay (None: all go)
        self.prefetch = False
        self._following = False  # this iteration matches the traced one so far

    # ------------------------------------------------------------------------ the plan
    def with_trace(self, plan: MemoryPlan) -> MemoryPlan:
        """``plan`` with the warm-up's saved sizes and unpack order, the reference for every iteration run on it."""
        return dataclasses.replace(plan, saved_sizes=tuple(self._sizes), saved_unpack_order=tuple(self._unpack_order))

    def plan(self, plan: MemoryPlan, room_bytes: int) -> int:
        """Follow ``plan``'s traced iteration, keeping on the device the last saved tensors that fit in ``room_bytes``
        (after room for one prefetched tensor, on CUDA); returns the bytes this commits in every period."""
        self.traced_sizes, self.traced_unpack_order = plan.saved_sizes, plan.saved_unpack_order
        sizes = self.traced_sizes or ()
        keep_from, committed, self.prefetch = kept_on_device(
            sizes, room_bytes, prefetch=self._cuda and len(self.traced_unpack_order) > 1)
        self.keep_from = keep_from if keep_from < len(sizes) else None
        kept = sum(sizes[keep_from:])
        logger.info("activation offload: %d of %d saved tensors (%d bytes) stay on the device, %d offloaded; "
                    "prefetch %s", len(sizes) - keep_from, len(sizes), kept, keep_from, self.prefetch)
        return committed

    def forget_plan(self) -> None:
        self.traced_sizes, self.traced_unpack_order = None, ()
        self.keep_from, self.prefetch = None, False

    # -------------------------------------------------------------------- forward/backward
    def begin_forward(self) -> None:
        """The root module's forward begins: saved tensors from here on are ours to place."""
        if self._iteration_over or (self._depth == 0 and not self._saved_alive()):
            self._iteration_over = False
            self._sizes, self._packed, self._kept, self._unpack_order = [], {}, [], []
            self._seen = weakref.WeakValueDictionary()
            self._following = self.traced_sizes is not None
        if self._depth == 0 and torch.is_grad_enabled():
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        self._depth += 1

    def end_forward(self) -> None:
        if self._depth == 0:
            return  # the forward failed before it reached begin_forward
        self._depth -= 1
        if self._depth == 0 and self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)

    def end_backward(self) -> None:
        self._iteration_over = True
        self._reap()
        self._seen = weakref.WeakValueDictionary()

    def _saved_alive(self) -> bool:
        """Whether a graph still holds something this iteration saved.

        See [Note: host copies die with their graph]."""
        return (any(ref() is not None for ref in self._packed.values())
                or any(ref() is not None for ref in self._kept))

    # ------------------------------------------------------------------------- hooks
    def _eligible(self, t: torch.Tensor) -> bool:
        if t.device != self.device or t.layout is not torch.strided or type(t) is not torch.Tensor:
            return False  # a parameter (chunk data, which the placement moves) or a tensor subclass
        if isinstance(t._base, nn.Parameter):
            return False  # a view of a parameter: chunk data too
        return t.numel() * t.element_size() >= self.min_bytes

    # [Note: saved-tensor hooks under torch.compile]
    # Autograd calls these hooks from a compiled model's eager stretches, where dynamo's frame callback is set.
    # Traced, ``_pack`` would guard on weakref.finalize's registry (which its own finalize changes) and on the saved
    # tensor: a recompile every step. They only move tensors to and from host buffers, so they run eagerly, like the
    # module hooks (see [Note: hooks under torch.compile] in gemini/engine/hooks.py).
    @torch._disable_dynamo
    def _pack(self, t: torch.Tensor):
        if not self._eligible(t):
            return _without_graph(t)
        # See [Note: one host copy per saved value].
        key = (id(t), t._version, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
               tuple(t.stride()), t.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen.source() is t:
            return seen
        nbytes = t.numel() * t.element_size()
        index = len(self._sizes)
        self._sizes.append(nbytes)
        if self._following and (index >= len(self.traced_sizes) or self.traced_sizes[index] != nbytes):
            self._following = False  # not the traced iteration: offload everything from here
        if self._following and self.keep_from is not None and index >= self.keep_from:
            self.ledger.transfers.activation_kept_bytes += nbytes
            kept = _Kept(_without_graph(t), t)
            self._kept.append(weakref.ref(kept))
            self._seen[key] = kept  # its repeats are no new saved tensors, as in the trace
            return kept
        with trace_range("gemini::offload_activation"):
            packed = self._copy_out(index, t, nbytes)
        packed.source = weakref.ref(t)
        self._packed[index] = weakref.ref(packed)
        self._seen[key] = packed
        return packed

    def _copy_out(self, index: int, t: torch.Tensor, nbytes: int) -> _Offloaded:
        storage = self.storage
        observer = storage.observer
        # The restored tensor keeps the original's layout (a transposed activation stays transposed), so backward
        # runs the same kernels: bit-identical results. empty_like keeps a dense tensor's strides and makes others
        # (gaps, overlaps) contiguous.
        stride = torch.empty_like(t, device="meta").stride()
        self._reap()  # buffers whose copies are done can serve again
        with observer.quiet() if observer is not None else contextlib.nullcontext():
            buffer = storage.pool.acquire(t.numel(), t.dtype)
            host = buffer.as_strided(t.shape, stride)
            if self._stream is not None:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self._stream):
                    host.copy_(t, non_blocking=True)
                t.record_stream(self._stream)  # its memory is not reused before the copy is done
            else:
                host.copy_(t)
        if observer is not None:
            observer.exclude(buffer)
        packed = _Offloaded(index, buffer, t.shape, stride, t.dtype, nbytes)
        weakref.finalize(packed, self._release, buffer, nbytes)
        self.ledger.activations.add(nbytes)
        self.ledger.transfers.activation_d2h_bytes += nbytes
        return packed

    def _release(self, buffer: torch.Tensor, nbytes: int) -> None:
        # The pool also serves host code (chunk payloads, NVMe reads), which must not write a buffer a side-stream
        # copy still uses: on CUDA a buffer goes back only once the side stream has passed this point.
        if self._stream is None:
            self._give_back(buffer, nbytes)
            return
        event = torch.cuda.Event()
        event.record(self._stream)
        with self._releasing_lock:  # a finalizer: it may run on whichever thread the GC ran on
            self._releasing.append((event, buffer, nbytes))
        self._reap()

    def _reap(self, *, wait: bool = False) -> None:
        """Give back the released buffers whose copies are done (``wait``: all of them)."""
        with self._releasing_lock:
            while self._releasing and (wait or self._releasing[0][0].query()):
                event, buffer, nbytes = self._releasing.popleft()
                event.synchronize()
                self._give_back(buffer, nbytes)

    def _give_back(self, buffer: torch.Tensor, nbytes: int) -> None:
        self.storage.pool.release(buffer)
        self.ledger.activations.sub(nbytes)

    @torch._disable_dynamo  # see [Note: saved-tensor hooks under torch.compile]
    def _unpack(self, packed):
        if not isinstance(packed, _Offloaded):
            return packed.tensor if isinstance(packed, _Kept) else packed
        with trace_range("gemini::restore_activation"):
            self._unpack_order.append(packed.index)
            out = self._device_copy(packed)
            if self.prefetch and self._following:
                self._prefetch_after(len(self._unpack_order))
        return out

    def _device_copy(self, packed: _Offloaded) -> torch.Tensor:
        held = packed.device_copy
        if isinstance(held, torch.Tensor):  # prefetched
            packed.device_copy = weakref.ref(held)
            torch.cuda.current_stream(self.device).wait_event(packed.event)
            return held
        if held is not None and held() is not None:  # unpacked before and still alive
            return held()
        out = self._start_copy_in(packed)
        if packed.event is not None:
            torch.cuda.current_stream(self.device).wait_event(packed.event)
        packed.device_copy = weakref.ref(out)
        return out

    def _start_copy_in(self, packed: _Offloaded) -> torch.Tensor:
        out = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype, device=self.device)
        host = packed.host.as_strided(packed.shape, packed.stride)
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))  # ``out`` is free to write
            with torch.cuda.stream(self._stream):
                out.copy_(host, non_blocking=True)
            out.record_stream(self._stream)  # freed unused (a prefetch never unpacked): not reused mid-copy
            packed.event = torch.cuda.Event()
            packed.event.record(self._stream)
        else:
            out.copy_(host)
        self.ledger.transfers.activation_h2d_bytes += packed.nbytes
        return out

    def _prefetch_after(self, unpacked: int) -> None:
        """Start copying back the tensor the traced backward unpacked next."""
        order = self.traced_unpack_order
        if unpacked >= len(order):
            return
        ref = self._packed.get(order[unpacked])
        nxt = ref() if ref is not None else None
        if nxt is not None and nxt.device_copy is None:
            nxt.device_copy = self._start_copy_in(nxt)

    def close(self) -> None:
        self._reap(wait=True)
        if self._hooks is not None:
            hooks, self._hooks = self._hooks, None
            hooks.__exit__(None, None, None)
