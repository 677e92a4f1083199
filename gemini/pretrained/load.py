"""Weights streamed from safetensors into chunks: the checkpoint's keys matched to the model's parameters and
buffers, and the value source the chunks are filled from.

[Note: a model that never exists whole in RAM]
``gemini.initialize(model, cfg, weights=PATH)`` takes a model whose parameters may be on the meta device
(``accelerate.init_empty_weights()``). Before anything is allocated the checkpoint's headers are checked against the
model (missing, unexpected and mis-shaped keys fail together, named). Then :class:`~chunks.ChunkManager` builds the
chunk groups one by one and asks a *value source* for each group's tensors just before filling its chunks ([Note:
where a chunk's first values come from] in chunks/manager.py). Here the source reads, with ``os.preadv`` at the
header's offset, only the range the group needs (under ZeRO-3, this rank's piece), and the chunk casts it to its dtype
(compute dtype for parameters, fp32 for the master). A group is complete, and the NVMe tier may be writing it out,
before the next is read, so host memory holds one group's values at a time. Files are read with positioned reads, not
memory-mapped: touched pages of a mapping count in the resident set while it lives, which for a large checkpoint
would look like (and under memory pressure behave like) holding the whole model.

Without ``weights``, meta parameters are initialized module by module: when the manager first asks for one of a
module's parameters, that module's own parameters get storage and its ``reset_parameters()`` runs; each value lives
until its group is built and its ``.data`` re-pointed into the chunk.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from chunks import TensorSlot, ValueSource
from gemini.module import GeminiModel, gemini_model
from gemini.pretrained.meta_init import _meta_buffers, _reset_source
from gemini.pretrained.reader import SafetensorsCheckpoint, WeightsError
from offload import format_size

logger = logging.getLogger(__name__)


@dataclass
class PreparedValues:
    """What ``initialize`` registers the model from: a value source, and what it read."""

    source: ValueSource
    checkpoint: SafetensorsCheckpoint | None = None
    started: float = 0.0

    def close(self) -> None:
        if self.checkpoint is not None:
            self.checkpoint.close()
            logger.info("read %s of weights from %s in %.2f s", format_size(self.checkpoint.bytes_read),
                        self.checkpoint.path, time.perf_counter() - self.started)


def _keys_by_tensor(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, list[str]]]:
    """The module's state_dict (keep_vars) and, per tensor, every key it appears under (tied parameters appear under
    several), in state_dict order."""
    own = model.state_dict(keep_vars=True)
    keys: dict[int, list[str]] = {}
    for key, t in own.items():
        keys.setdefault(id(t), []).append(key)
    return own, keys


def prepare_values(model: nn.Module, weights: str | os.PathLike | None) -> PreparedValues:
    """Check ``weights`` (or, without, the modules on the meta device) against ``model`` and return the value source
    ``ChunkManager.register`` fills the chunks from. Buffers are loaded here (they are small and stay outside chunks).
    Raises :class:`WeightsError` / ``ValueError`` naming every problem before anything is allocated."""
    if weights is None:
        return PreparedValues(_reset_source(model))
    started = time.perf_counter()
    checkpoint = SafetensorsCheckpoint(weights)
    try:
        source = _file_source(model, checkpoint)
    except BaseException:
        checkpoint.close()
        raise
    return PreparedValues(source, checkpoint, started)


def _check_keys(model: nn.Module, ckpt: SafetensorsCheckpoint, *, shape_of=lambda t: tuple(t.shape),
                problems: Iterable[str] = ()) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """Match the checkpoint's keys to the module's state_dict, strictly (like ``load_state_dict``): returns (the
    state_dict with keep_vars, tensor -> the key its value is read from), or raises :class:`WeightsError` listing
    every missing, unexpected and mis-shaped key (and ``problems``)."""
    own, keys = _keys_by_tensor(model)
    entries = ckpt.entries
    missing, mismatched = [], []
    key_of: dict[int, str] = {}
    for key, t in own.items():
        if id(t) in key_of:
            continue
        present = [k for k in keys[id(t)] if k in entries]
        if not present:
            # Tied parameters need only one of their names (HF checkpoints omit the duplicates).
            missing.extend(k for k in keys[id(t)] if k not in missing)
            continue
        key_of[id(t)] = present[0]
        for k in present:
            if entries[k].shape != shape_of(t):
                mismatched.append(f"{k}: checkpoint {list(entries[k].shape)}, model {list(shape_of(t))}")
    unexpected = [k for k in entries if k not in own]
    found = [f"missing keys {missing}"] if missing else []
    found += [f"unexpected keys {unexpected}"] if unexpected else []
    found += ["size mismatch for " + "; ".join(mismatched)] if mismatched else []
    found += list(problems)
    hint = _prefix_hint(missing, unexpected)
    found += [hint] if hint else []
    if found:
        raise WeightsError(f"the weights in {ckpt.path} do not match {type(model).__name__}: " + "; ".join(found))
    return own, key_of


def _common_prefix(longer: list[str], shorter: list[str]) -> tuple[str, int]:
    """The prefix (whole dotted components) that most often turns a key of ``shorter`` into one of ``longer``, and
    how many keys of ``shorter`` it does that for ("", 0 if none)."""
    targets, counts = set(shorter), {}
    for key in longer:
        for i, c in enumerate(key):
            if c == "." and key[i + 1:] in targets:
                counts[key[:i + 1]] = counts.get(key[:i + 1], 0) + 1
    return max(counts.items(), key=lambda kv: kv[1], default=("", 0))


def _prefix_hint(missing: list[str], unexpected: list[str]) -> str | None:
    """Why the keys may not match, when most of the file's unmatched keys are the missing ones less or plus one
    prefix: weights of the base model (``LlamaModel``) loaded into a model with a head (``LlamaForCausalLM``, keys
    with "model."), the reverse, or a wrapper's (torch.compile's "_orig_mod.", DDP's "module."). Transformers'
    ``from_pretrained`` adds or strips the base model's prefix itself; loading stays strict here, so this only
    says so."""
    lacks, n_lacks = _common_prefix(missing, unexpected)
    has, n_has = _common_prefix(unexpected, missing)
    if n_lacks >= n_has and 2 * n_lacks >= len(unexpected) > 0:
        return (f"hint: the file's keys lack the prefix {lacks!r} the model's keys have ({n_lacks} of the "
                f"{len(unexpected)} unexpected keys are missing keys without it): were the weights saved from the "
                f"base model (LlamaModel for LlamaForCausalLM)? Load them into that class, or save the full model")
    if n_has and 2 * n_has >= len(missing):
        return (f"hint: the file's keys have the prefix {has!r} the model's keys lack ({n_has} of the "
                f"{len(missing)} missing keys are unexpected keys without it): were the weights saved from a model "
                f"holding this one (a class with a head; torch.compile's '_orig_mod.', DDP's 'module.')? Load them "
                f"into that model, or save this one")
    return None


def _load_buffers(model: nn.Module, own: dict[str, torch.Tensor], key_of: dict[int, str],
                  ckpt: SafetensorsCheckpoint) -> None:
    """Buffers (small, outside chunks): a meta one replaced by the checkpoint's value, a real one overwritten in place
    (cast to its dtype)."""
    params = {id(p) for p in model.parameters()}
    loaded: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for key, t in own.items():
            if id(t) in params:
                continue
            if id(t) not in loaded:
                loaded[id(t)] = ckpt.read(key_of[id(t)]).reshape(t.shape).to(t.dtype)
            value = loaded[id(t)]
            mod_name, _, attr = key.rpartition(".")
            module = model.get_submodule(mod_name)
            if module._buffers[attr].is_meta:
                module._buffers[attr] = value
            elif module._buffers[attr] is not value:
                module._buffers[attr].copy_(value)


def _file_source(model: nn.Module, ckpt: SafetensorsCheckpoint) -> ValueSource:
    persistent = {id(t) for t in model.state_dict(keep_vars=True).values()}
    meta_unloaded = [name for name, module, attr in _meta_buffers(model)
                     if id(module._buffers[attr]) not in persistent]
    problems = [f"non-persistent buffers on the meta device, which no checkpoint holds: {meta_unloaded} (build the "
                f"model with accelerate.init_empty_weights(include_buffers=False), the default, so that buffers are "
                f"real)"] if meta_unloaded else []
    own, key_of = _check_keys(model, ckpt, problems=problems)
    _load_buffers(model, own, key_of, ckpt)

    def source(param: nn.Parameter, slot: TensorSlot, start: int, stop: int) -> torch.Tensor:
        return ckpt.read(key_of[id(param)], start, stop)

    return source


def load_pretrained_into(model: GeminiModel, weights: str | os.PathLike) -> None:
    """Overwrite an initialized model's weights (and persistent buffers) from safetensors, streamed like
    ``initialize(..., weights=...)``: per chunk group, each tensor's needed range is read once and written into the
    parameter chunk (or its ZeRO-3 shard) and the fp32 master; a master on NVMe is read and written back once. Keys
    are checked as strictly. Adam's states are untouched. Under ZeRO each rank reads its own ranges; no collective."""
    model = gemini_model(model, "load_pretrained_into")
    runtime = model._runtime
    manager = runtime.manager
    params = {id(p) for p in model.module.parameters()}

    def shape_of(t: torch.Tensor) -> tuple[int, ...]:
        # A parameter's shape from its slot: under ZeRO-3 its .data is empty between uses.
        return tuple(manager.locate(t)[1].shape) if id(t) in params else tuple(t.shape)

    with SafetensorsCheckpoint(weights) as ckpt, torch.no_grad():
        own, key_of = _check_keys(model.module, ckpt, shape_of=shape_of)
        _load_buffers(model.module, own, key_of, ckpt)
        for group in manager.groups:
            resident = (runtime.nvme.resident(group, modify=True, chunks=(group.master,))
                        if runtime.nvme is not None and group.master is not None else contextlib.nullcontext())
            with resident:
                manager.refill(group, lambda p, slot, start, stop: ckpt.read(key_of[id(p)], start, stop))
