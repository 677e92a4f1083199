"""Weights in and out of chunks, streamed: safetensors files read (or a model initialized) one
chunk group at a time, and written back one chunk group at a time.

[Note: a model that never exists whole in RAM]
``gemini.initialize(model, cfg, weights=PATH)`` takes a model whose parameters may be on the
meta device (``accelerate.init_empty_weights()``). Before anything is allocated the checkpoint's
headers are checked against the model (missing, unexpected and mis-shaped keys fail together,
naming them). Then :class:`~chunks.ChunkManager` builds the chunk groups one by one and asks a
*value source* for each group's tensors just before it fills that group's chunks (see [Note:
where a chunk's first values come from] in chunks/manager.py): here the source reads the
tensor's bytes from its file with ``os.preadv`` at the offset the header gives — only the range
the group needs (under ZeRO with parameter sharding, this rank's piece) — and the chunk casts
them to its dtype (the compute dtype for the parameters, fp32 for the master). A group is
complete, and the NVMe tier may already be writing it out, before the next group is read, so
host memory holds a group's values at a time. The files are read with plain positioned reads,
not memory-mapped: pages of a mapping that were touched count in the process's resident set
for as long as the mapping lives, which for a large checkpoint would look like — and under
memory pressure behave like — holding the whole model.

Without ``weights``, parameters on the meta device are initialized module by module: when the
manager first asks for one of a module's parameters, that module's own parameters get real
storage and its ``reset_parameters()`` runs; each parameter's value then lives until its group
is built and its ``.data`` re-pointed into the chunk.

[Note: writing safetensors a group at a time]
A safetensors file is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the raw bytes. Every shape and dtype is known before
any value is read, so :func:`save_pretrained` computes every shard's header first, then visits
the chunk groups in order — with a group's fp32 master read from NVMe once (not Adam's m and
v), and under ZeRO gathered from every rank — and writes each tensor's bytes at its offset. Files are written
under temporary names and renamed when complete.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from chunks import TensorSlot, ValueSource, values_of_params
from gemini.module import GeminiModel
from gemini.parallel.zero import gather_state
from offload import byte_view, format_size, parse_size

logger = logging.getLogger(__name__)

__all__ = [
    "PreparedValues",
    "SafetensorsCheckpoint",
    "WeightsError",
    "load_pretrained_into",
    "prepare_values",
    "save_pretrained",
    "tie_meta_weights",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")

# safetensors dtype names (see the format's specification) <-> torch dtypes.
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header

if sys.byteorder != "little":  # the format is little-endian; we copy raw bytes both ways
    raise ImportError("gemini.pretrained reads and writes safetensors' little-endian bytes as they are: "
                      "a big-endian machine is not supported")


class WeightsError(RuntimeError):
    """The checkpoint does not match the model (or cannot be read); the message lists every problem."""


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class _Entry:
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset of the tensor's first byte in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _read_header(path: Path) -> dict[str, _Entry]:
    """The tensors of one safetensors file, from its header (no tensor byte is read)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise WeightsError(f"{path} is not a safetensors file: {size} bytes, shorter than the 8-byte "
                                   f"header length")
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise WeightsError(f"{path} is not a safetensors file (or is truncated): header length {n}, "
                                   f"file size {size}")
            header = json.loads(f.read(n))
    except OSError as e:
        raise WeightsError(f"cannot read {path}: {e}") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path} is not a safetensors file: its header is not JSON ({e})") from e
    base = 8 + n
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info.get("dtype") not in _DTYPES:
            raise WeightsError(f"{path}: tensor {key} has dtype {info.get('dtype')!r}, not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[info["dtype"]]
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        entry = _Entry(path, dtype, shape, base + begin, end - begin)
        if entry.nbytes != entry.numel * _element_size(dtype) or base + end > size:
            raise WeightsError(f"{path}: tensor {key} ({info['dtype']} {list(shape)}) has byte range [{begin}, {end}) "
                               f"that does not match its shape or lies beyond the end of the file ({size} bytes)")
        out[key] = entry
    return out


class SafetensorsCheckpoint:
    """The tensors of a safetensors checkpoint: one file, or a folder as ``save_pretrained``
    writes it (``model.safetensors``, or shards listed by ``model.safetensors.index.json``).

    :meth:`read` returns any element range of a tensor, flat, in the file's dtype, reading only
    those bytes (see [Note: a model that never exists whole in RAM]).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files = self._files(self.path)
        self.entries: dict[str, _Entry] = {}
        for file in self.files:
            for key, entry in _read_header(file).items():
                if key in self.entries:
                    raise WeightsError(f"tensor {key} is in both {self.entries[key].file} and {file}")
                self.entries[key] = entry
        self.bytes_read = 0
        self._fds: dict[Path, int] = {}

    @staticmethod
    def _files(path: Path) -> list[Path]:
        index = None
        if path.is_dir():
            if (path / SAFE_WEIGHTS_INDEX_NAME).is_file():
                index = path / SAFE_WEIGHTS_INDEX_NAME
            elif (path / SAFE_WEIGHTS_NAME).is_file():
                return [path / SAFE_WEIGHTS_NAME]
            else:
                found = sorted(p.name for p in path.iterdir())[:20]
                raise WeightsError(f"weights folder {path} has neither {SAFE_WEIGHTS_INDEX_NAME} nor "
                                   f"{SAFE_WEIGHTS_NAME} (it holds {found}); pass a .safetensors file or a folder "
                                   f"written by save_pretrained")
        elif path.name.endswith(".index.json") and path.is_file():
            index = path
        elif path.is_file():
            return [path]
        else:
            raise WeightsError(f"weights {path} does not exist")
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"cannot read the index {index}: {e!r}; expected JSON with a 'weight_map'") from e
        files = [index.parent / name for name in dict.fromkeys(weight_map.values())]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise WeightsError(f"the index {index} names shard files that do not exist: {absent}")
        return files

    def read(self, key: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Elements ``[start, stop)`` of tensor ``key`` flattened, a new CPU tensor in the file's dtype."""
        entry = self.entries[key]
        stop = entry.numel if stop is None else stop
        if not 0 <= start <= stop <= entry.numel:
            raise IndexError(f"range [{start}, {stop}) outside tensor {key} of {entry.numel} elements")
        size = _element_size(entry.dtype)
        out = torch.empty((stop - start) * size, dtype=torch.uint8)
        fd = self._fds.get(entry.file)
        if fd is None:
            fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
        view, offset = byte_view(out), entry.start + start * size
        done = 0
        while done < len(view):  # preadv may return fewer bytes than asked (large reads, signals)
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise WeightsError(f"{entry.file} ended early reading {key} (byte {offset + done}): truncated file?")
            done += n
        self.bytes_read += done
        return out.view(entry.dtype)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------ initialize's sources
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
    """The module's state_dict (keep_vars) and, per tensor, every key it appears under (tied
    parameters appear under several), in state_dict order."""
    own = model.state_dict(keep_vars=True)
    keys: dict[int, list[str]] = {}
    for key, t in own.items():
        keys.setdefault(id(t), []).append(key)
    return own, keys


def _meta_buffers(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(qualified name, owning module, attribute) of every buffer on the meta device."""
    out = []
    for mod_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                out.append((f"{mod_name}.{name}" if mod_name else name, module, name))
    return out


def prepare_values(model: nn.Module, weights: str | os.PathLike | None) -> PreparedValues:
    """Check ``weights`` (or, without, the modules on the meta device) against ``model`` and return
    the value source ``ChunkManager.register`` fills the chunks from. Buffers are loaded here
    (they are small and stay outside chunks). Raises :class:`WeightsError` / ``ValueError``
    naming every problem before anything is allocated."""
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
    """Match the checkpoint's keys to the module's state_dict, strictly (like ``load_state_dict``):
    returns (the state_dict with keep_vars, tensor -> the key its value is read from), or raises
    :class:`WeightsError` listing every missing, unexpected and mis-shaped key (and ``problems``)."""
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
    if found:
        raise WeightsError(f"the weights in {ckpt.path} do not match {type(model).__name__}: " + "; ".join(found))
    return own, key_of


def _load_buffers(model: nn.Module, own: dict[str, torch.Tensor], key_of: dict[int, str],
                  ckpt: SafetensorsCheckpoint) -> None:
    """Buffers (small, outside chunks): a meta one replaced by the checkpoint's value, a real one
    overwritten in place (cast to its dtype)."""
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
    """Overwrite an initialized model's weights (and persistent buffers) from safetensors, streamed
    like ``initialize(..., weights=...)``: per chunk group, each tensor's needed range read once
    and written into the parameter chunk (or its ZeRO-3 shard) and the fp32 master, a master on
    NVMe read and written back once. Keys are checked as strictly. Adam's states are untouched.
    Under ZeRO every rank reads its own ranges; no collective."""
    if not isinstance(model, GeminiModel):
        raise TypeError(f"load_pretrained_into takes the model gemini.initialize returned, got {type(model).__name__}")
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

def _reset_source(model: nn.Module) -> ValueSource:
    """Values of parameters on the meta device from their module's ``reset_parameters()``, run
    when the first of the module's parameters is needed (see [Note: a model that never exists
    whole in RAM]); real parameters give their own values."""
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
            # Only this module's own parameters become real; swap_tensors keeps each Parameter
            # object (ties, optimizer references) while giving it storage.
            for p in module._parameters.values():
                if p is not None and p.is_meta:
                    real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)
                    torch.utils.swap_tensors(p, real)
            module.reset_parameters()
        return values_of_params(param, slot, start, stop)

    return source


def tie_meta_weights(model: nn.Module) -> None:
    """Tie a Hugging Face model's weights again if it has parameters on the meta device.

    ``accelerate.init_empty_weights()`` re-wraps every parameter as it is registered, which
    unties what the model's constructor tied (``lm_head.weight`` and ``embed_tokens.weight``);
    ``from_pretrained`` ties them again after loading, and so do we, before the chunks are laid
    out, so that a tied pair is one parameter with one chunk slot."""
    tie = getattr(model, "tie_weights", None)
    if callable(tie) and any(p.is_meta for p in model.parameters()):
        tie()


# ---------------------------------------------------------------------------------- writing
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
    """Greedy in key order, like transformers: a new shard when the next tensor would overflow
    the current one; a tensor larger than the limit gets a shard of its own."""
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
    """The shard's header, and each tensor's absolute offset set: larger elements first so that
    every tensor's bytes are aligned to its element size (as safetensors itself orders them)."""
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
    """Write ``model``'s weights (a :class:`~gemini.GeminiModel` from ``initialize``) to ``folder``
    as safetensors, in the layout ``transformers``' ``save_pretrained`` writes and
    ``from_pretrained`` / ``initialize(..., weights=folder)`` read: ``model.safetensors``, or
    ``model-0000k-of-0000n.safetensors`` shards of at most ``max_shard_size`` (``"5GB"`` is
    5 * 10**9 bytes, ``"5GiB"`` 5 * 2**30) and ``model.safetensors.index.json``. Keys are the
    wrapped module's ``state_dict`` keys, a tied parameter under its first name only (like
    transformers); values are the fp32 masters, or cast to ``dtype``. ``config.json`` (and
    ``generation_config.json``) are written too when the module is a Hugging Face model.

    Streamed: one chunk group's values in memory at a time (see [Note: writing safetensors a
    group at a time]). Under ZeRO a collective: every rank calls it, rank 0 writes. Returns the
    weight files written (on rank 0; an empty list elsewhere).
    """
    if not isinstance(model, GeminiModel):
        raise TypeError(f"save_pretrained takes the model gemini.initialize returned, got {type(model).__name__}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype not in _NAMES):
        raise ValueError(f"dtype={dtype!r} is invalid: expected None (the fp32 masters) or a floating-point torch "
                         f"dtype safetensors stores ({sorted(str(d) for d in _NAMES if d.is_floating_point)})")
    max_bytes = parse_size(max_shard_size, field="max_shard_size")
    if max_bytes <= 0:
        raise ValueError(f"max_shard_size={max_shard_size!r} must be positive")
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
    """Weight files of an earlier save in another layout (single file vs shards) would confuse a
    reader: remove them, as transformers does."""
    keep = set(keep)
    for path in folder.iterdir():
        if path.name in keep:
            continue
        if path.name == SAFE_WEIGHTS_NAME or _SHARD_NAME.fullmatch(path.name) or (
                path.name == SAFE_WEIGHTS_INDEX_NAME and len(keep) == 1):
            path.unlink()


def _save_hf_configs(module: nn.Module, folder: Path, dtype: torch.dtype) -> None:
    """``config.json`` (with the written dtype and the architecture, as transformers records them)
    and ``generation_config.json`` for a Hugging Face model; nothing for other modules."""
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
