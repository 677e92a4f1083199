"""Meta init and streamed weights: ``initialize(meta_model, cfg, weights=...)`` and ``save_pretrained``.

References are independent of gemini: transformers' ``save_pretrained`` / ``from_pretrained``,
safetensors' own reader, plain ``torch.optim.AdamW`` (fused) on the ``from_pretrained`` model,
and ``reset_parameters`` on a model built for real.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, LlamaModel
from transformers.utils import logging as hf_logging

import gemini
from chunks import ChunkManager, ChunkState
from gemini.engine.nvme_tier import NvmeTier
from gemini.pretrained import SafetensorsCheckpoint, WeightsError, load_pretrained_into
from helpers import DEVICE, tolerance

hf_logging.disable_progress_bar()

CHUNK = 12_000  # elements: the tiny Llama (~100k parameters) spans ~10 chunk groups
LR, WD = 1e-2, 0.1


def _llama_config(tie: bool) -> LlamaConfig:
    return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=128, tie_word_embeddings=tie)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """HF checkpoints written by transformers: (tied, sharded) -> folder."""
    out = {}
    for tie in (True, False):
        torch.manual_seed(0)
        model = LlamaForCausalLM(_llama_config(tie))
        for sharded in (False, True):
            folder = tmp_path_factory.mktemp(f"llama-tie{int(tie)}-shard{int(sharded)}")
            model.save_pretrained(folder, max_shard_size="60KB" if sharded else "5GB")
            assert (folder / "model.safetensors.index.json").exists() == sharded
            out[tie, sharded] = folder
    return out


def _meta_llama(folder) -> LlamaForCausalLM:
    config = LlamaConfig.from_pretrained(folder)
    with init_empty_weights():
        return LlamaForCausalLM(config)


def _reference(folder) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 128, (2, 16), generator=g).to(DEVICE) for _ in range(n)]


def _train(model, opt, data, *, gemini_opt: bool):
    """Per step, the model's state_dict in fp32 on the CPU."""
    snapshots = []
    for x in data:
        loss = model(input_ids=x, labels=x).loss
        opt.backward(loss) if gemini_opt else loss.backward()
        opt.step()
        opt.zero_grad()
        snapshots.append({k: v.detach().to("cpu", torch.float32, copy=True) for k, v in model.state_dict().items()})
    return snapshots


def _assert_state_equal(got: dict, want: dict, *, rtol=0.0, atol=0.0, what=""):
    """Equal entries, compared on the CPU (gemini's state_dict is there; a reference may not be)."""
    assert got.keys() == want.keys(), f"{what}: keys differ: {set(got) ^ set(want)}"
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), **tolerance(rtol, atol),
                                   msg=lambda m: f"{what} {k}: {m}")


def _assert_params_in_chunks(gmodel):
    """Every parameter is real and its .data a view of its param chunk's primary copy."""
    manager = gmodel._runtime.manager
    for name, p in gmodel.module.named_parameters():
        assert not p.is_meta, name
        group, slot = manager.locate(p)
        chunk = group.param
        assert chunk.state is not ChunkState.RELEASED
        assert p.data_ptr() == chunk.view(slot).data_ptr(), f"{name} is not a view of its chunk"


PLACEMENTS = {
    "cpu": dict(placement="cpu"),
    "cuda": dict(placement="cuda"),
    "auto": dict(placement="auto", device_memory="1MiB"),
}


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_meta_model_loads_what_from_pretrained_loads(checkpoints, placement, tie, sharded):
    folder = checkpoints[tie, sharded]
    ref = _reference(folder)
    model = _meta_llama(folder)
    assert all(p.is_meta for p in model.parameters())
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, chunk_size=CHUNK, **PLACEMENTS[placement]),
                                    weights=folder)
    _assert_state_equal(gmodel.state_dict(), ref.state_dict(), what=placement)
    _assert_params_in_chunks(gmodel)
    # The non-persistent rotary buffer stayed as the constructor computed it.
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.cpu(), ref.model.rotary_emb.inv_freq, rtol=0, atol=0)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    manager = gmodel._runtime.manager
    if tie:
        assert embed is head and manager.locate(embed) == manager.locate(head)
    else:
        assert embed is not head and manager.locate(embed) != manager.locate(head)
    opt.close()


