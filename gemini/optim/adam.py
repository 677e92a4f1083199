"""The Adam / AdamW update as a pure function over flat tensors.

Bookkeeping (which chunks, where, step counts, loss scale, clipping) is in :mod:`gemini.optim.hybrid_adam` and
:mod:`gemini.optim.adam_batches`; here is only the math, in torch's fused kernels (vectorised on the CPU since torch
2.4, one multi-tensor launch on CUDA).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.adam import adam as _torch_adam

__all__ = ["adam_update"]


def adam_update(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    steps: Sequence[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled_weight_decay: bool,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adam step over lists of same-device fp32 tensors, in place.

    ``steps`` are 0-dim float32 tensors on the params' device, incremented here (torch's convention). Gradients are
    divided by ``grad_scale`` when given, which folds the fp16 loss scale into the kernel with no extra pass over the
    grads. ``decoupled_weight_decay`` selects AdamW (decay applied to the weights) over Adam (decay added to the
    gradient). Matches ``torch.optim.AdamW(fused=True)`` bit for bit.
    """
    if not params:
        return
    _torch_adam(
        list(params),
        list(grads),
        list(exp_avgs),
        list(exp_avg_sqs),
        [],
        list(steps),
        fused=True,
        grad_scale=grad_scale,
        found_inf=None,
        decoupled_weight_decay=decoupled_weight_decay,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=weight_decay,
        eps=eps,
        maximize=False,
    )
