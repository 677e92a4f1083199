"""Every invalid GeminiConfig field fails with a ValueError naming it."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import subprocess
import warnings

import pytest
import torch

import gemini
from gemini.tools.gpt import GPT
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


@pytest.mark.parametrize("field, value, match", [
    ("precision", "fp8", "precision='fp8'"),
    ("gpu_margin_mem_ratio", 5.0, r"gpu_margin_mem_ratio=5\.0.*\[0, 1\]"),
    ("clip_grad_norm", -1.0, "clip_grad_norm=-1.0"),
    ("device_memory", "lots", "device_memory='lots'"),
])
def test_a_field_set_after_construction_is_checked_by_initialize(field, value, match):
    """Scripts tweak a config after making it: initialize checks it as it is then."""
    cfg = gemini.GeminiConfig(device="cpu", placement="auto")
    setattr(cfg, field, value)
    model = torch.nn.Linear(8, 8)
    before = model.weight.clone()
    with pytest.raises(ValueError, match=match):
        gemini.initialize(model, cfg)
    assert torch.equal(model.weight, before) and model.weight.device.type == "cpu"


def test_a_size_string_set_after_construction_is_converted_and_the_engine_keeps_its_copy():
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu")
    cfg.device_memory = "64MiB"
    model, opt = gemini.initialize(torch.nn.Linear(8, 8), cfg)
    opt.backward(model(torch.randn(2, 8)).sum())
    opt.step()
    assert opt.report.device_budget_bytes == 64 * 2**20
    cfg.device_memory = "1KiB"  # later changes to the user's object do not reach the running engine
    opt.backward(model(torch.randn(2, 8)).sum())
    opt.step()
    assert opt.report.device_budget_bytes == 64 * 2**20


def test_cuda_device_without_cuda_is_refused_by_initialize_not_by_the_config():
    """A config describes the run it is for: a machine without the GPU can plan it, and only
    initialize (before anything is built) refuses to run it."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    config = gemini.GeminiConfig(device="cuda")
    assert gemini.plan_placement(torch.nn.Linear(4, 4), config).fits
    model = torch.nn.Linear(4, 4)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"GeminiConfig\.device='cuda'.*no CUDA device"):
        gemini.initialize(model, config)
    assert torch.equal(model.weight, before)


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
        (dict(lr=torch.tensor(-1.0)), r"lr=tensor\(-1.\) is invalid"),
        (dict(lr=torch.tensor([1e-3, 1e-3])), "one-element float tensor"),
        (dict(betas=(0.9, 1.0)), "betas="),
        (dict(eps=-1e-8), "eps="),
        (dict(weight_decay=-0.1), "weight_decay="),
        (dict(param_groups=[{"params": [], "weight_decy": 0.1}]), "did you mean 'weight_decay'"),
        (dict(param_groups=[{"params": [], "beta": (0.9, 0.99)}]), "did you mean 'betas'"),
        (dict(param_groups=[{"params": [], "epsilon": 1e-6}]), "did you mean 'eps'"),
        (dict(param_groups=[{"params": [], "amsgrad": True}]), r"param_groups\[0\]\['amsgrad'\] = True is not supported"),
        (dict(param_groups=[{"params": [], "decoupled_weight_decay": False, "weight_decay": 0.1}]),
         r"param_groups\[0\]\['decoupled_weight_decay'\] = False"),
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


def test_integer_parameters_are_refused_naming_them():
    model = torch.nn.Linear(4, 4)
    model.counter = torch.nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
    with pytest.raises(TypeError, match="parameter counter has dtype torch.int64.*register a frozen torch.int64 tensor as a buffer"):
        gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cpu"))


@pytest.mark.parametrize("module", [torch.nn.Embedding(10, 4, sparse=True), torch.nn.EmbeddingBag(10, 4, sparse=True)])
def test_a_sparse_embedding_is_refused_naming_it(module):
    """A sparse gradient has no slot in a chunk: refused at initialize (it trained as dense under
    one placement and crashed in a hook under another)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), module)
    with pytest.raises(ValueError, match=rf"module 1 \({type(module).__name__}\) has sparse=True"):
        gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cpu"))
    module.weight.requires_grad_(False)  # frozen: no gradient at all, nothing to refuse
    gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cpu"))


class _FunctionalSparseEmbedding(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(10, 4))
        self.head = torch.nn.Linear(4, 1)
        self.sparse = True

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.nn.functional.embedding(idx, self.table, sparse=self.sparse))


@pytest.mark.parametrize("placement", ["cuda", "cpu", "static", "auto"])
def test_a_sparse_gradient_from_functional_code_is_refused_naming_it(placement):
    """F.embedding(..., sparse=True) on a plain parameter, which initialize cannot see: the backward refuses the
    sparse gradient under every placement, naming the parameter, before it reaches p.grad or a chunk (under cuda it
    trained as dense, elsewhere torch's "reshape is not implemented for sparse tensors" came out of a hook); after it,
    the model trains on dense gradients equal to torch's."""
    torch.manual_seed(0)
    model = _FunctionalSparseEmbedding()
    reference = copy.deepcopy(model)
    extra = dict(device_memory="64MiB") if placement == "auto" else {}
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement=placement, **extra), lr=1e-2)
    idx = torch.tensor([[1, 2, 3], [3, 4, 5]])
    before = model.table.detach().clone()
    with pytest.raises(RuntimeError, match="gradient of table is torch.sparse_coo.*dense gradients only"):
        gmodel(idx).sum().backward()
    opt.zero_grad()
    opt.step()
    assert torch.equal(model.table.detach(), before) and model.table.grad is None
    model.sparse = reference.sparse = False  # dense gradients again: trains as torch does
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    for net, o in ((gmodel, opt), (reference, ref_opt)):
        for _ in range(2):
            o.zero_grad()
            net(idx).sum().backward()
            o.step()
    torch.testing.assert_close(model.table.detach(), reference.table.detach(), rtol=1e-6, atol=1e-7)


