"""A model built on the meta device and no weights: each module's parameters get storage and their values from its
own ``reset_parameters()`` when the chunk manager first needs them."""

from __future__ import annotations

import torch
from torch import nn

from chunks import TensorSlot, ValueSource, values_of_params


def _meta_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, owning module, attribute) of every buffer on the meta device."""
    out = []
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                out.append((f"{mod_name}.{name}" if mod_name else name, module, name))
    return out


def _reset_source(model: nn.Module) -> ValueSource:
    """Values of parameters on the meta device from their module's ``reset_parameters()``, run when the first of the
    module's parameters is needed (see [Note: a model that never exists whole in RAM] in gemini/pretrained/load.py);
    real parameters give their own values."""
    owner: dict[int, tuple[str, nn.Module]] = {}
    for mod_name, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None:
                owner.setdefault(id(p), (mod_name, module))
    problems = []
    meta_owners = {}
    for p in model.parameters():
        if p.is_meta:
            name, module = owner[id(p)]
            meta_owners[name] = module
    for name, module in meta_owners.items():
        label = f"{name or '(the root module)'} ({type(module).__name__})"
        if not callable(getattr(module, "reset_parameters", None)):
            problems.append(f"{label} has parameters on the meta device and no reset_parameters()")
        elif any(p is not None and not p.is_meta for p in module._parameters.values()):
            # reset_parameters() would overwrite the real ones too, which may already be in a chunk.
            problems.append(f"{label} has parameters both on the meta device and real; its reset_parameters() "
                            f"would overwrite the real ones")
    if len(problems) > 12:  # a deep model repeats the same module class many times
        problems[12:] = [f"... and {len(problems) - 12} more"]
    buffers = [name for name, _, _ in _meta_buffers(model)]
    if buffers:
        problems.append(f"buffers on the meta device {buffers} (reset_parameters() is not trusted to set them; "
                        f"build the model with accelerate.init_empty_weights(include_buffers=False), the default)")
    if problems:
        raise ValueError(f"cannot initialize {type(model).__name__} without weights: " + "; ".join(problems)
                         + "; pass gemini.initialize(..., weights=<safetensors file or folder>) instead")

    def source(param: nn.Parameter, slot: TensorSlot, start: int, stop: int) -> torch.Tensor:
        if param.is_meta:
            name, module = owner[id(param)]
            # Only this module's own parameters become real; swap_tensors keeps each Parameter object (ties, optimizer
            # references) while giving it storage.
            for p in module._parameters.values():
                if p is not None and p.is_meta:
                    real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    torch.utils.swap_tensors(p, real)
            module.reset_parameters()
        return values_of_params(param, slot, start, stop)

    return source


def tie_meta_weights(model: nn.Module) -> None:
    """Tie a Hugging Face model's weights again if it has parameters on the meta device.

    ``accelerate.init_empty_weights()`` re-wraps every parameter as it is registered, which unties what the
    constructor tied (``lm_head.weight`` and ``embed_tokens.weight``); ``from_pretrained`` ties them again after
    loading, and so do we before the chunks are laid out, so a tied pair is one parameter with one chunk slot."""
    tie = getattr(model, "tie_weights", None)
    if callable(tie) and any(p.is_meta for p in model.parameters()):
        tie()

