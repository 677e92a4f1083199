"""`ModuleIdioms`: nn.Module's and DDP's methods that code calls on any model, as they mean on gemini's (a base of
``GeminiModel``): names, devices, DDP's contexts, DCP's names.

The wrapper holds the user's module as its child ``module``; these methods make it answer as that module does where
torch code reads names (state_dict's, with no "module." before them), and refuse what would move or cast parameters
gemini places itself.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from gemini.optim.group_specs import LAYOUT_NOT_KEPT

logger = logging.getLogger(__name__)

__all__ = ["ModuleIdioms"]


class ModuleIdioms:
    """Mixed into ``GeminiModel`` (an ``nn.Module`` with ``module``, ``_runtime`` and ``_compute_dtype``)."""

    module: nn.Module

    # The names state_dict() uses (the wrapped module's, no "module." before them), so code pairing parameters or
    # modules with a checkpoint's keys (an EMA kept as a state_dict, PEFT's get_peft_model_state_dict) finds them.
    # The wrapper itself is not among the modules, but is still the wrapped module's parent (children(), so train(),
    # eval() and apply() reach it).
    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        """The wrapped module's ``named_modules``: the names ``state_dict()`` has."""
        return self.module.named_modules(memo, prefix, remove_duplicate)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped module's ``named_parameters``: the names ``state_dict()`` has."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped module's ``named_buffers``: the names ``state_dict()`` has."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DDP's and FSDP's context for gradient-accumulation micro-batches, accepted so their loops run unchanged.

        Gradients accumulate as outside it; under ZeRO each backward still reduce-scatters (a sum of means is the mean
        of sums, so the step is the same; only DDP's saving of communication is lost)."""
        yield

    @contextlib.contextmanager
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Iterator[None]:
        """DDP's context for ranks with different numbers of batches: nothing to do in one process; refused under ZeRO,
        since a rank out of batches would have to join the other ranks' gathers and reductions of every forward,
        backward and step."""
        zero = self._runtime.zero
        if enable and zero is not None:
            raise RuntimeError(
                f"model.join() (DDP's uneven inputs) is not supported under gemini's ZeRO ({zero.world} ranks): every "
                f"rank must run the same forwards, backwards and steps, which are collectives. Give every rank the "
                f"same number of batches (DistributedSampler's default pads them to equal length; or drop_last=True)")
        yield

    def _fqn_modifiers(self) -> dict[str, str]:
        """torch.distributed.checkpoint.state_dict's contract for a module whose state_dict keys skip a child: each
        first name of a key -> "module", the child it lies under (else its set_state_dict looks for "module.<key>")."""
        inner = self.module
        return dict.fromkeys((n for named in (inner.named_children(), inner.named_parameters(recurse=False),
                                              inner.named_buffers(recurse=False)) for n, _ in named), "module")

    # ---------------------------------------------------------------------- devices
    def to(self, *args: Any, **kwargs: Any) -> ModuleIdioms:
        """A no-op when it asks for the compute device and precision already in force; anything else is refused:
        gemini decides where every parameter lives."""
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
            logger.warning("model.to(memory_format=%s) changes no parameter: %s", memory_format, LAYOUT_NOT_KEPT)
        mine = self._runtime.device
        if device is not None:
            device = torch.device(device)
            if device.type != mine.type or (device.index is not None and mine.index is not None
                                            and device.index != mine.index):
                raise RuntimeError(f"model.to({device}): gemini keeps this model's parameters in chunks for the "
                                   f"compute device {mine}; choose the device with GeminiConfig(device=...)")
        if dtype is not None and dtype != self._compute_dtype:
            raise RuntimeError(f"model.to({dtype}): gemini computes in {self._compute_dtype}; choose the precision "
                               f"with GeminiConfig(precision=...)")
        return self

    def cuda(self, device: Any = None) -> ModuleIdioms:
        return self.to(torch.device("cuda") if device is None else torch.device("cuda", device)
                       if isinstance(device, int) else device)

    def cpu(self) -> ModuleIdioms:
        return self.to("cpu")

    def half(self) -> ModuleIdioms:
        return self.to(torch.float16)

    def bfloat16(self) -> ModuleIdioms:
        return self.to(torch.bfloat16)

    def float(self) -> ModuleIdioms:
        return self.to(torch.float32)

    def _apply(self, fn, recurse: bool = True):
        raise RuntimeError("gemini keeps this model's parameters in chunks: moving or casting them in place "
                           "(model.to/cuda/half/type/share_memory) is not supported; see GeminiConfig(device=..., "
                           "precision=...)")
