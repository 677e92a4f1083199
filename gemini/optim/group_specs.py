"""The param groups ``gemini.initialize`` takes, checked and split: torch-style groups for
:class:`~gemini.optim.hybrid_adam.HybridAdam`, and the trainable parameters of each in model order for the chunk
layout (what the groups may become afterwards: :mod:`gemini.optim.param_groups`)."""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from gemini.optim.param_groups import check_flags

logger = logging.getLogger(__name__)

__all__ = ["check_hyperparams", "split_param_groups"]

_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")
# Other libraries' names for them (Keras, Hugging Face's TrainingArguments, optax): see [Note: the keys of a param group]
_OTHER_NAMES = {"learning_rate": "lr", "epsilon": "eps", "beta1": "betas", "beta2": "betas", "beta_1": "betas",
                "beta_2": "betas", "wd": "weight_decay", "decay": "weight_decay"}


def check_hyperparams(*, lr, betas, eps, weight_decay) -> None:
    """Raise ``ValueError`` naming the first hyperparameter out of range (initialize's, or a group's)."""
    value = lr.item() if isinstance(lr, torch.Tensor) and lr.numel() == 1 and lr.is_floating_point() else lr
    if not isinstance(value, (int, float)) or not (0.0 <= value < math.inf):  # a tensor lr as torch.optim takes it
        raise ValueError(f"lr={lr!r} is invalid: expected a finite number >= 0, or a one-element float tensor")
    if (
        not isinstance(betas, (tuple, list))
        or len(betas) != 2
        or not all(isinstance(b, (int, float)) and 0.0 <= b < 1.0 for b in betas)
    ):
        raise ValueError(f"betas={betas!r} is invalid: expected two numbers in [0, 1)")
    if not isinstance(eps, (int, float)) or not (0.0 <= eps < math.inf):
        raise ValueError(f"eps={eps!r} is invalid: expected a finite number >= 0")
    if not isinstance(weight_decay, (int, float)) or not (0.0 <= weight_decay < math.inf):
        raise ValueError(f"weight_decay={weight_decay!r} is invalid: expected a finite number >= 0")


def split_param_groups(model: nn.Module, param_groups):
    """(torch-style groups, named trainable params per group in model order, frozen params)."""
    named = list(model.named_parameters())  # tied parameters appear once, under their first name
    order = {p: i for i, (_, p) in enumerate(named)}
    name_of = {p: n for n, p in named}
    for n, p in named:
        if not p.is_floating_point():
            raise TypeError(f"parameter {n} has dtype {p.dtype}: gemini packs parameters into floating-point "
                            f"chunks{'' if p.requires_grad else f'; register a frozen {p.dtype} tensor as a buffer'}")
    _warn_mixed_dtypes(named)
    _warn_layouts_not_kept(named)
    _refuse_sparse_gradients(model)
    if param_groups is None:
        specs: list[dict[str, Any]] = [{"params": [p for _, p in named]}]
    else:
        specs = _validate_group_specs(param_groups, order, name_of)
        # Trainable parameters no group lists get a group of their own, frozen ones none: as a torch optimizer built
        # from the trainable parameters only (a LoRA recipe), so checkpoints load both ways. All are in chunks.
        listed = {p for spec in specs for p in spec["params"]}
        rest = [p for _, p in named if p not in listed and p.requires_grad]
        if rest:
            specs.append({"params": rest})
    torch_groups, named_groups = [], []
    for spec in specs:
        torch_groups.append(spec)
        trainable = sorted((p for p in spec["params"] if p.requires_grad), key=order.__getitem__)
        named_groups.append([(name_of[p], p) for p in trainable])
    frozen = [(n, p) for n, p in named if not p.requires_grad]
    return torch_groups, named_groups, frozen


