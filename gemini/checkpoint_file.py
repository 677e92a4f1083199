"""A checkpoint file: plain data only, checksums over all of it, written durably and all or nothing, read with one
clear error for anything wrong with it (see the safety list in gemini/checkpoint.py's doc).

[Note: a checkpoint's checksums]
torch does not check the zip records' CRCs when reading, so the file carries its own:
- ``"checksums"``: each tensor's CRC-32 (``zlib.crc32`` of its bytes), by its path in the saved dict
  (``"optimizer/state/3/exp_avg"``);
- ``"structure_crc32"``: the CRC-32 of a canonical encoding of everything else (every key, the type and value of every
  number, string and flag, each tensor's path, dtype and shape, the ``"checksums"`` entry too). A flipped byte in the
  pickled structure would otherwise load silently (a huge learning rate, a parameter's state dropped) or fail far away
  with an error naming nothing.
Both are checked before anything is loaded; the file's top-level keys must be the ones save writes (a damaged key name
would otherwise hide a checksum). Files written before either existed load without that check.
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
import zipfile
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterator

import psutil
import torch

from offload import byte_view

__all__ = ["CheckpointCorruptionError", "CheckpointDiskFullError", "atomic_save", "read_checkpoint"]

logger = logging.getLogger(__name__)

_CHECKSUMS = "checksums"
_STRUCTURE = "structure_crc32"
_TMP_MARK = ".gemini-tmp."
# <target name>.gemini-tmp.<host>.<pid>; the host may hold dots, the pid is the last field.
_TMP_RE = re.compile(r"^(?P<target>.+)\.gemini-tmp\.(?P<host>.+)\.(?P<pid>[1-9][0-9]*)$")
# What torch's zip writer says when a write came up short (the OSError may not be chained).
_ZIP_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed", "iostream error")
# What the weights-only unpickler says of an object it refuses (not of damaged bytes).
_CODE_NEEDED = ("GLOBAL", "add_safe_globals", "unrecognized function")
# What torch.load(weights_only=True) accepts besides tensors and containers.
_PLAIN = (int, float, bool, str, bytes, complex, type(None), torch.Size, torch.dtype, torch.device)


class CheckpointCorruptionError(ValueError):
    """A checkpoint is damaged: a tensor (``tensor``, its path in the saved dict) or the rest of its content does not
    match the CRC-32 saved with it, or the file cannot be read or does not hold what save_checkpoint writes (then
    ``tensor`` is None). ``path`` is the file."""

    def __init__(self, message: str, *, path: str, tensor: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor = tensor


class CheckpointDiskFullError(OSError):
    """The disk filled up while writing a checkpoint (errno ENOSPC); the previous file is intact.

    ``needed_bytes`` is the size of the tensor data to write, ``free_bytes`` what the file system had free once the
    partial file was removed, ``short_bytes`` the difference (at least 0)."""

    def __init__(self, message: str, *, path: str, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(errno.ENOSPC, message, path)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        self.short_bytes = max(needed_bytes - free_bytes, 0)


# ------------------------------------------------------------------------ plain data, checksums
def _plain(obj: Any, where: str) -> Any:
    """``obj`` as weights_only-loadable data: numpy scalars become Python numbers; anything
    torch.load(weights_only=True) would refuse raises here, naming its path, so an unloadable checkpoint is never
    written."""
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


def _structure_crc32(obj: Any) -> int:
    """The CRC-32 of everything in ``obj`` but the tensors' bytes (see [Note: a checkpoint's checksums])."""
    return zlib.crc32(repr(_canonical(obj)).encode())


def _canonical(obj: Any) -> tuple:
    """``obj`` as nested tuples of str: the same for the same data, before saving and after loading."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", str(obj.dtype), tuple(obj.shape))  # its bytes have their own CRC
    if isinstance(obj, dict):
        return (type(obj).__name__, tuple((_canonical(k), _canonical(v)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, tuple(_canonical(v) for v in obj))
    if type(obj) is float:
        return ("float", obj.hex())  # exact, and equal to itself for a NaN
    return (type(obj).__name__, repr(obj))


def _verify(state: dict[str, Any], file: Path, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Check the top-level ``keys`` (those in ``optional`` may be absent, in files written before they existed), then
    the structure and every tensor against the CRC-32s saved with them (where the file has them)."""
    unexpected = sorted(set(state) - {*keys, _CHECKSUMS, _STRUCTURE}, key=str)
    missing = [k for k in keys if k not in state and k not in optional]
    if unexpected or missing:
        raise CheckpointCorruptionError(
            f"checkpoint {file} holds the keys {sorted(state, key=str)}, not {list(keys)}: it is damaged or not what "
            f"save_checkpoint writes{' (a sharded checkpoint loads with sharded=True)' if 'buffers' in state else ''}",
            path=str(file))
    structure = state.pop(_STRUCTURE, None)
    if structure is not None and structure != _structure_crc32(state):
        raise CheckpointCorruptionError(
            f"checkpoint {file}: its content besides the tensors (param groups, their hyperparameters, which parameters "
            f"have optimizer state, dict keys) reads back with CRC-32 {_structure_crc32(state):#010x} but was saved "
            f"with {structure:#010x}: the file is damaged", path=str(file))
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
    """Remove temporaries left by writers that died on this host (a crash cannot clean up, and checkpoints are
    large). Another host's pid says nothing here; a live writer's file stays."""
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


def atomic_save(obj: dict[str, Any], path: Path) -> None:
    """Write ``obj`` and its checksums at ``path`` durably, all or nothing (see the module doc)."""
    folder = path.parent
    obj = _plain(obj, "")
    obj[_CHECKSUMS] = _checksums(obj)
    obj[_STRUCTURE] = _structure_crc32(obj)  # of everything above, the tensor checksums too
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


def read_checkpoint(file: Path, *, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """The dict ``atomic_save`` wrote at ``file``, with the top-level ``keys`` (those of ``optional`` may be missing),
    verified and with the checksums removed.

    Anything wrong with the file raises one error naming it: ``CheckpointCorruptionError`` (empty, truncated,
    damaged, not a checkpoint), ``pickle.UnpicklingError`` (it holds objects that loading would have to run code
    for), ``FileNotFoundError``."""
    if file.stat().st_size == 0:
        raise CheckpointCorruptionError(f"checkpoint {file} is empty (0 bytes): it was not written completely",
                                        path=str(file))
    if not zipfile.is_zipfile(file):
        raise CheckpointCorruptionError(
            f"checkpoint {file} is not a checkpoint: torch.save writes a zip archive, and this file is not one "
            f"(truncated, overwritten, or another kind of file)", path=str(file))
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not any(s in str(e) for s in _CODE_NEEDED):
            raise _damaged(file, e) from e
        why = next((line.strip() for line in str(e).splitlines() if "WeightsUnpickler error" in line), str(e)[:300])
        raise pickle.UnpicklingError(
            f"refused to load checkpoint {file}: it holds objects other than tensors and plain Python data "
            f"({why}). gemini loads checkpoints with torch.load(weights_only=True) so that loading a file never runs "
            f"code from it, and save_checkpoint writes only such data; if you trust this file, read it with "
            f"torch.load(..., weights_only=False) yourself and pass its parts to model.load_state_dict / "
            f"optimizer.load_state_dict") from None  # torch's own advice is to turn the check off
    except Exception as e:  # a mangled zip or pickle: torch's message (if any) does not name the file
        raise _damaged(file, e) from e
    if not isinstance(state, dict):
        raise CheckpointCorruptionError(f"checkpoint {file} holds a {type(state).__name__}, not the dict "
                                        f"save_checkpoint writes", path=str(file))
    _verify(state, file, keys, optional)
    return state


def _damaged(file: Path, error: Exception) -> CheckpointCorruptionError:
    return CheckpointCorruptionError(f"could not read checkpoint {file}: it is damaged ({type(error).__name__}: "
                                     f"{str(error)[:300]})", path=str(file))
