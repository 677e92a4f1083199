"""Kernels whose outputs differ between the meta device and the configured one.

The meta device's kernels give what CUDA's do. Two CPU kernels differ: the CPU's layer and batch norms keep their
saved statistics (mean, inverse std) in the input's dtype where CUDA and meta keep float32, so under bf16/fp16 the
meta run would charge twice the bytes the CPU stand-in holds (enough to change auto's margin); and the CPU's
``mse_loss`` and ``smooth_l1_loss`` reduce in place: the scalar is a view of the elementwise losses, which live as
long as the loss does. For a CPU target the meta run's outputs take the CPU's form (:class:`CpuKernels`, entered
below the tensor-accounting monitor, which sees only the final outputs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["as_on_device"]

_aten = torch.ops.aten
# Norms whose outputs are (output, saved statistics...), their input first.
_NORMS = {_aten.native_layer_norm.default, _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
          _aten._native_batch_norm_legit.no_stats, _aten._native_batch_norm_legit_no_training.default}


# Losses whose reduced result is a view of the elementwise losses: (input, target, reduction, ...).
_REDUCED_IN_PLACE = {_aten.mse_loss.default, _aten.smooth_l1_loss.default}


class CpuKernels(TorchDispatchMode):
    """Outputs as the CPU's kernels make them (see the module's docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _NORMS and args[0].dtype in (torch.bfloat16, torch.float16):
            low = args[0].dtype
            out = (out[0], *(s.to(low) if s.dtype == torch.float32 and s.numel() else s for s in out[1:]))
        elif func in _REDUCED_IN_PLACE and out.dim() == 0:  # reduction "mean" or "sum"
            losses = torch.empty(torch.broadcast_shapes(args[0].shape, args[1].shape), dtype=out.dtype,
                                 device=out.device)
            out = losses.as_strided((), (), 0)
        return out


@contextlib.contextmanager
def as_on_device(device_type: str) -> Iterator[None]:
    """Enter before the meta run's monitor: kernels' outputs as ``device_type``'s."""
    with CpuKernels() if device_type == "cpu" else contextlib.nullcontext():
        yield