def _refuse_sparse_gradients(model: nn.Module) -> None:
    """A sparse gradient has no slot in a dense gradient chunk; torch's Adam refuses it too."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            raise ValueError(f"module {name or 'model'} ({type(m).__name__}) has sparse=True: its weight would get "
                             f"sparse gradients, which gemini's chunks (and torch's Adam) do not support; build it "
                             f"with sparse=False (the default), or freeze its weight")


def _validate_group_specs(param_groups, order, name_of) -> list[dict[str, Any]]:
    if not isinstance(param_groups, (list, tuple)) or not param_groups:
        raise ValueError(f"param_groups={param_groups!r} is invalid: expected a non-empty list of dicts")
    seen: set = set()
    specs = []
    for i, spec in enumerate(param_groups):
        if not isinstance(spec, dict) or "params" not in spec:
            raise ValueError(f"param_groups[{i}] is invalid: expected a dict with a 'params' entry")
        _refuse_misspelt_keys(spec, i)
        params = spec["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params) if isinstance(params, Iterable) else None
        if params is None:
            raise ValueError(f"param_groups[{i}]['params'] must be an iterable of parameters")
        for p in params:
            if p not in order:
                raise ValueError(f"param_groups[{i}] holds a parameter of shape {tuple(p.shape)} that is not in the model")
            if p in seen:
                raise ValueError(f"parameter {name_of[p]} appears in more than one of param_groups")
            seen.add(p)
        hyper = {k: v for k, v in spec.items() if k != "params"}
        check_hyperparams(
            lr=hyper.get("lr", 0.0), betas=hyper.get("betas", (0.9, 0.999)),
            eps=hyper.get("eps", 0.0), weight_decay=hyper.get("weight_decay", 0.0),
        )
        specs.append({"params": params, **hyper})
    check_flags(specs, where="param_groups", advice="leave it out (gemini.initialize)")
    return specs


# [Note: the keys of a param group]
# torch keeps whatever keys a param group has (a name for logging, a recipe's "lr_scale" read by the user's scheduler,
# "initial_lr", torch's own flags in groups copied from a torch optimizer), and so does gemini. Two kinds are refused:
# torch's flags that ask for math the update lacks (check_flags), and a key a letter or two from a hyperparameter
# ("weight_decy") or another library's name for one ("epsilon"), which torch would keep and silently ignore.
def _refuse_misspelt_keys(spec: dict[str, Any], index: int) -> None:
    for key in spec:
        if key == "params" or key in _HYPERPARAMETERS or not isinstance(key, str):
            continue
        near = [_OTHER_NAMES[key]] if key in _OTHER_NAMES else difflib.get_close_matches(key, _HYPERPARAMETERS, n=1,
                                                                                          cutoff=0.85)
        if near:
            raise ValueError(f"param_groups[{index}] has the key {key!r}: did you mean {near[0]!r}? (the "
                             f"hyperparameters are {', '.join(_HYPERPARAMETERS)}; other keys are kept, as torch keeps them)")


LAYOUT_NOT_KEPT = ("gemini keeps every parameter contiguous in its chunk, so a parameter's memory format "
                   "(torch.channels_last, other strides) is not kept; torch picks a conv's channels_last kernels from "
                   "its input as well: x.to(memory_format=torch.channels_last)")


def _warn_layouts_not_kept(named: list[tuple[str, nn.Parameter]]) -> None:
    """Chunks hold each parameter as a flat slot viewed in its shape: a strided one becomes contiguous."""
    strided = [n for n, p in named if not p.is_contiguous()]
    if strided:
        logger.warning("%d of the model's parameters are not contiguous (like %r): %s", len(strided), strided[0],
                       LAYOUT_NOT_KEPT)


def _warn_mixed_dtypes(named: list[tuple[str, nn.Parameter]]) -> None:
    """Chunks hold one dtype (GeminiConfig.precision's): a model with several (an fp16 part in an fp32 model) gets
    all in that one, and a forward relying on the others may fail with a dtype mismatch; warn where it comes from."""
    first: dict[torch.dtype, tuple[str, int]] = {}
    for n, p in named:
        name, count = first.get(p.dtype, (n, 0))
        first[p.dtype] = (name, count + 1)
    if len(first) > 1:
        logger.warning(
            "the model's parameters have several dtypes (%s); gemini keeps every parameter in the dtype "
            "GeminiConfig.precision sets, so all of them change to it (convert the model to one dtype first "
            "to choose yourself)",
            ", ".join(f"{dtype}: {count} like {name!r}" for dtype, (name, count) in first.items()))
