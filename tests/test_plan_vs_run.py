"""The planner's predicted device peak against the peak a real run measures (the reference),
for the models whose shape once fooled the meta run: one parameter per chunk group, attention
with dropout, activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import gemini
from gemini.engine.memory import DeviceBudgetError
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch


def plan_for(make, config, inputs, loss_fn):
    """``plan_placement`` of ``make()`` built on the meta device; ``loss_fn(output, *targets)``."""
    *args, target = inputs
    with torch.device("meta"):
        model = make()
    meta_target = target.to("meta")
    return gemini.plan_placement(model, config, example_inputs=tuple(args),
                                 loss_fn=lambda out: loss_fn(out, meta_target))


def run_for(make, config, inputs, loss_fn, steps=2):
    """Each step's measured device peak, and whether every step trained (no budget error)."""
    *args, target = inputs
    try:
        model, opt = gemini.initialize(make(), config, lr=1e-3)
    except (ValueError, DeviceBudgetError):  # the chunks kept on the device alone do not fit
        return [], False
    peaks = []
    try:
        for _ in range(steps):
            opt.backward(loss_fn(model(*args), target))
            opt.step()
            opt.zero_grad()
            peaks.append(opt.report.device_peak_bytes)
        return peaks, True
    except DeviceBudgetError:
        return peaks, False
    finally:
        opt.close()


def assert_plan_matches_run(make, config, inputs, loss_fn, rel=0.03):
    """The verdict agrees with the run, and each step's peak is the predicted one within ``rel``."""
    plan = plan_for(make, config, inputs, loss_fn)
    peaks, trained = run_for(make, config, inputs, loss_fn)
    assert plan.fits == trained, (plan.problems, peaks)
    predicted = [plan.first_step_peak_bytes] + [plan.device_peak_bytes] * (len(peaks) - 1)
    for step, (measured, want) in enumerate(zip(peaks, predicted)):
        assert measured == pytest.approx(want, rel=rel), f"step {step}"
    return plan, peaks


def _squared_error(out, target):
    return (out.float() - target).pow(2).mean()


# ------------------------------------------------------------- one parameter per chunk group
def _two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024, bias=False), nn.Linear(1024, 256, bias=False))


def _mlp_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, 256, generator=g), torch.randn(64, 256, generator=g)


@pytest.mark.parametrize("loss_fn", [_squared_error, F.mse_loss])
@pytest.mark.parametrize("placement", ["cpu", "auto"])
@pytest.mark.parametrize("budget", [3_300_000, 1 << 30])
def test_a_group_of_one_parameter_holds_its_gradient_chunk_beside_the_gradient(placement, budget, loss_fn):
    """Each weight is a chunk group of its own: its only gradient is copied into the gradient
    chunk while the gradient itself is alive, next to the parameters. The plan once missed the
    chunk (31% under: it said fits for 3.3 MB, where the first step needs 3.6 MB). The CPU's
    ``F.mse_loss`` returns a view of its elementwise losses, alive with the loss (1.8% more)."""
    config = gemini.GeminiConfig(device="cpu", placement=placement, device_memory=budget)
    assert_plan_matches_run(_two_linears, config, _mlp_inputs(), loss_fn, rel=0.005)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 256))


@pytest.mark.parametrize("budget", [19_000_000, 1 << 30])
def test_static_peaks_are_the_kept_chunks_with_what_comes_and_goes_beside_them(budget):
    """Half the groups keep their parameters, half their optimizer states on the device; the
    others visit for compute. The plan once added the largest visiting group and the activation
    peak to the kept chunks, peaks that never coincide: 21% high, refusing 19 MB that trains."""
    config = gemini.GeminiConfig(device="cpu", placement="static", static_param_device_fraction=0.5,
                                 static_optimizer_offload_fraction=0.5, device_memory=budget)
    assert_plan_matches_run(_mlp, config, _mlp_inputs(), _squared_error)


