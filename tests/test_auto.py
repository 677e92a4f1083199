"""auto and static placement: the device budget is a promise, and results equal plain AdamW."""

from __future__ import annotations

import copy
import gc
import sys
import weakref

import pytest
import torch

import gemini
from chunks import Tier, chunk_capacity
from gemini.tools.gpt import GPT, GPTConfig
from gemini.engine.memory import DeviceBudgetError
from gemini.engine.iteration_state import IterationState
from tracer import Phase, input_signature
from helpers import (CUDA_ATOL, CUDA_RTOL, DEVICE, MOVES_DROP_ACCUMULATORS, assert_params_close, batches, clone_pair,
                     roomy_budget, train_gemini, train_reference)

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64)
CHUNK = 8192
# Tests marked standin give auto a budget sized in bytes for the CPU stand-in, which counts
# exactly the tensors alive (a fraction of this model's few MB of model data, or the warm-up's
# peak to the byte); on CUDA the caching allocator's segments and cuBLAS's workspace alone
# exceed such budgets. tests/test_cuda.py trains auto under a budget measured on the GPU.
STANDIN = pytest.mark.standin


def _model_data_bytes(cfg: GPTConfig = CFG) -> int:
    """Parameters, gradients and Adam's m and v in fp32: 16 bytes a parameter."""
    return 16 * cfg.num_params()


def _run_auto(budget: int, *, ratio: float = 0.0, steps: int = 6, cfg: GPTConfig = CFG, precision="fp32"):
    base, ref = clone_pair(cfg)
    data = batches(cfg, steps, batch=2, seq=16)
    want_losses, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory=budget,
                               gpu_margin_mem_ratio=ratio, precision=precision)
    reports = []
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2, weight_decay=0.1)
    got = []
    for x, y in data:
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
        got.append(gmodel.state_dict())
    return got, want, reports, opt


@STANDIN
def test_model_data_2_5x_the_budget_trains_under_budget_and_equals_adamw():
    budget = int(_model_data_bytes() / 2.5)
    got, want, reports, opt = _run_auto(budget)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    for r in reports:
        assert r.device_peak_bytes <= budget, f"step {r.step}: peak {r.device_peak_bytes} > budget {budget}"
        assert r.device_budget_bytes == budget
    # Parameters and gradients alone exceed the budget, so chunks really were evicted.
    assert 8 * CFG.num_params() > budget
    assert opt._rt.residency.evictions > 0
    assert reports[-1].h2d_bytes > 0 and reports[-1].os_chunks_on_device == 0
    assert opt._rt.plan is not None and opt._rt.plan.max_non_model_bytes > 0


@STANDIN
def test_one_set_of_hooks_traces_and_counts_every_period():
    """The warm-up's tracer and the policy's period count hear the same boundaries from the
    engine's one set of hooks: the root's forward is the first traced period, a later iteration
    counts exactly the traced periods, and no module carries a second set of period hooks."""
    budget = int(_model_data_bytes() / 2)
    got, want, reports, opt = _run_auto(budget, steps=3)
    rt = opt._rt
    assert rt.plan.keys[0] == (Phase.FORWARD, "")
    assert sum(k[0] is Phase.BACKWARD for k in rt.plan.keys) > 0
    assert rt.hooks.follows_periods and not rt.placement._diverged
    assert rt.placement.period == len(rt.plan.keys) - 1  # the last iteration saw every traced period
    # A leaf module's forward pre-hooks: one period hook and one chunk hook, nothing more.
    leaf = rt.module.blocks[0].mlp.fc
    assert len(leaf._forward_pre_hooks) == 2
    # The root's: the engine's iteration hook alone (the GPT owns no parameter itself; the
    # root's boundary comes from that hook, not from a period hook of its own).
    assert len(rt.module._forward_pre_hooks) == 1
    assert_params_close(got[-1], want[-1], step=len(got) - 1)


