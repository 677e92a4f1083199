"""Parameters read where no call of their own module fetches them: in a forward pre-hook the
model had before initialize (old-API weight_norm, spectral_norm, prune: [Note: the engine's
hooks around the user's] in gemini/engine/hooks.py), or by an ancestor that never calls the
module owning them (nn.MultiheadAttention's out_proj, in training and in its fused evaluation
path: [Note: parameters of a descendant read by its ancestor] in
gemini/engine/descendant_reads.py).

On the CPU stand-in a read of a chunk's host copy computes the right values (host memory is
CPU memory too), while on CUDA it feeds a CPU tensor to a CUDA op: so besides comparing with
plain AdamW, every op of forward and backward is checked to read no parameter chunk that has no
device copy. Under ZeRO-3 the unfetched parameter is an empty shard: the ranks crashed.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gemini
import zero_workers as zw
from chunks import Tier
from helpers import assert_params_close
from multiprocess import run_ranks

pytestmark = pytest.mark.standin  # the host tier and the device tier are both CPU memory here
STEPS = 3
# Elements per chunk, per model: a module's parameters in chunk groups apart from its
# descendants' (MultiheadAttention's out_proj.weight in one of its own).
CHUNK = {"weight_norm": 200, "spectral_norm": 200, "prune": 200, "multihead_attention": 64, "encoder_layer": 64,
         "tied_projection": 136, "hook_reads_earlier": 64, "root_owns_and_reads": 64}
PLACEMENTS = {
    "cpu": dict(placement="cpu"),
    "static": dict(placement="static", static_param_device_fraction=0.0),
    "auto": dict(placement="auto"),  # device_memory: see _budget
}
_MOVES = {torch.ops.aten.copy_.default, torch.ops.aten._to_copy.default}
_NO_VALUES = {torch.ops.aten._has_compatible_shallow_copy_type.default}  # ``p.data = t`` under inference_mode


class _HostReads(TorchDispatchMode):
    """Records every op (not a copy between tiers, not a view) that reads a parameter chunk's
    host copy while that chunk has no device copy: a CPU tensor in a CUDA op on a real GPU."""

    def __init__(self, manager) -> None:
        super().__init__()
        self.manager = manager
        self.hits: list[tuple[str, list[str]]] = []
        self.active = False  # in forward and backward (entered around the whole loop: the
        # stand-in's own monitor is a dispatch mode opened at a forward and closed at a step)

    def _host_only(self) -> dict[int, list[str]]:
        return {g.param.payload(Tier.HOST).untyped_storage().data_ptr(): [s.name for s in g.param.slots]
                for g in self.manager.groups if g.param.is_on(Tier.HOST) and not g.param.is_on(Tier.DEVICE)}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Off while dynamo traces, on while compiled code runs: without it torch.compile skips
        # (for good) every frame run under the mode, and nothing compiled is checked.
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.active and func not in _MOVES and func not in _NO_VALUES and not func.is_view:
            host = self._host_only()
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor) and t.numel() and t.untyped_storage().data_ptr() in host:
                    self.hits.append((str(func), host[t.untyped_storage().data_ptr()]))
        return func(*args, **kwargs)


def _budget(name: str) -> int:
    """A device budget just above what auto's warm-up needs: chunks are evicted."""
    model, opt = gemini.initialize(zw.make_zoo(name), gemini.GeminiConfig(
        device="cpu", placement="auto", chunk_size=CHUNK[name]), lr=1e-2, weight_decay=0.01)
    # A warm-up that finds reads after their owner's call traces again at the second step, with
    # the first batch, kept in the list, on the device too (as in _train_checked).
    for x, y in zw.make_data(2):
        if opt._rt.plan is None:
            opt.backward(zw.loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
    plan = opt._rt.plan
    opt.close()
    return plan.planned_peak_bytes + plan.reserve_bytes + 2 * CHUNK[name] * 4


def _train_checked(name: str, placement: str, *, before=lambda net: net, after=lambda model: model,
                   each_step=lambda step: None):
    """Train the zoo model ``name`` as ``after(model)`` on gemini with ``before(net)`` (what
    initialize gets), every op of forward and backward checked by ``_HostReads``;
    ``each_step(step)`` after each step."""
    extra = dict(device_memory=_budget(name)) if placement == "auto" else {}
    model, opt = gemini.initialize(before(zw.make_zoo(name)), gemini.GeminiConfig(
        device="cpu", chunk_size=CHUNK[name], **PLACEMENTS[placement], **extra), lr=1e-2, weight_decay=0.01)
    run = after(model)
    reads = _HostReads(opt._rt.manager)
    states = []
    with reads:
        for step, (x, y) in enumerate(zw.make_data(STEPS)):
            reads.active = True
            opt.backward(zw.loss_fn(run(x), y))
            reads.active = False
            opt.step()
            opt.zero_grad()
            states.append({k.removeprefix("_orig_mod."): v for k, v in model.state_dict().items()})
            each_step(step)
    return model, opt, reads, states


def _reference(name: str):
    states, model, _ = zw.train_reference(STEPS, model=zw.make_zoo(name))
    return states, model


def _assert_trains_like_torch(name: str, placement: str, *, kernels_reorder: bool = False, **compiled):
    """``kernels_reorder``: inductor's kernels may sum in another order; compared as in
    tests/test_compile.py, and without attention's key bias (see ``_without_key_bias``)."""
    model, opt, reads, states = _train_checked(name, placement, **compiled)
    want, ref = _reference(name)
    assert reads.hits == [], f"ops read parameter chunks with no device copy: {reads.hits[:4]}"
    for step, (g, w) in enumerate(zip(states, want)):
        if kernels_reorder:
            assert_params_close(_without_key_bias(g), _without_key_bias(w), rtol=1e-5, atol=1e-5, step=step)
        else:
            assert_params_close(g, w, step=step)
    return model, opt, ref


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", ["weight_norm", "spectral_norm", "prune"])
def test_pre_hooks_the_model_had_read_fetched_parameters(name, placement):
    """The old APIs compute ``weight`` in a forward pre-hook registered before initialize, which
    ran before the engine's fetch: it read the host copy (ZeRO-3: an empty shard, SIGFPE)."""
    _, opt, _ = _assert_trains_like_torch(name, placement)
    opt.close()


def test_pre_hooks_zero3_train_like_torch(tmp_path):
    names = ["weight_norm", "spectral_norm", "prune"]
    run_ranks(zw.run_zoo, names, STEPS, CHUNK[names[0]], str(tmp_path), timeout_seconds=240)
    for name in names:
        want, _ = _reference(name)
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}_rank{rank}.pt", weights_only=True)["states"]
            for step, (g, w) in enumerate(zip(got, want)):
                assert_params_close(g, w, step=step)