# ----------------------------------------------------------------- outputs modified in place
class _InPlaceResidual(nn.Module):
    """A residual added in place to a Linear's output on a 3-D input (a view)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(256, 256)
        self.b = nn.Linear(256, 256)
        self.head = nn.Linear(256, 256)

    def forward(self, x):
        h = self.a(x)
        out = self.b(h)
        out += h
        return self.head(out)


def _in_place_residual():
    torch.manual_seed(0)
    return _InPlaceResidual()


def _squared_error_in_place(out, target):
    return out.sub_(target).pow(2).mean()


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_outputs_modified_in_place_plan_as_they_train(placement):
    """The loss modifies the model's output (a view) in place: the planner's hook on the output
    tensor that splits the loss's backward from the model's was dropped (see [Note: a call's
    outputs hooked through in-place ops] in tracer/grad_nodes.py), so the model's backward was
    charged no gradient chunks: the first step's peak was predicted 10% under."""
    g = torch.Generator().manual_seed(1)
    inputs = (torch.randn(8, 16, 256, generator=g), torch.randn(8, 16, 256, generator=g))
    config = gemini.GeminiConfig(device="cpu", placement=placement, device_memory=1 << 30)
    assert_plan_matches_run(_in_place_residual, config, inputs, _squared_error_in_place, rel=0.001)


# ------------------------------------------------------------------ attention with dropout
class _Attention(nn.Module):
    def __init__(self, d=64, heads=4, dropout=0.1):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


def _attention(dropout):
    def make():
        torch.manual_seed(0)
        return nn.Sequential(_Attention(dropout=dropout), _Attention(dropout=dropout))
    return make


def _attention_inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 128, 64, generator=g), torch.randn(8, 128, 64, generator=g)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_attention_is_charged_as_the_configured_device_runs_it(dropout):
    """With dropout the CPU runs the math path, which saves the attention matrix (4x the fused
    kernel's peak here); CUDA's fused kernels take dropout, so a plan for CUDA charges less."""
    config = gemini.GeminiConfig(device="cpu", placement="cuda", device_memory=1 << 30)
    plan, _ = assert_plan_matches_run(_attention(dropout), config, _attention_inputs(), _squared_error, rel=0.01)
    on_gpu = plan_for(_attention(dropout), gemini.GeminiConfig(device="cuda", placement="cuda"),
                      _attention_inputs(), _squared_error)
    if dropout:
        assert on_gpu.non_model_peak_bytes < plan.non_model_peak_bytes / 2
    else:
        assert on_gpu.non_model_peak_bytes == plan.non_model_peak_bytes


def test_a_budget_for_the_fused_kernel_is_refused_when_dropout_takes_the_math_path():
    make, inputs = _attention(0.1), _attention_inputs()
    fused = plan_for(_attention(0.0), gemini.GeminiConfig(device="cpu", placement="cuda"), inputs, _squared_error)
    budget = 2 * fused.device_peak_bytes
    config = gemini.GeminiConfig(device="cpu", placement="cuda", device_memory=budget)
    plan = plan_for(make, config, inputs, _squared_error)
    _, trained = run_for(make, config, inputs, _squared_error, steps=1)
    assert not plan.fits and not trained


# ----------------------------------------------------------------- activation checkpointing
_CKPT = GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128, activation_checkpointing=True)


def _checkpointed_gpt():
    torch.manual_seed(0)
    return GPT(_CKPT)


