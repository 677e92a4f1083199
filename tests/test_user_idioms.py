"""More of the loops people write, each against plain PyTorch: an EMA keyed by the model's
names, torch's optimizer state-dict hooks, optimizer.state, a float64 model, torch.func's
transforms, and checkpointing turned on after initialize.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import gemini
from gemini.tools.gpt import GPT, GPTConfig
from helpers import DEVICE, assert_params_close, batches, clone_pair, cpu_copy, placement_configs

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64)  # as test_torch_idioms'
CONFIGS = placement_configs(16 * CFG.num_params())
NAMES = [pytest.param(n, marks=pytest.mark.standin) if n == "auto-evicting" else n for n in CONFIGS]


def _pair(name):
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    fields = CONFIGS.get(name, dict(placement=name, chunk_size=8192))  # "auto": without a budget
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, **fields), lr=1e-2, weight_decay=0.1)
    return (ref, ref_opt), (model, opt)


def _train_step(model, opt, x, y) -> None:
    GPT.loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("name", NAMES)
def test_an_ema_keyed_by_named_parameters_follows_the_model_like_torch(name):
    """The EMA recipe: a copy of state_dict(), then ``ema[n].lerp_(p, ...)`` for each of
    ``named_parameters()``. The names must be state_dict's (they had "module." before them)."""
    (ref, ref_opt), (model, opt) = _pair(name)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert set(dict(model.named_parameters())) <= set(model.state_dict())
    emas = [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in (ref, model)]
    for x, y in batches(CFG, 3, batch=2, seq=16):
        for (m, o), ema in zip(((ref, ref_opt), (model, opt)), emas):
            with model.join():  # DDP's context for uneven inputs: nothing to do in one process
                _train_step(m, o, x, y)
            with torch.no_grad():
                for n, p in m.named_parameters():
                    ema[n].lerp_(p.detach().to(ema[n].device), 0.25)
    assert_params_close(cpu_copy(emas[1]), cpu_copy(emas[0]))
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


@pytest.mark.parametrize("name", ["cuda", "cpu"])
def test_optimizer_state_dict_hooks_run_as_torchs_do(name):
    """register_state_dict_pre/post_hook and register_load_state_dict_pre/post_hook: the same
    calls, in the same order, as on torch's AdamW; a post-hook's returned dict is what
    state_dict() returns, a load pre-hook's what is loaded (on a copy: the caller's stays)."""
    (ref, ref_opt), (model, opt) = _pair(name)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    calls = {}
    for label, o in (("torch", ref_opt), ("gemini", opt)):
        seen = calls[label] = []
        o.register_state_dict_pre_hook(lambda o, seen=seen: seen.append("pre"))
        o.register_state_dict_post_hook(lambda o, sd, seen=seen: seen.append("post") or {**sd, "note": "kept"})
        o.register_load_state_dict_pre_hook(
            lambda o, sd, seen=seen: seen.append("load_pre") or {k: v for k, v in sd.items() if k != "note"})
        o.register_load_state_dict_post_hook(lambda o, seen=seen: seen.append("load_post"))
    _train_step(ref, ref_opt, x, y)
    _train_step(model, opt, x, y)
    saved = {label: o.state_dict() for label, o in (("torch", ref_opt), ("gemini", opt))}
    assert saved["gemini"]["note"] == saved["torch"]["note"] == "kept"
    for label, o in (("torch", ref_opt), ("gemini", opt)):
        o.load_state_dict(saved[label])
        assert "note" in saved[label]  # the hook changed a copy
    assert calls["gemini"] == calls["torch"] == ["pre", "post", "load_pre", "load_post"]
    for x, y in batches(CFG, 2, batch=2, seq=16, seed=2):  # the load took: training goes on as torch's
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, x, y)
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


