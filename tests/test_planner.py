"""The planner says, before training, what a real run then measures on each tier."""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace

import psutil
import pytest
import torch
import torch.nn.functional as F

import gemini
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch
from gemini.engine.memory import DeviceBudgetError
from gemini.tools import planner
from offload import NvmeStoreError
from helpers import DEVICE, TINY, batches, make_gpt


def _model():
    model = make_gpt()
    model.blocks[1].mlp.fc.weight.requires_grad_(False)  # frozen: param chunks only (and a master under bf16)
    return model


def _last_report(config: gemini.GeminiConfig) -> gemini.MemoryReport:
    """Two real steps of the same model under ``config``: the second step's report."""
    gmodel, opt = gemini.initialize(_model(), config, lr=1e-2)
    for x, y in batches(TINY, 2, device=config.resolved_device()):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
    opt.close()
    return opt.report


def _configs(tmp_path):
    nvme = dict(nvme_dir=str(tmp_path), nvme_pipeline_depth=1)
    return {  # host budgets below what the optimizer states need, so some go to NVMe
        "cpu-fp32-nvme": dict(placement="cpu", cpu_memory=250_000, **nvme),
        "cpu-bf16-nvme": dict(placement="cpu", precision="bf16", cpu_memory=300_000, **nvme),
        "cpu-bf16-nvme-fraction": dict(placement="cpu", precision="bf16", nvme_offload_fraction=0.5,
                                       nvme_dir=str(tmp_path), nvme_pipeline_depth=1),
        "cuda-bf16": dict(placement="cuda", precision="bf16"),
        "cuda-fp32": dict(placement="cuda"),
        "cpu-fp32": dict(placement="cpu"),
        "cpu-bf16": dict(placement="cpu", precision="bf16"),
        "static-fp32": dict(placement="static", static_param_device_fraction=0.5,
                            static_optimizer_offload_fraction=0.5),
        "static-bf16": dict(placement="static", precision="bf16", static_param_device_fraction=0.75,
                            static_optimizer_offload_fraction=0.5),
    }


@pytest.mark.parametrize("name", ["cpu-fp32-nvme", "cpu-bf16-nvme", "cpu-bf16-nvme-fraction", "cuda-bf16",
                                  "cuda-fp32", "cpu-fp32", "cpu-bf16", "static-fp32", "static-bf16"])
def test_plan_agrees_with_what_a_real_run_measures(tmp_path, name):
    """The plan's figures (gemini/policies/footprint.py's pure function of the layout and the placement's
    choice) equal the ledger's count after a real step, tier by tier and kind by kind."""
    config = gemini.GeminiConfig(device=DEVICE, chunk_size=2000, **_configs(tmp_path)[name])
    plan = gemini.plan_placement(_model(), config)
    r = _last_report(config)
    assert plan.fits, plan.problems
    for tier, measured in (("device", r.device_model_bytes), ("host", r.host_model_bytes), ("nvme", r.nvme_bytes)):
        assert plan.tier_bytes(tier) == pytest.approx(measured, rel=0.10), tier
    assert plan.model_bytes_by_tier == r.model_bytes_by_tier  # and kind by kind, exactly
    assert plan.os_groups_on_device == r.os_chunks_on_device
    assert plan.trainable_groups == r.os_chunks_total
    if "nvme" in name:
        assert plan.nvme_groups > 0 and r.nvme_bytes > 0


def test_ranks_on_one_host_share_its_memory(monkeypatch):
    """[Note: a plan under ZeRO]: with ``world_size`` the figures are one rank's, and the host
    check counts the ranks on one host against its memory: a host with room for two ranks'
    chunks fits two, not four."""
    config = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000)
    one = gemini.plan_placement(_model(), config, world_size=4, ranks_per_host=1)
    per_rank = one.tier_bytes("host") + one.tier_bytes("device")  # the stand-in's device is host memory
    monkeypatch.setattr(planner.psutil, "virtual_memory", lambda: SimpleNamespace(available=int(2.5 * per_rank)))
    two = gemini.plan_placement(_model(), config, world_size=4, ranks_per_host=2)
    four = gemini.plan_placement(_model(), config, world_size=4)  # planned ahead: every rank on this host
    assert two.fits and two.model_bytes_by_tier == one.model_bytes_by_tier
    assert four.ranks_per_host == 4 and not four.fits
    assert any("4 ranks of" in p for p in four.problems), four.problems