def _auto_checked_each_step(budget: int, *, chunk_size: int = CHUNK, ratio: float = 0.0,
                            configure=lambda opt: None, between_steps=lambda gmodel, opt, x, step: None):
    """Auto under ``budget`` against plain AdamW: every step under the budget and equal to AdamW.
    ``configure(opt)`` runs before the first step, ``between_steps(gmodel, opt, x, step)`` after
    each. Returns the optimizer."""
    base, ref = clone_pair(CFG)
    data = batches(CFG, 4, batch=2, seq=16)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=chunk_size, device_memory=budget,
                               gpu_margin_mem_ratio=ratio)
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2, weight_decay=0.1)
    configure(opt)
    for step, (x, y) in enumerate(data):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        assert opt.report.device_peak_bytes <= budget
        assert_params_close(gmodel.state_dict(), want[step], step=step)
        between_steps(gmodel, opt, x, step)
    return opt


@STANDIN
def test_a_validation_pass_between_steps_charges_nothing_to_the_next_iteration():
    """[Note: an evaluation forward's window]: after a forward under no_grad between steps, what
    the loop allocates and keeps (metrics, the next batch: the full budget's worth in host
    memory here) is not charged to the next training iteration; every step passes its budget
    check and equals AdamW."""
    budget = int(_model_data_bytes() / 2.5)
    held = []

    def validate_then_allocate(gmodel, opt, x, step):
        with torch.no_grad():
            gmodel(x)
        held[:] = [torch.zeros(budget // 4)]  # budget bytes of float32, alive through the next iteration

    opt = _auto_checked_each_step(budget, between_steps=validate_then_allocate)
    assert held and opt._rt.residency.evictions > 0


@STANDIN
def test_a_step_with_no_forward_after_a_refused_evaluation_checks_nothing():
    """An evaluation over the budget raises as it ends; a ``step()`` after it with no training
    forward (torch's AdamW: a no-op without gradients) raised the evaluation's peak as its own
    ("this iteration needed ..."), and a step's report gave it as the step's peak."""
    budget = int(_model_data_bytes() / 2.5)
    base, _ = clone_pair(CFG)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory=budget)
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2, weight_decay=0.1)
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    opt.backward(GPT.loss(gmodel(x), y))
    opt.step()
    opt.zero_grad()
    after = {k: v.clone() for k, v in gmodel.state_dict().items()}
    with pytest.raises(DeviceBudgetError, match="evaluation forward"), torch.no_grad():
        gmodel(batches(CFG, 1, batch=64, seq=32)[0][0])
    opt.step()
    assert_params_close(gmodel.state_dict(), after, rtol=0, atol=0)
    assert opt.report.device_peak_bytes <= budget


@STANDIN
def test_a_warmup_forward_out_of_memory_gives_the_trace_up():
    """An out-of-memory error in the warm-up's forward (a batch too large: on CUDA the budget's
    allocator cap raises it; emulated here) left the trace going, so the retry on a smaller batch
    was traced as the iteration's second forward, after the periods the failed one had recorded:
    its plan had more periods than the iteration (59 against 46 on the tiny GPT)."""

    def out_of_memory_above_4(module, args):
        if len(args[0]) > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (emulated)")

    def make():
        model = clone_pair(CFG)[0]
        model.blocks[1].register_forward_pre_hook(out_of_memory_above_4)
        return model

    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory=2 * _model_data_bytes())
    data = batches(CFG, 2, batch=2, seq=16)
    _, want, _ = train_reference(make(), data, lr=1e-2, weight_decay=0.1)
    plans = []
    for retried in (True, False):
        gmodel, opt = gemini.initialize(make(), gcfg, lr=1e-2, weight_decay=0.1)
        if retried:
            with pytest.raises(DeviceBudgetError, match="ran out of the device budget"):
                gmodel(batches(CFG, 1, batch=8, seq=16)[0][0])
        for step, (x, y) in enumerate(data):
            opt.backward(GPT.loss(gmodel(x), y))
            opt.step()
            opt.zero_grad()
            assert_params_close(gmodel.state_dict(), want[step], step=step)
        plans.append(opt._rt.plan)
    assert plans[0].keys == plans[1].keys


