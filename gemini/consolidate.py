"""A sharded checkpoint made whole, for any number of ranks (DeepSpeed's ``zero_to_fp32.py``).

[Note: a sharded checkpoint made whole]
``save_checkpoint(..., sharded=True)`` writes, per rank, its range of every chunk group's fp32 masters and Adam's m
and v (under ZeRO rank r holds ``[r * n, (r + 1) * n)`` of each group, see
[Note: ZeRO shards of a chunk] in chunks/shard.py; in one process the whole group), the step counts and the module's
buffers, with a manifest: where that range begins in each group, where each parameter sits (group, offset, shape) and
the optimizer's order of parameters. Laying each group's ranges end to end and cutting the parameters out gives
exactly what ``save_checkpoint(..., sharded=False)`` writes: the module's ``state_dict()`` (fp32 masters, tied
parameters under each of their keys) and AdamW's optimizer state, which loads into any number of ranks, or into a
plain ``nn.Module`` and ``torch.optim.AdamW``. Every file is read with its checksums verified; ranges that do not
tile their group (a file from another save) are refused. Memory: the whole checkpoint once (each group's ranges are
dropped as they are concatenated, and the tensors returned are views of the whole groups).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from gemini.checkpoint_file import CheckpointCorruptionError, read_checkpoint

if TYPE_CHECKING:
    from gemini.module import GeminiModel
    from gemini.optim.hybrid_adam import HybridAdam

__all__ = ["consolidate_checkpoint", "manifest", "shard_file", "shard_files"]

SHARD_KEYS = ("buffers", "optimizer", "manifest")
_SHARD_NAME = re.compile(r"^rank(\d{5})-of-(\d{5})\.pt$")


def shard_file(folder: Path, rank: int, world: int) -> Path:
    """Rank ``rank``'s file of a sharded checkpoint written by ``world`` ranks."""
    return folder / f"rank{rank:05d}-of-{world:05d}.pt"


