"""state_dicts: original keys, torch AdamW's format, and resume == uninterrupted; checkpoint
files: loaded without running code, verified, written durably and all or nothing."""

from __future__ import annotations

import copy
import errno
import os
import pathlib
import pickle
import re
import shutil
import socket
import subprocess
import sys
import zlib

import pytest
import torch

import gemini
from gemini.checkpoint import CheckpointCorruptionError, CheckpointDiskFullError
from gemini.tools.gpt import GPT
from helpers import (DEVICE, STATE_CUDA_ATOL, TINY, assert_params_close, batches, clone_pair, cpu_copy, make_gpt,
                     tolerance, train_reference)


def _run(gmodel, opt, data):
    for x, y in data:
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("placement", ["cuda", "cpu"])
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_save_reload_continue_equals_uninterrupted(placement, precision, tmp_path):
    data = batches(TINY, 8)
    cfg = lambda: gemini.GeminiConfig(device=DEVICE, placement=placement, precision=precision, chunk_size=3000,
                                      initial_scale=2.0**10, growth_interval=2)
    groups = lambda m: [{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                        {"params": [p for p in m.parameters() if p.dim() < 2], "lr": 5e-3}]
    m = make_gpt()
    full_model, full_opt = gemini.initialize(m, cfg(), lr=1e-2, param_groups=groups(m))
    _run(full_model, full_opt, data)

    m = make_gpt()
    first, first_opt = gemini.initialize(m, cfg(), lr=1e-2, param_groups=groups(m))
    _run(first, first_opt, data[:4])
    torch.save({"model": first.state_dict(), "optim": first_opt.state_dict()}, tmp_path / "ckpt.pt")
    del first, first_opt

    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = make_gpt(seed=123)  # different initial values: everything must come from the file
    fresh.load_state_dict(ckpt["model"])  # a plain module loads it
    resumed, resumed_opt = gemini.initialize(fresh, cfg(), lr=1e-2, param_groups=groups(fresh))
    resumed_opt.load_state_dict(ckpt["optim"])
    _run(resumed, resumed_opt, data[4:])
    assert_params_close(resumed.state_dict(), full_model.state_dict(), rtol=0, atol=0)
    assert resumed_opt.loss_scale == full_opt.loss_scale
    # The resumed run's reports go on numbering the run's steps (skipped fp16 ones included).
    assert resumed_opt.report.step == full_opt.report.step == len(data) - 1
    sd_a, sd_b = resumed_opt.state_dict(), full_opt.state_dict()
    assert sd_a["state"].keys() == sd_b["state"].keys()
    for k in sd_b["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd_a["state"][k][name], sd_b["state"][k][name])


def test_load_into_wrapped_model_after_initialize():
    data = batches(TINY, 2)
    src, src_opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=3000))
    _run(src, src_opt, data)
    dst, _ = gemini.initialize(make_gpt(seed=7), gemini.GeminiConfig(device=DEVICE, placement="cuda", chunk_size=5000))
    dst.load_state_dict(src.state_dict())
    assert_params_close(dst.state_dict(), src.state_dict(), rtol=0, atol=0)
    x, _ = data[0]
    with torch.no_grad():
        torch.testing.assert_close(dst(x), src(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="missing keys"):
        dst.load_state_dict({"wte.weight": torch.zeros(256, 32)})


def test_state_dicts_match_plain_pytorch():
    """The model keys/values and the optimizer state equal torch's own after the same training."""
    data = batches(TINY, 4)
    ref = make_gpt()
    _, _, ref_opt = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    gmodel, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=3000),
                                    lr=1e-2, weight_decay=0.1)
    _run(gmodel, opt, data)
    ours, theirs = gmodel.state_dict(), ref.state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in theirs)
    assert_params_close(ours, theirs)
    sd, ref_sd = opt.state_dict(), cpu_copy(ref_opt.state_dict())
    assert sd["state"].keys() == ref_sd["state"].keys()
    for i in ref_sd["state"]:
        assert float(sd["state"][i]["step"]) == float(ref_sd["state"][i]["step"])
        for name in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(sd["state"][i][name], ref_sd["state"][i][name],
                                       **tolerance(1e-6, 1e-9, cuda_atol=STATE_CUDA_ATOL))
    # The plain model loads gemini's state_dict and computes the same thing.
    plain = make_gpt(seed=99)
    plain.load_state_dict(ours)
    plain.to(DEVICE)
    x, _ = data[0]
    with torch.no_grad():
        torch.testing.assert_close(plain(x), gmodel(x))
    # Going on from torch's state, the reports number the steps from the updates it counted.
    resumed, resumed_opt = gemini.initialize(plain, gemini.GeminiConfig(device=DEVICE, placement="cpu",
                                                                        chunk_size=3000), lr=1e-2, weight_decay=0.1)
    resumed_opt.load_state_dict(ref_opt.state_dict())
    _run(resumed, resumed_opt, data[:1])
    assert resumed_opt.report.step == len(data)


