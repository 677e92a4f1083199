"""`non_model_peak_bytes`: the activations and temporaries of one forward and backward, measured
on the meta device before anything is allocated.

[Note: planning on the meta device]
A tensor on the meta device has a shape, a dtype and no storage: every operator computes its
output's shape and nothing else. Running the model once there, under the same tensor-
accounting monitor the warm-up uses on the CPU (tracer/monitors.py, which counts storages by
identity and so works on meta too), gives the peak of the bytes that are not model data —
activations saved for backward, temporaries, each parameter's gradient until it is taken —
without memory or compute. The parameters are meta stand-ins in the dtype the chunks will hold
(``param_dtype``), passed through ``torch.func.functional_call``, so the model itself is
never touched and may live anywhere (on meta too). Each gradient is dropped as soon as it is
accumulated, as the engine moves it into its gradient chunk.

What it cannot see: kernels' internal scratch (as on the CPU stand-in), the CUDA caching
allocator's rounding and fragmentation, and code that needs values (``.item()``, data-
dependent shapes), which fails here with a clear error.

[Note: attention on the meta device]
``F.scaled_dot_product_attention`` has no fused kernel on meta: it falls back to the math
path, which materializes and saves the (batch, heads, query, key) attention matrix. On the
devices the model really runs on (CUDA, and the CPU for fp32/bf16) a fused kernel saves only
its inputs, its output and one log-sum-exp per query row. The plan measures what the fused
kernel keeps: for the meta run a function mode routes the call to a stand-in with that output
and those saved tensors (``_FusedAttention``), so an attention matrix the run never holds is
not charged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tracer.monitors import TensorAccountingMonitor

__all__ = ["MetaPeaks", "meta_inputs", "meta_peaks", "non_model_peak_bytes"]


def meta_inputs(example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """``example_inputs`` on the meta device: tensors keep their shape and dtype, ``(shape,
    dtype)`` pairs become tensors of them, anything else passes unchanged."""
    if isinstance(example_inputs, (torch.Tensor, dict)) or not isinstance(example_inputs, Sequence):
        raise TypeError(f"example_inputs must be a tuple or list of the model's positional arguments, got "
                        f"{type(example_inputs).__name__}")
    out = []
    for i, a in enumerate(example_inputs):
        if isinstance(a, torch.Tensor):
            out.append(torch.empty(a.shape, dtype=a.dtype, device="meta"))
        elif (isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype)
              and isinstance(a[0], (tuple, list, torch.Size)) and all(isinstance(n, int) for n in a[0])):
            out.append(torch.empty(tuple(a[0]), dtype=a[1], device="meta"))
        elif isinstance(a, tuple) and any(isinstance(x, torch.dtype) for x in a):
            raise TypeError(f"example_inputs[{i}]={a!r}: a shape and dtype are given as ((d0, d1, ...), dtype)")
        else:
            out.append(a)
    return tuple(out)


def _first_output(output: Any) -> torch.Tensor:
    """The default loss's source: the output itself, or its first element (tuple, list, dict or a
    transformers ModelOutput)."""
    while not isinstance(output, torch.Tensor):
        if isinstance(output, dict) and output:
            output = next(iter(output.values()))
        elif isinstance(output, (tuple, list)) and output:
            output = output[0]
        else:
            raise TypeError(f"the model returned {type(output).__name__}: pass loss_fn(output) -> a scalar tensor")
    return output


class _FusedAttention(torch.autograd.Function):
    """Shapes and saved tensors of a fused attention kernel (see [Note: attention on the meta device])."""

    @staticmethod
    def forward(ctx, q, k, v):  # noqa: ANN001, ANN205
        if q.dim() == 4:
            # The fused kernels (CPU flash, CUDA flash and memory-efficient) write their output
            # (batch, query, heads, dim) in memory and return it transposed, so the usual
            # ``y.transpose(1, 2).contiguous()`` that follows copies nothing.
            b, h, t, _ = q.shape
            out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        else:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AttentionAsFused(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` on meta tensors to :class:`_FusedAttention`,
    for the meta run only (a function mode is thread-local and leaves other calls alone)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and args and args[0].device.type == "meta":
            query, key, value = args[:3]
            if kwargs.get("enable_gqa") and key.shape[-3] != query.shape[-3]:  # keys shared by head groups
                repeat = query.shape[-3] // key.shape[-3]
                key, value = key.repeat_interleave(repeat, dim=-3), value.repeat_interleave(repeat, dim=-3)
            return _FusedAttention.apply(query, key, value)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class MetaPeaks:
    """Non-model peaks of one forward and backward (see [Note: when chunks visit])."""

    non_model_bytes: int  # the most alive at once
    computing_bytes: int  # the most alive while a module owning parameters computes (or backward runs)


# [Note: when chunks visit]
# Under placements that fetch chunks for compute ("cpu", and "auto"'s warm-up) a chunk group
# is on the device only while a module using it runs forward, and during backward. The largest
# non-model peak often falls between those times: the loss on the logits (and its backward)
# runs after the root module's forward and before the first module's backward, when every
# chunk was dropped. So the meta run keeps two peaks: of all time, and of the times when
# chunks may visit (a module's forward; backward from the first module's backward pre-hook);
# the plan adds the visiting chunks only to the second.


class _PeakWhileComputing(TorchDispatchMode):
    """After each operator, the monitor's count enters the computing peak while ``computing``."""

    def __init__(self, monitor: TensorAccountingMonitor) -> None:
        super().__init__()
        self.monitor = monitor
        self.depth = 0  # modules owning parameters whose forward is running
        self.backward = False  # a module's backward has begun
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if self.depth or self.backward:
            self.peak = max(self.peak, self.monitor.current_bytes())
        return out


