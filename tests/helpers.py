"""Training loops shared by the integration tests: the same model and data, two optimizers.

``DEVICE`` is the compute device the tests train on: the CPU standing in for it (the default),
or CUDA with ``GEMINI_TEST_DEVICE=cuda``. Data from :func:`batches` is made on the CPU from a
seeded generator and then moved there, so that both devices see the same values; the plain
PyTorch reference runs where its data is; snapshots are taken on the CPU (where gemini's
``state_dict()`` puts them), so that comparisons never mix devices.
"""

from __future__ import annotations

import copy
import os
import re

import torch

import gemini
import gemini.engine.hooks
from chunks import ChunkManager, ChunkState, Tier
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch

DEVICE_ENV = "GEMINI_TEST_DEVICE"
DEVICES = ("cpu", "cuda")


def device_from_env() -> str:
    """The compute device named by GEMINI_TEST_DEVICE: "cpu" (the default) or "cuda"."""
    value = os.environ.get(DEVICE_ENV, "cpu")
    if value not in DEVICES:
        raise ValueError(f"{DEVICE_ENV}={value!r} is invalid: expected one of {', '.join(map(repr, DEVICES))} "
                         f"(unset means 'cpu')")
    return value


DEVICE = device_from_env()

# [Note: a GPU's parameter moves, emulated]
# On a GPU, ``p.data`` of an offloaded parameter moves between the device copy (a CUDA tensor) and
# the host copy or a released stand-in (CPU tensors), and each move across devices drops the
# AccumulateGrad node the tensor caches (torch's ``VariableHooks::set_data``); on the CPU stand-in
# both copies are CPU tensors and the cache stays. ``GEMINI_TEST_MOVES=gpu`` runs the whole suite
# with every re-point across what would be devices dropping the cache the same way
# (:func:`emulate_gpu_moves`; tests/test_device_moves.py's fixture does it per test), so what a GPU
# does to autograd can be checked without one. ``MOVES_DROP_ACCUMULATORS`` says whether this run
# moves parameters that way (a GPU, or the emulation): tests of what that costs ask it.
MOVES_ENV = "GEMINI_TEST_MOVES"
_moves = os.environ.get(MOVES_ENV, "standin")
if _moves not in ("standin", "gpu"):
    raise ValueError(f"{MOVES_ENV}={_moves!r} is invalid: expected 'standin' (the default) or 'gpu'")
EMULATED_GPU_MOVES = _moves == "gpu" and DEVICE == "cpu"
MOVES_DROP_ACCUMULATORS = DEVICE == "cuda" or EMULATED_GPU_MOVES


def emulate_gpu_moves(patch) -> None:
    """Make ``ChunkManager.repoint`` drop a parameter's cached accumulator whenever a GPU would
    have moved ``p.data`` to the other device, and the engine act as on a GPU (``patch``: a
    ``pytest.MonkeyPatch``; see [Note: a GPU's parameter moves, emulated])."""
    where: dict[int, str] = {}
    repoint = ChunkManager.repoint

    def repoint_across_devices(self, chunk):
        on_device = chunk.state is not ChunkState.RELEASED and chunk.primary_tier is Tier.DEVICE
        for p in self.groups[chunk.index].params:
            before, where[id(p)] = where.get(id(p)), "device" if on_device else "host"
            if before not in (None, where[id(p)]) and p.requires_grad:
                # Another type: the cache goes, as on a move; repoint then sets the new view. (Reading
                # p.data here would be a read of p to the engine's search for parameters read.)
                p.data = torch.empty(0, dtype=torch.float64)
        repoint(self, chunk)

    patch.setattr(ChunkManager, "repoint", repoint_across_devices)
    patch.setattr(gemini.engine.hooks, "moves_drop_accumulators", lambda device: True)

TINY = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def roomy_budget(cpu_budget: int | str) -> int | str:
    """A device budget that holds everything a tiny test model needs: ``cpu_budget`` on the CPU
    stand-in; on CUDA 1 GiB, since what the CUDA libraries keep on the device counts there too
    (cuBLAS's workspace alone is 32 MiB on Hopper)."""
    return cpu_budget if DEVICE == "cpu" else "1GiB"