def test_a_memory_format_not_kept_is_warned_about(caplog):
    """Chunks hold parameters contiguous: a channels_last conv weight becomes contiguous (torch then picks the conv's
    kernels by its input alone); both the converted model at initialize and model.to(memory_format=...) after it say
    so, and the numbers still equal torch's given channels_last inputs."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(1))
    model(torch.randn(1, 3, 6, 6))
    model = model.to(memory_format=torch.channels_last)
    reference = copy.deepcopy(model)
    with caplog.at_level("WARNING", logger="gemini"):
        gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cpu"), lr=1e-2)
    assert "1 of the model's parameters are not contiguous (like '0.weight')" in caplog.text
    assert model[0].weight.is_contiguous()  # not kept, as warned
    caplog.clear()
    with caplog.at_level("WARNING", logger="gemini"):
        assert gmodel.to(memory_format=torch.channels_last) is gmodel
        gmodel.to("cpu")
    assert caplog.text.count("changes no parameter") == 1, caplog.text
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    x = torch.randn(2, 3, 6, 6).to(memory_format=torch.channels_last)
    for net, o in ((gmodel, opt), (reference, ref_opt)):
        for _ in range(3):
            o.zero_grad()
            net(x).square().sum().backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)


def test_parameters_of_several_dtypes_are_warned_about(caplog):
    """Chunks hold one dtype: an fp16 part of an fp32 model becomes fp32, which its forward may
    not expect; the warning names a parameter of each dtype."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).half())
    with caplog.at_level("WARNING", logger="gemini.optim.group_specs"):
        wrapped, _ = gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cpu"))
    assert "torch.float32: 2 like '0.weight', torch.float16: 2 like '1.weight'" in caplog.text
    assert wrapped.module[1].weight.dtype == torch.float32
    caplog.clear()
    with caplog.at_level("WARNING", logger="gemini.optim.group_specs"):
        gemini.initialize(torch.nn.Linear(4, 4).double(), gemini.GeminiConfig(device="cpu", placement="cpu"))
    assert "several dtypes" not in caplog.text  # one dtype: the precision's, as asked


def test_device_budget_too_small_for_cuda_placement_says_how_much_is_missing():
    model = GPT(TINY)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(gemini.DeviceBudgetError, match=r"placement='cuda' needs \d+ bytes of chunks on the device "
                                                       r"but GeminiConfig.device_memory=65536: \d+ bytes are missing"):
        gemini.initialize(model, gemini.GeminiConfig(device="cpu", placement="cuda", device_memory="64KiB"))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("placement", ["cuda", "cpu", "static"])
def test_a_margin_ratio_without_a_margin_is_refused(placement):
    with pytest.raises(ValueError, match=rf"gpu_margin_mem_ratio=0.5 needs placement='auto' \(placement="
                                         rf"'{placement}' has no margin\)"):
        gemini.initialize(GPT(TINY), gemini.GeminiConfig(device="cpu", placement=placement, gpu_margin_mem_ratio=0.5))


# ------------------------------------------------------------------------------ report_path
def _report_path_error(value) -> str:
    with pytest.raises(ValueError, match=r"GeminiConfig\.report_path=") as info:
        gemini.GeminiConfig(report_path=value)
    message = str(info.value)
    assert repr(value) in message and "expected None or the path of a file" in message
    return message