# auto-evicting's 600 KiB budget is sized for the CPU stand-in, which counts exactly the tensors
# alive; on CUDA the allocator's segments and cuBLAS's workspace alone exceed it.
@pytest.mark.parametrize("case", ["cpu-tied", "cuda-untied",
                                  pytest.param("auto-evicting-tied", marks=pytest.mark.standin), "nvme-untied"])
def test_trains_exactly_like_from_pretrained_with_adamw(checkpoints, tmp_path, case):
    tie = case.endswith("-tied")
    folder = checkpoints[tie, True]
    extra = {
        "cpu": dict(placement="cpu"),
        "cuda": dict(placement="cuda"),
        "auto": dict(placement="auto", device_memory="600KiB"),
        "nvme": dict(placement="cpu", cpu_memory="600KiB", nvme_dir=tmp_path, nvme_offload_fraction=0.5),
    }[case.split("-")[0]]
    data = _batches(3)
    ref = _reference(folder).to(DEVICE)
    want = _train(ref, torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD, fused=True), data, gemini_opt=False)
    model = _meta_llama(folder)
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, chunk_size=CHUNK, **extra),
                                    weights=folder, lr=LR, weight_decay=WD)
    got = _train(gmodel, opt, data, gemini_opt=True)
    for step, (g, w) in enumerate(zip(got, want)):
        _assert_state_equal(g, w, rtol=1e-6, atol=1e-7, what=f"{case} step {step}")
    if tie:  # one parameter, so after training the embedding and the head are still the same values
        assert model.lm_head.weight is model.model.embed_tokens.weight
        torch.testing.assert_close(got[-1]["lm_head.weight"], got[-1]["model.embed_tokens.weight"], rtol=0, atol=0)
    if case.startswith("auto"):
        assert opt._rt.residency.evictions > 0, "the budget was meant to force evictions"
    if case.startswith("nvme"):
        assert opt._rt.nvme.groups, "some optimizer states were meant to live on NVMe"
        assert opt.report.nvme_read_bytes > 0
    opt.close()


def test_bf16_with_masters_on_nvme_equals_initialize_on_from_pretrained(checkpoints, tmp_path):
    """Under bf16 the fp32 masters come from the file (written to NVMe as the groups are built)
    and the bf16 parameters from the same values: training equals gemini on the real model."""
    folder = checkpoints[True, False]
    data = _batches(3)

    def cfg(sub):
        (tmp_path / sub).mkdir()
        return gemini.GeminiConfig(device=DEVICE, placement="cpu", precision="bf16", chunk_size=CHUNK,
                                   cpu_memory="800KiB", nvme_dir=tmp_path / sub, nvme_offload_fraction=0.5)

    ref_model, ref_opt = gemini.initialize(_reference(folder), cfg("ref"), lr=LR, weight_decay=WD)
    model = _meta_llama(folder)
    gmodel, opt = gemini.initialize(model, cfg("meta"), weights=folder, lr=LR, weight_decay=WD)
    assert opt._rt.nvme.groups
    masters = [g for g in opt._rt.manager.trainable_groups if g.index in opt._rt.nvme.groups]
    assert masters and all(g.master.state is ChunkState.NVME for g in masters)
    _assert_state_equal(gmodel.state_dict(), ref_model.state_dict(), what="bf16 loaded")
    for p, q in zip(model.parameters(), ref_model.module.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    got = _train(gmodel, opt, data, gemini_opt=True)
    want = _train(ref_model, ref_opt, data, gemini_opt=True)
    for step, (g, w) in enumerate(zip(got, want)):
        _assert_state_equal(g, w, what=f"bf16 step {step}")
    opt.close(), ref_opt.close()


def test_weights_overwrite_a_real_model(checkpoints):
    folder = checkpoints[False, False]
    torch.manual_seed(123)
    model = LlamaForCausalLM(_llama_config(False))  # real, other values
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=CHUNK),
                                    weights=folder / "model.safetensors")
    _assert_state_equal(gmodel.state_dict(), _reference(folder).state_dict())


def test_frozen_parameters_load_into_their_chunks_too(tmp_path):
    torch.manual_seed(0)
    real = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    save_file(real.state_dict(), tmp_path / "w.safetensors")
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    model[0].requires_grad_(False)
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu", precision="bf16"),
                                    weights=tmp_path / "w.safetensors")
    assert not opt._rt.manager.groups[-1].trainable  # the frozen group: a param chunk and an fp32 copy
    _assert_state_equal(gmodel.state_dict(), real.state_dict())
    assert not model[0].weight.requires_grad and model[0].weight.dtype == torch.bfloat16
    assert torch.equal(model[0].weight.cpu(), real[0].weight.to(torch.bfloat16))