@STANDIN
def test_a_hook_budget_error_in_the_warmup_forward_lets_every_post_hook_run(recwarn):
    """A budget error raised by a module's hook in the warm-up's forward closed the window but
    left the trace going: the post-hooks still running after it (always_call) had their moves cut
    by a stopped monitor and raised midway (torch silences such an error with a warning)."""
    from torch.nn.utils.parametrizations import orthogonal

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 128), torch.nn.Tanh(), orthogonal(torch.nn.Linear(128, 128)),
                              torch.nn.Tanh(), torch.nn.Linear(128, 4))
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=2048, device_memory=120_000)
    gmodel, opt = gemini.initialize(net, gcfg, lr=1e-2)
    with pytest.raises(DeviceBudgetError, match="cannot hold this period"):
        torch.nn.functional.mse_loss(gmodel(torch.randn(8, 16)), torch.randn(8, 4)).backward()
    assert [str(w.message) for w in recwarn if "silenced" in str(w.message)] == []
    assert opt._rt.state is IterationState.UNTRACED  # the next training forward traces anew


@STANDIN
def test_budget_too_small_is_a_clear_error_and_nothing_is_lost():
    base, _ = clone_pair(CFG)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory="200KiB")
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2)
    before = gmodel.state_dict()
    x, y = batches(CFG, 1, batch=2, seq=16)[0]
    with pytest.raises(DeviceBudgetError, match=r"\d+ bytes are missing") as err:
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
    assert err.value.missing_bytes > 0
    # Advice for a user already on auto: not "use placement='auto'", but what helps under it.
    assert "placement='auto'" not in str(err.value)
    assert "chunk_size" in str(err.value) and "checkpointing" in str(err.value)
    assert_params_close(gmodel.state_dict(), before, rtol=0, atol=0)
    assert opt.state_dict()["state"] == {}
    # The warm-up ended without a plan: no period hooks are left to trace or count.
    assert opt._rt.state.name == "UNPLANNED" and not opt._rt.hooks.follows_periods


@STANDIN
@pytest.mark.parametrize("placement, advice", [("cuda", "placement='auto'"), ("cpu", "chunk_size"),
                                               ("static", "static_param_device_fraction")])
def test_first_step_budget_error_advises_for_the_placement_in_force(placement, advice):
    base, _ = clone_pair(CFG)
    budget = 24 * CFG.num_params() if placement != "cpu" else 4 * CHUNK * 4 + 1024  # chunks fit, the step does not
    gcfg = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=CHUNK, device_memory=budget)
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2)
    x, y = batches(CFG, 1, batch=8, seq=32)[0]
    with pytest.raises(DeviceBudgetError, match="the first iteration") as err:
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
    assert advice in str(err.value)
    if placement == "cpu":
        assert "placement='auto'" not in str(err.value)


@STANDIN
def test_margin_ratio_puts_more_optimizer_states_on_the_device_and_changes_no_result():
    budget = int(1.5 * _model_data_bytes())
    counts = []
    for ratio in (0.0, 0.5, 1.0):
        got, want, reports, _ = _run_auto(budget, ratio=ratio, steps=4)
        for step, (g, w) in enumerate(zip(got, want)):
            assert_params_close(g, w, step=step)
        assert all(r.device_peak_bytes <= budget for r in reports)
        counts.append(reports[-1].os_chunks_on_device)
        if ratio > 0:
            assert reports[-1].optimizer_device_seconds > 0
    assert counts[0] == 0
    assert counts == sorted(counts) and counts[-1] > 0


@STANDIN
def test_activation_checkpointing_under_auto():
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64, activation_checkpointing=True)
    budget = int(_model_data_bytes(cfg) / 2.5)
    got, want, reports, opt = _run_auto(budget, cfg=cfg, steps=4)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    assert all(r.device_peak_bytes <= budget for r in reports)
    phases = {k[0].value for k in opt._rt.plan.keys}
    assert "recompute" in phases


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_checkpointing_leaves_no_compute_reference_behind(placement):
    """Non-reentrant checkpointing stops its recompute early with an exception inside the last
    module it needs: that module must still be left, or its chunk groups stay "in use" (never
    evictable), one more reference each iteration."""
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64, activation_checkpointing=True)
    base, _ = clone_pair(cfg)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=CHUNK)
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2)
    for x, y in batches(cfg, 3, batch=2, seq=16):
        opt.backward(GPT.loss(gmodel(x), y))
        assert not any(opt._rt.residency._compute_refs.values()), opt._rt.residency._compute_refs
        opt.step()
        opt.zero_grad()


