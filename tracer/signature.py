"""What about a model's inputs decides its memory: tensor shapes, dtypes, devices, structure.

A trace holds for the inputs it was taken with. When a batch arrives whose signature
differs (a new batch size or sequence length), its activations differ too, and the engine
re-traces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import TreeSpec, tree_flatten

__all__ = ["InputSignature", "TensorSignature", "input_signature"]

# Plain values that can change what a forward allocates (a sequence length passed as an
# int, a flag) are part of the signature by value; other objects by type only.
_BY_VALUE = (bool, int, float, str, type(None))


@dataclass(frozen=True, kw_only=True)
class TensorSignature:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    requires_grad: bool


@dataclass(frozen=True, kw_only=True)
class InputSignature:
    """The structure of a call's arguments and the signature of each leaf."""

    spec: TreeSpec
    leaves: tuple[Any, ...]

    def __str__(self) -> str:
        parts = []
        for leaf in self.leaves:
            if isinstance(leaf, TensorSignature):
                parts.append(f"{leaf.dtype}{list(leaf.shape)}@{leaf.device}")
            else:
                parts.append(repr(leaf))
        return "(" + ", ".join(parts) + ")"


def input_signature(args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None) -> InputSignature:
    """The signature of a call ``f(*args, **kwargs)``."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})))
    return InputSignature(spec=spec, leaves=tuple(_leaf_signature(leaf) for leaf in leaves))


def _leaf_signature(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return TensorSignature(
            shape=tuple(leaf.shape), dtype=leaf.dtype, device=leaf.device, requires_grad=leaf.requires_grad
        )
    if isinstance(leaf, _BY_VALUE):
        return (type(leaf).__name__, leaf)
    return (type(leaf).__name__,)