# ------------------------------------------------------------------------------------- errors
def _write_variant(folder, out, *, drop=(), add=None, reshape=None):
    """A copy of ``folder``'s single-file checkpoint with keys dropped, added or reshaped."""
    with safe_open(folder / "model.safetensors", "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    tensors.update(add or {})
    for k, shape in (reshape or {}).items():
        tensors[k] = torch.zeros(shape)
    save_file(tensors, out, metadata={"format": "pt"})
    return out


def test_missing_unexpected_and_mismatched_keys_are_all_named(checkpoints, tmp_path):
    folder = checkpoints[False, False]
    bad = _write_variant(folder, tmp_path / "bad.safetensors", drop=["model.norm.weight", "lm_head.weight"],
                         add={"model.extra.weight": torch.zeros(3)},
                         reshape={"model.layers.1.mlp.up_proj.weight": (4, 4)})
    model = _meta_llama(folder)
    with pytest.raises(WeightsError) as err:
        gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu"), weights=bad)
    msg = str(err.value)
    assert "missing keys ['model.norm.weight', 'lm_head.weight']" in msg
    assert "unexpected keys ['model.extra.weight']" in msg
    assert "model.layers.1.mlp.up_proj.weight: checkpoint [4, 4], model [128, 64]" in msg
    assert all(p.is_meta for p in model.parameters()), "nothing may change before the check"


def test_keys_that_differ_by_a_prefix_are_refused_with_a_hint(checkpoints, tmp_path):
    """Weights saved from the base model (LlamaModel: "layers.0...") for the model with a head
    (LlamaForCausalLM: "model.layers.0..."), or the reverse: transformers' from_pretrained adds
    or strips the prefix; gemini stays strict, and the error says which prefix differs."""
    folder = checkpoints[False, False]
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu")
    torch.manual_seed(0)
    saved = LlamaModel(_llama_config(False))
    saved.save_pretrained(tmp_path / "base")
    n = len(saved.state_dict())  # every key of the base model
    with pytest.raises(WeightsError, match=r"missing keys .*unexpected keys .*hint: the file's keys lack the prefix "
                                           rf"'model\.' the model's keys have \({n} of the {n} unexpected keys"):
        gemini.initialize(_meta_llama(folder), cfg, weights=tmp_path / "base")
    with init_empty_weights():
        base = LlamaModel(_llama_config(False))
    with pytest.raises(WeightsError, match=r"hint: the file's keys have the prefix 'model\.' the model's keys lack "
                                           rf"\({n} of the {n} missing keys"):
        gemini.initialize(base, cfg, weights=folder)
    # Keys that differ otherwise get no hint.
    other = _write_variant(folder, tmp_path / "other.safetensors", drop=["model.norm.weight"],
                           add={"norm.bias": torch.zeros(64)})
    with pytest.raises(WeightsError) as err:
        gemini.initialize(_meta_llama(folder), cfg, weights=other)
    assert "missing keys ['model.norm.weight']" in str(err.value) and "hint" not in str(err.value)


def test_a_tied_model_needs_one_of_the_tied_names_but_an_untied_one_needs_both(checkpoints):
    # The tied checkpoint has no lm_head.weight: fine for the tied model, missing for the untied one.
    tied_folder = checkpoints[True, False]
    with safe_open(tied_folder / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()
    with init_empty_weights():
        untied = LlamaForCausalLM(_llama_config(False))
    with pytest.raises(WeightsError, match=r"missing keys \['lm_head.weight'\]"):
        gemini.initialize(untied, gemini.GeminiConfig(device=DEVICE, placement="cpu"), weights=tied_folder)


def test_meta_buffers_load_from_the_file_or_are_named(tmp_path):
    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.register_buffer("scale", torch.full((4,), 2.0))
            self.register_buffer("table", torch.arange(4.0), persistent=False)

        def forward(self, x):
            return x * self.weight * self.scale + self.table

    with torch.device("meta"):
        model = Norm()
    save_file({"weight": torch.full((4,), 3.0), "scale": torch.full((4,), 5.0)}, tmp_path / "w.safetensors")
    with pytest.raises(WeightsError, match=r"non-persistent buffers on the meta device.*\['table'\]"):
        gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu"), weights=tmp_path / "w.safetensors")
    model.table = torch.arange(4.0)  # real now, as init_empty_weights(include_buffers=False) leaves buffers
    save_file({"weight": torch.full((4,), 3.0)}, tmp_path / "no-scale.safetensors")
    with pytest.raises(WeightsError, match=r"missing keys \['scale'\]"):
        gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu"),
                          weights=tmp_path / "no-scale.safetensors")
    gmodel, _ = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu"),
                                  weights=tmp_path / "w.safetensors")
    assert torch.equal(model.scale.cpu(), torch.full((4,), 5.0)) and not model.scale.is_meta
    assert torch.equal(gmodel(torch.ones(4, device=DEVICE)).cpu(), torch.full((4,), 15.0) + torch.arange(4.0))