@STANDIN
def test_bf16_under_auto_stays_under_budget():
    budget = int(_model_data_bytes() / 2.5)
    base, _ = clone_pair(CFG)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory=budget,
                               precision="bf16", gpu_margin_mem_ratio=1.0)
    data = batches(CFG, 1, batch=2, seq=16) * 5
    losses, _, _, opt = train_gemini(base, data, gcfg, lr=3e-3)
    assert losses[-1] < losses[0]
    assert opt.report.device_peak_bytes <= budget


@pytest.mark.parametrize("param_frac,offload_frac", [(1.0, 0.0), (0.5, 1.0), (0.0, 0.5)])
def test_static_fractions_equal_adamw(param_frac, offload_frac):
    base, ref = clone_pair(CFG)
    data = batches(CFG, 4)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="static", chunk_size=CHUNK,
                               static_param_device_fraction=param_frac, static_optimizer_offload_fraction=offload_frac)
    _, got, _, opt = train_gemini(base, data, gcfg, lr=1e-2, weight_decay=0.1)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    placement = opt._rt.placement
    n_trainable = len(opt._rt.manager.trainable_groups)
    assert len(placement.os_on_device) == n_trainable - round(offload_frac * n_trainable)
    assert opt.report.os_chunks_on_device == len(placement.os_on_device)


def test_static_budget_too_small_fails_at_initialize():
    with pytest.raises(DeviceBudgetError, match="bytes are missing"):
        gemini.initialize(clone_pair(CFG)[0], gemini.GeminiConfig(
            device=DEVICE, placement="static", chunk_size=CHUNK, device_memory="100KiB"))


def test_margin_ratio_needs_auto():
    with pytest.raises(ValueError, match="gpu_margin_mem_ratio"):
        gemini.initialize(clone_pair(CFG)[0], gemini.GeminiConfig(device=DEVICE, placement="cpu", gpu_margin_mem_ratio=0.5))


@STANDIN
def test_new_batch_shape_is_traced_again_and_results_still_equal_adamw():
    base, ref = clone_pair(CFG)
    short, long = batches(CFG, 2, batch=2, seq=16), batches(CFG, 3, batch=2, seq=32, seed=5)
    data = short + long
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    budget = int(_model_data_bytes() / 1.5)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory=budget,
                               gpu_margin_mem_ratio=1.0)
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2, weight_decay=0.1)
    plans = []
    for step, (x, y) in enumerate(data):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        assert_params_close(gmodel.state_dict(), want[step], step=step)
        assert opt.report.device_peak_bytes <= budget
        plans.append(opt._rt.plan)
    assert plans[0] is plans[1]  # same shapes: one trace
    assert plans[2] is not plans[1] and plans[3] is plans[2]  # new shapes: traced once more
    assert plans[2].max_non_model_bytes > plans[1].max_non_model_bytes  # twice the tokens


@STANDIN
def test_shorter_inputs_run_on_the_longer_traces_plan_and_equal_adamw():
    """Dynamic padding: the sequence length changes every step. A plan traced on longer inputs
    covers shorter ones ([Note: a trace covers smaller inputs] in tracer/signature.py): traced again
    only when a longer batch comes, every step under the budget, a covered iteration moving no more
    bytes than a planned one of the traced length (a warm-up, which it was before, moves more),
    and training equal to AdamW."""
    seqs = [24, 16, 24, 8, 20, 12, 32, 16, 28, 32]
    data = [batches(CFG, 1, batch=2, seq=seq, seed=i)[0] for i, seq in enumerate(seqs)]
    base, ref = clone_pair(CFG)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    budget = int(_model_data_bytes() / 1.5)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK,
                                                              device_memory=budget, gpu_margin_mem_ratio=1.0),
                                    lr=1e-2, weight_decay=0.1)
    plans, h2d = [], []
    for step, (x, y) in enumerate(data):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        assert_params_close(gmodel.state_dict(), want[step], step=step)
        assert opt.report.device_peak_bytes <= budget, f"step {step}"
        plans.append(opt._rt.plan)
        h2d.append(opt.report.h2d_bytes)
    assert all(plan is plans[0] for plan in plans[:6])  # traced at 24; 16, 24, 8, 20, 12 covered
    assert plans[6] is not plans[5] and all(plan is plans[6] for plan in plans[6:])  # 32 traced; 16, 28, 32 covered
    assert max(h2d[1:6]) <= h2d[2] < h2d[0], h2d