def test_host_memory_advice_names_what_is_left_to_turn(tmp_path, monkeypatch):
    """Host memory short with cpu_memory and nvme_dir set already: the advice is to lower
    cpu_memory, raise the NVMe fraction or shorten the pipeline (it used to say to set both)."""
    config = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000, cpu_memory=250_000,
                                 nvme_dir=str(tmp_path))
    monkeypatch.setattr(planner.psutil, "virtual_memory", lambda: SimpleNamespace(available=1000))
    plan = gemini.plan_placement(_model(), config)
    (problem,) = [p for p in plan.problems if p.startswith("host memory")]
    assert "lower cpu_memory" in problem and "set cpu_memory" not in problem and "nvme_pipeline_depth" in problem
    bare = gemini.plan_placement(_model(), dataclasses.replace(config, cpu_memory=None, nvme_dir=None))
    assert any("set cpu_memory and nvme_dir" in p for p in bare.problems), bare.problems


def test_auto_host_and_nvme_figures_are_those_of_ratio_zero(tmp_path):
    config = gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=2000, device_memory="8MiB",
                                 cpu_memory=250_000, nvme_dir=str(tmp_path), nvme_pipeline_depth=1)
    plan = gemini.plan_placement(_model(), config)
    r = _last_report(config)
    assert plan.model_bytes_by_tier["host"] == r.model_bytes_by_tier["host"]
    assert plan.model_bytes_by_tier["nvme"] == r.model_bytes_by_tier["nvme"]
    assert any("auto" in note for note in plan.notes)


def test_plans_a_model_larger_than_this_machine_without_allocating_it():
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600)  # 1.5B parameters
    with torch.device("meta"):
        model = GPT(cfg)
    plan = gemini.plan_placement(model, gemini.GeminiConfig(device="cpu", placement="cpu", precision="bf16"))
    assert plan.n_params == cfg.num_params()
    # bf16: 2 (param) + 2 (grad) + 12 (master, m, v) bytes a parameter, all on the host, padding aside.
    assert plan.tier_bytes("host") == pytest.approx(16 * cfg.num_params(), rel=0.02)
    assert plan.tier_bytes("device") == 0
    assert "fits" in plan.table()


def test_what_does_not_fit_is_said_with_the_knob_to_turn(tmp_path, monkeypatch):
    no_nvme = gemini.plan_placement(_model(), gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000,
                                                                  cpu_memory=100_000))
    assert not no_nvme.fits and "nvme_dir" in no_nvme.problems[0]
    small = gemini.plan_placement(_model(), gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=2000,
                                                                device_memory=100_000))
    assert not small.fits and "device_memory" in small.problems[0]
    assert "fits: NO" in small.table()
    with pytest.warns(UserWarning, match="will not be used"):  # no cpu_memory: NVMe would hold nothing anyway
        config = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000, nvme_dir=str(tmp_path / "missing"))
    missing = gemini.plan_placement(_model(), config)
    assert not missing.fits and "is not a folder" in missing.problems[0]
    # A folder this process cannot write (a read-only mount; root passes mode bits, so faked here):
    # the plan said it fit, and initialize refused it.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(tmp_path) and real_access(path, mode))
    read_only = dataclasses.replace(config, nvme_dir=str(tmp_path), cpu_memory=250_000)
    plan = gemini.plan_placement(_model(), read_only)
    assert not plan.fits and "is not writable by this process" in " ".join(plan.problems)
    with pytest.raises(NvmeStoreError, match="is not writable by this process"):
        gemini.initialize(_model(), read_only)
    monkeypatch.undo()
    # The same budgets really fail at initialize.
    with pytest.raises(ValueError, match="nvme_dir"):
        gemini.initialize(_model(), gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000,
                                                         cpu_memory=100_000))
    with pytest.raises(DeviceBudgetError, match="device_memory"):
        gemini.initialize(_model(), gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=2000,
                                                         device_memory=100_000))


