"""Checkpoint files: consolidated (one file, any world size) or sharded (one file per rank).

- Consolidated: ``model.state_dict()`` (the wrapped module's keys, full fp32 values: a plain
  ``nn.Module`` loads it) and ``optimizer.state_dict()`` (``torch.optim.AdamW``'s format), both
  gathered from every rank's shards and written by rank 0. It loads into any number of ranks:
  each rank takes its own range of every tensor.
- Sharded: each rank writes its own ranges (``optimizer.sharded_state_dict()``) and the
  module's buffers, with no communication; it loads only into the same world size and layout.

Under ZeRO both functions are collectives: every rank of the group calls them.

Safety:

- A checkpoint holds only tensors and plain Python data (dicts, lists, tuples, str, numbers,
  bool, None), and ``load_checkpoint`` reads it with ``torch.load(weights_only=True)``: loading a
  file never runs code from it. A file holding anything else (a pickled object) is refused with
  ``pickle.UnpicklingError`` naming the file.
- Every tensor's CRC-32 (``zlib.crc32`` of its bytes) is stored under the ``"checksums"`` key,
  by its path in the saved dict (``"optimizer/state/3/exp_avg"``), and checked on load; torch
  itself does not check the zip records' CRCs when reading. A mismatch raises
  ``CheckpointCorruptionError`` naming the tensor and the file, before anything is loaded.
  Files written before checksums existed load without the check.
- A file is written to a temporary name in the same folder (``<name>.gemini-tmp.<host>.<pid>``),
  flushed and fsync'ed, renamed over the target and the folder fsync'ed: after a crash or a
  power loss the name holds either the previous complete checkpoint or the new one. The
  temporary file is removed on any failure, and temporaries of writers no longer running on
  this host are removed by the next save into the folder. A full disk raises
  ``CheckpointDiskFullError`` (an ``OSError`` with errno ENOSPC) saying how many bytes were
  short; the previous checkpoint stays intact.
"""

from __future__ import annotations

import copy
import errno
import logging
import os
import pickle
import re
import shutil
import socket
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch
from torch import nn

from gemini.module import GeminiModel
from gemini.optim.hybrid_adam import HybridAdam
from offload import byte_view

__all__ = ["CheckpointCorruptionError", "CheckpointDiskFullError", "load_checkpoint", "save_checkpoint"]

logger = logging.getLogger(__name__)

_CHECKSUMS = "checksums"
_TMP_MARK = ".gemini-tmp."
# <target name>.gemini-tmp.<host>.<pid>; the host may hold dots, the pid is the last field.
_TMP_RE = re.compile(r"^(?P<target>.+)\.gemini-tmp\.(?P<host>.+)\.(?P<pid>[1-9][0-9]*)$")
# What torch's zip writer says when a write came up short (the OSError may not be chained).
_ZIP_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed", "iostream error")
# What torch.load(weights_only=True) accepts besides tensors and containers.
_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.Size, torch.dtype, torch.device)


