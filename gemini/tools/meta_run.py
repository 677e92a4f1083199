"""`non_model_peak_bytes`: the activations and temporaries of one forward and backward, measured on the meta device
before anything is allocated.

[Note: planning on the meta device]
A meta tensor has a shape, a dtype and no storage: every operator computes only its output's shape. Running the model
once there, under the tensor-accounting monitor the warm-up uses on the CPU (tracer/accounting_monitor.py, which
counts storages by identity and so works on meta too), gives the peak of the bytes that are not model data
(activations saved for backward, temporaries, each parameter's gradient until it is taken) without memory or compute.
The parameters are meta stand-ins in the chunks' dtype (``param_dtype``), passed through
``torch.func.functional_call``, so the model itself is never touched and may live anywhere (on meta too). Each
gradient is dropped as soon as it is accumulated, as the engine moves it into its gradient chunk.

It cannot see kernels' internal scratch (nor can the CPU stand-in), the CUDA caching allocator's rounding and
fragmentation, or code that needs values (``.item()``, data-dependent shapes), which fails here with a clear error.
Attention (``F.scaled_dot_product_attention``) is charged as the configured device runs it: see
[Note: attention on the meta device] in gemini/tools/meta_attention.py.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.utils._pytree import tree_leaves

from gemini.engine.backward_uses import hook_all_grads_of
from gemini.policies.footprint import DeviceGroups
from gemini.tools.meta_attention import attention_as_on
from gemini.tools.meta_device import as_on_device
from gemini.tools.meta_offload import MetaOffload
from gemini.tools.meta_replay import WarmupReplay
from tracer.grad_nodes import hook_first_grad
from tracer.hooks import PeriodHooks
from tracer.monitors import TensorAccountingMonitor

__all__ = ["MetaPeaks", "meta_inputs", "meta_peaks", "non_model_peak_bytes"]


def meta_inputs(example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """``example_inputs`` on the meta device: tensors keep their shape and dtype, ``(shape, dtype)`` pairs become
    tensors of them, anything else passes unchanged."""
    if isinstance(example_inputs, (torch.Tensor, dict)) or not isinstance(example_inputs, Sequence):
        raise TypeError(f"example_inputs must be a tuple or list of the model's positional arguments, got "
                        f"{type(example_inputs).__name__}")
    out = []
    for i, a in enumerate(example_inputs):
        if isinstance(a, torch.Tensor):
            out.append(torch.empty(a.shape, dtype=a.dtype, device="meta"))
        elif (isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], torch.dtype)
              and isinstance(a[0], (tuple, list, torch.Size)) and all(isinstance(n, int) for n in a[0])):
            out.append(torch.empty(tuple(a[0]), dtype=a[1], device="meta"))
        elif isinstance(a, tuple) and any(isinstance(x, torch.dtype) for x in a):
            raise TypeError(f"example_inputs[{i}]={a!r}: a shape and dtype are given as ((d0, d1, ...), dtype)")
        else:
            out.append(a)
    return tuple(out)


def _first_output(output: Any) -> torch.Tensor:
    """The default loss's source: the output, or its first element (tuple, list, dict or transformers ModelOutput)."""
    while not isinstance(output, torch.Tensor):
        if isinstance(output, dict) and output:
            output = next(iter(output.values()))
        elif isinstance(output, (tuple, list)) and output:
            output = output[0]
        else:
            raise TypeError(f"the model returned {type(output).__name__}: pass loss_fn(output) -> a scalar tensor")
    return output


@dataclass(frozen=True)
class MetaPeaks:
    """What one forward and backward on the meta device needs on the device (see
    [Note: the warm-up replayed on meta] in gemini/tools/meta_replay.py)."""

    non_model_bytes: int  # the most non-model bytes alive at once
    forward_non_model_bytes: int  # the most until the model's output has its gradient (the loss's too)
    backward_non_model_bytes: int  # the most from then on (the model's own backward)
    # With the chunk groups given: the warm-up's peak (non-model bytes and the chunks it holds, at the same moment),
    # and its planned peak (per period, the most chunk bytes held plus the most non-model bytes, as
    # ``MemoryPlan.planned_peak_bytes`` charges them). Buffers aside.
    warmup_peak_bytes: int
    planned_peak_bytes: int
    # With ``residents``: the peak of the non-model bytes and the chunks that come and go while those groups stay on
    # the device (see [Note: what stays on the device, replayed] in gemini/tools/meta_replay.py). 0 without.
    resident_peak_bytes: int = 0
    # With ``offload_min_bytes``: the bytes of each saved tensor offloaded, in the order saved.
    offloaded_sizes: tuple[int, ...] = ()