@pytest.mark.parametrize("placement", ["cpu", "cuda"])
def test_load_state_lacking_parameters_resets_them_like_torch(placement):
    """A state_dict without some parameters' entries: torch's AdamW drops those parameters' old
    state (they start again at step 0), so gemini, which had trained them, must too."""
    data = batches(TINY, 5)
    ref, base = clone_pair()
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)  # our arithmetic
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=3000),
                                    lr=1e-2, weight_decay=0.1)

    def both_step(x, y):
        GPT.loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        _run(gmodel, opt, [(x, y)])

    both_step(*data[0])
    saved = copy.deepcopy(ref_opt.state_dict())  # after 1 step; both optimizers go on to step 3
    n = len(saved["param_groups"][0]["params"])
    missing = {i for i in range(n) if i % 3 == 1}
    for i in missing:
        del saved["state"][i]
    for x, y in data[1:3]:
        both_step(x, y)
    ref_opt.load_state_dict(copy.deepcopy(saved))
    opt.load_state_dict(copy.deepcopy(saved))

    def assert_same_state():
        ours, theirs = opt.state_dict()["state"], cpu_copy(ref_opt.state_dict()["state"])
        assert sorted(ours) == sorted(theirs)
        for i in theirs:
            assert float(ours[i]["step"]) == float(theirs[i]["step"]), i
            for name in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours[i][name], theirs[i][name],
                                           **tolerance(1e-6, 1e-9, cuda_atol=STATE_CUDA_ATOL),
                                           msg=lambda m: f"param {i} {name}: {m}")

    assert_same_state()
    assert missing.isdisjoint(opt.state_dict()["state"])  # no stale step / m / v survived the load
    for step, (x, y) in enumerate(data[3:], start=3):
        both_step(x, y)
        assert_params_close(gmodel.state_dict(), ref.state_dict(), rtol=1e-6, atol=1e-7, step=step)
    assert_same_state()
    assert {float(opt.state_dict()["state"][i]["step"]) for i in missing} == {2.0}  # fresh at the load


# ------------------------------------------------------------------------- checkpoint files
def _trained(precision: str = "fp32", steps: int = 2):
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", precision=precision, chunk_size=3000,
                              initial_scale=2.0**10, growth_interval=1)
    gmodel, opt = gemini.initialize(make_gpt(), cfg, lr=1e-2, weight_decay=0.1)
    _run(gmodel, opt, batches(TINY, steps))
    return gmodel, opt


def _fresh(precision: str = "fp32"):
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", precision=precision, chunk_size=3000,
                              initial_scale=2.0**10, growth_interval=1)
    return gemini.initialize(make_gpt(seed=5), cfg, lr=1e-2, weight_decay=0.1)


def _saved_file(path: pathlib.Path, sharded: bool) -> pathlib.Path:
    return path / "rank00000-of-00001.pt" if sharded else path