def shard_files(folder: Path) -> dict[int, dict[int, Path]]:
    """The shard files in ``folder``: {world size: {rank: file}}."""
    found: dict[int, dict[int, Path]] = {}
    for file in folder.iterdir() if folder.is_dir() else ():
        m = _SHARD_NAME.match(file.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = file
    return found


def manifest(model: GeminiModel, optimizer: HybridAdam) -> dict[str, Any]:
    """What a sharded file needs besides its ranges for the checkpoint to be made whole."""
    manager = optimizer._rt.manager

    def where(p: nn.Parameter) -> list:
        group, slot = manager.locate(p)
        return [group.index, slot.offset, list(slot.shape), slot.index]

    own = model.module.state_dict(keep_vars=True)
    return {
        "world": manager.world,
        "keys": list(own),  # the state_dict's order, buffers included
        "params": {k: where(t) for k, t in own.items() if isinstance(t, nn.Parameter)},
        "optimizer": [where(p) for hp in optimizer.param_groups for p in hp["params"]],
        "param_group_sizes": [len(hp["params"]) for hp in optimizer.param_groups],
        # Where this rank's range of each group's masters, m and v begins.
        "starts": {g.index: g.shard.start if g.shard is not None else 0 for g in manager.groups},
    }


def read_shards(folder: Path, world: int | None = None) -> list[dict[str, Any]]:
    """Every rank's file of the sharded checkpoint in ``folder``, verified, rank 0 first (``world`` ranks; None: the
    one world size whose files are there)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} {'is a file, not' if folder.exists() else 'does not exist: expected'} the "
                                f"folder of a sharded checkpoint (one file per rank: save_checkpoint(..., sharded=True))")
    found = shard_files(folder)
    if world is None:
        if len(found) != 1:
            raise FileNotFoundError(f"{folder} holds no sharded checkpoint" if not found else
                                    f"{folder} holds the files of sharded checkpoints of {sorted(found)} ranks: "
                                    f"which one is meant?")
        world = next(iter(found))
    files = found.get(world, {})
    missing = [shard_file(folder, r, world).name for r in range(world) if r not in files]
    if missing:
        raise FileNotFoundError(f"the sharded checkpoint in {folder} lacks {missing[:4]}"
                                f"{' ...' if len(missing) > 4 else ''} of its {world} ranks' files")
    shards = []
    for rank in range(world):
        shard = read_checkpoint(files[rank], keys=SHARD_KEYS, optional=("manifest",))
        if "manifest" not in shard:
            raise ValueError(f"{files[rank]} was written before sharded checkpoints carried a manifest: load it into "
                             f"{world} rank(s) (load_checkpoint(..., sharded=True)) and save it again")
        shard["file"] = files[rank]
        shards.append(shard)
    return shards


def consolidate_checkpoint(path: str | Path) -> dict[str, Any]:
    """The sharded checkpoint in folder ``path`` (``save_checkpoint(..., sharded=True)``, any world size) as one.

    Returns ``{"model": state_dict, "optimizer": AdamW's state_dict}``, what ``save_checkpoint(..., sharded=False)``
    writes. See [Note: a sharded checkpoint made whole]."""
    shards = read_shards(Path(path))
    first, spec = shards[0], shards[0]["manifest"]
    masters, moments, steps = _whole_groups(shards)

    model: OrderedDict[str, torch.Tensor] = OrderedDict()
    tied: dict[tuple[int, int], torch.Tensor] = {}  # one value for the keys of one parameter
    for key in spec["keys"]:
        if key in spec["params"]:
            group, offset, shape, _ = spec["params"][key]
            if (group, offset) not in tied:
                tied[group, offset] = _cut(masters[group], offset, shape, key, first["file"])
            model[key] = tied[group, offset]
        else:
            model[key] = first["buffers"][key]

    state: dict[int, dict[str, torch.Tensor]] = {}
    for index, (group, offset, shape, slot) in enumerate(spec["optimizer"]):
        if group not in moments or float(steps[group][slot]) == 0:
            continue  # torch creates state at a parameter's first step
        m, v = moments[group]
        state[index] = {"step": steps[group][slot].clone(),
                        "exp_avg": _cut(m, offset, shape, f"exp_avg of parameter {index}", first["file"]),
                        "exp_avg_sq": _cut(v, offset, shape, f"exp_avg_sq of parameter {index}", first["file"])}
    param_groups, start = [], 0
    for saved, size in zip(first["optimizer"]["param_groups"], spec["param_group_sizes"], strict=True):
        param_groups.append({**saved, "params": list(range(start, start + size))})
        start += size
    optimizer = {"state": state, "param_groups": param_groups, "gemini": first["optimizer"]["gemini"]}
    return {"model": model, "optimizer": optimizer}


def _whole_groups(shards: list[dict[str, Any]]):
    """Per chunk group: the masters laid end to end over every rank, (m, v) likewise for groups with state, and the
    step counts."""
    masters, moments, steps = {}, {}, {}
    for group in shards[0]["optimizer"]["groups"]:
        pieces = sorted(((s["manifest"]["starts"][group], s["optimizer"]["groups"][group], s["file"]) for s in shards),
                        key=lambda piece: piece[0])
        end = 0
        for start, entry, file in pieces:
            if start != end:
                raise CheckpointCorruptionError(
                    f"{file}: chunk group {group}'s range begins at element {start}, the ranks before it end at {end}: "
                    f"the folder mixes files of different saves", path=str(file))
            end += entry["master"].numel()
        masters[group] = torch.cat([entry.pop("master") for _, entry, _ in pieces])
        if "exp_avg" in pieces[0][1]:
            moments[group] = tuple(torch.cat([entry.pop(k) for _, entry, _ in pieces]) for k in ("exp_avg", "exp_avg_sq"))
            steps[group] = pieces[0][1]["steps"]
    return masters, moments, steps


def _cut(flat: torch.Tensor, offset: int, shape: list[int], what: str, file: Path) -> torch.Tensor:
    n = math.prod(shape)
    if offset + n > flat.numel():
        raise CheckpointCorruptionError(f"{file}: {what} ends at element {offset + n} of a chunk group whose ranks "
                                        f"hold {flat.numel()}: the folder mixes files of different saves",
                                        path=str(file))
    return flat[offset : offset + n].view(shape)