def test_the_plan_is_for_the_configured_device_whatever_machine_plans_it():
    """A 1.5B bf16 model under placement cuda with an 80 GiB budget: its ~24 GB of chunks are
    on the GPU, not in this machine's host memory. The same plan with the CPU standing in for
    the device puts them in host memory, which is then short."""
    cfg = GPTConfig(vocab_size=50304, block_size=1024, n_layer=48, n_head=25, n_embd=1600)
    with torch.device("meta"):
        model = GPT(cfg)
    common = dict(placement="cuda", precision="bf16", device_memory="80GiB")
    on_gpu = gemini.plan_placement(model, gemini.GeminiConfig(device="cuda", **common))
    assert on_gpu.fits, on_gpu.problems
    assert on_gpu.tier_bytes("device") == pytest.approx(16 * cfg.num_params(), rel=0.02)
    assert on_gpu.tier_bytes("host") == 0
    assert "activations and other non-model memory are not counted" in on_gpu.table()
    if psutil.virtual_memory().available < 16 * cfg.num_params():
        stand_in = gemini.plan_placement(model, gemini.GeminiConfig(device="cpu", **common))
        assert not stand_in.fits
        problem = next(p for p in stand_in.problems if p.startswith("host memory"))
        # Under placement cuda, cpu_memory and nvme_dir are refused: the advice names the placements that take them.
        assert "with placement 'cpu', 'auto' or 'static'" in problem


_SMALL = GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128)


_PLACEMENTS = {
    "cuda": dict(placement="cuda"),
    "cpu": dict(placement="cpu"),
    "static": dict(placement="static", static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
    "auto-r0": dict(placement="auto", gpu_margin_mem_ratio=0.0),
    "auto-r0.5": dict(placement="auto", gpu_margin_mem_ratio=0.5),
    "auto-r1": dict(placement="auto", gpu_margin_mem_ratio=1.0),
}


def _small_batch():
    return synthetic_batch(_SMALL, 8, 64, generator=torch.Generator().manual_seed(1))


def _small_plan(config):
    x, y = _small_batch()
    with torch.device("meta"):
        meta_model = GPT(_SMALL)
    return gemini.plan_placement(meta_model, config, example_inputs=(x,),
                                 loss_fn=lambda out: GPT.loss(out, y.to("meta")))


def _small_run(config, steps=3):
    """Per step: the measured device peak; then the last report (None: a DeviceBudgetError)."""
    x, y = _small_batch()
    torch.manual_seed(0)
    model, opt = gemini.initialize(GPT(_SMALL), config)
    peaks = []
    try:
        for _ in range(steps):
            opt.backward(GPT.loss(model(x), y))
            opt.step()
            opt.zero_grad()
            peaks.append(opt.report.device_peak_bytes)
        return peaks, opt.report
    except DeviceBudgetError:
        return peaks, None
    finally:
        opt.close()


@pytest.mark.parametrize("name", list(_PLACEMENTS))
@pytest.mark.parametrize("budget_mib", [22, 28, 1024])
def test_the_plan_predicts_every_step_its_tiers_and_its_verdict(name, budget_mib):
    """One forward and backward on the meta device, the warm-up replayed there (no memory, no
    compute), predicts what training then does, for every placement: each step's measured peak
    within 10% (the first against ``first_step_peak_bytes``), the bytes of every tier and kind
    exactly — under auto at any ratio, the margin's groups chosen by the engine's own rule —
    and whether it trains at all. 22 MiB: only cpu and auto train; 28 MiB: static too, 1 GiB:
    everything."""
    config = gemini.GeminiConfig(device="cpu", precision="fp32", chunk_size=32768, device_memory=f"{budget_mib}MiB",
                                 **_PLACEMENTS[name])
    plan = _small_plan(config)
    peaks, report = _small_run(config)
    assert plan.fits == (report is not None), (plan.problems, peaks)
    if report is None:
        return
    predicted = [plan.first_step_peak_bytes] + [plan.device_peak_bytes] * (len(peaks) - 1)
    for step, (measured, want) in enumerate(zip(peaks, predicted)):
        assert measured == pytest.approx(want, rel=0.10), f"step {step}"
    assert plan.model_bytes_by_tier == report.model_bytes_by_tier
    assert plan.os_groups_on_device == report.os_chunks_on_device
    if name in ("auto-r0.5", "auto-r1"):
        assert plan.margin_bytes is not None and f"holds {plan.os_groups_on_device} whole chunk groups" in plan.table()


def test_bf16_predictions_hold_too():
    for name in ("cuda", "auto-r1"):
        config = gemini.GeminiConfig(device="cpu", precision="bf16", chunk_size=32768, device_memory="24MiB",
                                     **_PLACEMENTS[name])
        plan = _small_plan(config)
        peaks, report = _small_run(config)
        assert plan.fits and report is not None, plan.problems
        assert peaks[-1] == pytest.approx(plan.device_peak_bytes, rel=0.10)
        assert plan.model_bytes_by_tier == report.model_bytes_by_tier


def test_shapes_and_dtypes_plan_as_the_tensors_do():
    x, y = _small_batch()
    config = gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=32768, device_memory="26MiB",
                                 gpu_margin_mem_ratio=0.5)
    with torch.device("meta"):
        meta_model = GPT(_SMALL)
    same = gemini.plan_placement(meta_model, config, example_inputs=((tuple(x.shape), x.dtype),),
                                 loss_fn=lambda out: GPT.loss(out, y.to("meta")))
    plan = _small_plan(config)
    assert (same.device_peak_bytes, same.first_step_peak_bytes, same.margin_bytes) == \
        (plan.device_peak_bytes, plan.first_step_peak_bytes, plan.margin_bytes)