def make_gpt(cfg: GPTConfig = TINY, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def batches(cfg: GPTConfig, n: int, *, batch: int = 4, seq: int = 32, seed: int = 1, device: str | None = None):
    """``n`` (input, target) pairs on ``device`` (DEVICE by default), the same values on every device."""
    g = torch.Generator().manual_seed(seed)
    return [synthetic_batch(cfg, batch, seq, generator=g, device=DEVICE if device is None else device)
            for _ in range(n)]


def cpu_copy(state: dict) -> dict:
    """A state_dict's tensors copied to the CPU (``torch.optim`` state dicts: nested too)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: cpu_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cpu_copy(v) for v in state)
    return copy.deepcopy(state)


def train_reference(model, data, *, micro_batches: int = 1, clip: float = 0.0, param_groups=None, **adamw):
    """Plain PyTorch: AdamW over the model's parameters, on the device of ``data`` (the model is
    moved there). Returns (losses, params per step on the CPU, optimizer)."""
    model.to(data[0][0].device)
    groups = param_groups(model) if param_groups else model.parameters()
    opt = torch.optim.AdamW(groups, fused=True, **adamw)
    losses, snapshots = [], []
    for i in range(0, len(data), micro_batches):
        total = 0.0
        for x, y in data[i : i + micro_batches]:
            loss = GPT.loss(model(x), y) / micro_batches
            loss.backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        losses.append(total)
        snapshots.append({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
    return losses, snapshots, opt


def step_both(ref, ref_opt, gmodel, opt, loss_of, x, y) -> None:
    """One training step on batch (x, y) of the reference with its torch optimizer and of the
    model gemini.initialize gave, each through ``loss_of(model, x, y)``."""
    loss_of(ref, x, y).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    opt.backward(loss_of(gmodel, x, y))
    opt.step()
    opt.zero_grad()


def train_gemini(model, data, config: gemini.GeminiConfig, *, micro_batches: int = 1, param_groups=None, **adamw):
    """The same loop through gemini.initialize. Returns (losses, params per step, model, optimizer)."""
    groups = param_groups(model) if param_groups else None
    gmodel, opt = gemini.initialize(model, config, param_groups=groups, **adamw)
    losses, snapshots = [], []
    for i in range(0, len(data), micro_batches):
        total = 0.0
        for x, y in data[i : i + micro_batches]:
            loss = GPT.loss(gmodel(x), y) / micro_batches
            opt.backward(loss)
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
        snapshots.append(gmodel.state_dict())
    return losses, snapshots, gmodel, opt


# [Note: equal to torch on a GPU]
# On the CPU gemini's training is bit-identical to fused AdamW. On a GPU it is not, and neither
# is plain torch against itself: cuBLAS chooses a matrix product's kernel by the alignment of its
# operands, and a parameter that is a view into a chunk lies at another alignment than one
# allocated alone. Measured on an H200 (scripts/gpu_diag.py, 2026-11-26): the tiny GPT trained by
# fused AdamW for 3 steps at lr 1e-2, once with standalone parameters and once with every
# parameter a view at an odd offset of one flat buffer, differed in all 29 tensors, by up to
# 2.1e-5 on the attention's key bias, whose gradient is rounding noise only (softmax ignores a
# bias added to every key) and which Adam's normalisation turns into steps of the learning
# rate's order. Gemini against torch differed by less (9.6e-6). So on CUDA the comparisons allow
# that much: a few thousandths of the learning rate, far below what a wrong step would change.
CUDA_RTOL, CUDA_ATOL = 1e-3, 2e-4


def tolerance(rtol: float, atol: float, *, cuda_atol: float = CUDA_ATOL) -> dict[str, float]:
    """``torch.testing.assert_close``'s bounds: these on the CPU; in a process that trained on
    CUDA (GEMINI_TEST_DEVICE=cuda, or a test marked cuda) at least CUDA_RTOL and ``cuda_atol``
    (see [Note: equal to torch on a GPU]; Adam's states, far smaller than the parameters, take
    STATE_CUDA_ATOL)."""
    if DEVICE == "cuda" or (torch.cuda.is_available() and torch.cuda.is_initialized()):
        rtol, atol = max(rtol, CUDA_RTOL), max(atol, cuda_atol)
    return dict(rtol=rtol, atol=atol)


# Adam's m and v on CUDA: the first GPU run's state differences were up to 1.2e-8 (exp_avg_sq of
# the tiny GPT, whose entries are 1e-9 to 1e-6).
STATE_CUDA_ATOL = 5e-8


# [Note: parameters whose gradient is rounding noise]
# Some parameters have a gradient that is zero but for rounding: a bias added to every key of an
# attention (softmax ignores it), a bias before BatchNorm (the mean it removes). Adam divides it
# by its own size, so it steps by the learning rate's order in a direction rounding picks. On the
# CPU both sides round alike. On a GPU, where gemini's Adam runs on the host (placement cpu, the
# host's groups under auto) against the reference's fused CUDA kernel, the two updates differ in
# the last bit, the next noise differs entirely, and these tensors drift apart by up to the
# learning rate (the fourth suite run on a GPU, 2026-11-27: 9.7e-3 at lr 1e-2 after 5 steps, in no other
# tensor). On CUDA they are compared to NOISE_CUDA_ATOL; their values move no loss.
NOISE_GRADIENT = re.compile(r"(attn\.qkv\.bias|in_proj_bias)$")
NOISE_CUDA_ATOL = 5e-2


def assert_params_close(got: dict, want: dict, *, rtol: float = 1e-6, atol: float = 1e-7, step: int | None = None,
                        noise: tuple[str, ...] = ()):
    """Every entry equal to :func:`tolerance` (``rtol``, ``atol``), compared on the CPU (a
    reference on the device against gemini's ``state_dict()``, which is on the CPU). Entries
    whose gradient is rounding noise (NOISE_GRADIENT, and those named in ``noise``) are held to
    NOISE_CUDA_ATOL on CUDA (see [Note: parameters whose gradient is rounding noise])."""
    assert got.keys() == want.keys(), f"keys differ: {set(got) ^ set(want)}"
    bounds = tolerance(rtol, atol)
    noisy = tolerance(rtol, atol, cuda_atol=NOISE_CUDA_ATOL)
    for k in want:
        b = noisy if k in noise or NOISE_GRADIENT.search(k) else bounds
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), **b, msg=lambda m: f"step {step}, {k}: {m}")


def clone_pair(cfg: GPTConfig = TINY, seed: int = 0):
    base = make_gpt(cfg, seed)
    return base, copy.deepcopy(base)


def placement_configs(model_data_bytes: int) -> dict[str, dict]:
    """GeminiConfig fields of each placement the loop tests run, chunks of 8192 elements;
    "auto-evicting"'s budget (model data / 2.5) is sized for the CPU stand-in's exact counting."""
    return {
        "cuda": dict(placement="cuda", chunk_size=8192),
        "cpu": dict(placement="cpu", chunk_size=8192),
        "static": dict(placement="static", chunk_size=8192, static_param_device_fraction=0.5,
                       static_optimizer_offload_fraction=0.5),
        "auto-evicting": dict(placement="auto", chunk_size=8192, device_memory=int(model_data_bytes / 2.5)),
    }


class FakeCudaAllocator:
    """CUDA's caching allocator stood in for, as gemini's monitors read it (one nested read of
    its counters, [Note: reading the allocator's counters] in tracer/memory_monitor.py): ``use``
    sets what is allocated and reserved, peaks follow, ``torch.cuda.reset_peak_memory_stats``
    resets them. ``torch.cuda.memory_stats`` (the flattening read, 100 us a call) raises, and
    ``reads`` counts the nested ones."""

    def __init__(self, monkeypatch) -> None:
        self.allocated = self.reserved = self.allocated_peak = self.reserved_peak = 0
        self.reads = 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", self._nested)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)
        monkeypatch.setattr(torch.cuda, "empty_cache", self._empty_cache)

        def flattening(device=None):
            raise AssertionError("torch.cuda.memory_stats (or memory_allocated and its kin) read per reading")
        monkeypatch.setattr(torch.cuda, "memory_stats", flattening)

    def use(self, allocated: int, reserved: int | None = None) -> None:
        self.allocated, self.reserved = allocated, max(allocated, self.reserved if reserved is None else reserved)
        self.allocated_peak = max(self.allocated_peak, self.allocated)
        self.reserved_peak = max(self.reserved_peak, self.reserved)

    def _nested(self, device=None) -> dict:
        self.reads += 1
        return {"allocated_bytes": {"all": {"current": self.allocated, "peak": self.allocated_peak}},
                "reserved_bytes": {"all": {"current": self.reserved, "peak": self.reserved_peak}}}

    def _reset(self, device=None) -> None:
        self.allocated_peak, self.reserved_peak = self.allocated, self.reserved

    def _empty_cache(self) -> None:  # every cached block given back
        self.reserved = self.allocated