def _leaf_tensors(obj, where=""):
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaf_tensors(v, f"{where}/{k}" if where else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaf_tensors(v, f"{where}/{i}" if where else str(i))


@pytest.mark.parametrize("sharded", [False, True], ids=["consolidated", "sharded"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_checkpoint_is_plain_data_with_checksums_and_round_trips(precision, sharded, tmp_path):
    """What gemini writes loads with torch.load(weights_only=True), carries a CRC-32 of every
    tensor, and restores the model, the optimizer and the fp16 loss scaler."""
    gmodel, opt = _trained(precision)
    path = tmp_path / ("sharded" if sharded else "ckpt.pt")
    gemini.save_checkpoint(path, gmodel, opt, sharded=sharded)
    raw = torch.load(_saved_file(path, sharded), weights_only=True)  # no allow-listing needed
    sums = raw.pop("checksums")
    tensors = dict(_leaf_tensors(raw))
    assert sums.keys() == tensors.keys() and len(tensors) > 20
    for where, t in tensors.items():  # numpy's bytes, not gemini's byte_view: an independent CRC
        assert sums[where] == zlib.crc32(t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()), where
    if precision == "fp16":
        assert raw["optimizer"]["gemini"]["loss_scaler"] == opt.scaler.state_dict()

    model2, opt2 = _fresh(precision)
    gemini.load_checkpoint(path, model2, opt2, sharded=sharded)
    assert_params_close(model2.state_dict(), gmodel.state_dict(), rtol=0, atol=0)
    assert opt2.loss_scale == opt.loss_scale
    if precision == "fp16":
        assert opt2.scaler.state_dict() == opt.scaler.state_dict()
    want, got = opt.state_dict(), opt2.state_dict()
    assert got["state"].keys() == want["state"].keys()
    for i in want["state"]:
        for name in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][i][name], want["state"][i][name]), (i, name)


class _TouchesAFile:
    """Unpickling this calls Path.touch(marker): it stands for any code a file could run."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (self.marker,))


@pytest.mark.parametrize("sharded", [False, True], ids=["consolidated", "sharded"])
def test_loading_never_runs_code_from_the_file(sharded, tmp_path):
    gmodel, opt = _fresh()
    marker = tmp_path / "marker"
    path = tmp_path / ("sharded" if sharded else "ckpt.pt")
    file = _saved_file(path, sharded)
    file.parent.mkdir(exist_ok=True)
    payload = ({"buffers": {}, "optimizer": opt.sharded_state_dict()} if sharded
               else {"model": gmodel.state_dict(), "optimizer": opt.state_dict()})
    payload["extra"] = _TouchesAFile(marker)
    torch.save(payload, file)
    before = {k: v.clone() for k, v in gmodel.state_dict().items()}
    with pytest.raises(pickle.UnpicklingError, match=re.escape(str(file)) + ".*weights_only=True"):
        gemini.load_checkpoint(path, gmodel, opt, sharded=sharded)
    assert not marker.exists()
    assert_params_close(gmodel.state_dict(), before, rtol=0, atol=0)
    # The premise: an unrestricted unpickler does run it.
    torch.load(file, weights_only=False)
    assert marker.exists()


def test_save_refuses_values_that_would_not_load_safely(tmp_path):
    np = pytest.importorskip("numpy")
    gmodel, opt = _trained(steps=1)
    opt.param_groups[0]["lr"] = np.float64(3e-3)  # a numpy scalar is stored as a Python float
    gemini.save_checkpoint(tmp_path / "ok.pt", gmodel, opt)
    lr = torch.load(tmp_path / "ok.pt", weights_only=True)["optimizer"]["param_groups"][0]["lr"]
    assert type(lr) is float and lr == 3e-3
    opt.param_groups[0]["note"] = _TouchesAFile(tmp_path / "marker")
    with pytest.raises(TypeError, match="optimizer/param_groups/0/note.*_TouchesAFile"):
        gemini.save_checkpoint(tmp_path / "bad.pt", gmodel, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.pt"]


def test_flipped_byte_in_a_tensor_is_caught_on_load(tmp_path):
    gmodel, opt = _trained()
    path = tmp_path / "ckpt.pt"
    gemini.save_checkpoint(path, gmodel, opt)
    index = 3
    target = opt.state_dict()["state"][index]["exp_avg_sq"]
    data = bytearray(path.read_bytes())
    at = data.find(target.numpy().tobytes())
    assert at > 0 and data.find(target.numpy().tobytes(), at + 1) == -1  # the record, found once
    data[at + target.nbytes // 2] ^= 0x40
    path.write_bytes(bytes(data))
    # torch reads the damaged record without complaint (it does not check the zip's CRCs)...
    assert not torch.equal(torch.load(path, weights_only=True)["optimizer"]["state"][index]["exp_avg_sq"], target)
    model2, opt2 = _fresh()
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(CheckpointCorruptionError, match=f"{re.escape(str(path))}.*'optimizer/state/{index}/exp_avg_sq'"):
        gemini.load_checkpoint(path, model2, opt2)
    assert_params_close(model2.state_dict(), before, rtol=0, atol=0)  # checked before anything loads
    assert opt2.state_dict()["state"] == {}


def test_old_checkpoint_without_checksums_loads(tmp_path):
    gmodel, opt = _trained(steps=1)
    torch.save({"model": gmodel.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "old.pt")
    model2, opt2 = _fresh()
    gemini.load_checkpoint(tmp_path / "old.pt", model2, opt2)
    assert_params_close(model2.state_dict(), gmodel.state_dict(), rtol=0, atol=0)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd to name an fd's file")
def test_save_fsyncs_the_file_then_renames_then_fsyncs_the_folder(tmp_path, monkeypatch):
    gmodel, opt = _trained(steps=1)
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.fspath(src), os.fspath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    path = tmp_path / "ckpt.pt"
    gemini.save_checkpoint(path, gmodel, opt)
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"], events
    tmp = events[0][1]
    assert os.path.dirname(tmp) == str(tmp_path) and os.path.basename(tmp).startswith("ckpt.pt.gemini-tmp.")
    assert events[1] == ("replace", tmp, str(path))
    assert events[2] == ("fsync", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_failed_save_leaves_no_temp_and_the_previous_checkpoint(tmp_path, monkeypatch):
    gmodel, opt = _trained(steps=1)
    path = tmp_path / "ckpt.pt"
    gemini.save_checkpoint(path, gmodel, opt)
    previous = path.read_bytes()
    _run(gmodel, opt, batches(TINY, 1, seed=9))

    def half_then_fail(obj, f, *args, **kwargs):
        f.write(previous[: len(previous) // 2])
        raise RuntimeError("simulated failure half-way through torch.save")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(RuntimeError, match="simulated failure"):
        gemini.save_checkpoint(path, gmodel, opt)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pt"]
    assert path.read_bytes() == previous
    gemini.load_checkpoint(path, *_fresh())


def test_save_sweeps_temps_of_dead_writers_only(tmp_path):
    gmodel, opt = _trained(steps=1)
    host = socket.gethostname()
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(done.stdout)  # exited and reaped
    names = {"dead": f"ckpt.pt.gemini-tmp.{host}.{dead}",
             "live": f"other.pt.gemini-tmp.{host}.{os.getpid()}",  # another writer in this live process
             "elsewhere": f"ckpt.pt.gemini-tmp.another-host.{dead}",  # a pid of another machine says nothing
             "unrelated": f"notes.tmp.{dead}"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"partial")
    gemini.save_checkpoint(tmp_path / "ckpt.pt", gmodel, opt)
    left = set(os.listdir(tmp_path))
    assert names["dead"] not in left
    assert {names["live"], names["elsewhere"], names["unrelated"], "ckpt.pt"} == left


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mounts a tmpfs")
def test_full_disk_is_a_clear_error_and_keeps_the_previous_checkpoint(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a 256 KiB tmpfs (needs root): {mounted.stderr.strip()}")
    try:
        gmodel, opt = _fresh()
        path = mnt / "ckpt.pt"
        gemini.save_checkpoint(path, gmodel, opt)  # parameters only (no optimizer state yet): fits
        previous = path.read_bytes()
        _run(gmodel, opt, batches(TINY, 1))  # now m and v too: three times the bytes
        state = {"model": gmodel.state_dict(), "optimizer": opt.state_dict()}
        needed = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for _, t in _leaf_tensors(state)}.values())
        with pytest.raises(CheckpointDiskFullError) as caught:
            gemini.save_checkpoint(path, gmodel, opt)
        err = caught.value
        free = shutil.disk_usage(mnt).free
        assert isinstance(err, OSError) and err.errno == errno.ENOSPC
        assert (err.needed_bytes, err.free_bytes) == (needed, free) and needed > free
        assert f"disk full: {needed - free} bytes short" in str(err) and str(path) in str(err)
        assert sorted(os.listdir(mnt)) == ["ckpt.pt"]
        assert path.read_bytes() == previous
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mnt)], check=False)  # a file still open: detach anyway


def test_an_optimizer_state_that_does_not_fit_leaves_the_model_as_it_was(tmp_path):
    """All or nothing: the optimizer state is checked before the model's weights are loaded."""
    gmodel, opt = _trained(steps=1)
    path = tmp_path / "ckpt.pt"
    gemini.save_checkpoint(path, gmodel, opt)
    model2 = make_gpt(seed=1)
    model2, opt2 = gemini.initialize(model2, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000),
                                     lr=1e-2, param_groups=[{"params": [model2.ln_f.weight], "lr": 1e-3}])
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(ValueError, match=r"optimizer state has 1 param group\(s\), this optimizer 2"):
        gemini.load_checkpoint(path, model2, opt2)
    assert_params_close(model2.state_dict(), before, rtol=0, atol=0)