def _mlp(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
    m.register_buffer("shift", torch.full((3,), 0.5, dtype=dtype))
    return m


class _Shifted(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x) + self.inner.shift


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_model_of_another_dtype_trains_in_fp32_with_a_warning_and_takes_its_inputs(dtype, caplog):
    """A ``.double()`` (or ``.bfloat16()``) model under precision fp32: its parameters and buffers
    become fp32, said at initialize, and the inputs its callers pass in its dtype are cast on the
    way in (they met torch's dtype mismatch before); it trains as the fp32 model does."""
    ref = _Shifted(_mlp(torch.float32)).to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    source = _Shifted(_mlp(dtype))
    source.load_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
    with caplog.at_level("WARNING", logger="gemini.initialize"):
        model, opt = gemini.initialize(source, gemini.GeminiConfig(device=DEVICE, placement="cpu"), lr=1e-2)
    assert f"the model's parameters are {dtype}; gemini computes in torch.float32" in caplog.text
    ref.load_state_dict(model.state_dict())  # the fp32 values gemini trains from
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 8, generator=g).to(DEVICE)
        out = model(x.to(dtype))
        assert out.dtype == torch.float32
        out.square().mean().backward()
        ref(x.to(dtype).float()).square().mean().backward()  # what the cast gives the fp32 model
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


def test_fp32_inputs_of_an_fp32_model_are_left_to_torchs_promotion():
    """Under fp32 a float64 input of an fp32 model is not cast: the plain model's type
    promotion (a float64 output here) is kept, as without gemini."""
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))

        def forward(self, x, target):
            return (x * self.w - target).square().mean()

    model, _ = gemini.initialize(Scale(), gemini.GeminiConfig(device=DEVICE, placement="cuda"))
    target = torch.ones(3, dtype=torch.float64, device=DEVICE)
    assert model(torch.ones(3, device=DEVICE), target).dtype == Scale()(torch.ones(3), target.cpu()).dtype


@pytest.mark.parametrize("name", NAMES)
def test_torch_func_gradient_transforms_are_refused_and_change_nothing(name):
    """torch.func.grad over functional_call: wrapped tensors without storage reached the
    chunks, and under placement cpu the model could not train again (a KeyError at the next
    step). Refused at the root's first hook, called through the wrapper or on the module it
    wraps; vmap still works; and training afterwards equals torch's."""
    from torch.func import functional_call, grad, vmap
    (ref, ref_opt), (model, opt) = _pair(name)
    data = batches(CFG, 3, batch=2, seq=16)
    x, y = data[0]
    params = {k: v.detach().clone() for k, v in ref.named_parameters()}
    for target in (model, model.module):
        with pytest.raises(RuntimeError, match="inside torch.func's Grad transform.*nothing was changed"):
            grad(lambda p: GPT.loss(functional_call(target, p, (x,)), y))(params)
    if "device_memory" not in CONFIGS[name]:  # (vmap's attention runs per sample: more than the budget)
        with torch.no_grad():
            batched = vmap(lambda xi: functional_call(model, params, (xi[None],)))(x)
            torch.testing.assert_close(batched[:, 0], ref(x), rtol=1e-6, atol=1e-6)
    for x, y in data:
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, x, y)
        assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


@pytest.mark.parametrize("name", [*NAMES, "auto"])
def test_jit_trace_and_export_are_refused_where_chunks_move_and_change_nothing(name):
    """torch.jit.trace failed inside gemini's hooks with torch's errors, and torch.export under
    auto left symbolic sizes in the memory ledger for good (every later report a SymInt); see
    [Note: tracing a model whose chunks move] in gemini/engine/hooks.py. Where chunks move both are
    refused at the root's first hook, through the wrapper or on the module it wraps, and training
    afterwards equals torch's; under placement cuda both trace the model as torch does."""
    (ref, ref_opt), (model, opt) = _pair(name)
    data = batches(CFG, 3, batch=2, seq=16)
    _train_step(ref, ref_opt, *data[0])
    _train_step(model, opt, *data[0])
    x = data[1][0]
    moves = name != "cuda"
    for target in (model, model.module):
        for how, trace in (("torch.jit.trace", lambda: torch.jit.trace(target, (x,), check_trace=False)),
                           ("torch.export", lambda: torch.export.export(target, (x,)).module())):
            if moves:
                with pytest.raises(RuntimeError, match=f"{how}.* is not supported .*nothing was changed"):
                    trace()
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # jit.trace's TracerWarning on the length check
                    out = trace()(x)
                torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)
    for x, y in data[1:]:
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, x, y)
        assert isinstance(opt.report.device_peak_bytes, int)
        assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