def non_model_peak_bytes(model: nn.Module, example_inputs: Sequence[Any], *,
                         loss_fn: Callable[[Any], torch.Tensor] | None = None,
                         param_dtype: torch.dtype = torch.float32, device_type: str = "cuda") -> int:
    """The most bytes of non-model tensors alive at once in one forward and backward of ``model`` on
    ``example_inputs`` on a ``device_type`` device (see [Note: planning on the meta device])."""
    return meta_peaks(model, example_inputs, loss_fn=loss_fn, param_dtype=param_dtype,
                      device_type=device_type).non_model_bytes


def meta_peaks(model: nn.Module, example_inputs: Sequence[Any], *,
               loss_fn: Callable[[Any], torch.Tensor] | None = None,
               param_dtype: torch.dtype = torch.float32, device_type: str = "cuda",
               group_of: Mapping[str, int] | None = None, group_bytes: Sequence[int] = (),
               residents: DeviceGroups | None = None, offload_min_bytes: int | None = None,
               offload_keep_from: int | None = None) -> MetaPeaks:
    """The device's needs in one forward and backward of ``model`` on ``example_inputs``, on the meta device (see
    [Note: planning on the meta device]). ``group_of`` maps each parameter's name (as ``model.named_parameters()``
    gives it) to its chunk group, and ``group_bytes[g]`` is group g's parameter (and gradient) chunk bytes: with them
    the warm-up's chunk visits are replayed (see [Note: the warm-up replayed on meta] in gemini/tools/meta_replay.py);
    with ``residents`` too, the timeline of a placement that keeps those groups on the device. With
    ``offload_min_bytes`` the tensors the forward saves for backward are offloaded as ``offload_activations`` does
    (gemini/tools/meta_offload.py); with ``offload_keep_from`` too, those saved from that index on stay (auto after
    its warm-up).

    ``loss_fn(output)`` gives the scalar to differentiate (default: the sum of the first output, in fp32). Attention
    is charged as a ``device_type`` device runs it (see [Note: attention on the meta device] in
    gemini/tools/meta_attention.py). Raises ``ValueError`` if the model cannot run on the meta device.
    """
    group_of = dict(group_of or {})
    monitor = TensorAccountingMonitor("meta")
    uses: dict[int, int] = {}  # group -> module calls using it in one forward
    grads_expected: dict[int, int] = {}  # group -> trainable parameters in it
    replay = WarmupReplay(monitor, group_bytes, uses, grads_expected, residents)
    state = _stand_ins(model, param_dtype, group_of, replay, grads_expected)
    args = meta_inputs(example_inputs)
    monitor.exclude(list(state.values()))  # model data: counted by the plan's chunk bytes
    handles, groups_of = _hook_modules(model, group_of, replay, uses)
    periods = PeriodHooks(model, lambda boundary: replay.on_boundary(boundary, groups_of.get(boundary.module, ())))
    offload = None if offload_min_bytes is None else MetaOffload(offload_min_bytes, list(state.values()),
                                                                    offload_keep_from)
    iteration = _Iteration(model, functools.partial(_forward_backward, loss_fn=loss_fn, monitor=monitor,
                                                    replay=replay, offload=offload,
                                                    train=any(t.requires_grad for t in state.values())))
    try:
        with as_on_device(device_type), monitor, attention_as_on(device_type), replay, periods:
            # The stand-ins stay in place until backward is over: a checkpoint's recompute reads the parameters then.
            forward_peak, backward_peak = functional_call(iteration, {f"model.{k}": v for k, v in state.items()}, args)
            replay.finish()
    except _LossTypeError as e:
        raise TypeError(str(e)) from None
    except (RuntimeError, NotImplementedError, TypeError) as e:
        # A loss_fn given may be where it failed (a target on a real device, say).
        advice = ("; if it failed in loss_fn, make what loss_fn uses besides the output a meta tensor too "
                  "(y.to('meta'))" if loss_fn is not None else ", or pass loss_fn")
        raise ValueError(
            f"example_inputs: the model could not run on the meta device to measure its activations ({type(e).__name__}: "
            f"{e}); plan without example_inputs (activations are then not counted){advice}") from e
    finally:
        for h in handles:
            h.remove()
    return MetaPeaks(non_model_bytes=max(forward_peak, backward_peak), forward_non_model_bytes=forward_peak,
                     backward_non_model_bytes=backward_peak,
                     warmup_peak_bytes=replay.warmup_peak, planned_peak_bytes=max(replay.planned_peak, replay.warmup_peak),
                     resident_peak_bytes=replay.resident_peak,
                     offloaded_sizes=tuple(offload.sizes) if offload is not None else ())


