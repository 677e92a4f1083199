"""`GeminiModel`: the user's module with its parameters in chunks."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import logging
import sys
from collections import OrderedDict, UserDict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys  # what nn.Module.load_state_dict returns
from torch.nn.parallel import DistributedDataParallel

from chunks import ChunkGroup, ChunkState, TensorSlot
from gemini.engine.descendant_reads import run_uncompiled, skip_call_frame
from gemini.engine.load_transaction import LoadTransaction
from gemini.errors import NotCopyable
from gemini.module_idioms import ModuleIdioms
from gemini.optim.clipping import clip_model_grad_norm_
from gemini.parallel.zero import gather_state
from gemini.peft import MERGING as PEFT_MERGING
from gemini.peft import is_peft_model, merging_refused, save_adapter
from gemini.restructuring import RESTRUCTURING, restructuring_refused

if TYPE_CHECKING:
    from gemini.engine.runtime import GeminiRuntime

logger = logging.getLogger(__name__)

__all__ = ["GeminiModel", "gemini_model"]

# The code of DistributedDataParallel's method that calls the module it wraps (None elsewhere).
_DDP_CALLS_MODULE = getattr(getattr(DistributedDataParallel, "_run_ddp_forward", None), "__code__", None)


class GeminiModel(NotCopyable, ModuleIdioms, nn.Module):
    """Runs the wrapped module; ``state_dict`` speaks the wrapped module's keys.

    Floating-point inputs are cast to the compute precision on the way in under bf16/fp16, and under fp32 when the
    wrapped module's parameters had another dtype (a ``.double()`` model). ``state_dict()`` returns full fp32 values
    (the masters under bf16/fp16) on the CPU, under the original keys and shapes, so a plain module loads it.

    [Note: the wrapper looks like the wrapped model]
    Code that receives the wrapped model inspects it: Hugging Face's Trainer keeps only the batch columns named in
    ``inspect.signature(model.forward)``, finds label names in the class's ``forward``, and reads ``model.config``,
    ``model.loss_type`` and friends. So each instance is of a subclass per wrapped class (see :func:`_wrapper_class`)
    named like it, whose ``forward`` carries the wrapped ``forward``'s signature, and attributes this class does not
    have are read from the wrapped module.
    """

    def __new__(cls, module: nn.Module, runtime: GeminiRuntime, *, cast_inputs: bool = False) -> GeminiModel:
        if cls is GeminiModel:
            cls = _wrapper_class(type(module), _signature_class(module))
        return super().__new__(cls)

    def __init__(self, module: nn.Module, runtime: GeminiRuntime, *, cast_inputs: bool = False) -> None:
        super().__init__()
        self.module = module
        self._runtime = runtime
        self._compute_dtype = runtime.config.param_dtype
        # Under fp32 inputs are left as they are (torch's type promotion, as in the plain model), unless the module's
        # parameters were of another dtype, whose inputs its caller passes.
        self._cast_inputs = cast_inputs or self._compute_dtype != torch.float32
        self._foreign_warned: set[str] = set()  # parameters put in place since initialize, warned about
        self._parent_loads: list[int] = []  # see [Note: loaded by a parent module]
        self.register_load_state_dict_post_hook(_take_back_wrapped_missing)
        skip_call_frame(GeminiModel.__call__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if sys._getframe(1).f_code is _DDP_CALLS_MODULE:  # f_code only: reading f_locals would keep them alive
            # Its reducer would all-reduce p.grad, which under ZeRO a rank holds only in part (a placeholder, or no
            # gradient at all under ZeRO-3): refused before anything runs.
            raise RuntimeError(
                "gemini's model is wrapped in DistributedDataParallel (by DDP(...) or accelerate's prepare): gemini "
                "averages the gradients over the ranks itself (ZeRO over GeminiConfig.process_group), so call it "
                "unwrapped; with accelerate, use gemini.hf.GeminiAccelerator in place of accelerate.Accelerator")
        # The forward that searches for parameters of a descendant read by its ancestor runs uncompiled, decided here
        # in plain Python: see [Note: the search forward runs uncompiled] in gemini/engine/descendant_reads.py.
        hooks = self._runtime.hooks
        if hooks is not None and hooks.search_due():
            return run_uncompiled(super().__call__, args, kwargs)
        return super().__call__(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = self.__dict__.get("_modules", {}).get("module")
            if inner is None or name == "module":
                raise
            if name in PEFT_MERGING and is_peft_model(inner):
                return merging_refused(name)  # see [Note: PEFT models] in gemini/peft.py
            if name in RESTRUCTURING and hasattr(inner, name):
                return restructuring_refused(name)  # see [Note: methods that restructure the model]
            return getattr(inner, name)

    # -------------------------------------------------------------------- gradients
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Forget the gradients: exactly what ``optimizer.zero_grad()`` does (they live in chunks)."""
        self._runtime.zero_grad(set_to_none=set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients like ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``.

        Scales them in place so their total norm is at most ``max_norm`` and returns the total norm before clipping.
        Works under every placement, fp16 (the norm is of the unscaled gradients) and ZeRO (a collective: every rank
        calls it; ``norm_type`` 2 only)."""
        return clip_model_grad_norm_(self._runtime, max_norm, norm_type)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._cast_inputs:
            args, kwargs = _cast_floats((args, kwargs), self._compute_dtype)
        with self._runtime.budget_errors("the forward pass", evaluation=not torch.is_grad_enabled()):
            return self.module(*args, **kwargs)

    def save_pretrained(self, save_directory, *, state_dict: dict | None = None, max_shard_size: int | str = "5GB",
                        is_main_process: bool = True, safe_serialization: bool = True, **kwargs: Any):
        """Hugging Face's ``save_pretrained``, as accelerate scripts call it on the unwrapped model.

        Writes with :func:`gemini.save_pretrained` (the fp32 masters, streamed; under ZeRO every rank calls it and rank
        0 writes, whatever ``is_main_process`` says), not the wrapped model's, which would write the parameters'
        ``.data`` (empty under ZeRO-3). A ``state_dict`` given (the consolidated ``accelerator.get_state_dict(model)``)
        is written by the wrapped model's own."""
        if state_dict is not None:
            return self.module.save_pretrained(save_directory, state_dict=state_dict, max_shard_size=max_shard_size,
                                               is_main_process=is_main_process,
                                               safe_serialization=safe_serialization, **kwargs)
        kwargs.pop("save_function", None)  # accelerate's save: gemini writes the files itself
        from gemini.pretrained import save_pretrained  # gemini.pretrained imports this module

        if is_peft_model(self.module):  # PEFT's own options go to it: see [Note: PEFT models]
            return save_adapter(self, save_directory, safe_serialization=safe_serialization, **kwargs)
        if kwargs or not safe_serialization:
            unsupported = sorted(kwargs) + ([] if safe_serialization else ["safe_serialization=False"])
            raise ValueError(f"save_pretrained({', '.join(unsupported)}) is not supported on gemini's model: it writes "
                             f"safetensors of the fp32 masters (max_shard_size is honoured)")
        return save_pretrained(self, save_directory, max_shard_size=max_shard_size)

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False) -> dict[str, torch.Tensor]:
        if keep_vars:
            # torch's keep_vars hands out the live tensors; here they are views of chunks that move and are released
            # between modules, so only copies can be given.
            raise ValueError("model.state_dict(keep_vars=True) is not supported: gemini's parameters live in chunks "
                             "that move between tiers, so state_dict() returns fp32 copies on the CPU; to change "
                             "the model, load values with model.load_state_dict(...) or edit model.parameters() "
                             "in place under torch.no_grad()")
        return self._state_dict(OrderedDict() if destination is None else destination, prefix=prefix)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """``state_dict()``'s entries of the trainable (``requires_grad``) parameters only: a LoRA adapter's, without
        the frozen model's. Under ZeRO a collective, as state_dict()."""
        return self._state_dict(OrderedDict(), select=lambda t: isinstance(t, nn.Parameter) and t.requires_grad)

    def _state_dict(self, out: dict, *, prefix: str = "", select=lambda t: True) -> dict[str, torch.Tensor]:
        runtime = self._runtime
        runtime.manager.adopt_assigned()  # p.data assigned, and low-precision edits: what the step will train
        runtime.residency.merge_param_edits(runtime.manager.groups)
        own = {k: t for k, t in self.module.state_dict(keep_vars=True).items() if select(t)}
        params = [(t, None) for k, t in own.items() if self._in_chunks(k, t)]
        # Under ZeRO a collective: every rank calls it and gets the whole model.
        copies: dict[int, torch.Tensor] = {}  # tied parameters share one value
        for group, entries in self._per_group(params, modify=False):
            src = group.master_chunk
            if group.is_shard(src):  # ZeRO: every rank's range, gathered (a collective)
                full = gather_state(self._runtime.zero, group, src)
            else:
                full = src.payload()
            for t, slot, _ in entries:
                if id(t) not in copies:
                    copies[id(t)] = runtime.memory.to_host(full[slot.offset : slot.end].view(slot.shape),
                                                           torch.float32)
        for key, t in own.items():
            out[prefix + key] = copies[id(t)] if id(t) in copies else runtime.memory.to_host(t.detach())
        return out

    def _in_chunks(self, key: str, t: torch.Tensor) -> bool:
        """Whether ``t`` (``key`` of the wrapped module's state_dict) is a parameter in chunks.

        A parameter put in place since initialize (``module.w = nn.Parameter(...)``, parametrize's
        ``remove_parametrizations``) is not: state_dict and load_state_dict take it as a buffer, as torch takes a
        parameter its optimizer does not hold. It is warned about once."""
        if not isinstance(t, nn.Parameter):
            return False
        if self._runtime.manager.manages(t):
            return True
        if key not in self._foreign_warned:
            self._foreign_warned.add(key)
            logger.warning("parameter %s was put in place after gemini.initialize: it is not in gemini's chunks, so "
                           "gemini's optimizer does not train it (state_dict and load_state_dict take its tensor as "
                           "it is); set parameters up before gemini.initialize", key)
        return False

    def _per_group(self, pairs: list[tuple[nn.Parameter, Any]], *, modify: bool):
        """Yield (chunk group, [(param, slot, value), ...]) per chunk group, in group order, with the group's fp32
        masters in host memory for the block: masters on NVMe are read (and with ``modify`` written back) once per
        group, and nothing else of the group. Under fp32 the param chunk is the master and no file is read."""
        manager = self._runtime.manager
        grouped: dict[int, list] = {}
        for p, value in pairs:
            group, slot = manager.locate(p)
            grouped.setdefault(group.index, []).append((p, slot, value))
        for index in sorted(grouped):
            group = manager.groups[index]
            # Only the masters: Adam's m and v (two thirds of the bytes) stay in their files.
            masters = (self._runtime.resident(group, modify=modify, chunks=(group.master,))
                       if group.master is not None else contextlib.nullcontext())
            with masters:
                yield group, grouped[index]

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True, assign: bool = False):
        """torch's ``load_state_dict``: every key and shape is checked before anything is written, and the load is all
        or nothing (see [Note: a load is all or nothing] in gemini/engine/load_transaction.py)."""
        if assign:
            raise ValueError("GeminiModel.load_state_dict(assign=True) is not supported: parameters live in chunks")
        self._runtime.manager.adopt_assigned()  # torch would load into an assigned p.data: so do we
        keys = self._check_load(state_dict, strict=strict)
        with LoadTransaction(self._runtime) as tx:
            self._load_into(state_dict, tx)
        return keys

    # [Note: loaded by a parent module]
    # A parent (torch.compile's OptimizedModule, whose keys are "_orig_mod." + ours, or any module holding this one)
    # loads through nn.Module.load_state_dict's recursion: our ``_load_from_state_dict`` with our prefix, then our
    # children's. The keys our state_dict wrote under ``prefix`` are loaded here through gemini's own load (chunks,
    # masters, all or nothing). The wrapped module's keys lack "module.", so its modules, handed nothing, report all
    # their keys missing: the post-hook removes those (they come last, after the mark recorded here).
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(assign=True) is not supported on gemini's model: parameters live in chunks")
        ours = {k[len(prefix):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(prefix)}
        self._runtime.manager.adopt_assigned()  # as load_state_dict
        try:
            keys = self._check_load(ours, strict=False, prefix=prefix)
        except RuntimeError as e:  # a size mismatch: nothing of ours loads, torch raises it at the end
            error_msgs.append(str(e))
            keys = _IncompatibleKeys([], [])
        else:
            with LoadTransaction(self._runtime) as tx:
                self._load_into(ours, tx)
        missing_keys.extend(prefix + k for k in keys.missing_keys)
        unexpected_keys.extend(prefix + k for k in keys.unexpected_keys)
        self._parent_loads.append(len(missing_keys))

    def _check_load(self, state_dict: dict[str, torch.Tensor], *, strict: bool = True,
                    prefix: str = "") -> _IncompatibleKeys:
        """Raise what :meth:`load_state_dict` would raise for ``state_dict``, changing nothing (``prefix``: the keys'
        prefix in a parent's state_dict, for the messages)."""
        own = self.module.state_dict(keep_vars=True)
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise RuntimeError(f"Error(s) loading state_dict: missing keys {missing}, unexpected keys {unexpected}")
        for key, t in own.items():
            # A parameter's shape from its slot: under ZeRO-3 its .data is empty between uses.
            shape = tuple(self._runtime.manager.locate(t)[1].shape) if self._in_chunks(key, t) else tuple(t.shape)
            if key in state_dict and tuple(state_dict[key].shape) != shape:
                raise RuntimeError(f"size mismatch for {prefix}{key}: checkpoint {tuple(state_dict[key].shape)}, "
                                   f"model {shape}")
        return _IncompatibleKeys(missing, unexpected)

    def _load_into(self, state_dict: dict[str, torch.Tensor], tx: LoadTransaction) -> None:
        """Write ``state_dict`` (checked) in ``tx``: masters on NVMe now, everything in memory at its end."""
        own = self.module.state_dict(keep_vars=True)
        params = []
        for key, t in own.items():
            if key not in state_dict:
                continue
            if self._in_chunks(key, t):
                params.append((t, state_dict[key]))
            else:
                tx.later(functools.partial(_copy, t, state_dict[key]))
        grouped: dict[int, list] = {}
        for p, value in params:
            group, slot = self._runtime.manager.locate(p)
            grouped.setdefault(group.index, []).append((slot, value))
        for index in sorted(grouped):
            group, entries = self._runtime.manager.groups[index], grouped[index]
            write = functools.partial(_write_params, group, entries)
            if group.master is None:  # fp32: the param chunk is the master, in memory
                tx.later(write)
                continue
            # Every slot written: the masters' file (maybe lost or corrupted) is not read.
            whole = {slot.index for slot, _ in entries} == {slot.index for slot in group.slots}
            tx.write(group, write, chunks=(group.master,), overwrite=whole)


def _take_back_wrapped_missing(model: GeminiModel, incompatible: Any) -> None:
    """A post-hook of a parent's load (torch's incompatible keys): see [Note: loaded by a parent module]."""
    if model._parent_loads:  # our load_state_dict runs no hooks; only torch's recursion, after the mark
        del incompatible.missing_keys[model._parent_loads.pop():]


def _cast_floats(x: Any, dtype: torch.dtype) -> Any:
    """``x`` with every floating-point tensor cast to ``dtype``, looking into lists, tuples, namedtuples, dicts,
    ``UserDict`` (Hugging Face's ``BatchEncoding``) and dataclasses, as FSDP's casting does (torch's pytree does not
    look into the last two)."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, (dict, UserDict)):
        out = copy.copy(x)  # the same type (an OrderedDict, a defaultdict's factory, a BatchEncoding)
        for k in out.keys():
            out[k] = _cast_floats(out[k], dtype)
        return out
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: _cast_floats(getattr(x, f.name), dtype)
                                         for f in dataclasses.fields(x) if f.init})
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a namedtuple
        return type(x)(*(_cast_floats(v, dtype) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(_cast_floats(v, dtype) for v in x)
    return x


@torch.no_grad()
def _copy(buffer: torch.Tensor, value: torch.Tensor) -> None:
    buffer.copy_(value)


@torch.no_grad()
def _write_params(group: ChunkGroup, entries: list[tuple[TensorSlot, torch.Tensor]]) -> None:
    """Each (slot, value) of ``group`` into its parameters, param shard and masters."""
    for slot, value in entries:
        for chunk in (group.param, group.param_shard, group.master):
            if chunk is not None and chunk.state is not ChunkState.RELEASED:
                group.write_value(chunk, slot, value)


_WRAPPER_CLASSES: dict[tuple[type, type], type] = {}


_CONTAINER_METHODS = ("__getitem__", "__len__", "__iter__", "__contains__")


def _delegate(name: str) -> Any:
    def method(self, *args: Any) -> Any:
        return getattr(self.module, name)(*args)

    method.__name__ = name
    return method


def _signature_class(module: nn.Module) -> type[nn.Module]:
    """The class whose ``forward`` signature the wrapper shows: the module's own, or for a PEFT model whose forward
    takes ``(*args, **kwargs)`` its base model's (as Trainer reads it for a ``PeftModel``, which the wrapper is not)."""
    if is_peft_model(module):
        after_self = list(inspect.signature(type(module).forward).parameters.values())[1:]
        if all(p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD) for p in after_self):
            return type(module.get_base_model())
    return type(module)


