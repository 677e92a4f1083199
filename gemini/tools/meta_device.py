"""Kernels whose outputs differ between the meta device and the configured one.

The meta device's kernels give what CUDA's do. The CPU's layer and batch norms keep their
saved statistics (mean, inverse standard deviation) in the input's dtype, where CUDA and meta
keep float32: under bf16/fp16 every norm of a model saved twice the bytes the CPU stand-in
holds (14 KiB on a 3-layer GPT, enough that the warm-up's margin and the plan's differed and
gpu_margin_mem_ratio=1 kept 3 groups in the plan and 4 in training). For a CPU target the meta
run's statistics take the CPU's dtype (:class:`CpuStatistics`, below the tensor-accounting
monitor: it sees only the final outputs).
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


class CpuStatistics(TorchDispatchMode):
    """Saved norm statistics in the input's dtype, as the CPU keeps them."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        if func in _NORMS and args[0].dtype in (torch.bfloat16, torch.float16):
            low = args[0].dtype
            out = (out[0], *(s.to(low) if s.dtype == torch.float32 and s.numel() else s for s in out[1:]))
        return out


@contextlib.contextmanager
def as_on_device(device_type: str) -> Iterator[None]:
    """Enter before the meta run's monitor: kernels' outputs as ``device_type``'s."""
    with CpuStatistics() if device_type == "cpu" else contextlib.nullcontext():
        yield