class _HungrierWhenSmaller(torch.nn.Module):
    """A model whose memory does not shrink with its input: a batch under 4 rows makes a large
    temporary."""

    def __init__(self, temporary_bytes: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(256, 256)
        self.temporary_numel = temporary_bytes // 4

    def forward(self, x):
        out = self.lin(x)
        if x.shape[0] < 4:
            out = out + torch.zeros(self.temporary_numel, device=x.device).sum()
        return out


@STANDIN
def test_smaller_inputs_that_overrun_a_larger_traces_plan_are_traced_when_they_come_again():
    """Covered inputs that overran the budget on the larger trace's plan (the plan holds the
    optimizer states on the device in the margin the larger batch left): the step refuses with
    nothing updated, and the same inputs again are traced, planned with a margin that fits, and
    train as AdamW does."""
    torch.manual_seed(0)
    base = _HungrierWhenSmaller(1_200_000)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    budget = 2_000_000
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="auto", device_memory=budget,
                                                              gpu_margin_mem_ratio=1.0), lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    big, small = torch.randn(8, 256, generator=g), torch.randn(2, 256, generator=g)
    for step, x in enumerate((big, small, small)):
        ref(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(gmodel(x).square().mean())
        if step == 1:  # covered by the trace of the big batch, and over the budget on its plan
            assert opt._rt.traced_inputs.covered is not None and not opt._rt.tracing
            with opt._rt.memory.quiet():
                before = gmodel.state_dict()
            with pytest.raises(DeviceBudgetError, match="this iteration.*Nothing was updated"):
                opt.step()
            assert_params_close(gmodel.state_dict(), before, rtol=0, atol=0)
            opt.zero_grad()
            opt.backward(gmodel(x).square().mean())  # the same batch again: traced now
            assert opt._rt.tracing
        opt.step()
        opt.zero_grad()
        assert_params_close(gmodel.state_dict(), ref.state_dict(), step=step)
        assert opt.report.device_peak_bytes <= budget, f"step {step}"
    assert not opt._rt.tracing and opt._rt.traced_inputs.covered is None  # the small batch's own plan
    # The refusal charged the small inputs only, not the steps that landed before it: the big
    # batch's plan is kept and comes back ([Note: plans kept per input signature]).
    opt.backward(gmodel(big).square().mean())
    assert opt._rt.state is IterationState.PLANNED and opt._rt.traced_inputs.signature == input_signature((big,), {})
    opt.step()
    assert opt.report.device_peak_bytes <= budget and opt.report.timeline is None


def test_a_budget_that_fits_everything_needs_no_period_tracking():
    got, want, reports, opt = _run_auto(roomy_budget(4 * _model_data_bytes()), ratio=1.0, steps=3)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    placement = opt._rt.placement
    assert not placement.track_periods and not opt._rt.hooks.follows_periods
    assert reports[-1].os_chunks_on_device == len(opt._rt.manager.trainable_groups)
    assert reports[-1].h2d_bytes == reports[-1].d2h_bytes == 0


@STANDIN
def test_a_tight_budget_follows_periods():
    _, _, _, opt = _run_auto(int(_model_data_bytes() / 2.5), steps=2)
    assert opt._rt.placement.track_periods and opt._rt.hooks.follows_periods


@STANDIN
def test_budget_error_in_the_warmup_backward_says_and_keeps_nothing_updated():
    """One Linear in one chunk group: its parameters fit the budget, parameters plus gradients
    do not, so the warm-up's backward runs out of room. The error says nothing was updated, and
    nothing was: parameters, optimizer state and step counts are as before."""
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    param_bytes = 4 * chunk_capacity(64 * 64 + 64, 8192)  # one chunk, sized to its content
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=8192, device_memory=int(1.5 * param_bytes))
    gmodel, opt = gemini.initialize(net, gcfg, lr=1e-2)
    before = gmodel.state_dict()
    loss = gmodel(torch.randn(2, 64)).sum()  # the forward fits
    with pytest.raises(DeviceBudgetError, match="Nothing was updated") as err:
        loss.backward()
    assert err.value.missing_bytes > 0
    assert_params_close(gmodel.state_dict(), before, rtol=0, atol=0)
    assert opt.state_dict()["state"] == {}
    assert all(not g.steps.any() for g in opt._rt.manager.trainable_groups)
    # Dropped without another call, the engine leaves no dispatch mode behind once it is
    # collected ([Note: a mode left by a backward that raised] in tracer/accounting_monitor.py):
    # after the next backward on this thread, which lets torch free the raising pass's nodes.
    alive = weakref.ref(opt._rt)
    del gmodel, opt, loss, err, net
    torch.ones(1, requires_grad=True).sum().backward()
    gc.collect()
    assert alive() is None and torch._C._len_torch_dispatch_stack() == 0