@pytest.mark.parametrize("name", [*NAMES, "nvme"])
def test_param_state_is_what_torch_keeps_in_optimizer_state(name, tmp_path):
    """``optimizer.state[p]["exp_avg"]`` (logging Adam's moments) has no tensor to give: the states
    live in chunks, on the host or NVMe too. ``param_state(p)`` gives torch's entry as copies;
    ``optimizer.state`` stays empty and a read of a key says where to look."""
    (ref, ref_opt), (model, opt) = _pair(name) if name != "nvme" else _nvme_pair(tmp_path)
    first = next(model.parameters())
    assert opt.param_state(first) == {} and len(opt.state) == 0  # torch: no state before the first step
    for x, y in batches(CFG, 2, batch=2, seq=16):
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, x, y)
    for (n, p), (ref_n, ref_p) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        got, want = opt.param_state(p), ref_opt.state[ref_p]
        assert n == ref_n and got.keys() == want.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert_params_close(got, cpu_copy(dict(want)))
        got["exp_avg"].zero_()  # a copy: the optimizer's own is untouched
        assert not torch.equal(opt.param_state(p)["exp_avg"], got["exp_avg"])
    assert len(opt.state) == 0 and not list(opt.state.items())
    with pytest.raises(KeyError, match=r"optimizer.state\[p\]\['exp_avg'\]: gemini keeps .* optimizer.param_state"):
        opt.state[first]["exp_avg"]
    with pytest.raises(KeyError, match="not a parameter of this optimizer's model"):
        opt.param_state(torch.nn.Parameter(torch.zeros(3)))


def _nvme_pair(tmp_path):
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    config = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=8192, nvme_dir=tmp_path,
                                 nvme_offload_fraction=1.0)
    return (ref, ref_opt), gemini.initialize(base, config, lr=1e-2, weight_decay=0.1)


@pytest.mark.standin  # a budget in bytes the CPU stand-in counts exactly
def test_a_plain_backward_that_overran_the_plan_is_traced_again():
    """Activation checkpointing turned on after initialize (``model.gradient_checkpointing_enable()``)
    recomputes inside backward, which auto's plan never saw: the backward overran it. With a plain
    ``loss.backward()`` (not optimizer.backward) nothing asked for a new trace, and every later
    iteration raised DeviceBudgetError at the same place, at a budget the same model trains under
    when checkpointing is on from the start. Now the next iteration traces again and trains,
    within the budget, as torch does (the refused iteration updated nothing)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(config)
    model = transformers.LlamaForCausalLM(config)
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    budget = 340_000
    model, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=4096,
                                                              device_memory=budget), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    landed, refused = [], []
    for step in range(4):
        if step == 1:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
        except gemini.DeviceBudgetError:
            refused.append(step)
        else:
            landed.append(step)
            assert opt.report.device_peak_bytes <= budget
            ref(input_ids=ids, labels=ids).loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
        opt.zero_grad()
    assert refused == [1] and landed == [0, 2, 3]
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


def test_a_tensor_learning_rate_trains_like_torchs():
    """torch.optim takes ``lr`` as a 0-dim tensor (schedulers and capturable loops set one);
    initialize refused it, though a group's tensor lr set later trained."""
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=torch.tensor(1e-2), weight_decay=0.1, fused=True)
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, **CONFIGS["cpu"]), lr=torch.tensor(1e-2),
                                   weight_decay=0.1)
    for x, y in batches(CFG, 2, batch=2, seq=16):
        _train_step(ref, ref_opt, x, y)
        _train_step(model, opt, x, y)
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()))


