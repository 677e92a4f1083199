"""Global gradient-norm clipping over chunk groups, with ``torch.nn.utils.clip_grad_norm_``'s arithmetic.

Used by the optimizer's step (``GeminiConfig.clip_grad_norm``) and by ``GeminiModel.clip_grad_norm_`` (the FSDP-style
call between backward and step).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from chunks import ChunkGroup, Tier
from gemini.engine.runtime import GeminiRuntime
from gemini.parallel.collectives import Collectives
from gemini.parallel.zero import agree_grad_ready, sharded_grad_norm

__all__ = ["CLIP_EPS", "clip_coefficient", "clip_model_grad_norm_", "grad_norm", "scale_grads_"]

# torch.nn.utils.clip_grad_norm_ adds this to the norm before dividing.
CLIP_EPS = 1e-6


def grad_norm(groups: Sequence[ChunkGroup], tiers: dict[int, Tier], param_order: dict[int, int], *,
              zero: Collectives | None = None, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm (fp32, on the first gradient's device) of every gradient that arrived since zero_grad,
    as stored (loss-scaled under fp16: divide by the scale).

    [Note: clipping like torch]
    torch.nn.utils.clip_grad_norm_ takes one norm per parameter, in the model's parameter order, and the norm of
    those. Doing the same (not one norm per chunk) costs nothing and keeps results bit-identical to PyTorch: gradients
    that are rounding noise (a key projection's bias, zero in exact arithmetic) would otherwise differ in every bit,
    and Adam would amplify the difference.
    """
    norm_type = float(norm_type)
    if zero is not None:  # over every rank's shards: the same on all ranks
        if norm_type != 2.0:
            raise ValueError(f"norm_type={norm_type} is not supported under ZeRO: the norm is summed over ranks "
                             f"from squared pieces; use norm_type=2.0")
        return sharded_grad_norm(zero, groups, tiers, param_order)
    views: list[tuple[int, torch.Tensor]] = []
    for g in groups:
        tier = tiers[g.index]
        for slot in g.slots:
            if g.grad_ready[slot.index]:
                views.append((param_order[id(g.params[slot.index])], g.grad.flat_view(slot, tier)))
    if not views:
        return torch.zeros((), dtype=torch.float32)
    views.sort(key=lambda t: t[0])
    norms = torch._foreach_norm([v for _, v in views], norm_type, dtype=torch.float32)
    # Summed where the first gradient lies, as torch does: on CUDA a CPU sum differs in the last bit.
    first = views[0][1].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor | None:
    """``min(1, max_norm / (norm + 1e-6))`` in fp32 as torch computes it; None when it is 1."""
    coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
    return None if coef.item() == 1.0 else coef


def scale_grads_(groups: Sequence[ChunkGroup], tiers: dict[int, Tier], coef: torch.Tensor) -> None:
    """Multiply every stored gradient by ``coef`` in place (whole chunks: padding and slots without a gradient hold
    zeros or are overwritten before they are read)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in groups:
        c = g.step_grad
        n = g.os_numel if g.grad_shard is not None else c.used_numel
        view = c.payload(tiers[g.index])[:n]
        by_device.setdefault(view.device, []).append(view)
    for device, views in by_device.items():
        torch._foreach_mul_(views, coef.to(device))


def clip_model_grad_norm_(rt: GeminiRuntime, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``GeminiModel.clip_grad_norm_``: the total norm of the gradients in ``rt``'s chunks (unscaled under fp16);
    above ``max_norm``, every gradient is scaled down in place."""
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm >= 0:
        raise ValueError(f"max_norm={max_norm!r} is invalid: expected a number >= 0")
    if rt.scaler is not None:  # fp16: an unscaled pass's norm would be divided by a scale it never had
        rt.scaler.refuse_unscaled(rt.grads_cleared_at_pass)
    rt.grad_views.hide()  # what torch code did to p.grad counts
    with torch.no_grad():
        groups = rt.manager.trainable_groups
        if rt.zero is not None:
            agree_grad_ready(rt.zero, groups, rt.residency.reducer,  # see [Note: the order of collectives]
                             forwards_raised=rt.forwards_raised, step=False)
        groups = [g for g in groups if g.any_grad_ready]
        tiers = {g.index: g.step_grad.primary_tier for g in groups}
        norm = grad_norm(groups, tiers, rt.param_order, zero=rt.zero, norm_type=norm_type)
        if rt.scaler is not None:
            norm = norm / rt.scaler.scale
        coef = clip_coefficient(norm, float(max_norm))
        if coef is not None:
            scale_grads_(groups, tiers, coef)
    rt.grad_views.expose()
    return norm
