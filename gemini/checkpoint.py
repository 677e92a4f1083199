"""Checkpoint files: consolidated (one file, any world size) or sharded (one file per rank).

- Consolidated: ``model.state_dict()`` (the wrapped module's keys, full fp32 values: a plain ``nn.Module`` loads it)
  and ``optimizer.state_dict()`` (``torch.optim.AdamW``'s format), gathered from every rank's shards and written by
  rank 0. It loads into any number of ranks: each rank takes its own range of every tensor.
- Sharded: each rank writes its own ranges (``optimizer.sharded_state_dict()``), the module's buffers and a manifest
  of where each parameter lies, with no communication. It loads as it is into the same world size, chunk layout and
  precision; into others, or with :func:`consolidate_checkpoint` (``python -m gemini consolidate``), its files are
  made whole first ([Note: a sharded checkpoint made whole] in gemini/consolidate.py).

Under ZeRO both functions are collectives: every rank of the group calls them.

Safety:

- A checkpoint holds only tensors and plain Python data (dicts, lists, tuples, str, numbers, bool, None), read with
  ``torch.load(weights_only=True)``: loading a file never runs code from it. A file holding anything else (a pickled
  object) is refused with ``pickle.UnpicklingError`` naming the file.
- Every tensor's CRC-32 is stored under ``"checksums"`` and the CRC-32 of everything else (param groups, which
  parameters have state, ...) under ``"structure_crc32"``; both are checked on load, since torch does not check the
  zip records' CRCs ([Note: a checkpoint's checksums] in gemini/checkpoint_file.py). A mismatch, or a file that cannot
  be read or does not hold what save wrote (empty, truncated, not a checkpoint), raises ``CheckpointCorruptionError``
  naming the file and what is wrong, before anything is loaded. Files written before the checksums existed load
  without them.
- A load is all or nothing: every check runs first, and a failure while writing (the NVMe tier's disk full) leaves the
  model and the optimizer as they were ([Note: a load is all or nothing] in gemini/engine/load_transaction.py).
- A file is written to a temporary name in the same folder (``<name>.gemini-tmp.<host>.<pid>``), flushed and
  fsync'ed, renamed over the target, and the folder fsync'ed: after a crash or power loss the name holds either the
  previous complete checkpoint or the new one. The temporary is removed on any failure, and temporaries of writers no
  longer running on this host are removed by the next save into the folder. A full disk raises
  ``CheckpointDiskFullError`` (an ``OSError`` with errno ENOSPC) saying how many bytes were short; the previous
  checkpoint stays intact.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from gemini.checkpoint_file import CheckpointCorruptionError, CheckpointDiskFullError, atomic_save, read_checkpoint
from gemini.consolidate import SHARD_KEYS, consolidate_checkpoint, manifest, shard_file, shard_files
from gemini.engine.load_transaction import LoadTransaction
from gemini.module import GeminiModel, gemini_model
from gemini.optim.hybrid_adam import HybridAdam

__all__ = ["CheckpointCorruptionError", "CheckpointDiskFullError", "consolidate_checkpoint", "load_checkpoint",
           "save_checkpoint"]

logger = logging.getLogger(__name__)


def _buffers(model: GeminiModel) -> dict[str, torch.Tensor]:
    own, memory = model.module.state_dict(keep_vars=True), model._runtime.memory
    return {k: memory.to_host(v) for k, v in own.items() if not isinstance(v, nn.Parameter)}


def save_checkpoint(path: str | os.PathLike, model: GeminiModel, optimizer: HybridAdam, *,
                    sharded: bool = False) -> None:
    """Write a consolidated checkpoint file at ``path`` (rank 0 writes), or with ``sharded`` one file per rank into
    the folder ``path``.

    Durable and all or nothing: a crash, an error or a full disk (``CheckpointDiskFullError``) leaves the previous
    file at ``path`` intact. Only tensors and plain Python data are written; a param-group value of another type
    raises ``TypeError`` naming it. ``model`` may be the ``torch.compile``d model: the keys are the uncompiled
    model's."""
    model = gemini_model(model, "save_checkpoint")
    zero, manager = optimizer._rt.zero, optimizer._rt.manager
    rank, world = manager.rank, manager.world
    path = Path(path)
    if sharded:
        path.mkdir(parents=True, exist_ok=True)
        atomic_save({"buffers": _buffers(model), "optimizer": optimizer.sharded_state_dict(),
                     "manifest": manifest(model, optimizer)}, shard_file(path, rank, world))
    else:
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if rank == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_save(state, path)
    if zero is not None:
        zero.barrier()  # on return the checkpoint is complete for every rank


