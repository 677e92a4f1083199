"""Kernels whose outputs differ between the meta device and the configured one.

The meta device's kernels give what CUDA's do. The CPU's layer and batch norms keep their
saved statistics (mean, inverse standard deviation) in the input's dtype, where CUDA and meta
keep float32: under bf16/fp16 every norm of a model saved twice the bytes the CPU stand-in
holds (14 KiB on a 3-layer GPT, enough that the warm-up's margin and the plan's differed and
gpu_margin_mem_ratio=1 kept 3 groups in the plan and 4 in training). And the CPU's
``mse_loss`` and ``smooth_l1_loss`` reduce in place: the scalar they return is a view of the
elementwise losses, which live as long as the loss does (the input's size: 1.8% of the peak of
a small MLP trained on ``F.mse_loss``). For a CPU target the meta run's outputs take the CPU's
form (:class:`CpuKernels`, below the tensor-accounting monitor: it sees only the final ones).
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