def non_model_peak_bytes(model: nn.Module, example_inputs: Sequence[Any], *,
                         loss_fn: Callable[[Any], torch.Tensor] | None = None,
                         param_dtype: torch.dtype = torch.float32) -> int:
    """The most bytes of non-model tensors alive at once in one forward and backward of
    ``model`` on ``example_inputs`` (see [Note: planning on the meta device])."""
    return meta_peaks(model, example_inputs, loss_fn=loss_fn, param_dtype=param_dtype).non_model_bytes


def meta_peaks(model: nn.Module, example_inputs: Sequence[Any], *,
               loss_fn: Callable[[Any], torch.Tensor] | None = None,
               param_dtype: torch.dtype = torch.float32) -> MetaPeaks:
    """The non-model peaks of one forward and backward of ``model`` on ``example_inputs``: of
    all time and while chunks may visit (see [Note: planning on the meta device] and [Note:
    when chunks visit]).

    ``loss_fn(output)`` gives the scalar to differentiate (default: the sum of the first
    output, in fp32). Raises ``ValueError`` if the model cannot run on the meta device.
    """
    state: dict[str, torch.Tensor] = {}
    trainable = []
    for name, p in model.named_parameters():
        dtype = param_dtype if p.is_floating_point() else p.dtype
        t = torch.empty(p.shape, dtype=dtype, device="meta", requires_grad=p.requires_grad)
        if p.requires_grad:
            # The engine takes each gradient into its chunk as it arrives: it is not held.
            t.register_post_accumulate_grad_hook(lambda leaf: setattr(leaf, "grad", None))
            trainable.append(t)
        state[name] = t
    for name, b in model.named_buffers():
        state[name] = torch.empty(b.shape, dtype=param_dtype if b.is_floating_point() else b.dtype, device="meta")
    args = meta_inputs(example_inputs)
    monitor = TensorAccountingMonitor("meta")
    monitor.exclude(list(state.values()))  # model data: counted by the plan's chunk bytes
    computing = _PeakWhileComputing(monitor)

    def enter(*_: Any) -> None:
        computing.depth += 1

    def leave(*_: Any) -> None:
        computing.depth -= 1

    def backward_begins(*_: Any) -> None:
        computing.backward = True

    handles = []
    for sub in model.modules():
        if next(sub.parameters(recurse=False), None) is not None:
            handles.append(sub.register_forward_pre_hook(enter))
            handles.append(sub.register_forward_hook(leave, always_call=True))
            handles.append(sub.register_full_backward_pre_hook(backward_begins))
    try:
        with monitor, _AttentionAsFused(), computing, warnings.catch_warnings():
            # A module whose inputs need no gradient (the embedding) fires its pre-hook when its
            # outputs' gradients arrive, which is the moment wanted here: torch's warning is moot.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            output = functional_call(model, state, args)
            loss = loss_fn(output) if loss_fn is not None else _first_output(output).float().sum()
            del output
            if trainable and loss.requires_grad:
                loss.backward()
            del loss
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise ValueError(
            f"example_inputs: the model could not run on the meta device to measure its activations ({type(e).__name__}: "
            f"{e}); plan without example_inputs (activations are then not counted), or pass loss_fn") from e
    finally:
        for h in handles:
            h.remove()
    return MetaPeaks(non_model_bytes=monitor.peak_bytes(), computing_bytes=computing.peak)