def test_unreadable_weights_are_named(tmp_path):
    model = nn.Linear(2, 2, device="meta")
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu")
    with pytest.raises(WeightsError, match="does not exist"):
        gemini.initialize(model, cfg, weights=tmp_path / "nope.safetensors")
    with pytest.raises(WeightsError, match="neither model.safetensors.index.json nor model.safetensors"):
        gemini.initialize(model, cfg, weights=tmp_path)
    (tmp_path / "junk.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    with pytest.raises(WeightsError, match="not a safetensors file"):
        gemini.initialize(model, cfg, weights=tmp_path / "junk.safetensors")


def test_a_meta_module_without_reset_parameters_is_named():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x * self.gain

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Scale(), nn.Sequential(nn.Linear(8, 8), Scale()))
    with pytest.raises(ValueError) as err:
        gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu"))
    msg = str(err.value)
    assert "1 (Scale) has parameters on the meta device and no reset_parameters()" in msg
    assert "2.1 (Scale)" in msg and "(Linear)" not in msg
    # A Hugging Face model's RMSNorm has no reset_parameters either: it needs weights.
    with init_empty_weights():
        llama = LlamaForCausalLM(_llama_config(False))
    with pytest.raises(ValueError, match=r"model.norm \(LlamaRMSNorm\).*weights="):
        gemini.initialize(llama, gemini.GeminiConfig(device=DEVICE, placement="cpu"))


# ----------------------------------------------------------------------------- without weights
def test_meta_sequential_is_initialized_by_reset_parameters_like_a_real_one():
    def build():
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 48), nn.LayerNorm(48), nn.Linear(48, 8))

    torch.manual_seed(7)
    real = build()
    torch.manual_seed(7)
    with torch.device("meta"):
        model = build()
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=1000),
                                    lr=LR, weight_decay=WD)
    assert len(opt._rt.manager.groups) > 3, "the modules were meant to span several chunk groups"
    _assert_params_in_chunks(gmodel)
    got = gmodel.state_dict()
    assert not any(v.isnan().any() for v in got.values())
    _assert_state_equal(got, real.state_dict(), what="reset_parameters")
    # and it trains like the real one
    real.to(DEVICE)
    ref_opt = torch.optim.AdamW(real.parameters(), lr=LR, weight_decay=WD, fused=True)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for _ in range(2):
        real(x).square().mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.backward(gmodel(x).square().mean())
        opt.step()
        opt.zero_grad()
    _assert_state_equal(gmodel.state_dict(), real.state_dict(), rtol=1e-6, atol=1e-7, what="trained")