@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", ["multihead_attention", "encoder_layer"])
def test_descendants_read_by_an_ancestor_are_fetched_by_it(name, placement):
    """nn.MultiheadAttention reads out_proj's weight and bias without calling out_proj: its
    chunk was never fetched (a host read; ZeRO-3: "mat2 must be a matrix"); in an encoder layer
    too. Then evaluation forwards without grad (MultiheadAttention's fused path)."""
    model, opt, ref = _assert_trains_like_torch(name, placement)
    _assert_evaluates_like_torch(model, model, opt, ref)
    opt.close()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("name", ["tied_projection", "hook_reads_earlier", "root_owns_and_reads"])
def test_reads_after_the_owners_call_are_fetched_by_the_reading_ancestor(name, placement):
    """A root's ``F.linear(h, self.embed.weight)`` after embed's call (also by a root owning
    parameters), a parent's layer scale
    read after calling the child, a user's pre-hook reading an earlier layer's bias: the owner's
    hooks had released the group, so the read saw the host copy (CUDA: torch's device mismatch;
    ZeRO-3: an empty shard). Evaluation forwards without grad too."""
    model, opt, ref = _assert_trains_like_torch(name, placement)
    _assert_evaluates_like_torch(model, model, opt, ref)
    opt.close()
    if placement == "auto":  # the warm-up is traced again; the first step still reports its warm-up's peak
        model, opt = gemini.initialize(zw.make_zoo(name), gemini.GeminiConfig(device="cpu", placement="auto",
                                                                              chunk_size=CHUNK[name]), lr=1e-2)
        reports = []
        for x, y in zw.make_data(2):
            opt.backward(zw.loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
            reports.append(opt.report)
        assert reports[0].timeline is None and reports[1].timeline is not None
        # The first warm-up's peak, chunks included (the step reported its own 640 bytes of data alone).
        assert reports[0].device_peak_bytes > reports[1].timeline.warmup_model_peak_bytes > 0
        opt.close()


def _assert_evaluates_like_torch(model, run, opt, ref, *, rtol: float = 1e-6, atol: float = 1e-7) -> None:
    """Evaluation forwards without grad of ``run`` (MultiheadAttention's fused path) read
    fetched chunks only."""
    x = zw.make_data(1, seed=5)[0][0]
    model.eval()
    ref.eval()
    reads = _HostReads(opt._rt.manager)
    with reads, torch.no_grad():
        reads.active = True
        for _ in range(2):  # the first evaluation forward finds the reads, the second has them fetched
            torch.testing.assert_close(run(x), ref(x), rtol=rtol, atol=atol)
        reads.active = False
    assert reads.hits == [], f"ops read parameter chunks with no device copy: {reads.hits[:4]}"


class _Compiled:
    """A zoo model compiled ``how``, with ``backend``: ``before(net)`` is what initialize gets,
    ``after(model)`` what trains (and, as ``run``, evaluates)."""

    HOW = ("after initialize", "before initialize", "in place before initialize", "the block in place")

    def __init__(self, how: str, backend: str) -> None:
        self.how, self.backend, self.run = how, backend, None

    def before(self, net):
        if self.how == "before initialize":
            return torch.compile(net, backend=self.backend)
        if self.how == "in place before initialize":
            net.compile(backend=self.backend)
        return net

    def after(self, model):
        self.run = torch.compile(model, backend=self.backend) if self.how == "after initialize" else model
        if self.how == "the block in place":
            model.module.block.compile(backend=self.backend)
        return self.run


@pytest.mark.parametrize(("how", "backend"), [(how, "aot_eager") for how in _Compiled.HOW]
                         + [("after initialize", "eager"), ("after initialize", "inductor")])
@pytest.mark.parametrize("placement", ["cpu", "auto"])
@pytest.mark.parametrize("name", ["multihead_attention", "encoder_layer"])
def test_descendants_read_by_an_ancestor_are_fetched_under_compile(name, placement, how, backend):
    """Compiled, the first forward of each kind runs uncompiled and finds out_proj's reads (see
    [Note: the search forward runs uncompiled]): before, dynamo would have compiled every graph
    twice (it guards on the mode stack), so the search was skipped and the compiled attention read
    out_proj's host copy (on CUDA a CPU tensor in a CUDA op). The graphs compile at the second
    forward, and never again: the search adds no compile."""
    torch._dynamo.reset()
    counters.clear()
    graphs = []

    def each_step(step: int) -> None:
        graphs.append(counters["stats"]["unique_graphs"])
        # From the third step on, a frame compiled again (a guard failed) raises.
        torch._dynamo.config.error_on_recompile = step >= 1

    compiled = _Compiled(how, backend)
    try:
        with torch._dynamo.config.patch(error_on_recompile=False):
            model, opt, ref = _assert_trains_like_torch(name, placement, before=compiled.before, after=compiled.after,
                                                        each_step=each_step, kernels_reorder=backend == "inductor")
        assert graphs[0] == 0, f"the search forward compiled graphs: {graphs}"
        assert graphs[1] > 0 and graphs[-1] == graphs[1], f"graphs compiled per step: {graphs}"
        tol = dict(rtol=1e-5, atol=1e-5) if backend == "inductor" else {}
        _assert_evaluates_like_torch(model, compiled.run, opt, ref, **tol)
        assert counters["stats"]["unique_graphs"] > graphs[-1], "the evaluation forwards compiled nothing"
        opt.close()
    finally:
        torch._dynamo.reset()


def _without_key_bias(state: dict) -> dict:
    """The key part of attention's input bias cut out: its exact gradient is zero (it adds the
    same score to every key), so Adam makes full steps out of rounding noise there, which two
    ranks' summation order changes (see tests/zero_workers.py)."""
    state = dict(state)
    for k, v in state.items():
        if k.endswith("in_proj_bias"):
            third = v.shape[0] // 3
            state[k] = torch.cat([v[:third], v[2 * third:]])
    return state


def test_descendants_read_by_an_ancestor_zero3_train_like_torch(tmp_path):
    _assert_zero3_zoo_like_torch(["multihead_attention", "encoder_layer"], CHUNK["multihead_attention"], tmp_path,
                                 compared=_without_key_bias)


def test_reads_after_the_owners_call_zero3_train_like_torch(tmp_path):
    """Under ZeRO-3 a parameter read after its module's call was an empty shard (the group
    released); the reading module gathers it now."""
    _assert_zero3_zoo_like_torch(["tied_projection", "hook_reads_earlier", "root_owns_and_reads"], 64, tmp_path)


def _assert_zero3_zoo_like_torch(names, chunk_size: int, tmp_path, *, compared=lambda state: state) -> None:
    """The zoo models ``names`` trained on 2 ZeRO-3 ranks, then evaluated, equal to plain AdamW's
    (``compared``: the part of each state compared)."""
    run_ranks(zw.run_zoo, names, STEPS, chunk_size, str(tmp_path), timeout_seconds=240)
    for name in names:
        want, ref = _reference(name)
        ref.eval()
        with torch.no_grad():
            evaluation = ref(zw.make_data(1, seed=5)[0][0])
        for rank in range(2):
            got = torch.load(tmp_path / f"{name}_rank{rank}.pt", weights_only=True)
            for step, (g, w) in enumerate(zip(got["states"], want)):
                assert_params_close(compared(g), compared(w), step=step)
            torch.testing.assert_close(got["eval"], evaluation, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("placement", ["cpu", "static"])
def test_descendants_read_in_an_evaluation_before_any_training_are_fetched(placement, grad_off):
    """The first forward is an evaluation without grad (no warm-up to learn from): the fused
    attention reads out_proj in it, found at the dispatch level."""
    model, opt = gemini.initialize(zw.make_zoo("multihead_attention"), gemini.GeminiConfig(
        device="cpu", chunk_size=CHUNK["multihead_attention"], **PLACEMENTS[placement]), lr=1e-2)
    ref = zw.make_zoo("multihead_attention").eval()
    model.eval()
    x = zw.make_data(1, seed=5)[0][0]
    reads = _HostReads(opt._rt.manager)
    with reads, grad_off():
        reads.active = True
        for _ in range(2):
            torch.testing.assert_close(model(x), ref(x), rtol=1e-6, atol=1e-7)
        reads.active = False
    assert reads.hits == [], f"ops read parameter chunks with no device copy: {reads.hits[:4]}"
    opt.close()


@pytest.mark.parametrize("placement", ["cpu", "static", "auto"])
def test_an_inference_mode_forward_finds_no_reads_in_a_plain_model(placement, caplog):
    """Under inference_mode, ``p.data = view`` (a fetch re-pointing every parameter of its chunk, the
    next layer's too) dispatches ``_has_compatible_shallow_copy_type``: the search took it for the root
    reading the next layer's parameters, and the root's calls fetched every group from then on (under
    auto, an evaluation between micro-batches then crashed the warm-up's next forward)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))  # one chunk group
    ref = copy.deepcopy(net)
    model, opt = gemini.initialize(net, gemini.GeminiConfig(device="cpu", **PLACEMENTS[placement]), lr=1e-2)
    x = zw.make_data(1, seed=5)[0][0]
    with caplog.at_level("INFO", logger="gemini.engine.descendant_reads"), torch.inference_mode():
        torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    assert "reads parameters of its descendants" not in caplog.text
    assert model.module not in opt._rt.hooks._groups_of
    opt.close()


@pytest.mark.parametrize("between", ["none", "no_grad", "inference_mode"])
def test_auto_warm_up_over_micro_batches_with_a_read_after_the_owners_call(between):
    """A tied projection read in the root's forward, two micro-batches in the first step (with an
    evaluation between them): the search re-registers the root's pre-hook ahead of the tracer's
    signature hook, the next forward's root hook ended the warm-up and removed that hook while torch
    was calling them, and torch called it without its kwargs (a TypeError in every such loop)."""
    steps, micro = 2, 2
    data = zw.make_data(steps, micro)
    model, opt = gemini.initialize(zw.make_zoo("tied_projection"), gemini.GeminiConfig(
        device="cpu", placement="auto", chunk_size=CHUNK["tied_projection"]), lr=1e-2, weight_decay=0.01)
    probe = zw.make_data(1, seed=5)[0][0]
    states = []
    for s in range(steps):
        for i, (x, y) in enumerate(data[s * micro : (s + 1) * micro]):
            if i and between != "none":
                with getattr(torch, between)():
                    model(probe)
            (zw.loss_fn(model(x), y) / micro).backward()
        opt.step()
        opt.zero_grad()
        states.append(model.state_dict())
    want, _, _ = zw.train_reference(steps, micro_batches=micro, model=zw.make_zoo("tied_projection"), data=data)
    for step, (g, w) in enumerate(zip(states, want)):
        assert_params_close(g, w, step=step)
    opt.close()
