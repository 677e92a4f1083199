"""HybridAdam's two checkpoint formats, as functions over the runtime's chunk groups.

- **Full** (``state_dict`` / ``load_state_dict``): ``torch.optim.AdamW``'s format, per parameter ``step``,
  ``exp_avg``, ``exp_avg_sq`` on the CPU. Under ZeRO it is consolidated (a collective), so it loads into any number
  of ranks, or into a plain ``torch.optim.AdamW``.
- **Sharded** (``sharded_state_dict`` / ``load_sharded_state_dict``): this rank's ranges of the chunks as they are,
  with no communication; it loads only into the same layout, which its ``layout`` signature records.

Both carry the hyper-state: the param groups' values (lr, betas, ...) under ``param_groups`` and, under ``gemini``,
the precision, AdamW mode, loss scaler and step count. Loading changes no value before every check has passed.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any

import torch

from chunks import ChunkGroup
from gemini.optim.loss_scaler import DynamicLossScaler
from gemini.parallel.zero import gather_state

if TYPE_CHECKING:
    from gemini.engine.load_transaction import LoadTransaction
    from gemini.engine.runtime import GeminiRuntime

__all__ = [
    "full_state_dict",
    "hyper_state",
    "load_full_state_dict",
    "check_sharded_state_dict",
    "load_hyper_state",
    "load_sharded_state_dict",
    "param_state",
    "same_layout",
    "steps_reported",
    "sharded_state_dict",
]

ParamGroups = list[dict[str, Any]]
HyperState = tuple[list[dict[str, Any]], dict[str, Any]]  # (param groups less "params", the "gemini" entry)


# --------------------------------------------------------------------------- hyper-state
def hyper_state(param_groups: ParamGroups, *, precision: str, adamw_mode: bool,
                scaler: DynamicLossScaler | None, steps_reported: int) -> HyperState:
    """What both formats save besides the states: each param group's values, and the run's precision, AdamW mode,
    loss scaler and count of steps taken (skipped ones included)."""
    groups = [{k: v for k, v in hp.items() if k != "params"} for hp in param_groups]
    extra = {"precision": precision, "adamw_mode": adamw_mode, "steps_reported": steps_reported}
    if scaler is not None:
        extra["loss_scaler"] = scaler.state_dict()
    return groups, extra


def load_hyper_state(param_groups: ParamGroups, scaler: DynamicLossScaler | None,
                     saved_groups: list[dict[str, Any]], extra: dict[str, Any]) -> None:
    """Each param group's values replaced by the saved ones, as torch's ``load_state_dict`` does (a key the state
    lacks is removed); the group dicts and their ``params`` stay the same objects."""
    for saved, hp in zip(saved_groups, param_groups):
        params = hp["params"]
        hp.clear()
        hp.update((k, tuple(v) if k == "betas" else v) for k, v in saved.items())  # betas may be a list
        hp["params"] = params
    if scaler is not None and "loss_scaler" in extra:
        scaler.load_state_dict(extra["loss_scaler"])


def steps_reported(state_dict: dict[str, Any]) -> int:
    """How many steps the run that saved ``state_dict`` had taken, so a resumed run's reports go on numbering from
    there (as DeepSpeed's global step does). For a state saved by torch's AdamW: the largest per-parameter ``step``."""
    extra = state_dict.get("gemini", {})
    if "steps_reported" in extra:
        return int(extra["steps_reported"])
    return max((int(entry["step"]) for entry in state_dict.get("state", {}).values() if "step" in entry), default=0)


# ---------------------------------------------------------------------------- full format
def _param_index(param_groups: ParamGroups) -> dict[int, int]:
    """Each parameter's number in torch's format: its position across the param groups."""
    return {id(p): i for i, p in enumerate(p for hp in param_groups for p in hp["params"])}


@contextlib.contextmanager
def _group_states(rt: GeminiRuntime, g: ChunkGroup):
    """Yields a function giving a slot of ``g`` its torch-format entry as host copies (None before its first step,
    when torch has no state either), or None when no slot has stepped. Under ZeRO a collective (ranges gathered)."""
    steps = rt.memory.to_host(g.steps)  # what is returned is host memory, also on the stand-in
    counts = steps.tolist()
    if not any(counts):
        yield None
        return
    with rt.resident(g, modify=False):
        if g.shard is not None:  # every rank's ranges, gathered (a collective)
            m, v = (gather_state(rt.zero, g, c) for c in (g.exp_avg, g.exp_avg_sq))
        else:
            m, v = (c.payload() for c in (g.exp_avg, g.exp_avg_sq))

        def entry(slot) -> dict[str, torch.Tensor] | None:
            if counts[slot.index] == 0:
                return None
            return {"step": rt.memory.to_host(steps[slot.index]),
                    "exp_avg": rt.memory.to_host(m[slot.offset : slot.end].view(slot.shape)),
                    "exp_avg_sq": rt.memory.to_host(v[slot.offset : slot.end].view(slot.shape))}

        yield entry


def param_state(rt: GeminiRuntime, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """``param``'s entry of :func:`full_state_dict` (empty before its first step, or frozen)."""
    g, slot = rt.manager.locate(param)
    if not g.trainable:
        return {}
    with _group_states(rt, g) as entry_of:
        return (entry_of(slot) if entry_of is not None else None) or {}


def full_state_dict(rt: GeminiRuntime, param_groups: ParamGroups, hyper: HyperState) -> dict[str, Any]:
    """torch.optim.AdamW's format; under ZeRO every rank's shards gathered (call it on every rank)."""
    index = _param_index(param_groups)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for g in rt.manager.trainable_groups:
        with _group_states(rt, g) as entry_of:
            for slot, p in zip(g.slots, g.params) if entry_of is not None else ():
                if (values := entry_of(slot)) is not None:
                    state[index[id(p)]] = values
    groups, extra = hyper
    for entry, hp in zip(groups, param_groups):
        entry["params"] = [index[id(p)] for p in hp["params"]]
    return {"state": state, "param_groups": groups, "gemini": extra}


def load_full_state_dict(rt: GeminiRuntime, param_groups: ParamGroups, state_dict: dict[str, Any],
                         tx: LoadTransaction) -> None:
    """Write m, v and the step counts from ``full_state_dict``'s format in ``tx`` (the hyper-state is the caller's,
    see ``load_hyper_state``). A parameter without saved state starts afresh."""
    saved_index = check_full_state_dict(rt, param_groups, state_dict)
    state = state_dict["state"]
    for g in rt.manager.trainable_groups:
        # Every element of m and v is written: their files (maybe corrupted) are not read.
        tx.write(g, functools.partial(_load_group_state, g, state, saved_index), chunks=(g.exp_avg, g.exp_avg_sq),
                 overwrite=True)


def check_full_state_dict(rt: GeminiRuntime, param_groups: ParamGroups, state_dict: dict[str, Any]) -> dict[int, int]:
    """Every check of :func:`load_full_state_dict`, before any write (a checkpoint's model is loaded only once its
    optimizer state is known to fit); returns where each parameter's state is in it."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"optimizer state has {len(saved_groups)} param group(s), this optimizer {len(param_groups)}")
    for i, (saved, hp) in enumerate(zip(saved_groups, param_groups)):
        if len(saved["params"]) != len(hp["params"]):
            trainable = sum(p.requires_grad for p in hp["params"])
            hint = ("" if len(saved["params"]) != trainable or trainable == len(hp["params"]) else
                    f" ({trainable} of them train: saved by an optimizer over the trainable parameters only? Give "
                    f"gemini.initialize those: param_groups=[{{'params': [p for p in model.parameters() if "
                    f"p.requires_grad]}}], with each group's options)")
            raise ValueError(f"param group {i}: the state has {len(saved['params'])} parameters, this optimizer "
                             f"{len(hp['params'])}{hint}")
    saved_index = {}
    for saved, hp in zip(saved_groups, param_groups):
        for saved_i, p in zip(saved["params"], hp["params"]):
            saved_index[id(p)] = saved_i
    state = state_dict["state"]
    for g in rt.manager.trainable_groups:  # every check before the first write
        for slot, p in zip(g.slots, g.params):
            entry = state.get(saved_index[id(p)])
            for key in ("exp_avg", "exp_avg_sq"):
                if entry is not None and tuple(entry[key].shape) != tuple(slot.shape):
                    raise ValueError(f"state for {slot.name}: {key} shape {tuple(entry[key].shape)} != "
                                     f"parameter shape {tuple(slot.shape)}")
    return saved_index


@torch.no_grad()
def _load_group_state(g: ChunkGroup, state: dict, saved_index: dict[int, int]) -> None:
    for slot, p in zip(g.slots, g.params):
        entry = state.get(saved_index[id(p)])
        if entry is None:
            g.steps[slot.index] = 0.0
            g.write_value(g.exp_avg, slot, torch.zeros(slot.shape))
            g.write_value(g.exp_avg_sq, slot, torch.zeros(slot.shape))
            continue
        g.steps[slot.index] = float(entry["step"])
        g.write_value(g.exp_avg, slot, entry["exp_avg"])
        g.write_value(g.exp_avg_sq, slot, entry["exp_avg_sq"])
    g.steps_uniform = bool((g.steps == g.steps[0]).all())


# ------------------------------------------------------------------------- sharded format
def _layout_signature(rt: GeminiRuntime) -> dict[str, Any]:
    """What must match for a sharded state to load: the ranks and the chunk layout."""
    manager = rt.manager
    return {"world": manager.world, "rank": manager.rank,
            "capacities": [g.param.capacity for g in manager.groups],
            "precision": rt.config.precision}


def _master_range(g: ChunkGroup) -> torch.Tensor:
    """This rank's range of the group's fp32 masters."""
    c = g.master_chunk
    if g.is_shard(c):
        return c.payload()[: g.shard.numel]
    start, end = (g.shard.start, g.shard.end) if g.shard is not None else (0, c.used_numel)
    return c.payload()[start:end].float()


def sharded_state_dict(rt: GeminiRuntime, hyper: HyperState) -> dict[str, Any]:
    """Per chunk group this rank's range of the fp32 masters (frozen groups too) and, for trainable groups, of m and
    v, with the step counts."""
    groups = {}
    for g in rt.manager.groups:
        with rt.resident(g, modify=False) if g.trainable else contextlib.nullcontext():
            n = g.os_numel
            entry = {"master": rt.memory.to_host(_master_range(g))}
            if g.trainable:
                entry["exp_avg"] = rt.memory.to_host(g.exp_avg.payload()[:n])
                entry["exp_avg_sq"] = rt.memory.to_host(g.exp_avg_sq.payload()[:n])
                entry["steps"] = rt.memory.to_host(g.steps)
        groups[g.index] = entry
    param_groups, extra = hyper
    return {"layout": _layout_signature(rt), "groups": groups, "param_groups": param_groups, "gemini": extra}


_LAYOUT_KEYS = ("world", "rank", "precision", "capacities")


def same_layout(rt: GeminiRuntime, state_dict: dict[str, Any]) -> bool:
    """Whether ``sharded_state_dict``'s ranges fit this run as they are (else consolidate it: gemini/consolidate.py)."""
    saved, mine = state_dict["layout"], _layout_signature(rt)
    return all(saved[key] == mine[key] for key in _LAYOUT_KEYS)


def check_sharded_state_dict(rt: GeminiRuntime, state_dict: dict[str, Any]) -> None:
    """Every check of :func:`load_sharded_state_dict`, before any write: the same ranks, precision and chunk layout,
    and every group's entry with its ranges' sizes."""
    saved, mine = state_dict["layout"], _layout_signature(rt)
    for key in _LAYOUT_KEYS:
        if saved[key] != mine[key]:
            shown = (lambda v: f"{v[:4]}{'...' if len(v) > 4 else ''} ({len(v)} chunk group(s))") if key == "capacities" else repr
            raise ValueError(f"sharded optimizer state has {key} {shown(saved[key])}, this run "
                             f"{shown(mine[key])}: load the consolidated state_dict() instead")
    for g in rt.manager.groups:
        entry = state_dict["groups"].get(g.index)
        want = {"master": g.os_numel}  # what _master_range saved
        if g.trainable:
            want.update(exp_avg=g.os_numel, exp_avg_sq=g.os_numel, steps=g.steps.numel())
        got = {k: entry[k].numel() for k in want if entry is not None and torch.is_tensor(entry.get(k))}
        if got != want:
            raise ValueError(f"sharded optimizer state: chunk group {g.index} has {got or 'no entry'}, this run "
                             f"needs {want} elements: load the consolidated state_dict() instead")


def load_sharded_state_dict(rt: GeminiRuntime, state_dict: dict[str, Any], tx: LoadTransaction) -> None:
    """Write what ``sharded_state_dict`` saved on this rank in ``tx``: masters (so the parameters too), m, v and step
    counts (the hyper-state is the caller's). A collective under ZeRO-1/2."""
    check_sharded_state_dict(rt, state_dict)
    for g in rt.manager.groups:
        # Every element of its NVMe chunks is written: their files (maybe lost or corrupted) are not read.
        tx.write(g, functools.partial(_load_sharded_group, rt, g, state_dict["groups"][g.index]), overwrite=True)
    tx.later(lambda: rt.gather_updated_params(rt.manager.groups))


@torch.no_grad()
def _load_sharded_group(rt: GeminiRuntime, g: ChunkGroup, entry: dict[str, torch.Tensor]) -> None:
    c = g.master_chunk
    start = 0 if g.is_shard(c) else (g.shard.start if g.shard is not None else 0)
    c.write_range(start, entry["master"])
    if g.trainable:
        g.exp_avg.write_range(0, entry["exp_avg"])
        g.exp_avg_sq.write_range(0, entry["exp_avg_sq"])
        g.steps.copy_(entry["steps"])
        g.steps_uniform = bool((g.steps == g.steps[0]).all())
    rt.residency.after_step(g)  # the parameters from the masters