@pytest.mark.standin  # budgets in bytes the CPU stand-in counts exactly (on CUDA the allocator's cap)
@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_an_evaluation_forward_over_the_budget_is_refused_and_training_goes_on(placement):
    """An evaluation batch larger than training's ran at twice the budget, unnoticed on the CPU
    stand-in (each forward of generate() too): its peak is now checked as a step's, raising
    DeviceBudgetError after the forward; an evaluation that fits passes, and training goes on
    as torch's, on the plan it had."""
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    budget = 2_000_000  # training takes under 1 MB, an evaluation of 64 x 32 tokens about 5.8 MB
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=8192,
                                                             device_memory=budget), lr=1e-2, weight_decay=0.1)
    small, large = (batches(CFG, 1, batch=b, seq=32, seed=7)[0][0] for b in (2, 64))
    gc.disable()  # the error's traceback held the forward's tensors in a cycle until a collection
    try:
        for step, (x, y) in enumerate(batches(CFG, 3, batch=2, seq=16)):
            with torch.no_grad():
                torch.testing.assert_close(model(small), ref(small), rtol=1e-6, atol=1e-6)
                with pytest.raises(gemini.DeviceBudgetError, match=r"this evaluation forward \(without gradients\) "
                                                                   r"needed \d+ bytes .* smaller evaluation batch"):
                    model(large)
            _train_step(ref, ref_opt, x, y)
            _train_step(model, opt, x, y)
            _check_after_refused_evaluation(model, opt, ref, placement, step, budget)
    finally:
        gc.enable()


def _check_after_refused_evaluation(model, opt, ref, placement, step, budget) -> None:
    assert opt.report.device_peak_bytes <= budget
    # An evaluation's peak says nothing of training's plan: it is kept (was traced again, a
    # warm-up's traffic, after each refused evaluation).
    assert (opt.report.timeline is None) == (placement != "auto" or step > 0), step
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), step=step)


@pytest.mark.parametrize("call", ["resize_token_embeddings", "set_input_embeddings"])
def test_methods_that_restructure_a_hf_model_are_refused_before_changing_it(call):
    """``resize_token_embeddings`` after initialize went through (new embedding tensors, config's
    vocab_size 130) and the next forward refused the parameters gemini no longer held: a model
    neither usable nor as it was. Now refused up front ([Note: methods that restructure the
    model]); the model is unchanged and trains on."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model, opt = gemini.initialize(transformers.LlamaForCausalLM(config),
                                   gemini.GeminiConfig(device=DEVICE, placement="cpu"), lr=1e-3)
    before = cpu_copy(model.state_dict())
    args = {"resize_token_embeddings": (130,), "set_input_embeddings": (nn.Embedding(130, 32),)}[call]
    with pytest.raises(RuntimeError, match=rf"model.{call}\(\) after gemini.initialize is not supported.*nothing was "
                                           r"changed.*before gemini.initialize"):
        getattr(model, call)(*args)
    assert model.config.vocab_size == 128 and model.get_input_embeddings().weight.shape == (128, 32)
    assert_params_close(cpu_copy(model.state_dict()), before, rtol=0, atol=0)
    x = torch.randint(0, 128, (2, 16), device=DEVICE)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    with pytest.raises(AttributeError):  # a model without the method: as before
        gemini.initialize(nn.Linear(2, 2), gemini.GeminiConfig(device=DEVICE, placement="cpu"))[0].prune_heads


@pytest.mark.parametrize("name", [*NAMES, "auto"])
@pytest.mark.parametrize("edit", ["grad.data", "data-before-zero_grad"])
def test_data_assigned_to_p_grad_or_p_between_step_and_zero_grad_counts_like_torch(name, edit):
    """``p.grad.data = p.grad.data / 2`` (the old idiom for averaging gradients) keeps the
    p.grad object, so gemini took its gradient as untouched and stepped on the unscaled one;
    under "cuda" autograd then accumulated into the user's tensor for good (the cached view
    was armed again). ``p.data = t`` between step() and zero_grad() (vector_to_parameters)
    was dropped under auto, whose zero_grad re-pointed parameters left viewing the host copy."""
    if edit == "data-before-zero_grad" and DEVICE == "cuda" and name == "static":
        pytest.skip("static keeps part of the parameters on the GPU, part on the host: torch's "
                    "parameters_to_vector refuses parameters on two devices (README, on a GPU)")
    (ref, ref_opt), (model, opt) = _pair(name)
    for step, (x, y) in enumerate(batches(CFG, 3, batch=2, seq=16)):
        for m, o in ((ref, ref_opt), (model, opt)):
            GPT.loss(m(x), y).backward()
            if edit == "grad.data":
                for p in m.parameters():
                    p.grad.data = p.grad.data / 2
            o.step()
            if edit == "data-before-zero_grad":
                params = list(m.parameters())
                vector = torch.nn.utils.parameters_to_vector(params)
                torch.nn.utils.vector_to_parameters(vector * 0.9, params)
            o.zero_grad()
        assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), step=step)


@pytest.mark.parametrize("name", [*NAMES, "auto"])
def test_step_under_inference_mode_trains_like_torch_and_leaves_torch_working(name):
    """``optimizer.step()`` inside ``torch.inference_mode()`` under auto ended the accounting
    monitor's dispatch mode inside the guard, whose exit then restored the mode's dispatch key
    without the mode: every later operator of the process failed torch's internal assert."""
    (ref, ref_opt), (model, opt) = _pair(name)
    for step, (x, y) in enumerate(batches(CFG, 3, batch=2, seq=16)):
        for m, o in ((ref, ref_opt), (model, opt)):
            GPT.loss(m(x), y).backward()
            with torch.inference_mode():
                o.step()
                o.zero_grad()
        assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), step=step)
        if CONFIGS.get(name, {}).get("device_memory"):
            assert 0 < opt.report.device_peak_bytes <= CONFIGS[name]["device_memory"]  # still measured
    nn.Linear(3, 3)(torch.zeros(1, 3))  # torch works on: it failed here
    assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))