@pytest.mark.parametrize("placement,field,value", [
    ("auto", "static_optimizer_offload_fraction", 0.5), ("cpu", "static_param_device_fraction", 0.3),
    ("cuda", "static_optimizer_offload_fraction", 1.0),
])
def test_a_static_fraction_under_another_placement_is_refused(placement, field, value):
    """Only placement='static' reads the fractions: set under another they were silently ignored."""
    config = gemini.GeminiConfig(device="cpu", placement=placement, **{field: value})
    with pytest.raises(ValueError, match=rf"{field}={value} needs placement='static' \(placement='{placement}' "
                                         rf"ignores it\)"):
        gemini.initialize(GPT(TINY), config)
    with pytest.raises(ValueError, match=rf"{field}={value} needs placement='static'"):
        gemini.plan_placement(GPT(TINY), config)


def test_a_process_group_of_the_wrong_type_is_named():
    """Before: 'torch.distributed is not initialized', which is not what is wrong."""
    with pytest.raises(TypeError, match="process_group must be a torch.distributed.ProcessGroup or None, got str 'WORLD'"):
        gemini.initialize(GPT(TINY), gemini.GeminiConfig(device="cpu", placement="cpu", process_group="WORLD"))


def test_report_path_problems_fail_when_the_config_is_made(tmp_path):
    (tmp_path / "afile").write_text("x")
    assert "not a folder" in _report_path_error(tmp_path)  # a folder, not a file
    assert "is not a folder" in _report_path_error(str(tmp_path / "afile" / "r.jsonl"))  # parent is a file
    # The parent is missing and cannot be made: an ancestor is a file.
    assert repr(str(tmp_path / "afile")) in _report_path_error(str(tmp_path / "afile" / "a" / "b" / "r.jsonl"))
    assert "empty string" in _report_path_error("")
    # A missing parent that can be made is fine: initialize makes it.
    gemini.GeminiConfig(report_path=tmp_path / "new" / "r.jsonl")


def test_report_path_on_a_read_only_file_system_fails_when_the_config_is_made(tmp_path):
    # A permission even root lacks (chmod would not stop root): a file system mounted read-only.
    mnt = tmp_path / "ro"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mnt)], capture_output=True,
                          text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root): {done.stderr.strip()}")
    try:
        assert "may not create files in" in _report_path_error(str(mnt / "r.jsonl"))
        assert "may not create files in" in _report_path_error(str(mnt / "sub" / "r.jsonl"))
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def test_report_path_in_a_folder_without_write_permission(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes through mode bits; the read-only mount test covers this")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        assert "may not create files in" in _report_path_error(str(locked / "r.jsonl"))
    finally:
        locked.chmod(0o700)


def test_a_report_path_that_cannot_be_opened_fails_initialize_before_the_model_is_touched(tmp_path):
    path = tmp_path / "r.jsonl"
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2000, report_path=path, cpu_memory="1MiB",
                              nvme_dir=nvme)
    path.mkdir()  # made a folder after the config was made: initialize's check tells
    model = GPT(TINY)
    params = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=rf"GeminiConfig\.report_path={re.escape(repr(path))} is invalid: .*folder"):
        gemini.initialize(model, cfg)
    assert os.listdir(nvme) == []  # no NVMe store was opened
    for name, p in model.named_parameters():
        assert p is params[name][0] and torch.equal(p, params[name][1])  # not moved into chunks
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())  # not wrapped


# ------------------------------------------------------------------------------- nvme_dir
def test_an_empty_nvme_dir_is_named_as_given():
    with pytest.raises(ValueError, match=r"GeminiConfig\.nvme_dir='' is invalid: expected None or the path of an "
                                         r"existing folder \(an empty string names no folder"):
        gemini.GeminiConfig(nvme_dir="")


def test_an_nvme_dir_nothing_will_use_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match=r"GeminiConfig\.nvme_dir=.* will not be used: with cpu_memory=None .* and "
                                         r"nvme_offload_fraction=0 .*set cpu_memory .* or nvme_offload_fraction > 0"):
        gemini.GeminiConfig(nvme_dir=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gemini.GeminiConfig(nvme_dir=tmp_path, cpu_memory="1GiB")
        gemini.GeminiConfig(nvme_dir=tmp_path, nvme_offload_fraction=0.5)
        gemini.GeminiConfig()


def test_loss_scaler_fields_under_another_precision_are_warned_about_at_initialize():
    """The loss scaler runs under fp16 only: ``initial_scale=1024`` with bf16 was ignored without a
    word (the docs promise a warning for settings with no effect). Warned at initialize, where
    the precision is final (GeminiTrainer sets it from its fp16/bf16 arguments)."""
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu", precision="bf16", initial_scale=1024.0)
    with pytest.warns(UserWarning, match=r"GeminiConfig.initial_scale=1024.0 will not be used.*precision is 'bf16'"):
        gemini.initialize(torch.nn.Linear(2, 2), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        gemini.initialize(torch.nn.Linear(2, 2), dataclasses.replace(cfg, precision="fp16"))
        gemini.initialize(torch.nn.Linear(2, 2), gemini.GeminiConfig(device="cpu", placement="cpu", precision="bf16"))