def test_a_checkpoint_of_another_model_names_its_keys_with_the_optimizer_given(tmp_path):
    """Another model's checkpoint (a layer more) loaded with the optimizer: the error named only
    the optimizer's parameter counts ("the state has 40 parameters, this optimizer 28"); the
    model is checked first now, and its error names the keys. Nothing changes."""
    from gemini.tools.gpt import GPTConfig

    bigger = GPT(GPTConfig(**{**TINY.__dict__, "n_layer": TINY.n_layer + 1}))
    gmodel, opt = gemini.initialize(bigger, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=3000),
                                    lr=1e-2)
    _run(gmodel, opt, batches(TINY, 1))
    gemini.save_checkpoint(tmp_path / "ckpt.pt", gmodel, opt)
    model2, opt2 = _fresh()
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(RuntimeError, match=rf"unexpected keys \['blocks\.{TINY.n_layer}\."):
        gemini.load_checkpoint(tmp_path / "ckpt.pt", model2, opt2)
    assert_params_close(model2.state_dict(), before, rtol=0, atol=0)
    assert opt2.state_dict()["state"] == {}


def test_a_file_loaded_as_sharded_and_a_folder_as_whole_are_named(tmp_path):
    gmodel, opt = _trained(steps=1)
    gemini.save_checkpoint(tmp_path / "whole.pt", gmodel, opt)
    gemini.save_checkpoint(tmp_path / "shards", gmodel, opt, sharded=True)
    with pytest.raises(ValueError, match="that is a file; sharded=True reads the folder"):
        gemini.load_checkpoint(tmp_path / "whole.pt", gmodel, opt, sharded=True)
    with pytest.raises(ValueError, match="that is a folder; a sharded checkpoint .* loads with sharded=True"):
        gemini.load_checkpoint(tmp_path / "shards", gmodel, opt)