@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_a_parameter_put_in_place_after_initialize_is_saved_and_loaded_as_torch_does(name, caplog):
    """weight_norm trained, then baked into a plain weight for export
    (``parametrize.remove_parametrizations``, which puts a new nn.Parameter in place):
    ``state_dict()`` raised a bare KeyError from the chunk manager. Now it holds the new
    tensor as torch's does (warned: gemini's optimizer does not train it), and
    ``load_state_dict`` writes into it."""
    from torch.nn.utils import parametrizations, parametrize

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), parametrizations.weight_norm(nn.Linear(16, 4)))

    ref = make().to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    model, opt = gemini.initialize(make(), gemini.GeminiConfig(device=DEVICE, placement=name), lr=1e-2,
                                   weight_decay=0.1)
    x = torch.randn(6, 8, device=DEVICE)
    for m, o in ((ref, ref_opt), (model, opt)):
        for _ in range(3):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
        parametrize.remove_parametrizations(m[2], "weight")
    with caplog.at_level("WARNING", logger="gemini.module"):
        saved = model.state_dict()
    assert "parameter 2.weight was put in place after gemini.initialize" in caplog.text
    assert_params_close(saved, cpu_copy(ref.state_dict()))
    saved["2.weight"] = saved["2.weight"] * 2
    model.load_state_dict(saved)
    ref.load_state_dict({k: v.to(DEVICE) for k, v in saved.items()})
    assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


@pytest.mark.standin  # the budget in the stand-in's bytes
def test_an_evaluation_between_micro_batches_is_no_part_of_the_traced_iteration(caplog):
    """An evaluation forward (no grad) between two micro-batches of auto's warm-up was traced as
    part of its iteration: every later iteration "diverged from the traced one" at its backward
    (a warning per micro-batch, and plans of the largest non-model peak instead of the traced
    ones). Its boundaries are not traced now; training equals torch's."""
    (ref, ref_opt), (model, opt) = _pair("auto-evicting")
    probe = batches(CFG, 1, batch=3, seq=16, seed=9)[0][0]
    with caplog.at_level("WARNING", logger="gemini.policies.auto"):
        for step, (x, y) in enumerate(batches(CFG, 3, batch=4, seq=16)):
            for m, o in ((ref, ref_opt), (model, opt)):
                GPT.loss(m(x[:2]), y[:2]).backward()
                m.eval()
                with torch.no_grad():
                    m(probe)
                m.train()
                GPT.loss(m(x[2:]), y[2:]).backward()
                o.step()
                o.zero_grad()
            assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), step=step)
    assert "diverged" not in caplog.text
    assert opt.report.device_peak_bytes <= CONFIGS["auto-evicting"]["device_memory"]


