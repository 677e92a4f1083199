"""Hugging Face ``transformers.Trainer`` with gemini underneath (the ``hf`` extra).

    from gemini.hf import GeminiTrainer
    trainer = GeminiTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            gemini_config=gemini.GeminiConfig(placement="auto", device_memory="8GiB"))
    trainer.train()

[Note: what GeminiTrainer changes in Trainer]
Trainer builds AdamW from its arguments, wraps the model for mixed precision and clips through
torch. Here gemini owns the parameters, so:
- ``__init__`` wraps the model with :func:`gemini.initialize` and builds :class:`HybridAdam`
  exactly as Trainer builds AdamW: ``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, and
  Trainer's own decay / no-decay parameter groups with ``weight_decay``. Trainer then only adds
  its learning-rate scheduler (``lr_scheduler_type``, warm-up) on that optimizer.
- ``bf16`` / ``fp16`` become ``GeminiConfig.precision`` (bf16/fp16 parameters with fp32
  masters, gemini's dynamic loss scaler); Trainer's own autocast and GradScaler are turned off,
  so the accelerator's ``backward`` goes through ``optimizer.backward`` (which scales under fp16).
- ``max_grad_norm`` clips with ``model.clip_grad_norm_`` (global norm over the chunks, the
  unscaled norm under fp16), which is also the ``grad_norm`` Trainer logs.
- ``save_model`` and checkpoints write safetensors with the original keys, streamed chunk group
  by chunk group (:func:`gemini.save_pretrained`), so ``AutoModel*.from_pretrained`` loads them;
  ``resume_from_checkpoint`` reads them back and restores the optimizer state exactly.
- Each training log line carries the step's memory report: device peak and bytes per tier.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import torch
from torch import nn

try:
    import accelerate
    import transformers
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError("gemini.hf needs the 'hf' extra: pip install 'gemini-offload[hf]' "
                      "(transformers, safetensors, accelerate)") from e

from gemini.config import GeminiConfig
from gemini.initialize import initialize
from gemini.module import GeminiModel
from gemini.optim.hybrid_adam import HybridAdam
from gemini.pretrained import load_pretrained_into, save_pretrained
from gemini.parallel.zero import resolve_group

__all__ = ["GeminiTrainer"]

_MiB = 2**20


class _GeminiAccelerator(accelerate.Accelerator):
    """The accelerator Trainer drives, with the backward pass and skipped steps gemini's."""

    gemini_optimizer: HybridAdam | None = None

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.gemini_optimizer is None:
            super().backward(loss, **kwargs)
        else:
            self.gemini_optimizer.backward(loss)  # scales the loss under fp16

    @property
    def optimizer_step_was_skipped(self) -> bool:
        opt = self.gemini_optimizer
        if opt is not None and opt.report is not None:
            return bool(opt.report.skipped)  # fp16 overflow: Trainer then holds the scheduler too
        return super().optimizer_step_was_skipped


class GeminiTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through gemini; see [Note: what GeminiTrainer changes in Trainer].

    ``gemini_config`` is the :class:`gemini.GeminiConfig` (placement, budgets, NVMe...);
    ``weights`` (optional) streams the model's weights from safetensors into a model built on
    the meta device (see :func:`gemini.initialize`). Every other argument is Trainer's.
    """

    def __init__(self, model: nn.Module | None = None, args: transformers.TrainingArguments | None = None, *,
                 gemini_config: GeminiConfig | None = None, weights: str | os.PathLike | None = None,
                 **kwargs: Any) -> None:
        if model is None:
            raise ValueError("GeminiTrainer needs model= (model_init is not supported: gemini wraps one model)")
        if isinstance(model, GeminiModel):
            raise ValueError("GeminiTrainer wraps the model itself: pass the plain model, not gemini.initialize's")
        if kwargs.get("optimizers", (None, None))[0] is not None or kwargs.get("optimizer_cls_and_kwargs"):
            raise ValueError("GeminiTrainer builds gemini's HybridAdam from the TrainingArguments: do not pass "
                             "optimizers= or optimizer_cls_and_kwargs=")
        if args is None:
            args = transformers.TrainingArguments(output_dir="tmp_trainer")
        if args.optim not in ("adamw_torch", "adamw_torch_fused", "adamw_hf", "adamw_apex_fused"):
            raise ValueError(f"TrainingArguments.optim={args.optim!r} is not supported by GeminiTrainer: gemini "
                             f"trains with AdamW (HybridAdam); use optim='adamw_torch_fused' (the default)")
        config = _resolve_config(gemini_config, args)
        if resolve_group(config.process_group) is not None:
            # Trainer saves optimizer.pt on rank 0 alone; under ZeRO state_dict() is a collective.
            raise ValueError("GeminiTrainer runs in one process: ZeRO (a process group of several ranks) is not "
                             "supported under Trainer yet; train with gemini.initialize and your own loop")
        # Trainer's mixed precision would autocast and scale on top of gemini's own (see the note).
        args = dataclasses.replace(args, bf16=False, fp16=False)
        groups = self._param_groups(model, args)
        wrapped, optimizer = initialize(model, config, weights=weights, lr=args.learning_rate,
                                        betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                        weight_decay=args.weight_decay, param_groups=groups)
        self.gemini_config = config
        self.gemini_optimizer = optimizer  # self.optimizer becomes accelerate's wrapper of it
        super().__init__(model=wrapped, args=args, optimizers=(optimizer, kwargs.pop("optimizers", (None, None))[1]),
                         **kwargs)
        # The accelerator Trainer made, with gemini's backward (one class swap, no global patch).
        self.accelerator.__class__ = _GeminiAccelerator
        self.accelerator.gemini_optimizer = optimizer
        self.args._n_gpu = 1  # one process drives the device; never nn.DataParallel around the chunks

    # ------------------------------------------------------------------ construction
    def _param_groups(self, model: nn.Module, args) -> list[dict[str, Any]]:
        """Trainer's decay / no-decay groups (``Trainer.create_optimizer``), empty ones dropped."""
        decay = set(self.get_decay_parameter_names(model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    # ------------------------------------------------------------------------ clipping
    def _clip_grad_norm(self, model):
        return self.model.clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        if grad_norm is None:
            grad_norm = self.model.clip_grad_norm_(math.inf)
        return grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm

    # ---------------------------------------------------------------------- logging
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        report = self.gemini_optimizer.report
        if report is not None and "loss" in logs:
            logs = {**logs,
                    "gemini_device_peak_mib": round(report.device_peak_bytes / _MiB, 3),
                    "gemini_device_model_mib": round(report.device_model_bytes / _MiB, 3),
                    "gemini_host_model_mib": round(report.host_model_bytes / _MiB, 3),
                    "gemini_nvme_mib": round(report.nvme_bytes / _MiB, 3)}
        super().log(logs, start_time)

    def close(self) -> None:
        """Delete gemini's NVMe files and stop its I/O threads (also done at garbage collection)."""
        self.gemini_optimizer.close()

    # -------------------------------------------------------------------- checkpoints
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        save_pretrained(self.model, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        load_pretrained_into(self.model, resume_from_checkpoint)


def _resolve_config(config: GeminiConfig | None, args) -> GeminiConfig:
    """The GeminiConfig with Trainer's precision: args.bf16/fp16 set it, a contradiction is an error."""
    config = GeminiConfig() if config is None else config
    if not isinstance(config, GeminiConfig):
        raise TypeError(f"gemini_config must be a gemini.GeminiConfig, got {type(config).__name__}")
    config = config.checked()
    wanted = "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if wanted is None:
        return config
    if config.precision not in ("fp32", wanted):
        raise ValueError(f"TrainingArguments asks for {wanted} but GeminiConfig.precision={config.precision!r}: "
                         f"set one of them")
    return dataclasses.replace(config, precision=wanted)
