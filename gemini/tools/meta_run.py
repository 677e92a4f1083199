"""`non_model_peak_bytes`: the activations and temporaries of one forward and backward, measured
on the meta device before anything is allocated.

[Note: planning on the meta device]
A tensor on the meta device has a shape, a dtype and no storage: every operator computes its
output's shape and nothing else. Running the model once there, under the same tensor-
accounting monitor the warm-up uses on the CPU (tracer/accounting_monitor.py, which counts storages by
identity and so works on meta too), gives the peak of the bytes that are not model data —
activations saved for backward, temporaries, each parameter's gradient until it is taken —
without memory or compute. The parameters are meta stand-ins in the dtype the chunks will hold
(``param_dtype``), passed through ``torch.func.functional_call``, so the model itself is
never touched and may live anywhere (on meta too). Each gradient is dropped as soon as it is
accumulated, as the engine moves it into its gradient chunk.

What it cannot see: kernels' internal scratch (as on the CPU stand-in), the CUDA caching
allocator's rounding and fragmentation, and code that needs values (``.item()``, data-
dependent shapes), which fails here with a clear error.

[Note: attention on the meta device]
``F.scaled_dot_product_attention`` has no fused kernel on meta: it falls back to the math
path, which materializes and saves the (batch, heads, query, key) attention matrix. On the
devices the model really runs on (CUDA, and the CPU for fp32/bf16) a fused kernel saves only
its inputs, its output and one log-sum-exp per query row. The plan measures what the fused
kernel keeps: for the meta run a function mode routes the call to a stand-in with that output
and those saved tensors (``_FusedAttention``), so an attention matrix the run never holds is
not charged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

from gemini.engine.backward_uses import hook_all_grads_of
from tracer.hooks import Boundary, PeriodHooks, Phase
from tracer.monitors import TensorAccountingMonitor

__all__ = ["MetaPeaks", "meta_inputs", "meta_peaks", "non_model_peak_bytes"]


def meta_inputs(example_inputs: Sequence[Any]) -> tuple[Any, ...]:
    """``example_inputs`` on the meta device: tensors keep their shape and dtype, ``(shape,
    dtype)`` pairs become tensors of them, anything else passes unchanged."""
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
    """The default loss's source: the output itself, or its first element (tuple, list, dict or a
    transformers ModelOutput)."""
    while not isinstance(output, torch.Tensor):
        if isinstance(output, dict) and output:
            output = next(iter(output.values()))
        elif isinstance(output, (tuple, list)) and output:
            output = output[0]
        else:
            raise TypeError(f"the model returned {type(output).__name__}: pass loss_fn(output) -> a scalar tensor")
    return output


class _FusedAttention(torch.autograd.Function):
    """Shapes and saved tensors of a fused attention kernel (see [Note: attention on the meta device])."""

    @staticmethod
    def forward(ctx, q, k, v):  # noqa: ANN001, ANN205
        if q.dim() == 4:
            # The fused kernels (CPU flash, CUDA flash and memory-efficient) write their output
            # (batch, query, heads, dim) in memory and return it transposed, so the usual
            # ``y.transpose(1, 2).contiguous()`` that follows copies nothing.
            b, h, t, _ = q.shape
            out = q.new_empty(b, t, h, v.shape[-1]).transpose(1, 2)
        else:
            out = q.new_empty(*q.shape[:-1], v.shape[-1])
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, _, _ = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _AttentionAsFused(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` on meta tensors to :class:`_FusedAttention`,
    for the meta run only (a function mode is thread-local and leaves other calls alone)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention and args and args[0].device.type == "meta":
            # Keys shared by head groups (enable_gqa) are read in place by the fused kernels,
            # never repeated: the stand-in keeps them at their own shape too.
            return _FusedAttention.apply(*args[:3])
        return func(*args, **kwargs)


@dataclass(frozen=True)
class MetaPeaks:
    """What one forward and backward on the meta device needs on the device (see [Note: the
    warm-up replayed on meta])."""

    non_model_bytes: int  # the most non-model bytes alive at once
    forward_non_model_bytes: int  # the most until the model's output has its gradient (the loss's too)
    backward_non_model_bytes: int  # the most from then on (the model's own backward)
    # With the chunk groups given: the warm-up's peak (non-model bytes and the chunks it holds,
    # at the same moment), and its planned peak (per period, the most chunk bytes held plus the
    # most non-model bytes, as ``MemoryPlan.planned_peak_bytes`` charges them). Buffers aside.
    warmup_peak_bytes: int
    planned_peak_bytes: int


# [Note: the warm-up replayed on meta]
# The warm-up (placement "cpu", and "auto" before its plan) holds a chunk group on the device
# only while it computes: from the forward pre-hook of the first module using it in a forward
# until the last such module's forward ends (tied and straddling groups wait for their last
# use); in backward from the backward of a module call using it until every begun call using
# it is done (its inputs' gradients computed) or all its gradients are in, with its gradient
# chunk from the first gradient to the last. The meta run follows the same events with the
# engine's own period hooks (tracer/hooks.py), module hooks and gradient hooks, and after every
# operator adds the chunk bytes held to the non-model bytes alive: the largest sum is the
# warm-up's peak. (The largest non-model peak often falls where no chunk is held: the loss on
# the logits runs after the root module's forward. Adding the largest group to it, as a sum
# of peaks would, overstates the peak.) The engine's plan charges each segment — a period,
# from one module's forward or backward to the next, cut again where backward marks a
# decision: a group's first gradient, a call's backward done — its own most chunk bytes plus
# its own non-model peak, since later iterations keep fetched chunks cached; the meta run
# keeps the same per-segment figures, so its planned peak, and the margin auto computes from
# it, are the engine's (bench_plan.py compares them).


class _WarmupReplay(TorchDispatchMode):
    """Follows the chunk groups the warm-up holds, and the peaks (see [Note: the warm-up
    replayed on meta])."""

    def __init__(self, monitor: TensorAccountingMonitor, group_bytes: Sequence[int],
                 uses: dict[int, int], grads_expected: dict[int, int]) -> None:
        super().__init__()
        self.monitor = monitor
        self.group_bytes = group_bytes
        self.uses = uses  # group -> module calls using it in one forward
        self.grads_expected = grads_expected  # group -> trainable parameters in it
        self.uses_left: dict[int, int] = {}
        self.refs: dict[int, int] = {}  # forward: modules using the group now
        self.backward_open: dict[int, int] = {}  # group -> module calls whose backward began, not done
        self.grads_in: dict[int, int] = {}
        self.held_bytes = 0
        self.warmup_peak = 0
        self.period_non_model = 0
        self.period_held = 0
        self.planned_peak = 0

    def _update(self) -> None:
        held = set(g for g, n in self.refs.items() if n) | set(g for g, n in self.uses_left.items() if n) \
            | set(g for g, n in self.backward_open.items() if n)
        grads = set(g for g, n in self.grads_in.items() if 0 < n < self.grads_expected.get(g, 0))
        self.held_bytes = sum(self.group_bytes[g] for g in held) + sum(self.group_bytes[g] for g in grads)
        self._measure()

    def _measure(self) -> None:
        now = self.monitor.current_bytes()
        self.warmup_peak = max(self.warmup_peak, now + self.held_bytes)
        self.period_non_model = max(self.period_non_model, now)
        self.period_held = max(self.period_held, self.held_bytes)

    def new_period(self) -> None:
        self.planned_peak = max(self.planned_peak, self.period_non_model + self.period_held)
        self.period_non_model = self.monitor.current_bytes()
        self.period_held = self.held_bytes

    def on_boundary(self, boundary: Boundary, groups: Sequence[int]) -> None:
        """A period begins (the engine's own boundaries: tracer/hooks.py); a backward one
        fetches the module's groups."""
        self.new_period()
        if boundary.phase is Phase.BACKWARD and groups:
            for g in groups:
                self.backward_open[g] = self.backward_open.get(g, 0) + 1
            self._update()

    def forward_begins(self, groups: Sequence[int]) -> None:
        for g in groups:
            if not self.uses_left.get(g):
                self.uses_left[g] = self.uses[g]
            self.refs[g] = self.refs.get(g, 0) + 1
        self._update()

    def backward_done(self, groups: Sequence[int]) -> None:
        """A module call's inputs have their gradients: the engine marks, and releases the
        groups no other begun call still reads."""
        self.new_period()
        for g in groups:
            if self.backward_open.get(g):
                self.backward_open[g] -= 1
        self._update()

    def forward_ends(self, groups: Sequence[int]) -> None:
        for g in groups:
            self.refs[g] -= 1
            self.uses_left[g] -= 1
        self._update()

    def grad_in(self, group: int) -> None:
        self.grads_in[group] = self.grads_in.get(group, 0) + 1
        if self.grads_in[group] == 1:
            # The engine marks a decision here (a new segment), then the gradient chunk arrives.
            self.new_period()
            self._update()
        if self.grads_in[group] >= self.grads_expected[group]:
            self.backward_open.pop(group, None)
            self._update()

    def finish(self) -> None:
        self.new_period()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        self._measure()
        return out


def non_model_peak_bytes(model: nn.Module, example_inputs: Sequence[Any], *,
                         loss_fn: Callable[[Any], torch.Tensor] | None = None,
                         param_dtype: torch.dtype = torch.float32) -> int:
    """The most bytes of non-model tensors alive at once in one forward and backward of
    ``model`` on ``example_inputs`` (see [Note: planning on the meta device])."""
    return meta_peaks(model, example_inputs, loss_fn=loss_fn, param_dtype=param_dtype).non_model_bytes


def meta_peaks(model: nn.Module, example_inputs: Sequence[Any], *,
               loss_fn: Callable[[Any], torch.Tensor] | None = None,
               param_dtype: torch.dtype = torch.float32,
               group_of: Mapping[str, int] | None = None, group_bytes: Sequence[int] = ()) -> MetaPeaks:
    """The device's needs in one forward and backward of ``model`` on ``example_inputs``, on
    the meta device (see [Note: planning on the meta device]). ``group_of`` maps each
    parameter's name (as ``model.named_parameters()`` gives it) to its chunk group, and
    ``group_bytes[g]`` is group g's parameter (and gradient) chunk bytes: with them the
    warm-up's chunk visits are replayed (see [Note: the warm-up replayed on meta]).

    ``loss_fn(output)`` gives the scalar to differentiate (default: the sum of the first
    output, in fp32). Raises ``ValueError`` if the model cannot run on the meta device.
    """
    group_of = dict(group_of or {})
    state: dict[str, torch.Tensor] = {}
    trainable = []
    grads_expected: dict[int, int] = {}
    monitor = TensorAccountingMonitor("meta")
    uses: dict[int, int] = {}
    replay = _WarmupReplay(monitor, group_bytes, uses, grads_expected)
    for name, p in model.named_parameters():
        dtype = param_dtype if p.is_floating_point() else p.dtype
        t = torch.empty(p.shape, dtype=dtype, device="meta", requires_grad=p.requires_grad)
        if p.requires_grad:
            group = group_of.get(name)

            def taken(leaf: torch.Tensor, group: int | None = group) -> None:
                # The engine takes each gradient into its chunk as it arrives: it is not held.
                leaf.grad = None
                if group is not None:
                    replay.grad_in(group)

            t.register_post_accumulate_grad_hook(taken)
            trainable.append(t)
            if group is not None:
                grads_expected[group] = grads_expected.get(group, 0) + 1
        state[name] = t
    for name, b in model.named_buffers():
        state[name] = torch.empty(b.shape, dtype=param_dtype if b.is_floating_point() else b.dtype, device="meta")
    args = meta_inputs(example_inputs)
    monitor.exclude(list(state.values()))  # model data: counted by the plan's chunk bytes

    def begin_call(groups: list[int], module: nn.Module, inputs: tuple) -> None:
        replay.forward_begins(groups)
        # Done when its inputs' gradients are computed (as the engine follows it); a call whose
        # inputs need none (the embedding) holds its groups until their gradients are in.
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
    periods = PeriodHooks(model, lambda boundary: replay.on_boundary(boundary, groups_of.get(boundary.module, ())))
    try:
        with monitor, _AttentionAsFused(), replay, periods:
            output = functional_call(model, state, args)
            # Until the model's output has its gradient, the engine's backward has not begun (its
            # gradient chunks come then): the loss and its backward belong to the first part.
            split = [None]

            def output_grad(_grad: torch.Tensor) -> None:
                split[0] = monitor.peak_bytes()
                monitor.reset_peak()

            outputs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
            if outputs:
                torch.autograd.graph.register_multi_grad_hook(outputs, output_grad, mode="any")
            loss = loss_fn(output) if loss_fn is not None else _first_output(output).float().sum()
            del output, outputs
            if trainable and loss.requires_grad:
                loss.backward()
            del loss
            if split[0] is None:  # no backward reached the model
                forward_peak, backward_peak = monitor.peak_bytes(), 0
            else:
                forward_peak, backward_peak = split[0], monitor.peak_bytes()
            replay.finish()
    except (RuntimeError, NotImplementedError, TypeError) as e:
        raise ValueError(
            f"example_inputs: the model could not run on the meta device to measure its activations ({type(e).__name__}: "
            f"{e}); plan without example_inputs (activations are then not counted), or pass loss_fn") from e
    finally:
        for h in handles:
            h.remove()
    return MetaPeaks(non_model_bytes=max(forward_peak, backward_peak), forward_non_model_bytes=forward_peak,
                     backward_non_model_bytes=backward_peak,
                     warmup_peak_bytes=replay.warmup_peak, planned_peak_bytes=max(replay.planned_peak, replay.warmup_peak))
