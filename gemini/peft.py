"""PEFT models (LoRA and friends) under gemini: PEFT's adapter files written and read through gemini's model.

[Note: PEFT models]
A ``peft.PeftModel`` given to ``initialize`` trains as it does plain: its frozen base and its adapters are chunk
groups like any parameters. But what PEFT does around training goes through the parameters' ``.data``, which gemini
does not see: its ``save_pretrained`` reads the module's own ``state_dict`` (empty parameters under ZeRO-3; gemini's
writer would write the whole model, which PEFT cannot load), ``merge_adapter`` / ``merge_and_unload`` add into
``.data`` (lost when a device copy is dropped), and ``unload`` changes the module tree gemini laid out. So the adapter
is saved from gemini's values of the trainable parameters (gathered under ZeRO) by PEFT's own ``save_pretrained``,
loaded through gemini's ``load_state_dict`` by PEFT's ``set_peft_model_state_dict``, and merging is refused with the
way to do it on a plain model.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gemini.restructuring import refusing

if TYPE_CHECKING:
    from gemini.module import GeminiModel

__all__ = ["ADAPTER_FILE", "MERGING", "is_peft_model", "load_adapter_into", "merging_refused", "save_adapter"]

ADAPTER_FILE = "adapter_model.safetensors"  # what PEFT's save_pretrained writes (safetensors)

# PEFT's methods that write the merged weights through .data or replace modules.
MERGING = ("merge_adapter", "unmerge_adapter", "merge_and_unload", "unload")


def is_peft_model(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT model (duck-typed: peft is an optional dependency)."""
    return hasattr(module, "peft_config") and callable(getattr(module, "get_base_model", None))


def merging_refused(name: str) -> Any:
    """What ``model.<name>`` (one of MERGING) is on gemini's model: a function raising why not."""
    return refusing(name, f"model.{name}() on gemini's model is not supported: PEFT writes the merged weights through "
                          f"the parameters' .data (which gemini's chunks do not see) or replaces the modules gemini laid "
                          f"out. Save the adapter (model.save_pretrained(folder)) and merge on a plain model: "
                          f"PeftModel.from_pretrained(base_model, folder).merge_and_unload()")


def save_adapter(model: GeminiModel, folder: str | os.PathLike, *, dtype: torch.dtype | None = None,
                 **peft_options: Any) -> list[Path]:
    """PEFT's ``save_pretrained`` (``adapter_model.safetensors``, ``adapter_config.json``) of the adapter.

    The values are the trainable parameters' fp32 masters (or cast to ``dtype``). Under ZeRO a collective: every rank
    calls it, rank 0 writes. Returns the adapter files written (on rank 0; empty elsewhere)."""
    state = model.trainable_state_dict()  # a collective under ZeRO
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    runtime = model._runtime
    writer = runtime.manager.rank == 0
    if writer:
        model.module.save_pretrained(folder, state_dict=state, is_main_process=True, **peft_options)
    if runtime.zero is not None:
        runtime.zero.barrier()  # on return the folder is complete for every rank
    return sorted(Path(folder).rglob(ADAPTER_FILE)) if writer else []


def load_adapter_into(model: GeminiModel, folder: str | os.PathLike) -> None:
    """Load the adapter PEFT saved in ``folder`` through gemini's ``load_state_dict`` (all or nothing; a collective
    under ZeRO)."""
    from peft.utils import set_peft_model_state_dict  # the model is a PeftModel: peft is installed
    from safetensors.torch import load_file

    adapter = model.module.active_adapter
    set_peft_model_state_dict(model, load_file(Path(folder) / ADAPTER_FILE), adapter_name=adapter)
