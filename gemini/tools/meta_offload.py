"""``offload_activations`` in the planner's meta run: saved tensors wait off the device.

The engine (see [Note: activation offload] in gemini/engine/activations.py) installs saved-tensor hooks around the
root module's forward: each saved tensor of at least ``activation_offload_min_bytes`` that is no parameter (nor a
view of one) is copied to host memory, its device memory freed once nothing else holds it, and copied back when
backward unpacks it (one device copy per unpack while it lives). :class:`MetaOffload` does the same on meta tensors:
the host copy is a record of shape, strides and dtype, the copy back a new meta tensor the monitor counts as the
device's. The sizes it packed, in order, are the warm-up's trace; auto keeps the last tensors on the device after its
warm-up (``keep_from``: a second meta run replays those later steps).
"""

from __future__ import annotations

import weakref

import torch

__all__ = ["MetaOffload"]


class _Packed:
    """A saved tensor off the device: how to make its device copy, and that copy while it lives."""

    __slots__ = ("shape", "stride", "dtype", "device_copy")

    def __init__(self, t: torch.Tensor) -> None:
        self.shape, self.dtype = t.shape, t.dtype
        # As the engine restores it: dense tensors keep their strides, others become contiguous.
        self.stride = torch.empty_like(t, device="meta").stride()
        self.device_copy: weakref.ref | None = None


class MetaOffload:
    """Saved-tensor hooks that offload as the engine does (see the module's docstring)."""

    def __init__(self, min_bytes: int, model_data: list[torch.Tensor], keep_from: int | None = None) -> None:
        self.min_bytes = min_bytes
        self.keep_from = keep_from  # eligible tensors from this index on stay on the device (auto's plan)
        self._params = {id(t) for t in model_data if t.requires_grad}  # chunk data: the placement moves it
        self._seen: dict[tuple, tuple[weakref.ref, _Packed]] = {}
        self.sizes: list[int] = []  # bytes of each tensor offloaded, in pack order

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _eligible(self, t: torch.Tensor) -> bool:
        if t.device.type != "meta" or t.layout is not torch.strided or type(t) is not torch.Tensor:
            return False
        if id(t) in self._params or (t._base is not None and id(t._base) in self._params):
            return False
        return t.numel() * t.element_size() >= self.min_bytes

    def _pack(self, t: torch.Tensor):  # noqa: ANN202
        if not self._eligible(t):
            return t
        # The same tensor saved twice (a LayerNorm's input is also the residual) goes once.
        key = (id(t.untyped_storage()), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        seen = self._seen.get(key)
        if seen is not None and seen[0]() is t:
            return seen[1]
        self.sizes.append(t.numel() * t.element_size())
        if self.keep_from is not None and len(self.sizes) > self.keep_from:
            return t
        packed = _Packed(t)
        self._seen[key] = (weakref.ref(t), packed)
        return packed

    @staticmethod
    def _unpack(packed):  # noqa: ANN001, ANN205
        if not isinstance(packed, _Packed):
            return packed
        held = packed.device_copy() if packed.device_copy is not None else None
        if held is None:
            held = torch.empty_strided(packed.shape, packed.stride, dtype=packed.dtype, device="meta")
            packed.device_copy = weakref.ref(held)
        return held