def _stand_ins(model: nn.Module, param_dtype: torch.dtype, group_of: Mapping[str, int], replay: WarmupReplay,
               grads_expected: dict[int, int]) -> dict[str, torch.Tensor]:
    """Meta tensors for the parameters (in the chunks' dtype) and buffers, by name; each trainable parameter's
    gradient is taken as the engine takes it."""
    state: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        dtype = param_dtype if p.is_floating_point() else p.dtype
        t = torch.empty(p.shape, dtype=dtype, device="meta", requires_grad=p.requires_grad)
        group = group_of.get(name) if p.requires_grad else None
        if p.requires_grad:
            t.register_post_accumulate_grad_hook(functools.partial(_take_grad, replay, group))
        if group is not None:
            grads_expected[group] = grads_expected.get(group, 0) + 1
        state[name] = t
    for name, b in model.named_buffers():
        state[name] = torch.empty(b.shape, dtype=param_dtype if b.is_floating_point() else b.dtype, device="meta")
    return state


def _take_grad(replay: WarmupReplay, group: int | None, leaf: torch.Tensor) -> None:
    """The engine copies each gradient into its chunk as it arrives, then drops it."""
    if group is not None:
        replay.grad_in(group)
    leaf.grad = None
    if group is not None:
        replay.grad_taken(group)


def _hook_modules(model: nn.Module, group_of: Mapping[str, int], replay: WarmupReplay,
                  uses: dict[int, int]) -> tuple[list, dict[nn.Module, list[int]]]:
    """Forward hooks on each module owning parameters, as the engine's; their handles, and each module's groups."""

    def begin_call(groups: list[int], module: nn.Module, inputs: tuple) -> None:
        replay.forward_begins(groups)
        # Done when its inputs' gradients are computed (as the engine follows it); a call whose inputs need none (the
        # embedding) holds its groups until their gradients are in. A recompute's inputs never get gradients (the
        # engine follows none either).
        if torch._C._current_graph_task_id() == -1:
            hook_all_grads_of(inputs, lambda: replay.backward_done(groups))

    names = {id(p): n for n, p in model.named_parameters()}
    groups_of: dict[nn.Module, list[int]] = {}
    handles = []
    for sub in model.modules():
        groups = sorted({group_of[names[id(p)]] for p in sub.parameters(recurse=False)
                         if names.get(id(p)) in group_of})
        groups_of[sub] = groups
        if groups:
            for g in groups:
                uses[g] = uses.get(g, 0) + 1
            handles.append(sub.register_forward_pre_hook(functools.partial(begin_call, groups)))
            handles.append(sub.register_forward_hook(lambda *_, gs=groups: replay.forward_ends(gs), always_call=True))
    return handles, groups_of


class _LossTypeError(TypeError):
    """loss_fn returned no tensor: said as is, not as a model that cannot run on meta."""


def _check_loss(loss: Any, source: str) -> None:
    """The loss a trainable model's backward starts from: a tensor with a graph. ``source`` says where it came from
    ("loss_fn returned")."""
    if not isinstance(loss, torch.Tensor):
        raise _LossTypeError(f"{source} {type(loss).__name__} {loss!r}: loss_fn must return the scalar tensor to "
                             f"differentiate, computed from the model's output")
    if not loss.requires_grad:
        raise ValueError(f"{source} a tensor that needs no gradient (detached from the model's output?): training "
                         f"would backward nothing, and the plan would count a forward only; loss_fn must return the "
                         f"loss computed from the output")


class _Iteration(nn.Module):
    """``body(model, *args)`` as a module, so that ``functional_call`` keeps the stand-ins in ``model`` through
    forward and backward."""

    def __init__(self, model: nn.Module, body: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self.body = body

    def forward(self, *args: Any) -> Any:
        return self.body(self.model, *args)


def _forward_backward(model: nn.Module, *args: Any, loss_fn: Callable[[Any], torch.Tensor] | None,
                      monitor: TensorAccountingMonitor, replay: WarmupReplay, offload: MetaOffload | None,
                      train: bool) -> tuple[int, int]:
    """One forward, the loss and its backward; the non-model peak before the model's output has its gradient and
    after."""
    with offload.hooks() if offload is not None else contextlib.nullcontext():  # the root's forward only
        output = model(*args)
    replay.forward_over()
    # Until the model's output has its gradient the engine's backward has not begun (its gradient chunks come then):
    # the loss and its backward belong to the first part.
    split = [None]

    def output_grad() -> None:
        split[0] = monitor.peak_bytes()
        monitor.reset_peak()

    # On the outputs' gradient nodes, as the engine's hook beginning its backward: a loss_fn modifying the output in
    # place keeps them (see [Note: a call's outputs hooked through in-place ops] in tracer/grad_nodes.py).
    outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if outputs:
        hook_first_grad(outputs, output_grad)
    loss = loss_fn(output) if loss_fn is not None else _first_output(output).float().sum()
    del output, outputs
    if train:
        _check_loss(loss, "loss_fn returned" if loss_fn is not None else "the model's first output is")
        loss.backward()
    del loss
    if split[0] is None:  # no backward reached the model
        return monitor.peak_bytes(), 0
    return split[0], monitor.peak_bytes()