def load_checkpoint(path: str | os.PathLike, model: GeminiModel, optimizer: HybridAdam | None = None, *,
                    sharded: bool = False) -> None:
    """Load what ``save_checkpoint`` wrote (the optimizer part only if ``optimizer`` is given).

    Reads with ``torch.load(weights_only=True)`` (pickled objects are refused with ``pickle.UnpicklingError``) and
    checks every tensor against its saved CRC-32 (``CheckpointCorruptionError`` names the tensor and the file) before
    anything is loaded into the model or the optimizer. A sharded checkpoint of another world size, chunk layout or
    precision is made whole first (:func:`consolidate_checkpoint`: every rank reads every rank's file)."""
    model = gemini_model(model, "load_checkpoint")
    path = Path(path)
    file = _file_to_load(path, optimizer, sharded=sharded)
    if file is not None:
        keys, optional = (SHARD_KEYS, ("manifest",)) if sharded else (("model", "optimizer"), ())
        state = read_checkpoint(file, keys=keys, optional=optional)  # files from before manifests load too
    # Another world's shards, or another chunk layout or precision: made whole, loaded as one.
    if file is not None and sharded and "manifest" in state:
        with _named(file):
            if not optimizer.fits_sharded_state_dict(state["optimizer"]):
                file = None
    if file is None:
        file, sharded = path, False
        state = consolidate_checkpoint(path)
        logger.info("%s: a sharded checkpoint of another world size or layout, made whole to load", path)
    model._runtime.manager.adopt_assigned()  # an assigned p.data is loaded into, as by load_state_dict
    with _named(file):  # every check before the first write; what fails names the file
        if sharded:
            optimizer.check_sharded_state_dict(state["optimizer"])
            buffers = _checked_buffers(model, state["buffers"], file)
        else:  # the model first: another model's keys are named there, not counted by the optimizer
            model._check_load(state["model"])
            if optimizer is not None:
                optimizer.check_state_dict(state["optimizer"])
    with LoadTransaction(model._runtime) as tx:  # both or neither: [Note: a load is all or nothing]
        if sharded:
            optimizer._load_sharded(state["optimizer"], tx)
            tx.later(functools.partial(_copy_buffers, buffers))
            return
        if optimizer is not None:
            optimizer._load_full(state["optimizer"], tx)
        model._load_into(state["model"], tx)


def _file_to_load(path: Path, optimizer: HybridAdam | None, *, sharded: bool) -> Path | None:
    """The file ``load_checkpoint`` reads: ``path``, or with ``sharded`` this rank's file in it (None: the folder
    holds only files of another world size)."""
    if not sharded:
        if path.is_dir():
            raise ValueError(f"load_checkpoint({str(path)!r}): that is a folder; a sharded checkpoint (the folder "
                             f"save_checkpoint(..., sharded=True) wrote) loads with sharded=True")
        return path
    if optimizer is None:
        raise ValueError("a sharded checkpoint holds the parameters in the optimizer's masters: pass the optimizer")
    if path.is_file():
        raise ValueError(f"load_checkpoint({str(path)!r}, sharded=True): that is a file; sharded=True reads the "
                         f"folder save_checkpoint(..., sharded=True) wrote (load a file with sharded=False)")
    rank, world = optimizer._rt.manager.rank, optimizer._rt.manager.world
    file = shard_file(path, rank, world)
    if file.exists():
        return file
    worlds = sorted(shard_files(path))
    if worlds and world not in worlds:
        return None
    raise FileNotFoundError(f"no shard {file.name} in {path} for rank {rank} of {world} (found the files of "
                            f"{worlds or 'no'} sharded checkpoint(s) of that many ranks)")


@contextlib.contextmanager
def _named(file: Path) -> Iterator[None]:
    """A check's error names ``file``; one saying the data is not what save writes (a missing key or index, a value
    of the wrong type: a damaged file from before the checksums) becomes a ``CheckpointCorruptionError``."""
    try:
        yield
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise CheckpointCorruptionError(
            f"checkpoint {file} does not hold what save_checkpoint writes ({type(e).__name__}: {e}): it is damaged "
            f"or not a gemini checkpoint; nothing was loaded", path=str(file)) from e
    except (ValueError, RuntimeError) as e:
        if e.args and isinstance(e.args[0], str) and str(file) not in e.args[0]:
            e.args = (f"checkpoint {file}: {e.args[0]}", *e.args[1:])
        raise


def _checked_buffers(model: GeminiModel, saved: dict[str, torch.Tensor], file: Path) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(the module's buffer, its saved value) for each saved buffer, once all are known to fit."""
    own = model.module.state_dict(keep_vars=True)
    pairs = []
    for key, value in saved.items():
        t = own.get(key)
        if t is None or isinstance(t, nn.Parameter) or tuple(t.shape) != tuple(value.shape):
            have = "no such buffer" if t is None or isinstance(t, nn.Parameter) else f"shape {tuple(t.shape)}"
            raise ValueError(f"checkpoint {file}: buffer {key!r} (shape {tuple(value.shape)}) does not fit the model "
                             f"({have}); nothing was loaded")
        pairs.append((t, value))
    return pairs


@torch.no_grad()
def _copy_buffers(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for buffer, value in pairs:
        buffer.copy_(value)