def _gpt_inputs():
    return synthetic_batch(_CKPT, 8, 64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("placement", ["cpu", "auto", "cuda"])
def test_activation_checkpointing_plans_as_it_trains(placement):
    """The recompute in backward runs attention as the forward did (the planner's attention
    stand-in reaches it) and reads the planned parameters: no CheckpointError, and the peak
    (the recompute's activations, not the forward's) is the measured one."""
    config = gemini.GeminiConfig(device="cpu", placement=placement, device_memory=1 << 30)
    assert_plan_matches_run(_checkpointed_gpt, config, _gpt_inputs(), GPT.loss, rel=0.01)


class _CheckpointedAttention(_Attention):
    """Attention alone recomputed (the recompute's first call), the block around it too."""

    def __init__(self, use_reentrant):
        super().__init__(dropout=0.0)
        self.use_reentrant = use_reentrant

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (y.view(b, t, self.heads, c // self.heads).transpose(1, 2) for y in self.qkv(x).split(c, 2))
        y = checkpoint(F.scaled_dot_product_attention, q, k, v, use_reentrant=self.use_reentrant)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class _CheckpointedBlocks(nn.Module):
    def __init__(self, use_reentrant, d=64, n=2):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.embed = nn.Linear(d, d)  # the blocks' inputs need gradients: reentrant checkpoints need one
        self.blocks = nn.ModuleList(_CheckpointedAttention(use_reentrant) for _ in range(n))

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = x + checkpoint(block, x, use_reentrant=self.use_reentrant)
        return x


def _checkpointed_blocks(use_reentrant):
    def make():
        torch.manual_seed(0)
        return _CheckpointedBlocks(use_reentrant)
    return make


@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # the inner reentrant forward
@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("placement", ["cpu", "cuda"])
def test_nested_checkpoints_recompute_attention_first_and_plan_as_they_train(placement, use_reentrant):
    config = gemini.GeminiConfig(device="cpu", placement=placement, device_memory=1 << 30)
    assert_plan_matches_run(_checkpointed_blocks(use_reentrant), config, _attention_inputs(), _squared_error)


def test_the_cli_plans_a_checkpointed_gpt():
    from gemini.tools.cli import main
    assert main(["plan", "--device", "cpu", "--activation-checkpointing", "--layers", "2", "--embd", "64",
                 "--heads", "2", "--vocab", "256", "--seq", "32", "--batch", "2"]) == 0


# ---------------------------------------------------------------------- activation offload
_GPT = GPTConfig(vocab_size=512, block_size=64, n_layer=3, n_head=4, n_embd=128)


def _gpt():
    torch.manual_seed(0)
    return GPT(_GPT)


@pytest.mark.parametrize("placement,ratio", [("cpu", 0.0), ("cuda", 0.0), ("static", 0.0), ("auto", 0.0),
                                             ("auto", 1.0)])
@pytest.mark.parametrize("budget", [8_000_000, 1 << 30])
def test_offloaded_activations_are_planned_off_the_device(placement, ratio, budget):
    """offload_activations: the saved tensors wait in host memory (the plan once predicted the
    no-offload peak, 4.4x the measured one, refused 8 MB that trains, and advised the knob
    already on). auto keeps the last ones on the device after its warm-up, as the margin allows:
    its later steps are replayed with them."""
    config = gemini.GeminiConfig(device="cpu", placement=placement, device_memory=budget, gpu_margin_mem_ratio=ratio,
                                 offload_activations=True, activation_offload_min_bytes=4096)
    plan, _ = assert_plan_matches_run(_gpt, config, _gpt_inputs(), GPT.loss, rel=0.02)
    assert not any("or offload_activations" in p for p in plan.problems)


# ------------------------------------------------------------------------ auto under bf16
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("ratio,budget", [(0.0, 30_000_000), (1.0, 13_547_780), (1.0, 30_000_000)])
def test_auto_under_low_precision_plans_the_warmups_margin_and_its_cached_parameters(precision, ratio, budget):
    """Under bf16/fp16 the CPU keeps the norms' statistics in the input's dtype (the meta run
    once charged float32: a margin 14 KiB short of the warm-up's, 3 groups kept at ratio 1
    where training keeps 4), the step leaves every cached parameter chunk on the device (the
    plan said 0 bytes there), and the device's Adam holds an fp32 gradient's scratch beside
    the margin's groups (2.5% over the first step's plan at ratio 1)."""
    config = gemini.GeminiConfig(device="cpu", placement="auto", precision=precision, gpu_margin_mem_ratio=ratio,
                                 device_memory=budget)
    plan = plan_for(_gpt, config, _gpt_inputs(), GPT.loss)
    x, y = _gpt_inputs()
    model, opt = gemini.initialize(_gpt(), config, lr=1e-3)
    for step in range(2):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        if step == 0:
            # 4 KiB apart with this batch (not yet explained; the norms' statistics made 14 KiB).
            assert plan.margin_bytes == pytest.approx(opt.report.timeline.margin_bytes, abs=8192)
            # The warm-up's step: the margin's groups and the fp32 scratch of the device's Adam.
            assert opt.report.device_peak_bytes == pytest.approx(plan.first_step_peak_bytes, rel=0.01)
    opt.close()
    assert plan.os_groups_on_device == opt.report.os_chunks_on_device
    assert plan.model_bytes_by_tier == opt.report.model_bytes_by_tier
    assert opt.report.device_peak_bytes == pytest.approx(plan.device_peak_bytes, rel=0.02)