@STANDIN
def test_margin_is_measured_at_one_moment_not_summed_across_moments():
    """The margin subtracts the warm-up's measured peak, not the largest non-model peak plus the
    largest chunk working set (peaks of two moments): the margin is larger, and training with
    all of it on the device stays under the budget on every step and equals AdamW."""
    opt = _auto_checked_each_step(int(1.2 * _model_data_bytes()), chunk_size=4096, ratio=1.0)
    plan = opt._rt.plan
    assert plan.margin_bytes == plan.budget_bytes - plan.reserve_bytes - plan.planned_peak_bytes
    assert plan.planned_peak_bytes >= plan.warmup_peak_bytes
    summed = (plan.budget_bytes - plan.reserve_bytes - plan.fixed_bytes - plan.max_non_model_bytes
              - plan.warmup_model_peak_bytes)
    assert plan.margin_bytes > summed
    assert opt.report.os_chunks_on_device > 0


def _two_forward_run(placement: str, halves: int, **config):
    """Each step: the batch in ``halves`` forwards, one backward of their mean loss."""
    base, ref = clone_pair(CFG)
    ref.to(DEVICE)
    data = batches(CFG, 3, batch=4, seq=16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=CHUNK,
                                                              **config), lr=1e-2, weight_decay=0.1)
    reports = []
    for x, y in data:
        for model, o in ((ref, ref_opt), (gmodel, opt)):
            n = x.shape[0] // halves
            loss = sum(GPT.loss(model(x[i * n : (i + 1) * n]), y[i * n : (i + 1) * n]) for i in range(halves)) / halves
            (opt.backward(loss) if o is opt else loss.backward())
            o.step()
            o.zero_grad()
        reports.append(opt.report)
        # Where moves drop accumulators, a tied weight sums its gradients per forward (see [Note:
        # one accumulator per forward] in gemini/engine/backward_uses.py): a GPU's bounds.
        bounds = dict(rtol=CUDA_RTOL, atol=CUDA_ATOL) if MOVES_DROP_ACCUMULATORS else {}
        assert_params_close(gmodel.state_dict(), ref.state_dict(), step=len(reports), **bounds)
    return reports, opt


def test_two_forwards_before_one_backward_hold_no_more_chunks_than_one():
    """Autograd runs the second forward's backward before the first's, and a parameter's
    gradient arrives only after both: groups are released between their uses in backward (see
    [Note: a group between its uses in backward]), so the chunks on the device at once are
    those of one forward's modules, and each group crosses once per forward. Where moves drop
    accumulators (a GPU) a parameter's gradient arrives once per forward, and its gradient chunk
    comes back for the second: 2.5x the bytes of one forward, the open cost the README states
    (parameters twice per forward, the gradients once more)."""
    one, _ = _two_forward_run("cpu", 1, device_memory=2**40)
    two, opt = _two_forward_run("cpu", 2, device_memory=2**40)
    assert two[-1].device_model_peak_bytes <= one[-1].device_model_peak_bytes
    assert two[-1].h2d_bytes <= (2.5 if MOVES_DROP_ACCUMULATORS else 2) * one[-1].h2d_bytes  # once per forward
    assert not opt._rt.residency._fetched_for_backward and not any(opt._rt.residency._compute_refs.values())


