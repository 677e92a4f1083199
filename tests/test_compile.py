"""torch.compile over a gemini model equals plain torch.optim.AdamW under every placement.

Each test trains the same GPT and data with plain PyTorch and through gemini with the model
compiled, and checks after every step: the same losses and parameters, graphs really
compiled, and none compiled after the first step that compiles (``error_on_recompile`` from
then on: every later step reuses its graphs; under placements that move chunks the first forward
runs uncompiled, see [Note: the search forward runs uncompiled] in gemini/engine/descendant_reads.py). gemini's forward hooks are graph breaks (see
[Note: hooks under torch.compile] in gemini/engine/hooks.py), so the graphs are the pieces between
them.

Backends: "aot_eager" runs the captured graphs through AOTAutograd with the eager kernels,
so its results equal eager mode bit for bit; one test uses the default, inductor, whose
kernels may order float operations differently (there the tolerance is looser, see below).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import _get_current_dispatch_mode

import gemini
from gemini.pretrained import load_pretrained_into
from gemini.tools.gpt import GPT
from helpers import (DEVICE, TINY, assert_params_close, batches, clone_pair, make_gpt, roomy_budget, tolerance,
                     train_reference)

STEPS = 3
CHUNK = 2000  # 14 chunk groups for TINY: most modules' parameters share a chunk with others
MODEL_DATA_BYTES = 16 * TINY.num_params()  # fp32 params, grads, m and v


def _data():
    return batches(TINY, STEPS, batch=2, seq=16)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch and counts only its own graphs."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _train_compiled(model, data, config: gemini.GeminiConfig, compile_fn, *, lr: float):
    """``compile_fn(gemini_model)`` returns what to call for the forward pass. Returns the
    losses, the parameters after each step, the graphs compiled after each step, and the
    optimizer."""
    gmodel, opt = gemini.initialize(model, config, lr=lr, weight_decay=0.1)
    run = compile_fn(gmodel)
    losses, snapshots, graphs = [], [], []
    for step, (x, y) in enumerate(data):
        # The first step that compiles (the second under placements that move chunks: the
        # first forward runs uncompiled, see [Note: the search forward runs uncompiled] in
        # gemini/engine/descendant_reads.py) may compile a function twice where it runs on inputs
        # of another rank or size (Embedding.forward for wte and wpe, Linear.forward for
        # layers of other widths: dynamo then marks the sizes dynamic); a recompile storm
        # would hit the recompile limit, which raises here. From the next step on, any
        # frame compiled again (a guard failed) raises: every graph is reused.
        compiled = bool(graphs) and graphs[-1] > 0
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, error_on_recompile=compiled):
            loss = GPT.loss(run(x), y)
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        snapshots.append(gmodel.state_dict())
        graphs.append(_unique_graphs())
    return losses, snapshots, graphs, opt


def _check(got_losses, got, want_losses, want, graphs, *, rtol: float, atol: float):
    assert got_losses == pytest.approx(want_losses, rel=tolerance(max(rtol, 1e-6), 0)["rtol"])
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, rtol=rtol, atol=atol, step=step)
    assert graphs[1] > 0, "nothing was compiled"
    assert graphs[-1] == graphs[1], f"graphs compiled after the second step: {graphs}"
    assert counters["frames"]["ok"] > 0


PLACEMENTS = {
    "cpu": dict(placement="cpu"),
    # Half the parameter chunks stay on the device, half of the optimizer states on the host.
    "static": dict(placement="static", static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
    # Parameters and gradients alone exceed the budget: chunks are evicted inside forward and
    # backward; the warm-up (the first step) is traced uncompiled, the later steps keep to its
    # plan compiled. The budget is sized for the CPU stand-in, which counts exactly the tensors alive (standin: on CUDA the
    # allocator's segments and cuBLAS's workspace alone exceed it).
    "auto-evicting": dict(placement="auto", device_memory=int(0.8 * MODEL_DATA_BYTES)),
}
STANDIN = {"auto-evicting"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.standin) if n in STANDIN else n
                                  for n in PLACEMENTS])
def test_compiled_model_equals_adamw(name):
    base, ref = clone_pair()
    data = _data()
    want_losses, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    cfg = gemini.GeminiConfig(device=DEVICE, chunk_size=CHUNK, **PLACEMENTS[name])
    got_losses, got, graphs, opt = _train_compiled(
        base, data, cfg, lambda m: torch.compile(m, backend="aot_eager"), lr=1e-2
    )
    # aot_eager runs the eager kernels: the same bits as eager gemini, which equals AdamW.
    _check(got_losses, got, want_losses, want, graphs, rtol=1e-6, atol=1e-7)
    if name == "auto-evicting":
        assert opt._rt.residency.evictions > 0
        assert opt.report.device_peak_bytes <= cfg.device_memory


def test_a_compiled_model_trained_and_evaluated_stays_compiled():
    """Each hooked module's forward is a compiled frame of its own, and TINY's Linear layers (5 parameter shapes),
    trained and evaluated under no_grad, took 10 of dynamo's 8 cache entries for Linear.forward: dynamo ran it
    eagerly from then on, with a warning. The first compiled forward makes room ([Note: compiled frames between the
    module hooks] in gemini/engine/hooks.py); every output and step still equals eager torch."""
    base, ref = clone_pair()
    data = _data()
    evaluate = batches(TINY, 1, batch=3, seq=16, seed=7)[0][0]
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=CHUNK),
                                    lr=1e-2, weight_decay=0.1)
    run = torch.compile(gmodel, backend="aot_eager")
    with torch._dynamo.config.patch(recompile_limit=8, fail_on_recompile_limit_hit=True):
        for x, y in data:
            for net, o in ((run, opt), (ref, ref_opt)):
                GPT.loss(net(x), y).backward()
                o.step()
                o.zero_grad()
            with torch.no_grad():
                torch.testing.assert_close(run(evaluate), ref(evaluate), rtol=1e-6, atol=1e-7)
            assert_params_close(gmodel.state_dict(), ref.state_dict())
        assert torch._dynamo.config.recompile_limit >= 2 * 2 * 5
    assert counters["frames"]["ok"] > 0


def test_compiled_with_inductor_under_cuda_placement_equals_adamw():
    """The default backend. Inductor's kernels (fused bias gradients, GELU backward) may sum in
    another order; Adam turns a gradient's last bits into a visible change where it is near 0
    (``m / sqrt(v)`` is about its sign at first), so the parameters agree to about lr * 1e-3:
    measured 3.3e-6 at lr 1e-3 over 3 steps (4.8e-5 at lr 1e-2); the losses to 1e-6."""
    base, ref = clone_pair()
    data = _data()
    want_losses, want, _ = train_reference(ref, data, lr=1e-3, weight_decay=0.1)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cuda", chunk_size=CHUNK)
    got_losses, got, graphs, _ = _train_compiled(base, data, cfg, torch.compile, lr=1e-3)
    _check(got_losses, got, want_losses, want, graphs, rtol=1e-5, atol=1e-5)


def test_compiling_each_block_equals_adamw():
    """The other pattern: compile the repeated blocks in place, after ``initialize``."""
    base, ref = clone_pair()
    data = _data()
    want_losses, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=CHUNK)

    def compile_blocks(gmodel):
        for block in gmodel.module.blocks:
            block.compile(backend="aot_eager")
        return gmodel

    got_losses, got, graphs, _ = _train_compiled(base, data, cfg, compile_blocks, lr=1e-2)
    _check(got_losses, got, want_losses, want, graphs, rtol=1e-6, atol=1e-7)


# Activation offload's saved-tensor hooks run wherever autograd saves a tensor, also in the
# compiled model's eager stretches (here GELU's forward runs eagerly between the Linears'
# graphs): traced, the first compiled forward under "cpu" failed a guard on weakref.finalize's
# registry ("Guard failed on the same frame it was created"), and under "auto" with room to
# keep them ``_pack`` was compiled again every step. See [Note: saved-tensor hooks under
# torch.compile] in gemini/engine/activations.py.
OFFLOADING = {
    "cpu": dict(placement="cpu"),
    "auto-keeping": dict(placement="auto", device_memory=roomy_budget("4MiB")),  # keeps every saved tensor
    # Evicts chunks, keeps some saved tensors and offloads the others (measured on the stand-in:
    # 256 KiB kept, 320 KiB offloaded per step).
    "auto-evicting": dict(placement="auto", device_memory=int(1.2 * 2**20)),
}


# The Linears' forward is the test's own, not torch.nn's: gemini's hooks are graph breaks, so the
# frames left to compile are the hooked modules' forwards, and torch before 2.12 never compiles a
# frame of torch.nn's own code (trace_rules: MOD_SKIPLIST torch/nn; 2.12 on trace it when the
# module has hooks, "inbuilt nn.Module.forward allowed - module has hooks"). With nn.Linear,
# torch 2.11 compiled no graph at all. GELU stays torch.nn's: its forward is the eager stretch.
class _Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.standin) if n in STANDIN else n
                                  for n in OFFLOADING])
def test_compiled_model_with_activation_offload_equals_adamw(name):
    torch.manual_seed(0)
    base = nn.Sequential(_Linear(64, 256), nn.GELU(), _Linear(256, 64))  # 256 KiB saved per GELU
    ref = copy.deepcopy(base).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    cfg = gemini.GeminiConfig(device=DEVICE, chunk_size=CHUNK, offload_activations=True,
                              activation_offload_min_bytes=1024, **OFFLOADING[name])
    gmodel, opt = gemini.initialize(base, cfg, lr=1e-2, weight_decay=0.1)
    compiled = torch.compile(gmodel, backend="aot_eager")
    graphs, reports = [], []
    for step in range(4):
        x = torch.randn(256, 64, generator=torch.Generator().manual_seed(step)).to(DEVICE)
        want = ref(x).square().mean()
        want.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # From the step after the first that compiled on, a frame compiled again raises.
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True,
                                        error_on_recompile=bool(graphs) and graphs[-1] > 0):
            loss = compiled(x).square().mean()
            opt.backward(loss)
        opt.step()
        opt.zero_grad()
        graphs.append(_unique_graphs())
        reports.append(opt.report)
        assert loss.item() == pytest.approx(want.item(), rel=tolerance(1e-6, 0)["rtol"])  # see [Note: equal to torch on a GPU]
        assert_params_close(gmodel.state_dict(), ref.state_dict(), step=step)
    assert graphs[1] > 0 and graphs[-1] == graphs[1], f"graphs compiled after the second step: {graphs}"
    last = reports[-1]
    if name == "auto-keeping":
        assert last.activation_kept_bytes > 0 and last.activation_offload_bytes == 0
    else:
        assert last.activation_offload_bytes > 0, "the last (compiled) step offloaded nothing"
    if name == "auto-evicting":
        assert last.activation_kept_bytes > 0, "the plan kept nothing on the device"
        assert opt._rt.residency.evictions > 0
        assert last.device_peak_bytes <= cfg.device_memory


# ------------------------------------------------------------------ state dicts and checkpoints
# The compiled handle's own state_dict has torch's "_orig_mod." keys, and a parent module holding
# the gemini model names it by its attribute: both load what they saved through torch's
# recursion, which reaches gemini's load (see [Note: loaded by a parent module] in
# gemini/module.py). Before, the recursion expected "_orig_mod.module.<key>".
class _Parent(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(4, 4)


_HANDLES = {
    "compiled": lambda m: torch.compile(m, backend="aot_eager"),
    "parent": lambda m: _Parent(m),
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("handle", list(_HANDLES))
def test_handle_holding_the_model_round_trips_its_state_dict_like_torch(handle, precision):
    data = _data()
    torch.manual_seed(3)
    ref = _HANDLES[handle](make_gpt().to(DEVICE))  # plain torch under the same handle
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", precision=precision, chunk_size=CHUNK)
    gmodel, opt = gemini.initialize(make_gpt(), cfg, lr=1e-2)
    torch.manual_seed(3)
    ours = _HANDLES[handle](gmodel)
    run = ours if handle == "compiled" else gmodel
    opt.backward(GPT.loss(run(data[0][0]), data[0][1]))
    opt.step()
    inner = "_orig_mod." if handle == "compiled" else "body."
    saved = ours.state_dict()
    assert list(saved) == list(ref.state_dict())
    ours.load_state_dict(saved)  # what it saved loads back, changing nothing
    assert_params_close(gmodel.state_dict(), {k[len(inner):]: v for k, v in saved.items() if k.startswith(inner)},
                        rtol=0, atol=0)

    g = torch.Generator().manual_seed(11)
    new = {k: torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point() else v
           for k, v in saved.items()}
    assert tuple(ours.load_state_dict(new)) == tuple(ref.load_state_dict(new)) == ([], [])
    # The values torch's model holds after the same load (the tied embedding and head: the
    # last key's), in gemini's masters under bf16.
    assert_params_close(gmodel.state_dict(), {k[len(inner):]: v for k, v in ref.state_dict().items()
                                              if k.startswith(inner)}, rtol=0, atol=0)
    if handle == "parent":
        assert_params_close(ours.head.state_dict(), ref.head.state_dict(), rtol=0, atol=0)
    x = data[1][0]
    plain = ref if handle == "compiled" else ref.body
    if precision == "bf16":  # gemini computes with bf16 copies of its masters: so does this one
        plain = copy.deepcopy(plain).to(torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(run(x), plain(x))

    # strict=False reports what torch reports; a mismatched shape loads nothing of gemini's.
    dropped, lacking = next(iter(new)), dict(new)
    del lacking[dropped]
    lacking[inner + "extra.weight"] = torch.zeros(1)
    assert tuple(ours.load_state_dict(lacking, strict=False)) == tuple(ref.load_state_dict(lacking, strict=False))
    with pytest.raises(RuntimeError, match=re.escape(f"Missing key(s) in state_dict: \"{dropped}\"")):
        ours.load_state_dict(lacking)
    before = gmodel.state_dict()
    wrong = dict(new)
    wrong[inner + "wte.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError, match=re.escape(f"size mismatch for {inner}wte.weight")):
        ours.load_state_dict(wrong)
    assert_params_close(gmodel.state_dict(), before, rtol=0, atol=0)


@pytest.mark.parametrize("sharded", [False, True], ids=["consolidated", "sharded"])
def test_checkpoint_of_the_compiled_handle_has_the_bare_keys(sharded, tmp_path):
    """save_checkpoint/load_checkpoint take the compiled model: the file's keys are the uncompiled
    model's (a plain module's), and it loads into either handle."""
    data = _data()
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=CHUNK)
    gmodel, opt = gemini.initialize(make_gpt(), cfg, lr=1e-2)
    compiled = torch.compile(gmodel, backend="aot_eager")
    for x, y in data[:2]:
        opt.backward(GPT.loss(compiled(x), y))
        opt.step()
        opt.zero_grad()
    want, want_opt = gmodel.state_dict(), opt.state_dict()
    path = tmp_path / ("sharded" if sharded else "ckpt.pt")
    gemini.save_checkpoint(path, compiled, opt, sharded=sharded)
    if not sharded:
        plain = make_gpt(seed=9)
        plain.load_state_dict(torch.load(path, weights_only=True)["model"])  # bare keys: a plain module loads them
        assert_params_close(plain.state_dict(), want, rtol=0, atol=0)
    for compile_target in (False, True):
        target, target_opt = gemini.initialize(make_gpt(seed=5), cfg, lr=1e-2)
        handle = torch.compile(target, backend="aot_eager") if compile_target else target
        gemini.load_checkpoint(path, handle, target_opt, sharded=sharded)
        assert_params_close(target.state_dict(), want, rtol=0, atol=0)
        got_opt = target_opt.state_dict()["state"]
        for i, state in want_opt["state"].items():
            assert torch.equal(got_opt[i]["exp_avg"], state["exp_avg"]), i
    uncompiled_path = tmp_path / "uncompiled.pt"
    gemini.save_checkpoint(uncompiled_path, gmodel, opt)  # the uncompiled handle's loads into the compiled one
    target, target_opt = gemini.initialize(make_gpt(seed=5), cfg, lr=1e-2)
    gemini.load_checkpoint(uncompiled_path, torch.compile(target, backend="aot_eager"), target_opt)
    assert_params_close(target.state_dict(), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="GPT for model: pass the model gemini.initialize returned"):
        gemini.save_checkpoint(tmp_path / "plain.pt", make_gpt(), opt)


def test_safetensors_of_the_compiled_handle_have_the_bare_keys(tmp_path):
    """save_pretrained / load_pretrained_into take the compiled model like the checkpoints do:
    the files' keys are the plain module's, read back byte for byte."""
    safetensors = pytest.importorskip("safetensors.torch")
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=CHUNK)
    gmodel, opt = gemini.initialize(make_gpt(), cfg, lr=1e-2)
    compiled = torch.compile(gmodel, backend="aot_eager")
    x, y = _data()[0]
    opt.backward(GPT.loss(compiled(x), y))
    opt.step()
    want = gmodel.state_dict()
    gemini.save_pretrained(compiled, tmp_path)
    saved = safetensors.load_file(tmp_path / "model.safetensors")
    for key, value in saved.items():  # a tied parameter under its first name only
        assert torch.equal(value, want[key]), key
    target, _ = gemini.initialize(make_gpt(seed=5), cfg, lr=1e-2)
    load_pretrained_into(torch.compile(target, backend="aot_eager"), tmp_path)
    assert_params_close(target.state_dict(), want, rtol=0, atol=0)
    for function in (gemini.save_pretrained, load_pretrained_into):
        with pytest.raises(TypeError, match="GPT for model: pass the model gemini.initialize returned"):
            function(make_gpt(), tmp_path)


@pytest.mark.standin  # the budget in the stand-in's bytes
def test_a_budget_error_inside_a_compiled_call_leaves_torch_usable():
    """The warm-up of two micro-batches ends at the second forward's root pre-hook, inside the
    compiled model's call; its budget error stopped the accounting monitor there, popping its
    dispatch mode, and torch.compile's wrapper then restored the dispatch keys it had found: the
    Python key with no mode, so every later operator without tensor arguments failed (torch.zeros,
    a retry's initialize, the process group's barrier). The mode now stays, empty, until a monitor
    stops outside the compiled call."""
    torch._dynamo.reset()
    model, opt = gemini.initialize(make_gpt(TINY, 0), gemini.GeminiConfig(
        device=DEVICE, placement="auto", device_memory=250_000, chunk_size=4000), lr=1e-2)
    run = torch.compile(model, backend="aot_eager")
    x, y = batches(TINY, 1)[0]
    with pytest.raises(gemini.DeviceBudgetError, match="bytes are missing"):
        for half in (slice(0, 1), slice(1, 2)):
            opt.backward(GPT.loss(run(x[half]), y[half]) / 2)
    assert torch.zeros(2).sum().item() == 0  # failed: "Hit Python dispatch key but no arguments had PyInterpreter"
    opt.close()
    ref, retry = clone_pair()  # a retry with room: trains like AdamW
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0, fused=True)
    gmodel, gopt = gemini.initialize(retry, gemini.GeminiConfig(device=DEVICE, placement="auto",
                                                                device_memory=roomy_budget("64MiB")), lr=1e-2)
    compiled = torch.compile(gmodel, backend="aot_eager")
    for x, y in batches(TINY, 2):
        GPT.loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        gopt.backward(GPT.loss(compiled(x), y))
        gopt.step()
        gopt.zero_grad()
        assert_params_close(gmodel.state_dict(), ref.state_dict())
    gopt.close()
    assert _get_current_dispatch_mode() is None  # the mode the error kept left with the retry's window
    torch._dynamo.reset()
