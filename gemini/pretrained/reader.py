"""Reading safetensors checkpoints: every file's header checked when the checkpoint is opened, then any element range
of a tensor read with positioned reads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gemini.pretrained.format import _DTYPES, _MAX_HEADER, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, _element_size
from offload import byte_view


class WeightsError(RuntimeError):
    """The checkpoint does not match the model (or cannot be read); the message lists every problem."""


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
    """The tensors of a safetensors checkpoint: one file, or a folder as ``save_pretrained`` writes it
    (``model.safetensors``, or shards listed by ``model.safetensors.index.json``).

    :meth:`read` returns any element range of a tensor, flat, in the file's dtype, reading only those bytes (see
    [Note: a model that never exists whole in RAM] in gemini/pretrained/load.py).
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