# --------------------------------------------------------------------------- streaming, measured
def test_weights_are_read_group_by_group_just_before_each_group_is_built(checkpoints, tmp_path, monkeypatch):
    """Every tensor is read exactly once, while its own chunk group is being built, and the
    group is handed to the NVMe tier before the next one is read: the loader never holds more
    than one group's values (it would fail if the checkpoint were loaded first)."""
    folder = checkpoints[False, True]
    events = []
    read, build, admit = SafetensorsCheckpoint.read, ChunkManager._build_group, NvmeTier.admit

    def logged_read(self, key, start=0, stop=None):
        value = read(self, key, start, stop)
        events.append(("read", key, value.numel() * value.element_size()))
        return value

    def logged_build(self, slots, *args):
        events.append(("build", len(self.groups), tuple(s.name for s in slots)))
        build(self, slots, *args)
        events.append(("built", len(self.groups) - 1, None))

    def logged_admit(self, group):
        events.append(("admit", group.index, None))
        admit(self, group)

    monkeypatch.setattr(SafetensorsCheckpoint, "read", logged_read)
    monkeypatch.setattr(ChunkManager, "_build_group", logged_build)
    monkeypatch.setattr(NvmeTier, "admit", logged_admit)
    model = _meta_llama(folder)
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(
        device=DEVICE, placement="cpu", precision="bf16", chunk_size=CHUNK, cpu_memory="800KiB",
        nvme_dir=tmp_path, nvme_offload_fraction=1.0), weights=folder)
    groups = opt._rt.manager.groups
    assert len(groups) >= 8
    with safe_open(next(folder.glob("model-00001-of-*.safetensors")), "pt") as f:  # the file's dtype
        itemsize = f.get_tensor(next(iter(f.keys()))).element_size()
    reads_of: dict[int, list[str]] = {}
    current, read_keys = None, []
    for kind, what, extra in events:
        if kind == "build":
            current = what
            reads_of[what] = []
        elif kind == "read":
            assert current is not None, f"{what} was read before any chunk group was being built"
            reads_of[current].append(what)
            read_keys.append(what)
        elif kind == "built":
            current = None
        elif kind == "admit":  # built, then handed to the NVMe tier, before the next read
            assert events[events.index((kind, what, extra)) - 1] == ("built", what, None)
    assert sorted(read_keys) == sorted(set(read_keys)), "a tensor was read twice"
    for g in groups:
        assert reads_of[g.index] == [s.name for s in g.slots], f"group {g.index} read other tensors"
        group_bytes = sum(e[2] for e in events if e[0] == "read" and e[1] in reads_of[g.index])
        assert group_bytes == g.param.used_numel * itemsize <= g.param.capacity * itemsize
    trainable = [g for g in groups if g.trainable]
    assert all(g.master.state is ChunkState.NVME for g in trainable)
    _assert_state_equal(gmodel.state_dict(), _reference(folder).state_dict())
    opt.close()


def test_own_reader_equals_safetensors(checkpoints):
    folder = checkpoints[True, True]
    ckpt = SafetensorsCheckpoint(folder)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(ckpt.entries) == set(index)
    for key, file in index.items():
        with safe_open(folder / file, "pt") as f:
            want = f.get_tensor(key)
        assert torch.equal(ckpt.read(key).view(want.shape), want)
        flat = want.reshape(-1)
        lo, hi = flat.numel() // 3, flat.numel() - 1
        assert torch.equal(ckpt.read(key, lo, hi), flat[lo:hi])
    assert ckpt.bytes_read > 0
    ckpt.close()


# ----------------------------------------------------------------------------- save_pretrained
def _read_folder(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder, by safetensors' own reader."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_save_pretrained_streams_masters_from_nvme_into_shards_from_pretrained_loads(checkpoints, tmp_path):
    folder = checkpoints[True, False]
    model = _meta_llama(folder)
    (tmp_path / "nvme").mkdir()
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(
        device=DEVICE, placement="cpu", precision="bf16", chunk_size=CHUNK, cpu_memory="800KiB",
        nvme_dir=tmp_path / "nvme", nvme_offload_fraction=0.5), weights=folder, lr=LR)
    _train(gmodel, opt, _batches(1), gemini_opt=True)
    masters = gmodel.state_dict()
    reads_before = opt._rt.storage.nvme.stats().read_bytes

    out = tmp_path / "out"
    files = gemini.save_pretrained(gmodel, out, max_shard_size="80KB")
    assert len(files) > 2 and all(f.exists() for f in files)
    assert not list(out.glob("*.tmp*"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    on_disk = _read_folder(out)
    assert set(index["weight_map"]) == set(on_disk) == set(masters) - {"lm_head.weight"}  # tied: first name only
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in on_disk.values())
    for k, v in on_disk.items():  # the bytes on disk are the fp32 masters
        assert v.dtype == torch.float32 and torch.equal(v, masters[k]), k
        assert index["weight_map"][k] in {f.name for f in files}
    # Each NVMe-resident group's master was read once, and nothing else (not Adam's m and v).
    master_bytes = sum(opt._rt.manager.groups[i].master.nbytes for i in opt._rt.nvme.groups)
    assert master_bytes > 0
    assert opt._rt.storage.nvme.stats().read_bytes - reads_before == master_bytes

    loaded, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    _assert_state_equal(loaded.state_dict(), masters)
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"

    # Saved again as one file in bf16: the shards and the index go, the values are the masters in bf16.
    files = gemini.save_pretrained(gmodel, out, dtype=torch.bfloat16)
    assert [f.name for f in files] == ["model.safetensors"]
    assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
    on_disk = _read_folder(out)
    for k, v in on_disk.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, masters[k].to(torch.bfloat16)), k
    # ... and initialize reads it back into a fresh meta model.
    again, opt2 = gemini.initialize(_meta_llama(out), gemini.GeminiConfig(device=DEVICE, placement="cpu"), weights=out)
    _assert_state_equal(again.state_dict(), {k: v.to(torch.bfloat16).float() for k, v in masters.items()})
    opt.close(), opt2.close()