def test_auto_with_a_ratio_and_nvme_plans_host_and_nvme_as_placed(tmp_path):
    """The margin takes groups onto the device; the NVMe tier then chooses among those left."""
    config = gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=32768, device_memory="26MiB",
                                 gpu_margin_mem_ratio=1.0, cpu_memory=2_000_000, nvme_dir=str(tmp_path),
                                 nvme_pipeline_depth=1)
    plan = _small_plan(config)
    blind = gemini.plan_placement(GPT(_SMALL), config)  # no inputs: the margin is unknown
    _, report = _small_run(config, steps=2)
    assert report is not None and plan.fits
    assert 0 < plan.os_groups_on_device == report.os_chunks_on_device
    assert plan.nvme_groups > 0
    assert plan.model_bytes_by_tier == report.model_bytes_by_tier
    assert blind.tier_bytes("nvme") > plan.tier_bytes("nvme")  # ratio 0's figures, said so
    assert any("host and NVMe are shown as at ratio 0" in n for n in blind.notes)


def test_a_budget_the_activations_do_not_fit_is_refused_by_the_plan_as_by_training():
    """Model data fits, activations do not: without example inputs the plan cannot know (and
    says so); with them it refuses, as the first step does."""
    x, y = synthetic_batch(_SMALL, 8, 64, generator=torch.Generator().manual_seed(1))
    with torch.device("meta"):
        meta_model = GPT(_SMALL)
    probe = gemini.plan_placement(meta_model, gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=32768),
                                  example_inputs=(x,), loss_fn=lambda out: GPT.loss(out, y.to("meta")))
    model_bytes = probe.tier_bytes("device") + probe.buffer_bytes
    budget = model_bytes + probe.non_model_peak_bytes // 2
    config = gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=32768, device_memory=budget)
    blind = gemini.plan_placement(meta_model, config)
    assert blind.fits and "activations and other non-model memory are not counted" in blind.table()
    plan = gemini.plan_placement(meta_model, config, example_inputs=(x,),
                                 loss_fn=lambda out: GPT.loss(out, y.to("meta")))
    assert not plan.fits and "the device needs" in plan.problems[0] and "are missing" in plan.problems[0]
    torch.manual_seed(0)
    model, opt = gemini.initialize(GPT(_SMALL), config)
    with pytest.raises(DeviceBudgetError):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
    opt.close()