@STANDIN
def test_two_forwards_follow_the_traced_iteration_under_auto():
    """The traced iteration had two forwards: later iterations match it period by period (the
    period count restarts per iteration, not per forward), stay under the budget and equal AdamW."""
    budget = int(_model_data_bytes() / 2)
    reports, opt = _two_forward_run("auto", 2, device_memory=budget)
    assert sum(k == (Phase.FORWARD, "") for k in opt._rt.plan.keys) == 2  # one period per root forward
    assert not opt._rt.placement._diverged
    assert opt._rt.placement.period == len(opt._rt.plan.keys) - 1  # every traced period was seen
    assert all(r.device_peak_bytes <= budget for r in reports)
    assert opt._rt.residency.evictions > 0


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_tied_weight_leaves_the_device_between_its_uses_in_backward(checkpointing):
    """The head, tied to the embedding, is the first module in backward and the embedding the
    last; the tied weight's gradient arrives only after both. Between them its chunk group is
    released (see [Note: a group between its uses in backward]), not held through the whole
    backward; fetched again for the embedding, it still trains exactly like AdamW."""
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64,
                    activation_checkpointing=checkpointing)
    base, ref = clone_pair(cfg)
    data = batches(cfg, 3, batch=2, seq=16)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=CHUNK),
                                    lr=1e-2, weight_decay=0.1)
    tied, _ = opt._rt.manager.locate(base.wte.weight)
    assert tied is opt._rt.manager.locate(base.lm_head.weight)[0]
    on_device_in_block_backward = []

    def watch(module, args, out):
        if torch.is_grad_enabled() and out.requires_grad:
            out.register_hook(lambda grad: on_device_in_block_backward.append(tied.param.is_on(Tier.DEVICE)))

    for block in base.blocks:  # inside each block's backward (a released group lingers until the next module's)
        block.attn.qkv.register_forward_hook(watch)
    for step, (x, y) in enumerate(data):
        on_device_in_block_backward.clear()
        opt.backward(GPT.loss(gmodel(x), y))
        assert on_device_in_block_backward and not any(on_device_in_block_backward)
        assert not opt._rt.residency._fetched_for_backward and not any(opt._rt.residency._compute_refs.values())
        opt.step()
        opt.zero_grad()
        assert_params_close(gmodel.state_dict(), want[step], step=step)


@STANDIN
@pytest.mark.parametrize("ratio", [0.0, 1.0])
def test_every_budget_the_warmup_accepts_trains_to_the_end(ratio):
    """The steady state charges each allocation the non-model bytes that can still be live
    with it: a gradient chunk allocated inside a period is charged the period's peak from that
    moment on, not the peak the period had before it (see [Note: segments of a period] in tracer/runtime.py).
    Charged the whole period's peak, steady-state steps ran out of room at budgets whose
    warm-up had made the very same allocations, with the margin full of optimizer states."""
    data = batches(CFG, 3, batch=2, seq=16)
    base, ref = clone_pair(CFG)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    accepted = 0
    for frac in (1 / 1.5, 1 / 2, 1 / 3, 1 / 5, 1 / 8):
        budget = int(frac * _model_data_bytes())
        base, _ = clone_pair(CFG)
        gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory=budget,
                                   gpu_margin_mem_ratio=ratio)
        gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2, weight_decay=0.1)
        for step, (x, y) in enumerate(data):
            try:
                opt.backward(GPT.loss(gmodel(x), y))
                opt.step()
            except DeviceBudgetError:
                assert step == 0, f"budget {budget} passed the warm-up but step {step} ran out of room"
                break
            opt.zero_grad()
            assert opt.report.device_peak_bytes <= budget
        else:
            accepted += 1
            assert_params_close(gmodel.state_dict(), want[-1])
    assert 2 <= accepted < 5  # the sweep reaches budgets the warm-up refuses


@STANDIN
def test_the_least_budget_the_warmup_accepts_trains_every_later_step():
    """The warm-up accepts a budget only if its schedule fits at each of its decisions
    (``MemoryPlan.planned_peak_bytes``), which later iterations can always fall back to: at the
    very least budget it accepts, every later step trains under it. (Checked against the
    measured peak alone, a chain of five Linears passed the warm-up and ran out of room at step
    2, a few bytes short.)"""
    net = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Tanh())
                                for _ in range(5)))

    def run(budget: int | None, steps: int):
        torch.manual_seed(0)
        model = copy.deepcopy(net)
        gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=4096,
                                                                   device_memory=budget), lr=1e-2)
        x = torch.randn(2, 64)
        for _ in range(steps):
            opt.backward(gmodel(x).square().mean())
            opt.step()
            opt.zero_grad()
            assert budget is None or opt.report.device_peak_bytes <= budget
        return opt

    timeline = run(None, 1).timeline
    probe = timeline.warmup_peak_bytes + timeline.reserve_bytes - 1
    with pytest.raises(DeviceBudgetError) as err:
        run(probe, 1)
    least = probe + err.value.missing_bytes
    run(least, 4)
    with pytest.raises(DeviceBudgetError, match="1 bytes are missing"):
        run(least - 1, 1)


