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

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from tracer.monitors import TensorAccountingMonitor

__all__ = ["meta_inputs", "non_model_peak_bytes"]


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


def non_model_peak_bytes(model: nn.Module, example_inputs: Sequence[Any], *,
                         loss_fn: Callable[[Any], torch.Tensor] | None = None,
                         param_dtype: torch.dtype = torch.float32) -> int:
    """The most bytes of non-model tensors alive at once in one forward and backward of
    ``model`` on ``example_inputs`` (see [Note: planning on the meta device]).

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
    try:
        with monitor, _AttentionAsFused():
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
    return monitor.peak_bytes()