def test_inputs_in_dataclasses_and_userdicts_are_cast_like_plain_ones():
    """Under bf16 floating-point inputs are cast on the way in; torch's pytree did not look into
    a dataclass or a ``UserDict`` (Hugging Face's ``BatchEncoding``): their fp32 tensors reached
    the bf16 model ("mat1 and mat2 must have the same dtype"). Integer tensors stay as they are."""
    import collections
    import dataclasses

    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        index: torch.Tensor

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, batch):
            x, index = (batch.x, batch.index) if isinstance(batch, Batch) else (batch["x"], batch["index"])
            assert index.dtype == torch.int64
            return self.lin(x)[index]

    torch.manual_seed(0)
    model, _ = gemini.initialize(Net(), gemini.GeminiConfig(device=DEVICE, placement="cpu", precision="bf16"))
    x, index = torch.randn(3, 4, device=DEVICE), torch.tensor([2, 0], device=DEVICE)
    want = model({"x": x, "index": index})
    assert want.dtype == torch.bfloat16
    user_dict = collections.UserDict({"x": x, "index": index})
    for batch in (Batch(x, index), user_dict, collections.OrderedDict(x=x, index=index)):
        torch.testing.assert_close(model(batch), want, rtol=0, atol=0)
    assert user_dict["x"].dtype == torch.float32  # the caller's container is left as it was


@pytest.mark.standin  # budgets in the stand-in's bytes
def test_a_loop_that_keeps_its_outputs_is_told_so_when_the_budget_runs_out():
    """``outputs.append(model(x))`` keeps every iteration's logits on the device, so the peak
    grows until the budget refuses an iteration; the error advised a smaller batch only. It now
    names tensors kept across iterations, and once they are dropped training goes on."""
    base, _ = clone_pair(CFG)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    probe, probe_opt = gemini.initialize(clone_pair(CFG)[0], gemini.GeminiConfig(device=DEVICE, placement="cpu",
                                                                                  device_memory=10**9))
    _train_step(probe, probe_opt, x, y)
    budget = probe_opt.report.device_peak_bytes + 100_000  # about three iterations' logits (32 KiB each)
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu", device_memory=budget))
    outputs = []
    with pytest.raises(gemini.DeviceBudgetError, match=r"this iteration needed .*A tensor the loop keeps from "
                                                       r"earlier iterations counts too \(outputs kept in a list"):
        for _ in range(10):
            outputs.append(model(x))
            GPT.loss(outputs[-1], y).backward()
            opt.step()
            opt.zero_grad()
    steps_taken = opt.reports_made
    assert 2 <= steps_taken < 10
    outputs.clear()
    gc.collect()  # pytest's ExceptionInfo holds the frames in a cycle
    opt.zero_grad()
    _train_step(model, opt, x, y)
    assert opt.reports_made == steps_taken + 1 and opt.report.device_peak_bytes <= budget


@pytest.mark.parametrize("name", [*NAMES, "auto"])
def test_a_step_after_a_forward_without_backward_is_a_no_op_like_torchs(name):
    """A NaN guard (``if torch.isfinite(loss): loss.backward()``, then ``step()``) tripping on the first
    batch: torch's step is a no-op; under auto the warm-up raised "optimizer.step() before any backward
    pass". The traced iteration is given up and the next one traced; training equals torch's."""
    (ref, ref_opt), (model, opt) = _pair(name)
    timelines = []
    for step, (x, y) in enumerate(batches(CFG, 3, batch=2, seq=16)):
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = GPT.loss(m(x), y)
            if step != 0:  # the first batch's loss "was not finite"
                loss.backward()
            o.step()
            o.zero_grad()
        timelines.append(opt.report.timeline is not None)
        assert_params_close(model.state_dict(), cpu_copy(ref.state_dict()), step=step)
    assert timelines == [False, name.startswith("auto"), False]  # the second step ended the warm-up