def _wrapper_class(inner: type[nn.Module], signature_of: type[nn.Module]) -> type[GeminiModel]:
    """The :class:`GeminiModel` subclass for modules of class ``inner``: named like it, with ``signature_of.forward``'s
    signature (see [Note: the wrapper looks like the wrapped model])."""
    cls = _WRAPPER_CLASSES.get((inner, signature_of))
    if cls is not None:
        return cls

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return GeminiModel.forward(self, *args, **kwargs)

    try:
        forward.__signature__ = inspect.signature(signature_of.forward)
    except (TypeError, ValueError):  # a forward without an introspectable signature keeps (*args, **kwargs)
        pass
    forward.__doc__ = signature_of.forward.__doc__
    # Python looks special methods up on the class, past __getattr__: a wrapped container (nn.Sequential,
    # nn.ModuleList) indexes, counts and iterates as the wrapped one does.
    containers = {name: _delegate(name) for name in _CONTAINER_METHODS if getattr(inner, name, None) is not None}
    cls = type(inner.__name__, (GeminiModel,), {
        "forward": forward,
        "__module__": GeminiModel.__module__,
        "__qualname__": f"GeminiModel[{inner.__qualname__}]",
        "__doc__": GeminiModel.__doc__,
        **containers,
    })
    _WRAPPER_CLASSES[inner, signature_of] = cls
    return cls


def gemini_model(model: nn.Module, function: str) -> GeminiModel:
    """The model ``initialize`` returned, unwrapping its ``torch.compile`` handle ("_orig_mod." keys)."""
    # Only a loaded dynamo can have made an OptimizedModule: gemini does not import it for this.
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        model = model._orig_mod
    if not isinstance(model, GeminiModel):
        raise TypeError(f"{function}() got a {type(model).__name__} for model: pass the model gemini.initialize "
                        f"returned (or torch.compile of it)")
    return model
