"""`GeminiConfig`: every knob of the engine, validated where it is made."""

from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from chunks import compute_device
from offload import parse_size

__all__ = ["CONFIG_DEFAULTS", "GeminiConfig", "PLACEMENTS", "PRECISIONS"]

PLACEMENTS = ("cuda", "cpu", "auto", "static")
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _fail(name: str, value: Any, accepted: str) -> None:
    raise ValueError(f"GeminiConfig.{name}={value!r} is invalid: expected {accepted}")


# The fp16 loss scaler's fields (set under another precision, warned about at initialize).
SCALER_FIELDS = ("initial_scale", "min_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
                  "max_scale")


@dataclass(kw_only=True)
class GeminiConfig:
    """Configuration of :func:`gemini.initialize`. Bad values raise ``ValueError`` naming the field."""

    device: str | torch.device | None = None
    """Compute device: "cuda", "cuda:N", "cpu" (the CPU standing in for an accelerator), or
    None for cuda when available, else cpu."""

    placement: str = "auto"
    """Where chunks live: "cuda" (all on the device), "cpu" (on the host, fetched for compute,
    optimizer on the host), "auto" (traced, budgeted, margin on the device) or "static"."""

    precision: str = "fp32"
    """Compute precision of parameters: "fp32", "bf16" or "fp16" (fp16 uses dynamic loss
    scaling). Master weights and Adam states are always fp32."""

    chunk_size: int | None = None
    """Elements per chunk; None searches for the size with the least padding waste."""

    device_memory: int | str | None = None
    """Budget for the compute device in bytes (int or "512MiB"); None = the whole device."""

    gpu_margin_mem_ratio: float = 0.0
    """Share of the margin (budget - reserve - the warm-up's planned peak) given to optimizer-state
    chunks updated on the device, in [0, 1]."""

    static_param_device_fraction: float = 1.0
    """placement="static": share of parameter chunk groups (the first ones) kept on the device
    for good; the others visit it for compute, in [0, 1] (counts round halves up)."""

    static_optimizer_offload_fraction: float = 0.0
    """placement="static": share of optimizer-state chunk groups (the last ones) kept on the host
    and updated by CPU Adam; the others live and update on the device, in [0, 1] (counts round halves up)."""

    cpu_memory: int | str | None = None
    """Host budget for optimizer-state chunks (bytes or "8GiB"); beyond it they go to NVMe."""

    nvme_dir: str | os.PathLike | None = None
    """Folder for NVMe-resident chunks (a private subfolder is made per process and rank)."""

    nvme_offload_fraction: float = 0.0
    """Share of optimizer-state chunks always kept on NVMe, in [0, 1]; needs ``nvme_dir``."""

    nvme_pipeline_depth: int = 2
    """Chunk groups whose NVMe-resident states are read ahead of (and written behind) the one
    being updated, an int in [1, 64]; the pipeline holds ``2 * depth + 1`` groups in host memory."""

    clip_grad_norm: float = 0.0
    """Max global L2 norm of the gradients over all chunks (and ranks); 0 turns clipping off."""

    initial_scale: float = 2.0**16
    """fp16 loss scaler: the starting scale."""

    min_scale: float = 1.0
    """fp16 loss scaler: the scale never backs off below this."""

    growth_factor: float = 2.0
    """fp16 loss scaler: multiplies the scale after ``growth_interval`` steps without overflow."""

    backoff_factor: float = 0.5
    """fp16 loss scaler: multiplies the scale after ``hysteresis`` overflows, in (0, 1)."""

    growth_interval: int = 1000
    """fp16 loss scaler: consecutive good steps before the scale grows."""

    hysteresis: int = 2
    """fp16 loss scaler: overflows tolerated (each still skips its step) before backing off."""

    max_scale: float = 2.0**32
    """fp16 loss scaler: the scale never grows above this."""

    offload_activations: bool = False
    """Tensors autograd saves for backward (at least ``activation_offload_min_bytes``) wait in
    host memory between forward and backward instead of on the device; under "auto" the budget's
    margin keeps the last ones on the device (see gemini/engine/activations.py)."""

    activation_offload_min_bytes: int = 64 * 1024
    """With ``offload_activations``: smaller saved tensors stay on the device (a copy costs more
    than it frees), an int >= 1."""

    report_path: str | os.PathLike | None = None
    """JSON Lines file receiving one MemoryReport per step; None writes no file. In a job of several
    processes (torch.distributed initialized, world size > 1) every rank reports to a file of its
    own: rank 0 to this path, so ``read_reports(path)`` and ``gemini report`` show rank 0 as
    DeepSpeed and Colossal-AI log from rank 0; rank N to ``<stem>.rankN<ext>`` beside it
    (``reports.rank1.jsonl``; ``gemini.rank_report_path(path, N)``)."""

    process_group: Any = None
    """torch.distributed group for ZeRO sharding; None = no sharding (or WORLD when initialized).
    Each rank keeps 1/world of every chunk's fp32 master, Adam m and v and reduced gradients
    (ZeRO-1/2); initialize, forward, backward, step and checkpoints are then collectives that
    every rank of the group calls."""

    shard_params: bool = False
    """ZeRO-3 (with a process group of more than one rank): parameters are kept as shards too,
    all-gathered on the device for each module's compute and released after it, prefetched one
    chunk group ahead in the order the first iteration recorded."""

    def __post_init__(self) -> None:
        self._check_device()
        if self.placement not in PLACEMENTS:
            _fail("placement", self.placement, f"one of {PLACEMENTS}")
        if self.precision not in PRECISIONS:
            _fail("precision", self.precision, f"one of {tuple(PRECISIONS)}")
        if self.chunk_size is not None and (
            isinstance(self.chunk_size, bool) or not isinstance(self.chunk_size, int) or self.chunk_size <= 0
        ):
            _fail("chunk_size", self.chunk_size, "None or a positive int (elements per chunk)")
        for name in ("device_memory", "cpu_memory"):
            value = getattr(self, name)
            if value is None:
                continue
            try:
                nbytes = parse_size(value)
            except (ValueError, TypeError) as e:
                _fail(name, value, f"None, a positive int of bytes or a size string like '512MiB' ({e})")
            if nbytes <= 0:
                _fail(name, value, "a positive size")
            setattr(self, name, nbytes)
        for name in ("gpu_margin_mem_ratio", "nvme_offload_fraction", "static_param_device_fraction",
                     "static_optimizer_offload_fraction"):
            self._check_fraction(name)
        if self.nvme_dir is not None and (not isinstance(self.nvme_dir, (str, os.PathLike))
                                          or not isinstance(os.fspath(self.nvme_dir), str)):
            _fail("nvme_dir", self.nvme_dir, "None or the path of an existing folder")
        if self.nvme_dir is not None and os.fspath(self.nvme_dir) == "":
            _fail("nvme_dir", self.nvme_dir, "None or the path of an existing folder (an empty string names no "
                  "folder; None keeps everything in memory)")
        if self.nvme_offload_fraction > 0 and self.nvme_dir is None:
            _fail("nvme_dir", None, "a folder when nvme_offload_fraction > 0")
        if self.placement == "cuda" and (self.nvme_dir is not None or self.cpu_memory is not None):
            _fail("placement", self.placement, "'cpu', 'auto' or 'static' when cpu_memory or nvme_dir is set "
                  "(under 'cuda' every optimizer state lives on the device)")
        depth = self.nvme_pipeline_depth
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 64:
            _fail("nvme_pipeline_depth", depth, "an int in [1, 64]")
        if not _is_real(self.clip_grad_norm) or self.clip_grad_norm < 0 or not math.isfinite(self.clip_grad_norm):
            _fail("clip_grad_norm", self.clip_grad_norm, "a finite number >= 0 (0 = off)")
        self._check_scaler()
        if not isinstance(self.offload_activations, bool):
            _fail("offload_activations", self.offload_activations, "True or False")
        m = self.activation_offload_min_bytes
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            _fail("activation_offload_min_bytes", m, "an int >= 1 (bytes)")
        if not isinstance(self.shard_params, bool):
            _fail("shard_params", self.shard_params, "True or False")
        self._check_report_path()
        if self.nvme_dir is not None and self.cpu_memory is None and self.nvme_offload_fraction == 0:
            warnings.warn(
                f"GeminiConfig.nvme_dir={self.nvme_dir!r} will not be used: with cpu_memory=None (no host budget) "
                f"and nvme_offload_fraction=0 every optimizer state stays in host memory; set cpu_memory to a host "
                f"budget (states beyond it go to NVMe) or nvme_offload_fraction > 0 (that share always on NVMe)",
                UserWarning, stacklevel=3)

    # ------------------------------------------------------------------------ validation
    def _check_device(self) -> None:
        if self.device is None:
            return
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError):
            _fail("device", self.device, '"cuda", "cuda:N", "cpu" or None')
        if dev.type not in ("cuda", "cpu"):
            _fail("device", self.device, '"cuda", "cuda:N", "cpu" or None')

    def check_device_available(self) -> None:
        """Raise ``ValueError`` naming the field if this machine cannot run on :attr:`device`.

        Not part of construction: a config describes the run it is for, and a machine without that GPU may still plan
        it (``gemini.plan_placement``); ``initialize`` calls this first."""
        if self.device is not None and torch.device(self.device).type == "cuda" and not torch.cuda.is_available():
            _fail("device", self.device, '"cpu" or None: this torch build or machine has no CUDA device')

    def _check_report_path(self) -> None:
        """Check what can be told before opening; ``initialize``, which appends to the file, reports what only opening
        can tell (a permission the mode bits do not show)."""
        value = self.report_path
        if value is None:
            return
        accepted = "None or the path of a file to append JSON lines to"
        if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str):
            _fail("report_path", value, accepted)
        path = os.path.abspath(os.fspath(value))
        if os.fspath(value) == "":
            _fail("report_path", value, f"{accepted} (an empty string names no file)")
        if os.path.isdir(path):
            _fail("report_path", value, f"{accepted}, not a folder")
        # The file, or the folders initialize would create for it, must be makeable under the nearest existing ancestor.
        ancestor = os.path.dirname(path)
        while not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            _fail("report_path", value, f"{accepted}: {ancestor!r} is not a folder, so nothing can be made in it")
        if os.path.exists(path):
            if not os.access(path, os.W_OK):
                _fail("report_path", value, f"{accepted}: this process may not write to it")
        elif not os.access(ancestor, os.W_OK | os.X_OK):
            _fail("report_path", value, f"{accepted}: this process may not create files in {ancestor!r}")

    def _check_fraction(self, name: str) -> None:
        value = getattr(self, name)
        if not _is_real(value) or not 0.0 <= value <= 1.0:
            _fail(name, value, "a number in [0, 1]")

    def _check_scaler(self) -> None:
        for name in ("initial_scale", "min_scale", "max_scale"):
            v = getattr(self, name)
            if not _is_real(v) or not (0 < v < math.inf):
                _fail(name, v, "a finite number > 0")
        if not self.min_scale <= self.initial_scale <= self.max_scale:
            _fail(
                "initial_scale",
                self.initial_scale,
                f"a value within [min_scale={self.min_scale}, max_scale={self.max_scale}]",
            )
        if not _is_real(self.growth_factor) or not (1 < self.growth_factor < math.inf):
            _fail("growth_factor", self.growth_factor, "a finite number > 1")
        if not _is_real(self.backoff_factor) or not (0 < self.backoff_factor < 1):
            _fail("backoff_factor", self.backoff_factor, "a number in (0, 1)")
        for name in ("growth_interval", "hysteresis"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                _fail(name, v, "an int >= 1")

    def warn_unused_scaler(self) -> None:
        """A ``UserWarning`` if a loss-scaler field is set under a precision other than fp16 (called by ``initialize``
        once the precision is final: GeminiTrainer sets it from its arguments)."""
        scaler = [f.name for f in fields(self) if f.name in SCALER_FIELDS and getattr(self, f.name) != f.default]
        if scaler and self.precision != "fp16":
            warnings.warn(f"GeminiConfig.{scaler[0]}={getattr(self, scaler[0])!r} will not be used: the loss scaler "
                          f"runs under precision='fp16' only, and precision is {self.precision!r}",
                          UserWarning, stacklevel=3)

    def checked(self) -> GeminiConfig:
        """A validated copy of this config as it is now.

        A field set after construction (``cfg.device_memory = "8GiB"``) is checked and converted like a constructor
        argument. ``initialize`` runs with such a copy, so changing the config later does not reach a running engine."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # construction warned already
            return replace(self)

    # ----------------------------------------------------------------------------- derived
    @property
    def param_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    def resolved_device(self) -> torch.device:
        """The compute device, indexed where it is CUDA (see ``chunks.compute_device``)."""
        return compute_device(self.device if self.device is not None else
                              "cuda" if torch.cuda.is_available() else "cpu")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# Each field's default, by name (the CLI's defaults, and what check_supported calls "not set").
CONFIG_DEFAULTS = {f.name: f.default for f in fields(GeminiConfig)}


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