def test_load_pretrained_into_an_initialized_model_trains_like_one_initialized_from_it(checkpoints, tmp_path):
    """Resuming from a save: weights loaded into a running model (bf16, masters on NVMe) give the
    same state and the same next steps as a model initialized from that save."""
    folder = checkpoints[False, False]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()

    def cfg(sub):
        return gemini.GeminiConfig(device=DEVICE, placement="cpu", precision="bf16", chunk_size=CHUNK,
                                   cpu_memory="800KiB", nvme_dir=tmp_path / sub, nvme_offload_fraction=0.5)

    trained, opt = gemini.initialize(_meta_llama(folder), cfg("a"), weights=folder, lr=LR, weight_decay=WD)
    _train(trained, opt, _batches(2, seed=5), gemini_opt=True)
    gemini.save_pretrained(trained, tmp_path / "saved")
    want = trained.state_dict()
    opt.close()

    fresh, opt_b = gemini.initialize(_meta_llama(folder), cfg("b"), weights=folder, lr=LR, weight_decay=WD)
    load_pretrained_into(fresh, tmp_path / "saved")
    _assert_state_equal(fresh.state_dict(), want, what="loaded into")
    direct, opt_c = gemini.initialize(_meta_llama(folder), cfg("c"), weights=tmp_path / "saved", lr=LR,
                                      weight_decay=WD)
    for p, q in zip(fresh.module.parameters(), direct.module.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    data = _batches(2)
    for step, (g, w) in enumerate(zip(_train(fresh, opt_b, data, gemini_opt=True),
                                      _train(direct, opt_c, data, gemini_opt=True))):
        _assert_state_equal(g, w, what=f"step {step}")
    with pytest.raises(WeightsError, match=r"unexpected keys \['model.extra.weight'\]"):
        load_pretrained_into(fresh, _write_variant(folder, tmp_path / "bad.safetensors",
                                                   add={"model.extra.weight": torch.zeros(3)}))
    opt_b.close(), opt_c.close()


def test_save_pretrained_of_a_plain_module_and_its_buffers(tmp_path):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.norm = nn.BatchNorm1d(4)

        def forward(self, x):
            return self.norm(self.lin(x))

    torch.manual_seed(0)
    net = Net()
    want = {k: v.clone() for k, v in net.state_dict().items()}
    gmodel, opt = gemini.initialize(net, gemini.GeminiConfig(device=DEVICE, placement="cuda"))
    gemini.save_pretrained(gmodel, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no HF config to write
    on_disk = _read_folder(tmp_path)
    _assert_state_equal(on_disk, want)
    assert on_disk["norm.num_batches_tracked"].dtype == torch.int64
    with pytest.raises(TypeError, match="the model gemini.initialize returned"):
        gemini.save_pretrained(net, tmp_path)
    with pytest.raises(ValueError, match="dtype=torch.int32 is invalid"):
        gemini.save_pretrained(gmodel, tmp_path, dtype=torch.int32)


# ------------------------------------------------------------------------------------ ZeRO
def test_zero3_ranks_read_their_ranges_and_save_collectively(tmp_path):
    import pretrained_workers as pw
    from multiprocess import run_ranks

    torch.manual_seed(3)
    want = pw.zero_net().state_dict()
    save_file(want, tmp_path / "w.safetensors", metadata={"format": "pt"})
    save_file(pw.zero_net().state_dict(), tmp_path / "other.safetensors", metadata={"format": "pt"})
    run_ranks(pw.zero_load_and_save, str(tmp_path / "w.safetensors"), str(tmp_path / "out"),
              str(tmp_path / "other.safetensors"), timeout_seconds=120)
    _assert_state_equal(_read_folder(tmp_path / "out"), dict(want))
