"""Every invalid GeminiConfig field fails with a ValueError naming it."""

from __future__ import annotations

import pytest
import torch

import gemini
from gemini.gpt import GPT
from helpers import TINY

BAD = [
    ("device", "tpu"),
    ("placement", "gpu"),
    ("precision", "fp8"),
    ("chunk_size", 0),
    ("chunk_size", 1.5),
    ("chunk_size", True),
    ("device_memory", "12 parsecs"),
    ("device_memory", -5),
    ("gpu_margin_mem_ratio", 1.5),
    ("gpu_margin_mem_ratio", -0.1),
    ("cpu_memory", "lots"),
    ("nvme_offload_fraction", 2.0),
    ("nvme_dir", 123),
    ("clip_grad_norm", -1.0),
    ("clip_grad_norm", float("inf")),
    ("initial_scale", 0.0),
    ("min_scale", -1.0),
    ("max_scale", float("inf")),
    ("growth_factor", 1.0),
    ("backoff_factor", 1.0),
    ("backoff_factor", 0.0),
    ("growth_interval", 0),
    ("hysteresis", 0),
    ("hysteresis", 1.5),
    ("report_path", 3.0),
]


@pytest.mark.parametrize("field,value", BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_invalid_field_names_itself(field, value):
    with pytest.raises(ValueError, match=rf"GeminiConfig\.{field}="):
        gemini.GeminiConfig(**{field: value})


def test_cuda_device_without_cuda_is_refused():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match=r"GeminiConfig\.device='cuda'"):
        gemini.GeminiConfig(device="cuda")


def test_nvme_fraction_needs_a_dir():
    with pytest.raises(ValueError, match=r"GeminiConfig\.nvme_dir"):
        gemini.GeminiConfig(nvme_offload_fraction=0.5)


def test_initial_scale_outside_bounds():
    with pytest.raises(ValueError, match=r"GeminiConfig\.initial_scale"):
        gemini.GeminiConfig(initial_scale=4.0, max_scale=2.0)


def test_sizes_accept_strings_and_ints():
    cfg = gemini.GeminiConfig(device_memory="512MiB", cpu_memory=1 << 30)
    assert cfg.device_memory == 512 * 2**20 and cfg.cpu_memory == 2**30


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError):
        gemini.GeminiConfig(chunksize=10)  # a typo is never swallowed


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        gemini.GeminiConfig("cpu")


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(lr=-1.0), "lr=-1.0"),
        (dict(betas=(0.9, 1.0)), "betas="),
        (dict(eps=-1e-8), "eps="),
        (dict(weight_decay=-0.1), "weight_decay="),
        (dict(param_groups=[{"params": [], "momentum": 0.9}]), "unknown keys"),
        (dict(param_groups=[{"lr": 1.0}]), "'params'"),
    ],
)
def test_initialize_hyperparameters_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        gemini.initialize(GPT(TINY), gemini.GeminiConfig(device="cpu", placement="cpu"), **kwargs)


def test_param_in_two_groups_is_refused():
    model = GPT(TINY)
    p = model.ln_f.weight
    with pytest.raises(ValueError, match="more than one"):
        gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cpu"),
                          param_groups=[{"params": [p]}, {"params": [p]}])


def test_device_budget_too_small_for_cuda_placement_says_how_much_is_missing():
    with pytest.raises(ValueError, match=r"bytes are missing"):
        gemini.initialize(GPT(TINY), gemini.GeminiConfig(device="cpu", placement="cuda", device_memory="64KiB"))