def test_a_model_that_cannot_run_on_meta_is_a_clear_error():
    class NeedsValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * float(x.sum().item())

    with pytest.raises(ValueError, match="example_inputs: the model could not run on the meta device"):
        gemini.plan_placement(NeedsValues(), gemini.GeminiConfig(device="cpu"), example_inputs=(torch.ones(2, 4),))


def test_a_transformers_llama_is_predicted_from_its_input_ids():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    config = gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=65536, device_memory="1GiB")
    loss_fn = lambda out: out.logits.float().sum()  # noqa: E731
    plan = gemini.plan_placement(model, config, example_inputs=((tuple(ids.shape), ids.dtype),), loss_fn=loss_fn)
    gmodel, opt = gemini.initialize(model, config)
    for step in range(3):
        opt.backward(loss_fn(gmodel(ids)))
        opt.step()
        opt.zero_grad()
        if step:
            assert opt.report.device_peak_bytes == pytest.approx(plan.device_peak_bytes, rel=0.10)
    opt.close()


def test_bad_inputs_are_said_naming_the_argument():
    """config None is GeminiConfig(), as initialize takes it; a loss_fn returning no tensor, a
    detached loss (training would backward nothing: the plan would count a forward only), a
    loss_fn without example_inputs, and a real tensor inside loss_fn are clear errors."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    assert gemini.plan_placement(model, None).placement == gemini.GeminiConfig().placement
    config = gemini.GeminiConfig(device="cpu", placement="auto", device_memory="64MiB")
    with pytest.raises(TypeError, match="config must be a GeminiConfig or None, got dict"):
        gemini.plan_placement(model, {"placement": "cpu"})
    for returned in (1.0, None):
        with pytest.raises(TypeError, match=f"loss_fn returned {type(returned).__name__}"):
            gemini.plan_placement(model, config, example_inputs=(x,), loss_fn=lambda out, r=returned: r)
    with pytest.raises(ValueError, match="loss_fn returned a tensor that needs no gradient"):
        gemini.plan_placement(model, config, example_inputs=(x,), loss_fn=lambda out: out.detach().sum())
    with pytest.raises(ValueError, match="loss_fn is given but example_inputs is not"):
        gemini.plan_placement(model, config, loss_fn=lambda out: out.sum())
    target = torch.zeros(8, dtype=torch.long)  # on the CPU, not meta
    with pytest.raises(ValueError, match=r"if it failed in loss_fn, make what loss_fn uses .* a meta tensor") as e:
        gemini.plan_placement(model, config, example_inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, target))
    assert "or pass loss_fn" not in str(e.value)


@pytest.mark.standin  # budgets in bytes the CPU stand-in counts exactly
@pytest.mark.parametrize("placement, budget", [("cpu", 830_000), ("static", 1_960_000)])
def test_placements_without_a_warm_up_are_not_refused_a_reserve_they_do_not_keep(placement, budget):
    """cpu and static check each step's peak against the budget itself, without auto's 64 KiB
    warm-up reserve; the plan added it and said "does not fit" for budgets they train under
    (cpu from 825 to 875 kB here). Now a 1% slack: the verdict and training agree."""
    cfg_gpt = GPTConfig(n_layer=2, n_embd=64, n_head=2, vocab_size=256, block_size=32)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (2, 32), generator=g) for _ in range(2))
    extra = dict(static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5) if placement == "static" else {}
    config = gemini.GeminiConfig(device="cpu", placement=placement, device_memory=budget, **extra)
    with torch.device("meta"):
        meta = GPT(cfg_gpt)
    plan = gemini.plan_placement(meta, config, example_inputs=(x,), loss_fn=lambda out: GPT.loss(out, y.to("meta")))
    assert plan.fits, plan.problems
    torch.manual_seed(0)
    model, opt = gemini.initialize(GPT(cfg_gpt), config)
    for _ in range(2):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        assert plan.device_peak_bytes <= opt.report.device_peak_bytes <= budget
        assert opt.report.device_peak_bytes - plan.device_peak_bytes < 0.01 * plan.non_model_peak_bytes
