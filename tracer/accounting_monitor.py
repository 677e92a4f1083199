"""A memory monitor that sums live tensor storages seen through a dispatch mode.

It needs no allocator statistics, so it measures any device: the CPU when it stands in for
the accelerator, and the meta device (``gemini.tools.meta_run``).
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode

from tracer.memory_monitor import MemoryMonitor, as_device
from tracer.storage_ledger import StorageLedger, storages_of

__all__ = ["TensorAccountingMonitor"]


# [Note: monitors sharing one mode]
# Several monitors may run at once on one thread: two engines in one process (a GAN's generator
# and discriminator, RLHF's actor and critic), each measuring its own iterations, which
# interleave. A dispatch mode can only leave the mode stack from its top, and each monitor had a
# mode of its own: the generator's window, open from its forward to its step, ended while the
# discriminator's, opened inside it, was still on top (RuntimeError at the generator's step). So a
# thread has one mode, entered by the first monitor started there and left by the last one stopped,
# and it hands each operator's tensors to every monitor running then. Storages a monitor
# excludes (host payloads where the CPU stands in for the device) are host memory for every
# monitor: an engine's host chunks, read and written by its CPU Adam while another engine's window
# is open, are no part of the device that window measures.
_THREAD = threading.local()  # .mode: this thread's shared mode while a monitor runs on it
_EXCLUDED: dict[int, weakref.ref] = {}  # id(storage) -> a weak reference to it, for every monitor


def _raising_in_compiled_call() -> bool:
    """Whether an exception is being handled inside a torch.compile'd callable's call on this
    thread (whose wrapper restores the dispatch keys it found: see _AccountingMode.leave_if_idle)."""
    if sys.exc_info()[0] is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compile_wrapper" and code.co_filename.endswith("eval_frame.py"):
            return True
        frame = frame.f_back
    return False


class _AccountingMode(TorchDispatchMode):
    """Hands every tensor an operator produces (and, optionally, consumes) to each monitor
    running on this thread (see [Note: monitors sharing one mode])."""

    def __init__(self) -> None:
        super().__init__()
        self.monitors: list[TensorAccountingMonitor] = []
        self.in_inference_mode = torch.is_inference_mode_enabled()  # entered inside it (see leave_if_idle)
        self.kept_depth = 0  # moves that keep it now ([Note: a mode kept through a move] in chunks/storage.py)

    def leave_if_idle(self) -> None:
        """Leave the stack once no monitor runs here, where the thread can now (the last stop, a move's end)."""
        # Inside a backward the stack is the graph task's copy: popping the mode there left it on
        # the caller's stack with no monitor and none to reuse it. torch.inference_mode()'s guard
        # restores, when it ends, the dispatch keys it found: a mode entered outside it and popped
        # inside (optimizer.step() under inference_mode) left the mode's key set with no mode, and
        # every later operator of the thread failed ("Hit Python dispatch key but no arguments had
        # PyInterpreter"). torch.compile's wrapper does the same when its call ends by an error
        # (a budget error at the warm-up's end, raised in the root's pre-hook inside a compiled
        # model's call, left every later operator failing so, a retry and the process group's
        # barrier included; a call that returns is left as before). In these cases, and while a
        # move keeps it, it stays, empty, until a monitor stops where it can go.
        if (not self.monitors and getattr(_THREAD, "mode", None) is self and _get_current_dispatch_mode() is self
                and not self.kept_depth and torch._C._current_graph_task_id() == -1
                and torch.is_inference_mode_enabled() == self.in_inference_mode and not _raising_in_compiled_call()):
            self.__exit__(None, None, None)
            _THREAD.mode = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        for monitor in tuple(self.monitors):  # a collected engine's monitor may leave meanwhile
            monitor._see(out)
            if monitor.count_inputs:
                monitor._see(args)
                if kwargs:
                    monitor._see(kwargs)
        return out

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile skips every frame while a dispatch mode that does not say this is
        # active, so with the monitor running (the CPU stand-in with a budget, or placement
        # auto) nothing was compiled. Saying it keeps the mode off while dynamo traces and
        # compiles, and on while the compiled code runs: with the "eager" and "aot_eager"
        # backends every operator of the graphs reaches the mode, as in eager mode; inductor's
        # generated code allocates some buffers below the dispatcher, which the mode then
        # misses (a lower bound; on CUDA the allocator monitor sees every byte).
        return True


def _excluded(storage: torch.UntypedStorage) -> bool:
    ref = _EXCLUDED.get(id(storage))
    return ref is not None and ref() is storage


def _forget_excluded(key: int, ref: weakref.ref) -> None:
    if _EXCLUDED.get(key) is ref:
        del _EXCLUDED[key]


class TensorAccountingMonitor(MemoryMonitor):
    """Exact sum of the bytes of live tensor storages on one device; works on any device.

    While running, a dispatch mode sees every operator on the thread that started the
    monitor, and on the autograd threads of a ``backward()`` called from it; each new
    storage on ``device`` among the operator's outputs (and inputs, with ``count_inputs``)
    is counted once and dropped when it is freed. Storages that existed before, and were
    never an operator's input, are invisible: pass them to :meth:`track`, or give their
    total as ``baseline_bytes``. Storages the caller knows are not device data (host-tier
    buffers when the CPU stands in for the device) can be left out with :meth:`exclude`.

    See [Note: what the accounting monitor sees] for what it cannot see.
    """

    # [Note: what the accounting monitor sees]
    # - Threads: the dispatch-mode stack is thread-local. PyTorch copies it into the
    #   autograd engine's graph task when backward() is called, so backward ops are seen on
    #   the CPU (which runs them on the calling thread) and on CUDA's per-device threads.
    #   Operators run on any other thread (a copy thread, a data-loader thread) are not
    #   seen; give their results to track() if they stay on the device.
    # - Inside a kernel: scratch buffers an operator allocates and frees internally (the
    #   CPU flash-attention kernel's per-thread buffers, for instance) never surface as
    #   tensors, so a peak inside such an op is missed; the allocator-based monitor sees it.
    #   On CUDA a reduction split over thread blocks (a Linear's bias gradient, the sum of a
    #   (tokens, out) gradient over its rows once a thread would sum 256 values or more)
    #   stages its partial sums in fp32 from the allocator: 4 MiB for a sum of 1024 x 512 on
    #   an H200 (runs 3 and 4 of the suite on a GPU, 4,177,936 bytes short both times).
    # - Allocator rounding and fragmentation: storage bytes are what tensors need, not what
    #   a caching allocator reserves (CUDA rounds blocks to 512 bytes and caches freed ones).
    # - In-place resizes: UntypedStorage.resize_ bypasses the dispatcher; call refresh().
    # - Cost: a Python call per operator plus, per new storage, a weakref; only meant for
    #   warm-up iterations and tests.

    def __init__(
        self,
        device: str | torch.device = "cpu",
        *,
        baseline_bytes: int = 0,
        count_inputs: bool = True,
    ) -> None:
        super().__init__()
        dev = as_device(device)
        if not isinstance(baseline_bytes, int) or isinstance(baseline_bytes, bool):
            raise TypeError(f"baseline_bytes must be an int, got {type(baseline_bytes).__name__} {baseline_bytes!r}")
        if baseline_bytes < 0:
            raise ValueError(f"baseline_bytes must be >= 0, got {baseline_bytes}")
        self.device = dev
        self.baseline_bytes = baseline_bytes
        self.count_inputs = bool(count_inputs)
        self._ledger = StorageLedger()
        self._mode: _AccountingMode | None = None
        self._owner_thread: int | None = None
        self._strict = True  # stop() refuses another thread and an out-of-order mode (not discard())

    def __repr__(self) -> str:
        return f"TensorAccountingMonitor(device={self.device}, baseline_bytes={self.baseline_bytes})"

    def track(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Count these tensors' storages (those on the watched device) from now on."""
        for t in _tensor_list(tensors, "tensors"):
            self._see_tensor(t)

    def resized(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """These tensors' storages were resized in place (``resize_`` bypasses the dispatcher):
        this monitor and every other one running on this thread count them at their new size
        (see [Note: monitors sharing one mode])."""
        mode = getattr(_THREAD, "mode", None)
        for monitor in {self, *(mode.monitors if mode is not None else [])}:
            monitor.track(tensors)

    @staticmethod
    def counts_in(mode: object) -> bool:
        """Whether ``mode`` is the dispatch mode handing operators to the monitors (one a thread,
        shared by every monitor running there): code that hides its operators from other modes
        keeps this one, so that the device stays measured."""
        return isinstance(mode, _AccountingMode)

    def exclude(self, tensors: torch.Tensor | Iterable[torch.Tensor]) -> None:
        """Never count these tensors' storages while they live, even when operators use them;
        nor does any other monitor (see [Note: monitors sharing one mode])."""
        mode = getattr(_THREAD, "mode", None)
        others = mode.monitors if mode is not None else []
        for t in _tensor_list(tensors, "tensors"):
            for storage in storages_of(t):
                key = id(storage)
                _EXCLUDED[key] = weakref.ref(storage, lambda ref, key=key: _forget_excluded(key, ref))
                for monitor in {self, *others}:
                    monitor._ledger.exclude(storage)

    def refresh(self) -> None:
        """Re-read the sizes of the counted storages (after ``UntypedStorage.resize_``)."""
        self._ledger.refresh()

    def _start(self) -> None:
        mode = getattr(_THREAD, "mode", None)
        if mode is None:  # the first monitor on this thread (see [Note: monitors sharing one mode])
            mode = _AccountingMode()
            mode.__enter__()
            _THREAD.mode = mode
        mode.monitors.append(self)
        self._mode = mode
        self._owner_thread = threading.get_ident()

    # [Note: a mode left by a backward that raised]
    # A monitor stopped inside a backward (a budget error in a gradient hook) cannot take the
    # mode off the caller's stack (leave_if_idle): it stays there, empty, until a monitor of the
    # thread stops outside one (the engine's next forward, zero_grad() or step()). An engine
    # dropped instead never stops one, and every later operator of the thread ran through the
    # empty mode: slower, and torch.export failed under it. So the engine's close, also when it
    # is collected, takes an idle mode off. Collected late: torch keeps the raising graph task's
    # pending nodes (and the hooks on them, which hold the engine) in the thread's ready queue
    # until the next backward on that thread.
    def discard(self) -> None:
        """Stop counting, from any thread and in any order: an engine closed or collected with
        its window open. Where the shared mode cannot leave the stack now (not on top, or
        another thread), it stays there empty, for the next monitor started on its thread."""
        if self.running:
            self._strict = False
            try:
                self.stop()
            finally:
                self._strict = True
        else:  # stopped inside a backward that raised: see [Note: a mode left by a backward that raised]
            mode = getattr(_THREAD, "mode", None)
            if mode is not None:
                mode.leave_if_idle()

    def _stop(self) -> None:
        mode = self._mode
        assert mode is not None, "stop() without a mode"
        owner = threading.get_ident() == self._owner_thread
        if not owner and self._strict:
            raise RuntimeError(
                f"{self!r} must be stopped on the thread that started it: dispatch modes are thread-local"
            )
        last = mode.monitors == [self]
        on_top = owner and _get_current_dispatch_mode() is mode
        if last and not on_top and self._strict:
            # Exiting would pop whichever mode is on top, not ours.
            raise RuntimeError(
                f"{self!r} must be stopped after the dispatch modes entered since it started "
                f"have exited; the innermost mode is {_get_current_dispatch_mode()!r}"
            )
        mode.monitors.remove(self)
        mode.leave_if_idle()
        self._mode = None

    def _current_bytes(self) -> int:
        return self.baseline_bytes + self._ledger.current_bytes

    def _peak_bytes(self) -> int:
        return self.baseline_bytes + self._ledger.peak_bytes

    def _reset_peak(self) -> None:
        self._ledger.reset_peak()

    def _see(self, tree: Any) -> None:
        # Operator arguments and results are tensors, scalars and (nested) lists or tuples
        # of them; a direct walk costs a fraction of a general pytree flatten per operator.
        if isinstance(tree, torch.Tensor):
            self._see_tensor(tree)
        elif isinstance(tree, (tuple, list)):
            for item in tree:
                self._see(item)
        elif isinstance(tree, dict):
            for item in tree.values():
                self._see(item)

    def _see_tensor(self, t: torch.Tensor) -> None:
        if not self._watches(t.device):
            return
        if t.layout is torch.strided and type(t) in (torch.Tensor, nn.Parameter):
            storage = t.untyped_storage()  # the common case, without a generator
            if not (_EXCLUDED and _excluded(storage)):
                self._ledger.add(storage)
            return
        for storage in storages_of(t):
            if not (_EXCLUDED and _excluded(storage)):
                self._ledger.add(storage)

    def _watches(self, device: torch.device) -> bool:
        # A watched device without an index ("cuda") watches every index of its type.
        if device.type != self.device.type:
            return False
        return self.device.index is None or device.index == self.device.index


def _tensor_list(tensors: torch.Tensor | Iterable[torch.Tensor], name: str) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    try:
        items = list(tensors)
    except TypeError:
        raise TypeError(f"{name} must be a tensor or an iterable of tensors, got {type(tensors).__name__}") from None
    for i, t in enumerate(items):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__} {t!r}")
    return items

