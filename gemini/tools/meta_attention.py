"""``F.scaled_dot_product_attention`` in the planner's meta run, as the target device runs it.

[Note: attention on the meta device]
``F.scaled_dot_product_attention`` picks a kernel per call from the device, dtypes, shapes and strides, the mask and
``dropout_p``. On meta it always takes the math path, which materializes and saves the (batch, heads, query, key)
attention matrix; a fused kernel (flash, memory-efficient) saves only its inputs, its output and one log-sum-exp per
query row. So each call of the meta run is charged as the configured device would run it:
- on the CPU, torch itself is asked (``torch._fused_sdp_choice``, the choice the call makes) about small CPU
  stand-ins that keep everything the choice reads: dtypes, head counts and head dims, which sizes are 0, 1 or equal
  to which, the last dimension's stride, and ``requires_grad``. (In torch 2.13 the CPU's flash kernel refuses
  dropout, 3-D inputs and a mask that needs a gradient: those take the math path on the CPU too, matrix saved.)
- on CUDA there may be no device to ask: 4-D inputs take a fused kernel (flash and memory-efficient both support
  dropout and masks), anything else the math path, as does every call with all fused backends disabled
  (``torch.backends.cuda.enable_*_sdp(False)``).
A fused call goes to :class:`_FusedAttention`, a stand-in with the fused kernel's output and saved tensors; a math
call to torch's own math path on meta, which is what the device runs.

Why a dispatcher kernel and not a ``TorchFunctionMode``: autograd runs backward with an empty function-mode stack, so
an activation checkpoint's recompute (reentrant or not) would escape the mode, take the math path, and the
non-reentrant checkpoint would refuse its different saved tensors (``CheckpointError``). A kernel registered for
``aten::scaled_dot_product_attention`` at ``AutogradMeta`` is reached from anywhere, the recompute included;
:func:`attention_as_on` registers it for the meta run only (reference-counted across threads), and outside a meta run
on this thread it runs torch's own composite, unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.nn.attention import SDPBackend

__all__ = ["attention_as_on", "fused_on"]


class _FusedAttention(torch.autograd.Function):
    """Shapes and saved tensors of a fused attention kernel (see [Note: attention on the meta device])."""

    @staticmethod
    def forward(ctx, q, k, v):  # noqa: ANN001, ANN205
        if q.dim() == 4:
            # The fused kernels (CPU flash, CUDA flash and memory-efficient) write their output (batch, query, heads,
            # dim) in memory and return it transposed, so the usual ``y.transpose(1, 2).contiguous()`` copies nothing.
            b, h, t, _ = q.shape
            out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        else:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        # The kernel reads its output and log-sum-exp while it writes the gradients: recomputed by a checkpoint, they
        # live only as long as these names do.
        q, k, v, out, lse = ctx.saved_tensors
        # The fused backward kernels write their gradients (batch, sequence, heads, dim) too, so the ``view`` that
        # made the heads takes them back without a copy.
        grads = tuple(torch.empty_permuted(t.shape, (0, 2, 1, 3), dtype=t.dtype, device=t.device) if t.dim() == 4
                      else torch.empty_like(t) for t in (q, k, v))
        del out, lse
        return grads


def fused_on(device_type: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
             dropout_p: float, is_causal: bool, scale: float | None, enable_gqa: bool) -> bool:
    """Whether ``F.scaled_dot_product_attention`` with these arguments takes a fused kernel on ``device_type`` (see
    [Note: attention on the meta device])."""
    if device_type == "cpu":
        return _cpu_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    backends = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                torch.backends.cuda.cudnn_sdp_enabled())
    return q.dim() == 4 and any(backends)


def _cpu_choice(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa) -> bool:  # noqa: ANN001
    """torch's own choice on the CPU, asked about small stand-ins of the arguments."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or (attn_mask is not None and attn_mask.dim() > 4):
        return False  # the fused CPU kernel takes (batch, heads, sequence, dim) only
    # Batch and sequence sizes shrink (0 and 1 kept, equal sizes kept equal); head counts and head dims are kept: the
    # choice compares them (grouped heads divide). A mask lines up from the right with (batch, heads, query, key).
    args = [(t, ("batch", "heads", "seq", "dim")) for t in (q, k, v)]
    if attn_mask is not None:
        args.append((attn_mask, ("batch", "heads", "seq", "seq")[4 - attn_mask.dim():]))
    sizes = sorted({n for t, roles in args for n, r in zip(t.shape, roles) if r in ("batch", "seq")} - {0, 1})
    small = {n: i + 2 for i, n in enumerate(sizes)} | {0: 0, 1: 1}
    q, k, v, *mask = [_stand_in(t, [small[n] if r in ("batch", "seq") else n for n, r in zip(t.shape, roles)])
                      for t, roles in args]
    choice = torch._fused_sdp_choice(q, k, v, attn_mask=mask[0] if mask else None, dropout_p=dropout_p,
                                     is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return choice != int(SDPBackend.MATH)


def _stand_in(t: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """A small CPU tensor of ``shape`` with ``t``'s dtype, ``requires_grad``, broadcast (stride 0) dimensions and
    whether its last dimension is contiguous."""
    last_unit = t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] <= 1
    base = torch.empty(*shape, 1 if last_unit else 2, dtype=t.dtype)[..., 0]
    for i, (n, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and n > 1:
            base = base.narrow(i, 0, 1).expand(*base.shape[:i], shape[i], *base.shape[i + 1:])
    return base.detach().requires_grad_(t.requires_grad)


# The registration and the device each thread's meta run plans for.
_lock = threading.Lock()
_registered: list = []  # [torch.library.Library, users] while any meta run needs it
_local = threading.local()


def _meta_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,  # noqa: ANN001, ANN202
                    enable_gqa=False):
    device_type = getattr(_local, "device_type", None)
    if device_type is not None and fused_on(device_type, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        # Keys shared by head groups (enable_gqa) are read in place by the fused kernels, never repeated: the stand-in
        # keeps them at their own shape too.
        return _FusedAttention.apply(q, k, v)
    return torch.ops.aten.scaled_dot_product_attention.default.decompose(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


@contextlib.contextmanager
def attention_as_on(device_type: str) -> Iterator[None]:
    """Inside, attention on meta tensors on this thread is charged as ``device_type`` runs it (see
    [Note: attention on the meta device])."""
    with _lock:
        if not _registered:
            lib = torch.library.Library("aten", "IMPL")
            lib.impl("scaled_dot_product_attention", _meta_attention, "AutogradMeta")
            _registered[:] = [lib, 0]
        _registered[1] += 1
    before, _local.device_type = getattr(_local, "device_type", None), device_type
    try:
        yield
    finally:
        _local.device_type = before
        with _lock:
            _registered[1] -= 1
            if not _registered[1]:
                _registered.pop(0)._destroy()  # as torch.library._scoped_library does
                _registered.clear()
