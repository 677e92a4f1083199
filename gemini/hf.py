"""Hugging Face ``transformers.Trainer`` with gemini underneath (the ``hf`` extra).

    from gemini.hf import GeminiTrainer
    trainer = GeminiTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                            gemini_config=gemini.GeminiConfig(placement="auto", device_memory="8GiB"))
    trainer.train()

[Note: what GeminiTrainer changes in Trainer]
Trainer builds AdamW from its arguments, wraps the model for mixed precision and clips through torch. Here gemini owns
the parameters, so:
- ``__init__`` wraps the model with :func:`gemini.initialize` and builds :class:`HybridAdam` as Trainer builds AdamW
  (``learning_rate``, ``adam_beta1/2``, ``adam_epsilon``, Trainer's decay / no-decay groups with ``weight_decay``);
  Trainer only adds its learning-rate scheduler on that optimizer.
- ``bf16`` / ``fp16`` become ``GeminiConfig.precision`` (fp32 masters, gemini's dynamic loss scaler); Trainer's
  autocast and GradScaler are turned off, and the accelerator's ``backward`` goes through ``optimizer.backward``
  (which scales under fp16).
- ``max_grad_norm`` clips with ``model.clip_grad_norm_`` (global norm over the chunks, unscaled under fp16), which is
  also the ``grad_norm`` Trainer logs.
- ``save_model`` and checkpoints write safetensors with the original keys, streamed chunk group by chunk group
  (:func:`gemini.save_pretrained`), so ``AutoModel*.from_pretrained`` loads them (for a PEFT model, the adapter's
  files, see [Note: PEFT models]); ``resume_from_checkpoint`` reads them back and restores the optimizer state exactly.
- Each training log line carries the step's memory report: device peak and bytes per tier.
- Under torchrun gemini's ZeRO shards the chunks over Trainer's process group. The model is not wrapped in DDP, which
  would all-reduce the gradients ZeRO already reduce-scatters (and keep a second copy of them); each rank still gets
  its share of every batch and gradients are averaged, so a run equals Trainer's DDP run. Every rank saves the model
  together (rank 0 writes), and a checkpoint's optimizer state is one file per rank (:func:`gemini.save_checkpoint`
  ``sharded=True``, no gathering), which resumes on any number of ranks (made whole where the number or layout
  differs).
The accelerator is :class:`GeminiAccelerator`, which a loop of one's own under ``accelerate launch`` can use too.
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

from gemini.checkpoint import load_checkpoint, save_checkpoint
from gemini.config import GeminiConfig
from gemini.initialize import initialize
from gemini.module import GeminiModel
from gemini.optim.hybrid_adam import HybridAdam
from gemini.pretrained import load_pretrained_into, save_pretrained
from gemini.peft import is_peft_model, load_adapter_into
from gemini.parallel.zero import resolve_group

__all__ = ["GeminiAccelerator", "GeminiTrainer"]

_MiB = 2**20
# Under ZeRO a checkpoint's optimizer state: this folder, one file per rank (sharded, see the note).
OPTIMIZER_SHARDS_NAME = "gemini_optimizer"


class GeminiAccelerator(accelerate.Accelerator):
    """``accelerate.Accelerator`` for a model and optimizer from :func:`gemini.initialize` (GeminiTrainer uses it
    too); every argument is Accelerator's.

        accelerator = GeminiAccelerator(gradient_accumulation_steps=4)
        model, optimizer = gemini.initialize(model, config, lr=3e-4)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    What it changes, and why (see [Note: what GeminiTrainer changes in Trainer]):
    - ``prepare`` never wraps gemini's model for data parallelism: gemini's ZeRO averages the gradients over the
      ranks itself, and DDP around it would reduce gradients a rank no longer holds whole (mixed precision and
      ``torch.compile`` are applied as for any model);
    - ``backward`` goes through the gemini optimizer's (the loss scaled under fp16), after Accelerator's division
      by the accumulation steps;
    - ``clip_grad_norm_(model.parameters(), ...)`` uses ``model.clip_grad_norm_``, which works under every
      placement, fp16 and ZeRO, where torch's sees placeholders;
    - ``optimizer_step_was_skipped`` is the gemini step's (fp16 overflow).
    """

    gemini_optimizer: HybridAdam | None = None

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False):
        # Accelerator's evaluation mode is all of its preparation but the data-parallel wrapping.
        return super().prepare_model(model, device_placement, evaluation_mode or isinstance(model, GeminiModel))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None):
        if isinstance(optimizer, HybridAdam):
            if self.scaler is not None:
                # Its GradScaler unscales through p.grad at the step: gradients this backward never scaled, and
                # under ZeRO placeholders. gemini scales fp16 itself.
                raise ValueError(f"GeminiAccelerator(mixed_precision={self.mixed_precision!r}) scales the loss with "
                                 f"torch's GradScaler, which gemini's optimizer does not go through: use "
                                 f"GeminiConfig(precision='fp16') (gemini's own loss scaler) and mixed_precision='no'")
            self.gemini_optimizer = optimizer
        return super().prepare_optimizer(optimizer, device_placement)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        if self.gemini_optimizer is None:
            return super().backward(loss, **kwargs)
        # Accelerator's own division (GeminiTrainer's Accelerator accumulates over 1 step: Trainer divides).
        self.gemini_optimizer.backward(loss / self.gradient_accumulation_steps, **kwargs)

    def clip_grad_norm_(self, parameters, max_norm: float, norm_type: float = 2):
        parameters = list(parameters)
        for model in self._models:
            if isinstance(model, GeminiModel) and _same_tensors(parameters, model.parameters()):
                return model.clip_grad_norm_(max_norm, norm_type)
        return super().clip_grad_norm_(parameters, max_norm, norm_type)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        opt = self.gemini_optimizer
        if opt is not None and opt.report is not None:
            return bool(opt.report.skipped)  # fp16 overflow: Trainer then holds the scheduler too
        return super().optimizer_step_was_skipped


def _same_tensors(a: list[torch.Tensor], b) -> bool:
    b = list(b)
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class GeminiTrainer(transformers.Trainer):
    """``transformers.Trainer`` training through gemini; see [Note: what GeminiTrainer changes in Trainer].

    ``gemini_config`` is the :class:`gemini.GeminiConfig` (placement, budgets, NVMe...); ``weights`` (optional)
    streams the model's weights from safetensors into a model built on the meta device (see
    :func:`gemini.initialize`). Every other argument is Trainer's.
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
        self.gemini_world_size = _check_world(config, args)
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
        self.accelerator.__class__ = GeminiAccelerator
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
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.gemini_world_size == 1:
            return super().save_model(output_dir, _internal_call)
        # Every rank: a collective under ZeRO (some Trainer versions call _save on rank 0 alone).
        self._save(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        save_pretrained(self.model, output_dir)  # under ZeRO every rank gathers, rank 0 writes
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, transformers.trainer.TRAINING_ARGS_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        if is_peft_model(self.model.module):  # the adapter PEFT's files hold: see [Note: PEFT models]
            load_adapter_into(self.model, resume_from_checkpoint)
        else:
            load_pretrained_into(self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        if is_peft_model(self.model.module):  # Trainer's own looks for PeftModel, which the wrapper is not
            load_adapter_into(self.model, self.state.best_model_checkpoint)
        else:
            super()._load_best_model()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.gemini_world_size == 1:
            return super()._save_optimizer_and_scheduler(output_dir)
        # Trainer writes optimizer.pt from rank 0's state_dict(), a gathering collective under ZeRO (every rank would
        # hold the whole state): each rank writes its own shard instead.
        save_checkpoint(os.path.join(output_dir, OPTIMIZER_SHARDS_NAME), self.model, self.gemini_optimizer,
                        sharded=True)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, transformers.trainer.SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        shards = None if checkpoint is None else os.path.join(checkpoint, OPTIMIZER_SHARDS_NAME)
        if shards is None or not os.path.isdir(shards):
            # Trainer's optimizer.pt: the consolidated state, which loads into any number of ranks.
            return super()._load_optimizer_and_scheduler(checkpoint)
        # This rank's file; shards of another number of ranks or layout are made whole (gemini/consolidate.py).
        load_checkpoint(shards, self.model, self.gemini_optimizer, sharded=True)
        scheduler = os.path.join(checkpoint, transformers.trainer.SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

def _check_world(config: GeminiConfig, args) -> int:
    """The number of ranks gemini shards over, which must be Trainer's: under torchrun Trainer joins the process
    group first (``args.device`` sets it up), then gemini finds it."""
    args.device  # noqa: B018 - Trainer's distributed setup (torchrun's process group), done once
    comm = resolve_group(config.process_group)
    world = 1 if comm is None else comm.world
    if world != args.world_size:
        raise ValueError(f"GeminiConfig.process_group has {world} rank(s) but Trainer runs {args.world_size} "
                         f"process(es): leave process_group=None under Trainer (its world is used)")
    return world


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
