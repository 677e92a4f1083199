"""The planner says, before training, what a real run then measures on each tier."""

from __future__ import annotations

import psutil
import pytest
import torch

import gemini
from gemini.gpt import GPT, GPTConfig
from helpers import TINY, batches, make_gpt


def _model():
    model = make_gpt()
    model.blocks[1].mlp.fc.weight.requires_grad_(False)  # frozen: param chunks only (and a master under bf16)
    return model


def _last_report(config: gemini.GeminiConfig) -> gemini.MemoryReport:
    """Two real steps of the same model under ``config``: the second step's report."""
    gmodel, opt = gemini.initialize(_model(), config, lr=1e-2)
    for x, y in batches(TINY, 2):
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
    """The plan's figures (gemini/footprint.py's pure function of the layout and the placement's
    choice) equal the ledger's count after a real step, tier by tier and kind by kind."""
    config = gemini.GeminiConfig(device="cpu", chunk_size=2000, **_configs(tmp_path)[name])
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


def test_what_does_not_fit_is_said_with_the_knob_to_turn(tmp_path):
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
    # The same budgets really fail at initialize.
    with pytest.raises(ValueError, match="nvme_dir"):
        gemini.initialize(_model(), gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000,
                                                         cpu_memory=100_000))
    with pytest.raises(ValueError, match="device_memory"):
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