class CheckpointCorruptionError(ValueError):
    """A tensor read from a checkpoint does not match the CRC-32 recorded when it was saved."""

    def __init__(self, message: str, *, path: str, tensor: str) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class CheckpointDiskFullError(OSError):
    """The disk filled up while writing a checkpoint (errno ENOSPC); the previous file is intact.

    ``needed_bytes`` is the size of the tensor data to write, ``free_bytes`` what the file system
    had free once the partial file was removed, ``short_bytes`` the difference (at least 0)."""

    def __init__(self, message: str, *, path: str, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(errno.ENOSPC, message, path)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.short_bytes = max(needed_bytes - free_bytes, 0)


def _shard_file(folder: Path, rank: int, world: int) -> Path:
    return folder / f"rank{rank:05d}-of-{world:05d}.pt"


# ------------------------------------------------------------------------ plain data, checksums
def _plain(obj: Any, where: str) -> Any:
    """``obj`` as weights_only-loadable data: numpy scalars become Python numbers; anything
    torch.load(weights_only=True) would refuse raises here, at save time, naming its path, so a
    checkpoint that cannot be loaded is never written."""
    if isinstance(obj, torch.Tensor) or type(obj) in _PLAIN:  # exact: torch refuses subclasses (np.float64)
        return obj
    if type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0:
        return _plain(obj.item(), where)  # a numpy scalar (say an lr computed with numpy)
    if isinstance(obj, dict):
        # An OrderedDict keeps its class (a state_dict its _metadata); torch refuses other subclasses.
        out = copy.copy(obj) if type(obj) in (dict, OrderedDict) else dict(obj)
        for k, v in obj.items():
            out[k] = _plain(v, _join(where, k))
        return out
    if type(obj) in (list, tuple):  # exact: torch refuses a namedtuple
        return type(obj)(_plain(v, _join(where, i)) for i, v in enumerate(obj))
    raise TypeError(f"checkpoint value {where!r} is a {type(obj).__module__}.{type(obj).__qualname__}: a checkpoint "
                    f"holds only tensors and plain Python data (dict, list, tuple, str, int, float, bool, None) so "
                    f"that loading it never runs code; store it as one of those")


def _join(where: str, key: Any) -> str:
    return f"{where}/{key}" if where else str(key)


def _tensors(obj: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` with its path of keys, ``"optimizer/state/3/exp_avg"``."""
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, _join(where, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, _join(where, i))


def _crc32(t: torch.Tensor) -> int | None:
    if t.layout is not torch.strided:
        return None  # sparse / nested tensors have no single byte buffer to check
    flat = t.detach().cpu().contiguous()
    return zlib.crc32(byte_view(flat))  # the bytes as they are in memory: any dtype, bf16 included


def _checksums(obj: Any) -> dict[str, int]:
    return {where: crc for where, t in _tensors(obj) if (crc := _crc32(t)) is not None}


def _verify(state: dict[str, Any], file: Path) -> None:
    """Check every tensor against the CRC-32 saved with it (files from before checksums: none)."""
    saved = state.pop(_CHECKSUMS, None)
    if saved is None:
        logger.debug("checkpoint %s has no checksums (written before they existed): not verified", file)
        return
    seen = set()
    for where, t in _tensors(state):
        crc = _crc32(t)
        if crc is None:
            continue
        seen.add(where)
        if where not in saved:
            raise CheckpointCorruptionError(f"checkpoint {file}: tensor {where!r} has no recorded checksum: the file "
                                            f"is damaged or was altered", path=str(file), tensor=where)
        if crc != saved[where]:
            raise CheckpointCorruptionError(
                f"checkpoint {file}: tensor {where!r} (shape {tuple(t.shape)}, {t.dtype}) reads back with CRC-32 "
                f"{crc:#010x} but was saved with {saved[where]:#010x}: the file is damaged", path=str(file), tensor=where)
    missing = sorted(set(saved) - seen)
    if missing:
        raise CheckpointCorruptionError(f"checkpoint {file}: tensor(s) {missing[:5]} recorded when it was saved are "
                                        f"missing: the file is damaged or was altered", path=str(file), tensor=missing[0])


# ------------------------------------------------------------------------------------ writing
def _storage_bytes(obj: Any) -> int:
    """The tensor bytes torch.save writes: each storage once, whole (a view saves all of it)."""
    storages = {}
    for _, t in _tensors(obj):
        if t.layout is torch.strided:
            s = t.untyped_storage()
            storages[(s.device, s.data_ptr())] = s.nbytes()
    return sum(storages.values())


def _sweep_stale_temps(folder: Path) -> None:
    """Remove temporaries left by writers that died on this host (a crash cannot clean up, and
    checkpoints are large). Another host's pid says nothing here; a live writer's file stays."""
    host, me = socket.gethostname(), os.getpid()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        m = _TMP_RE.match(name)
        if m is None or m["host"] != host:
            continue
        pid = int(m["pid"])
        if pid == me or psutil.pid_exists(pid):
            continue
        try:
            os.unlink(folder / name)
            logger.warning("removed %s: a temporary checkpoint of process %d, which is no longer running",
                           folder / name, pid)
        except FileNotFoundError:
            pass  # another rank swept it first
        except OSError as e:
            logger.warning("could not remove stale temporary checkpoint %s: %s", folder / name, e)


def _fsync_folder(folder: Path) -> None:
    if not hasattr(os, "O_DIRECTORY"):
        return  # Windows: no directory handles to fsync; the rename is durable as NTFS makes it
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)  # the rename itself reaches the disk, not just the file's bytes
    finally:
        os.close(fd)


def _disk_full(exc: BaseException, path: Path, needed: int) -> CheckpointDiskFullError | None:
    """``exc`` as a disk-full error, or None when it is something else."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain)
    zip_short = isinstance(exc, RuntimeError) and any(s in str(exc) for s in _ZIP_WRITE_FAILED)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = 0
    if not enospc and not (zip_short and free < needed):
        return None
    short = needed - free
    detail = (f"disk full: {short} bytes short" if short > 0 else
              f"disk full (ENOSPC; {free} bytes free now, another writer or a quota may have taken the space)")
    return CheckpointDiskFullError(
        f"{detail} writing checkpoint {path}: its tensors need {needed} bytes, {path.parent} has {free} free; "
        f"the previous file at that name is intact", path=str(path), needed_bytes=needed, free_bytes=free)


def _atomic_save(obj: dict[str, Any], path: Path) -> None:
    """Write ``obj`` and its checksums at ``path`` durably, all or nothing (see the module doc)."""
    folder = path.parent
    obj = _plain(obj, "")
    obj[_CHECKSUMS] = _checksums(obj)
    _sweep_stale_temps(folder)
    tmp = folder / f"{path.name}{_TMP_MARK}{socket.gethostname()}.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)  # first: the free space below counts without our partial file
        full = _disk_full(exc, path, _storage_bytes(obj)) if isinstance(exc, Exception) else None
        if full is not None:
            raise full from exc
        raise
    _fsync_folder(folder)


def _buffers(model: GeminiModel) -> dict[str, torch.Tensor]:
    own = model.module.state_dict(keep_vars=True)
    return {k: v.detach().cpu().clone() for k, v in own.items() if not isinstance(v, nn.Parameter)}


def save_checkpoint(path: str | os.PathLike, model: GeminiModel, optimizer: HybridAdam, *,
                    sharded: bool = False) -> None:
    """Write a consolidated checkpoint file at ``path`` (rank 0 writes), or with ``sharded`` one
    file per rank into the folder ``path``.

    Durable and all or nothing: a crash, an error or a full disk (``CheckpointDiskFullError``)
    leaves the previous file at ``path`` intact. Only tensors and plain Python data are written;
    a param-group value of another type raises ``TypeError`` naming it."""
    zero, manager = optimizer._rt.zero, optimizer._rt.manager
    rank, world = manager.rank, manager.world
    path = Path(path)
    if sharded:
        path.mkdir(parents=True, exist_ok=True)
        _atomic_save({"buffers": _buffers(model), "optimizer": optimizer.sharded_state_dict()},
                     _shard_file(path, rank, world))
    else:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            _atomic_save(state, path)
    if zero is not None:
        zero.barrier()  # on return the checkpoint is complete for every rank


def _load(file: Path) -> dict[str, Any]:
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = next((line.strip() for line in str(e).splitlines() if "WeightsUnpickler error" in line), str(e)[:300])
        raise pickle.UnpicklingError(
            f"refused to load checkpoint {file}: it holds objects other than tensors and plain Python data "
            f"({why}). gemini loads checkpoints with torch.load(weights_only=True) so that loading a file never runs "
            f"code from it, and save_checkpoint writes only such data; if you trust this file, read it with "
            f"torch.load(..., weights_only=False) yourself and pass its parts to model.load_state_dict / "
            f"optimizer.load_state_dict") from None  # torch's own advice is to turn the check off
    except RuntimeError as e:  # a truncated or mangled zip: torch's message does not name the file
        raise RuntimeError(f"could not read checkpoint {file}: {e}") from e
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {file} holds a {type(state).__name__}, not the dict save_checkpoint writes")
    _verify(state, file)
    return state


def load_checkpoint(path: str | os.PathLike, model: GeminiModel, optimizer: HybridAdam | None = None, *,
                    sharded: bool = False) -> None:
    """Load what ``save_checkpoint`` wrote (the optimizer part only if ``optimizer`` is given).

    Reads with ``torch.load(weights_only=True)`` (a file holding pickled objects is refused with
    ``pickle.UnpicklingError``: loading never runs code from the file) and checks every tensor
    against its saved CRC-32 (``CheckpointCorruptionError`` names the tensor and the file) before
    anything is loaded into the model or the optimizer."""
    path = Path(path)
    if sharded:
        if optimizer is None:
            raise ValueError("a sharded checkpoint holds the parameters in the optimizer's masters: pass the optimizer")
        if path.is_file():
            raise ValueError(f"load_checkpoint({str(path)!r}, sharded=True): that is a file; sharded=True reads the "
                             f"folder save_checkpoint(..., sharded=True) wrote (load a file with sharded=False)")
        rank, world = optimizer._rt.manager.rank, optimizer._rt.manager.world
        file = _shard_file(path, rank, world)
        if not file.exists():
            found = sorted(p.name for p in path.glob("rank*-of-*.pt"))
            raise FileNotFoundError(f"no shard {file.name} in {path} for rank {rank} of {world} (found {found}); "
                                    f"a sharded checkpoint loads only into the world size that saved it")
        state = _load(file)
        with torch.no_grad():
            own = model.module.state_dict(keep_vars=True)
            for key, value in state["buffers"].items():
                own[key].copy_(value)
        optimizer.load_sharded_state_dict(state["optimizer"])
        return
    if path.is_dir():
        raise ValueError(f"load_checkpoint({str(path)!r}): that is a folder; a sharded checkpoint (the folder "
                         f"save_checkpoint(..., sharded=True) wrote) loads with sharded=True")
    state = _load(path)
    if optimizer is not None:
        optimizer.check_state_dict(state["optimizer"])  # a state that does not fit leaves the model as it was
    model.load_state_dict(state["model"])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
