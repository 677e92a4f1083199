"""Weights written out of chunks as safetensors, one chunk group at a time.

[Note: writing safetensors a group at a time]
A safetensors file is an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and byte
range, then the raw bytes. Every shape and dtype is known before any value is read, so :func:`save_pretrained`
computes every shard's header first, then visits the chunk groups in order (a group's fp32 master read from NVMe
once, not Adam's m and v; under ZeRO gathered from every rank) and writes each tensor's bytes at its offset. Files
are written under temporary names and renamed when complete.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from gemini.module import GeminiModel, gemini_model
from gemini.parallel.zero import gather_state
from gemini.peft import is_peft_model, save_adapter
from gemini.pretrained.format import _NAMES, _SHARD_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, _element_size
from offload import byte_view, format_size, parse_size

logger = logging.getLogger(__name__)


@dataclass
class _Out:
    key: str
    tensor: torch.Tensor  # the module's parameter or buffer
    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str = ""
    offset: int = 0  # absolute byte offset in the file

    @property
    def nbytes(self) -> int:
        n = _element_size(self.dtype)
        for d in self.shape:
            n *= d
        return n


def _plan_shards(outs: list[_Out], max_shard_bytes: int) -> list[list[_Out]]:
    """Greedy in key order, like transformers: a new shard when the next tensor would overflow the current one; a
    tensor larger than the limit gets a shard of its own."""
    shards: list[list[_Out]] = []
    size = 0
    for o in outs:
        if not shards or (shards[-1] and size + o.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(o)
        size += o.nbytes
    return shards or [[]]


def _header(tensors: list[_Out]) -> bytes:
    """The shard's header, and each tensor's absolute offset set: larger elements first so that every tensor's bytes
    are aligned to its element size (as safetensors itself orders them)."""
    ordered = sorted(tensors, key=lambda o: -_element_size(o.dtype))  # stable: key order within a size
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for o in ordered:
        header[o.key] = {"dtype": _NAMES[o.dtype], "shape": list(o.shape), "data_offsets": [pos, pos + o.nbytes]}
        o.offset = pos
        pos += o.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    for o in ordered:
        o.offset += 8 + len(text)
    return len(text).to_bytes(8, "little") + text


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def save_pretrained(model: GeminiModel, folder: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                    dtype: torch.dtype | None = None) -> list[Path]:
    """Write ``model``'s weights (a :class:`~gemini.GeminiModel` from ``initialize``) to ``folder`` as safetensors,
    in the layout ``transformers``' ``save_pretrained`` writes and ``from_pretrained`` / ``initialize(...,
    weights=folder)`` read: ``model.safetensors``, or ``model-0000k-of-0000n.safetensors`` shards of at most
    ``max_shard_size`` (``"5GB"`` is 5 * 10**9 bytes, ``"5GiB"`` 5 * 2**30) and ``model.safetensors.index.json``. Keys
    are the wrapped module's ``state_dict`` keys, a tied parameter under its first name only (like transformers);
    values are the fp32 masters, or cast to ``dtype``. ``config.json`` (and ``generation_config.json``) are written
    too when the module is a Hugging Face model.

    Streamed: one chunk group's values in memory at a time (see [Note: writing safetensors a group at a time]). Under
    ZeRO a collective: every rank calls it, rank 0 writes. Returns the weight files written (on rank 0; an empty list
    elsewhere).
    """
    model = gemini_model(model, "save_pretrained")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in _NAMES):
        raise ValueError(f"dtype={dtype!r} is invalid: expected None (the fp32 masters) or a floating-point torch "
                         f"dtype safetensors stores ({sorted(str(d) for d in _NAMES if d.is_floating_point)})")
    max_bytes = parse_size(max_shard_size, field="max_shard_size")
    if max_bytes <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be positive")
    if is_peft_model(model.module):  # PEFT's adapter files: see [Note: PEFT models] in gemini/peft.py
        return save_adapter(model, folder, dtype=dtype)
    runtime = model._runtime
    manager, zero = runtime.manager, runtime.zero
    writer = manager.rank == 0
    folder = Path(folder)
    started = time.perf_counter()

    module = model.module
    params = {id(p) for p in module.parameters()}
    outs: list[_Out] = []
    seen: set[int] = set()
    for key, t in module.state_dict(keep_vars=True).items():
        if id(t) in seen:
            continue  # a tied parameter: written once, under its first name
        seen.add(id(t))
        if id(t) in params:
            # The shape from the slot: under ZeRO-3 a parameter's .data is empty between uses.
            shape = tuple(manager.locate(t)[1].shape)
            out_dtype = dtype or torch.float32
        else:
            shape = tuple(t.shape)
            out_dtype = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if out_dtype not in _NAMES:
            raise ValueError(f"{key} has dtype {out_dtype}, which safetensors cannot store")
        outs.append(_Out(key, t, shape, out_dtype))
    shards = _plan_shards(outs, max_bytes)
    n = len(shards)
    names = [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    headers = []
    for name, shard in zip(names, shards):
        headers.append(_header(shard))
        for o in shard:
            o.file = name
    by_tensor = {id(o.tensor): o for o in outs}

    fds: dict[str, int] = {}
    tmp = {name: folder / f"{name}.tmp{os.getpid()}" for name in names}
    try:
        if writer:
            folder.mkdir(parents=True, exist_ok=True)
            for name, shard, header in zip(names, shards, headers):
                fd = fds[name] = os.open(tmp[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                _pwrite_all(fd, memoryview(header), 0)
                os.ftruncate(fd, len(header) + sum(o.nbytes for o in shard))

        def write(o: _Out, value: torch.Tensor) -> None:
            if writer:
                data = value.detach().reshape(-1).to("cpu", o.dtype).contiguous().view(torch.uint8)
                _pwrite_all(fds[o.file], byte_view(data), o.offset)  # keeps data alive: a view of it

        # Every rank walks the groups in the same order (under ZeRO gather_state is a collective).
        for group in manager.groups:
            # Masters on NVMe are read once per group, and only they (not Adam's m and v).
            resident = (runtime.nvme.resident(group, modify=False, chunks=(group.master,))
                        if runtime.nvme is not None and group.master is not None else contextlib.nullcontext())
            with resident:
                src = group.master_chunk
                full = gather_state(zero, group, src) if group.is_shard(src) else src.payload()
                for slot, p in zip(group.slots, group.params):
                    write(by_tensor[id(p)], full[slot.offset : slot.end])
                del full
        for o in outs:
            if id(o.tensor) not in params:
                write(o, o.tensor)
        if writer:
            for name in names:
                os.fsync(fds[name])
                os.close(fds.pop(name))
                os.replace(tmp[name], folder / name)
            _remove_stale(folder, keep=set(names))
            if n > 1:
                index = {"metadata": {"total_size": sum(o.nbytes for o in outs),
                                      "total_parameters": sum(manager.locate(o.tensor)[1].shape.numel()
                                                              for o in outs if id(o.tensor) in params)},
                         "weight_map": {o.key: o.file for o in outs}}
                index_tmp = folder / f"{SAFE_WEIGHTS_INDEX_NAME}.tmp{os.getpid()}"
                index_tmp.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
                os.replace(index_tmp, folder / SAFE_WEIGHTS_INDEX_NAME)
            _save_hf_configs(module, folder, dtype or torch.float32)
    finally:
        for fd in fds.values():
            os.close(fd)
        for path in tmp.values():
            path.unlink(missing_ok=True)
    if zero is not None:
        zero.barrier()  # on return the folder is complete for every rank
    if not writer:
        return []
    total = sum(o.nbytes for o in outs)
    logger.info("save_pretrained: %d tensors, %s in %d file(s) under %s in %.2f s", len(outs), format_size(total), n,
                folder, time.perf_counter() - started)
    return [folder / name for name in names]


def _remove_stale(folder: Path, keep: Iterable[str]) -> None:
    """Weight files of an earlier save in another layout (single file vs shards) would confuse a reader: remove them,
    as transformers does."""
    keep = set(keep)
    for path in folder.iterdir():
        if path.name in keep:
            continue
        if path.name == SAFE_WEIGHTS_NAME or _SHARD_NAME.fullmatch(path.name) or (
                path.name == SAFE_WEIGHTS_INDEX_NAME and len(keep) == 1):
            path.unlink()


def _save_hf_configs(module: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """``config.json`` (with the written dtype and the architecture, as transformers records them) and
    ``generation_config.json`` for a Hugging Face model; nothing for other modules."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    config.dtype = str(dtype).split(".")[1]
    config.architectures = [type(module).__name__]
    config.save_pretrained(folder)
    can_generate = getattr(module, "can_generate", None)
    generation = getattr(module, "generation_config", None)
    if callable(can_generate) and can_generate() and generation is not None:
        generation.save_pretrained(folder)