@STANDIN
def test_eviction_order_changes_traffic_never_results():
    """The LRU counterfactual bench_budget measures: equal to AdamW under the same budget, and it
    moves more bytes than the Belady order over the plan."""
    from tracer import EvictionRule

    traffic = {}
    for rule in EvictionRule:
        moved = [0]

        def count_traffic(gmodel, opt, x, step):
            if step > 0:  # after the warm-up, where the rule is in force
                moved[0] += opt.report.h2d_bytes + opt.report.d2h_bytes

        def use_rule(opt, rule=rule):
            opt._rt.placement.eviction_rule = rule

        opt = _auto_checked_each_step(int(_model_data_bytes() / 4), configure=use_rule, between_steps=count_traffic)
        assert opt._rt.residency.evictions > 0
        traffic[rule] = moved[0]
    # On this model and budget the orders differ, so the rule is really in force.
    assert traffic[EvictionRule.LRU] > traffic[EvictionRule.BELADY] > 0


_CHUNK_MOVES = ("allocate", "fetch", "offload", "drop_host_copy", "drop_device_copy", "move_to", "release")


@pytest.mark.parametrize("placement", [pytest.param("auto", marks=STANDIN), "static", "cpu"])
def test_policies_decide_and_the_engine_moves(monkeypatch, placement):
    """No chunk move is made from gemini/policies/: the policy decides (tiers, what stays, what to
    evict and prefetch) and gemini/engine/residency.py moves, under budget pressure too."""
    from chunks import Chunk

    callers = []
    for name in _CHUNK_MOVES:
        def recorded(self, *args, _move=getattr(Chunk, name), **kwargs):
            callers.append(sys._getframe(1).f_globals.get("__name__", "?"))
            return _move(self, *args, **kwargs)

        monkeypatch.setattr(Chunk, name, recorded)
    extra = {"auto": dict(device_memory=int(_model_data_bytes() / 2.5)),
             "static": dict(static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
             "cpu": {}}[placement]
    base, _ = clone_pair(CFG)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=CHUNK,
                                                              **extra), lr=1e-2)
    for x, y in batches(CFG, 3, batch=2, seq=16):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
    assert "gemini.engine.residency" in callers
    assert not [c for c in callers if c.startswith("gemini.policies")], sorted(set(callers))
    if placement == "auto":
        assert opt._rt.residency.evictions > 0


@STANDIN
def test_the_engine_moves_through_its_states_and_refuses_a_wrong_move():
    """IterationState: auto goes UNTRACED -> TRACING (first forward) -> PLANNED (first step) ->
    TRACING (longer inputs) -> PLANNED; cuda stays FIXED; ending a warm-up that is not running
    raises, naming the state."""
    from gemini.engine.runtime import IterationState as S

    base, _ = clone_pair(CFG)
    gcfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=CHUNK, device_memory=int(_model_data_bytes() / 2))
    gmodel, opt = gemini.initialize(base, gcfg, lr=1e-2)
    rt = opt._rt
    seen = [rt.state]
    for seq in (8, 8, 16, 16):
        x, y = batches(CFG, 1, batch=2, seq=seq)[0]
        loss = GPT.loss(gmodel(x), y)
        seen.append(rt.state)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        seen.append(rt.state)
    assert seen == [S.UNTRACED, S.TRACING, S.PLANNED, S.PLANNED, S.PLANNED, S.TRACING, S.PLANNED, S.PLANNED, S.PLANNED]
    with pytest.raises(RuntimeError, match="the engine is IterationState.PLANNED, expected one of \\['TRACING'\\]"):
        rt.finish_warmup()
    base, _ = clone_pair(CFG)
    _, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cuda", chunk_size=CHUNK), lr=1e-2)
    assert opt._rt.state is S.FIXED
