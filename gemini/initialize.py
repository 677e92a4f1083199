"""`initialize()`: pack a module into chunks and hand back the wrapped module and its optimizer."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from chunks import ChunkManager, ChunkStorage, Tier, missing_bytes, round_up, search_chunk_size
from offload import NvmeStore
from gemini.engine.activations import ActivationOffload
from gemini.config import GeminiConfig
from gemini.policies.footprint import Layout, chunk_bytes
from gemini.engine.hooks import ModuleHooks
from gemini.engine.residency import Residency
from gemini.engine.memory import DeviceBudgetError, DeviceMemory
from gemini.module import GeminiModel
from gemini.engine.nvme_tier import NvmeTier
from gemini.optim.hybrid_adam import HybridAdam
from gemini.optim.group_specs import check_hyperparams, split_param_groups
from gemini.optim.param_groups import check_weight_decay_mode
from gemini.pretrained import PreparedValues, prepare_values, tie_meta_weights
from gemini.policies import check_supported, device_groups, make_placement, placement_type
from gemini.report import ReportWriter, rank_report_path
from gemini.engine.runtime import GeminiRuntime
from gemini.parallel.agreement import check_ranks_agree, describe, sync_buffers
from gemini.parallel.zero import GradReducer, ParamGatherer, resolve_group

logger = logging.getLogger(__name__)

__all__ = ["initialize", "resolve_chunk_size", "split_param_groups"]

def initialize(
    model: nn.Module,
    config: GeminiConfig | None = None,
    *,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    adamw_mode: bool = True,
    param_groups: list[dict[str, Any]] | None = None,
    weights: str | os.PathLike | None = None,
) -> tuple[GeminiModel, HybridAdam]:
    """Move ``model``'s parameters into chunks and build its optimizer.

    ``param_groups`` (optional) works as in ``torch.optim``: dicts with ``params`` and any of ``lr``, ``betas``,
    ``eps``, ``weight_decay``; parameters of the model not listed form a last group with the defaults. Returns
    ``(model, optimizer)``; train with ``optimizer.backward(loss)`` (or ``loss.backward()`` outside fp16),
    ``optimizer.step()`` and ``optimizer.zero_grad()``.

    ``model``'s parameters may be on the meta device (``accelerate.init_empty_weights()``). ``weights`` (a
    safetensors file, or a folder as ``save_pretrained`` writes it) then gives every parameter and persistent buffer,
    strictly (missing, unexpected or mis-shaped keys raise, naming them), read one chunk group at a time straight into
    its chunks, so the model never exists whole in memory (a real model's values are overwritten). Without
    ``weights``, each module with parameters on the meta device is initialized by its ``reset_parameters()`` when its
    chunk group is built. See gemini/pretrained/load.py.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(model, GeminiModel):
        raise ValueError("model is already wrapped by gemini.initialize")
    config = GeminiConfig() if config is None else config
    if not isinstance(config, GeminiConfig):
        raise TypeError(f"config must be a gemini.GeminiConfig, got {type(config).__name__}")
    config = config.checked()
    config.warn_unused_scaler()
    config.check_device_available()
    check_hyperparams(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    check_supported(config)  # combinations of fields that mean nothing fail loudly
    writer = _open_report(config)
    tie_meta_weights(model)
    # Checked against the model (and buffers loaded) before anything is allocated.
    values = prepare_values(model, weights)
    try:
        return _initialize(model, config, values, writer, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                           adamw_mode=adamw_mode, param_groups=param_groups)
    finally:
        values.close()


def _open_report(config: GeminiConfig) -> ReportWriter | None:
    """The report file, opened for appending before any work, so what GeminiConfig could not tell without opening it
    (a read-only file system, a path made a folder since) fails here."""
    if config.report_path is None:
        return None
    path = rank_report_path(config.report_path, _job_rank())
    shown = "" if path == os.fspath(config.report_path) else f" (this rank's file {path!r})"
    try:
        return ReportWriter(path)
    except OSError as e:
        raise ValueError(f"GeminiConfig.report_path={config.report_path!r}{shown} is invalid: expected a file this "
                         f"process can create or append to, but opening it failed: [Errno {e.errno}] {e.strerror}"
                         ) from e


def _job_rank() -> int:
    """This process's global rank (0 outside torch.distributed): unique in the job, unlike a rank within
    ``process_group``, so ranks of different groups never share a report file."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _run_header(config: GeminiConfig, *, chunk_size: int, world: int, rank: int) -> dict[str, Any]:
    """The ``{"run": ...}`` line starting this run in the report file."""
    settings = {}
    for name, value in config.to_dict().items():
        if name == "process_group":
            value = None if value is None else type(value).__name__
        elif isinstance(value, (torch.device, os.PathLike)):
            value = str(value)
        settings[name] = value
    return {"started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "unix_time": time.time(), "pid": os.getpid(), "host": socket.gethostname(), "rank": rank,
            "world_size": world, "chunk_size": chunk_size, "config": settings}


def _initialize(model: nn.Module, config: GeminiConfig, values: PreparedValues, writer: ReportWriter | None, *, lr,
                betas, eps, weight_decay, adamw_mode, param_groups) -> tuple[GeminiModel, HybridAdam]:
    """``initialize`` once the arguments are checked: chunks filled from ``values.source``."""
    device = config.resolved_device()
    zero = resolve_group(config.process_group)  # None: one rank, nothing sharded
    world, rank = (zero.world, zero.rank) if zero is not None else (1, 0)
    torch_groups, named_groups, frozen = split_param_groups(model, param_groups)
    check_weight_decay_mode(torch_groups, adamw_mode=adamw_mode, where="param_groups",
                            advice=f"set it to {adamw_mode} or delete it, or pass adamw_mode={not adamw_mode}")
    source_dtypes = _source_dtypes(model, config.param_dtype)
    numels = [[p.numel() for _, p in g] for g in named_groups] + [[p.numel() for _, p in frozen]]
    chunk_size = resolve_chunk_size(config, numels, world=world)

    # The device is measured on CUDA always (the allocator's counters cost nothing), and on the CPU stand-in (a
    # dispatch mode, costly per operator) only when there is a budget to keep or the policy plans from measurement
    # (auto's warm-up; with no budget on the CPU, against the machine's memory).
    policy_type = placement_type(config.placement)
    memory = DeviceMemory(device, config.device_memory,
                          measure=config.device_memory is not None or policy_type.plans_from_measurement)
    storage = ChunkStorage(device, pin_host=True, observer=memory.observer())
    storage.swap_move_watcher(memory.model_data_move)  # the step's non-model peak (see DeviceMemory)
    manager = ChunkManager(storage, chunk_size=chunk_size, param_dtype=config.param_dtype, rank=rank, world=world,
                           shard_params=config.shard_params)
    layout = manager.layout(named_groups, frozen)  # what register() will build; nothing allocated yet
    if zero is not None:  # before any collective sized by the layout: [Note: ranks agree at initialize]
        check_ranks_agree(zero, describe(config, chunk_size=chunk_size, named_groups=named_groups, frozen=frozen,
                                         model=model))
    _check_device_budget(config, layout, manager)
    fixed_bytes = _move_buffers(model, device, config.param_dtype)
    if zero is not None:
        sync_buffers(zero, model)  # rank 0's, as DDP's
    placement = make_placement(config, manager, budget_bytes=memory.budget_bytes, fixed_bytes=fixed_bytes)
    residency = Residency(manager, placement, quiet=memory.quiet)
    nvme = _make_nvme_tier(config, manager, layout)
    residency.nvme = nvme
    try:
        manager.register(named_groups, frozen, initial_tier=placement.initial_tier,
                         on_group=nvme.admit if nvme is not None else lambda group: None, source=values.source,
                         sync=_sync_values(zero, values))
        if nvme is not None:
            nvme.finish_registration()
        if config.device_memory is not None:
            placement.check_budget(config.device_memory, fixed_bytes)
        if zero is not None:
            _attach_zero(zero, manager, residency, quiet=memory.quiet)
        residency.setup()
        residency.rebalance_nvme()
        if writer is not None:
            writer.start_run(_run_header(config, chunk_size=chunk_size, world=world, rank=rank))
    except BaseException:
        storage.close_nvme()  # no files left behind by a failed initialize
        raise
    runtime = GeminiRuntime(
        config=config, device=device, storage=storage, manager=manager, placement=placement,
        residency=residency, memory=memory,
        module=model, module_params=tuple(model.parameters()), fixed_bytes=fixed_bytes, report_writer=writer,
        nvme=nvme, zero=zero,
    )
    if config.offload_activations:
        runtime.activations = ActivationOffload(storage, min_bytes=config.activation_offload_min_bytes)
    runtime.hooks = ModuleHooks(
        model, manager, residency, on_root_forward=runtime.on_root_forward, on_budget_error=runtime.on_budget_error,
        on_backward_begin=runtime.on_backward_begin, on_backward_end=runtime.on_backward_end,
        on_root_forward_end=runtime.on_root_forward_end, accumulated_in_place=runtime.grad_views.accumulated_in_place,
        on_boundary=runtime.on_boundary,
    )
    wrapped = GeminiModel(model, runtime, cast_inputs=bool(source_dtypes))
    optimizer = HybridAdam(
        runtime, torch_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode
    )
    runtime.scaler = optimizer.scaled_backwards if optimizer.scaler is not None else None
    runtime.start_new_step()
    return wrapped, optimizer


def resolve_chunk_size(config: GeminiConfig, numels: list[list[int]], *, world: int = 1) -> int:
    """``config.chunk_size``, or the searched size with the least padding for ``numels`` (element counts per param
    group, frozen last); under ZeRO rounded up to a multiple of the world size, so every rank's shard of a chunk is
    the same size."""
    if config.chunk_size is not None:
        size = round_up(config.chunk_size, world)
        if size != config.chunk_size:
            logger.info("chunk_size %d rounded up to %d, a multiple of the %d ranks", config.chunk_size, size, world)
        return size
    found = search_chunk_size([n for n in numels if n])
    logger.info("chunk size %d elements: %d chunks, %d elements of padding (%d sizes scored)",
                found.chunk_size, found.n_chunks, found.waste, found.candidates)
    return round_up(found.chunk_size, world)


def _sync_values(zero, values: PreparedValues):
    """Under ZeRO, rank 0's first values for every rank (DDP's broadcast); not for a ``weights`` file, which every
    rank reads alike (see [Note: ranks agree at initialize] in gemini/parallel/agreement.py)."""
    return zero.broadcast if zero is not None and values.checkpoint is None else None


def _attach_zero(zero, manager: ChunkManager, residency: Residency, *, quiet) -> None:
    """ZeRO's collectives, driven by the engine's moves (see gemini/parallel/zero.py)."""
    placement = residency.policy
    residency.reducer = GradReducer(zero, manager, optimizer_tier=placement.optimizer_tier, quiet=quiet)
    if manager.shard_params:
        residency.gatherer = ParamGatherer(zero, manager)
        placement.gathers_params = True
        placement.prefetch_reserve_bytes = max((g.param.nbytes for g in manager.groups), default=0)
        placement.prefetched = residency.gatherer.prefetched
    logger.info("ZeRO-%d: rank %d of %d keeps 1/%d of every chunk's optimizer states%s", 3 if manager.shard_params
                else 2, zero.rank, zero.world, zero.world, " and parameters" if manager.shard_params else "")


def _make_nvme_tier(config: GeminiConfig, manager: ChunkManager, layout: Layout) -> NvmeTier | None:
    """The NVMe tier when a host budget or an NVMe folder is set; its store opens here."""
    if config.cpu_memory is None and config.nvme_dir is None:
        return None
    if config.nvme_dir is not None:
        manager.storage.nvme = NvmeStore(config.nvme_dir)
    nvme = NvmeTier(manager, cpu_memory=config.cpu_memory, fraction=config.nvme_offload_fraction,
                    depth=config.nvme_pipeline_depth)
    try:
        nvme.plan_registration(layout, on_device=device_groups(config, layout).whole)
    except BaseException:
        manager.storage.close_nvme()
        raise
    return nvme


def _check_device_budget(config: GeminiConfig, layout: Layout, manager: ChunkManager) -> None:
    """Where a placement keeps every chunk on the device ('cuda'), fail before allocating if they can't fit (a policy
    that keeps less checks once registered: ``PlacementPolicy.check_budget``)."""
    if not placement_type(config.placement).keeps_every_chunk_on_device:
        return
    need = sum(chunk_bytes(layout, device_groups(config, layout), param_dtype=manager.param_dtype,
                           world=manager.world, shard_params=manager.shard_params)[Tier.DEVICE].values())
    missing = missing_bytes(config.device_memory, need)
    if missing:  # the error users catch for a budget, as static's check_budget raises
        raise DeviceBudgetError(
            f"placement={config.placement!r} needs {need} bytes of chunks on the device but "
            f"GeminiConfig.device_memory={config.device_memory}: {missing} bytes are missing; "
            f"use placement='cpu' (or 'auto'), a larger device_memory, or a smaller chunk_size",
            missing_bytes=missing,
        )



def _source_dtypes(model: nn.Module, compute_dtype: torch.dtype) -> set[torch.dtype]:
    """The parameters' dtypes other than the one gemini computes in.

    The wrapped module's forward expected inputs of those, so the model casts its floating-point inputs (see
    GeminiModel.forward). A single dtype that is not fp32 (a ``.double()`` or ``.bfloat16()`` model) would change
    silently, so it is logged here (several dtypes are warned about by ``split_param_groups``)."""
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) == 1 and not dtypes & {torch.float32, compute_dtype}:
        logger.warning(
            "the model's parameters are %s; gemini computes in %s (GeminiConfig.precision), so they and its "
            "floating-point buffers change to it and floating-point inputs are cast to it on the way in",
            next(iter(dtypes)), compute_dtype)
    return dtypes - {compute_dtype}


def _move_buffers(model: nn.Module, device: torch.device, dtype: torch.dtype) -> int:
    """Buffers are small and stay on the compute device, in the compute precision; returns their bytes."""
    total = 0
    for sub in model.modules():
        for name, buf in sub._buffers.items():
            if buf is None:
                continue
            target = dtype if buf.is_floating_point() else buf.dtype
            sub._buffers[name] = buf.to(device=device, dtype=target)
            total += sub._buffers[name].numel() * sub._buffers[name].element_size()
    return total
