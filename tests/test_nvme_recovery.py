"""Recovering from failures with optimizer states on NVMe: a failure before the step's stream, at
the warm-up's end, or while a checkpoint loads leaves every value as before it and no request in
flight, and what follows equals plain AdamW; the files outlive the optimizer while the model lives."""

from __future__ import annotations

import errno
import gc
import os
import shutil

import pytest
import torch

import gemini
import gemini.optim.hybrid_adam as hybrid_adam
from chunks.storage import ChunkStorage
from gemini.checkpoint import load_checkpoint, save_checkpoint
from gemini.tools.gpt import GPT
from helpers import (DEVICE, STATE_CUDA_ATOL, TINY, assert_params_close, batches, clone_pair, cpu_copy, roomy_budget,
                     tolerance, train_reference)
from offload import NvmeStoreError

LR = 1e-2


def _cfg(tmp_path, **kw) -> gemini.GeminiConfig:
    base = dict(device=DEVICE, placement="cpu", chunk_size=2000, nvme_dir=str(tmp_path))
    base.update(kw)
    return gemini.GeminiConfig(**base)


def _train(model, opt, data) -> None:
    for x, y in data:
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()


def _values(model, opt):
    return model.state_dict(), cpu_copy(opt.state_dict()["state"])


def _assert_equal(got, want, what: str) -> None:
    (params, state), (want_params, want_state) = got, want
    for name, w in want_params.items():
        assert torch.equal(params[name], w), f"{what}: {name}"
    assert state.keys() == want_state.keys(), what
    for i, entry in want_state.items():
        for key, w in entry.items():
            assert torch.equal(state[i][key], w), f"{what}: state {i} {key}"


def _assert_adamw(model, opt, ref, ref_opt) -> None:
    """Parameters and m, v, step of every parameter equal to plain AdamW's."""
    assert_params_close(model.state_dict(), {k: v.cpu() for k, v in ref.state_dict().items()})
    state = opt.state_dict()["state"]
    for i, p in enumerate(ref.parameters()):
        want = ref_opt.state[p]
        assert int(state[i]["step"]) == int(want["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[i][key], want[key].cpu(),
                                       **tolerance(1e-6, 1e-9, cuda_atol=STATE_CUDA_ATOL))


def _fail_in_prefetch(monkeypatch):
    """The second host buffer the step allocates (the prefetch's read of group 0's v) runs out."""
    real, calls = ChunkStorage.alloc, [0]

    def alloc(storage, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 2:
            raise torch.OutOfMemoryError("injected: host out of memory")
        return real(storage, *args, **kwargs)

    monkeypatch.setattr(ChunkStorage, "alloc", alloc)


def _fail_in(name: str):
    def arm(monkeypatch):
        def fail(*args, **kwargs):
            raise torch.OutOfMemoryError(f"injected: out of memory in {name}")
        monkeypatch.setattr(hybrid_adam, name, fail)
    return arm


@pytest.mark.parametrize("where, extra", [
    ("prefetch", dict(nvme_offload_fraction=1.0)),
    ("grad_norm", dict(nvme_offload_fraction=0.5, clip_grad_norm=1.0)),
    ("prepare_batches", dict(nvme_offload_fraction=0.5)),
])
def test_a_failure_before_the_stream_leaves_no_read_in_flight(where, extra, monkeypatch, tmp_path):
    """An allocation failure after the first reads started (in the prefetch itself, the gradient
    norm, the in-memory update's temporaries) raises as itself, changes nothing, and the retry
    and the steps after it equal AdamW."""
    base, ref = clone_pair()
    data = batches(TINY, 3)
    clip = extra.get("clip_grad_norm", 0.0)
    _, _, ref_opt = train_reference(ref, data, lr=LR, weight_decay=0.0, clip=clip)
    model, opt = gemini.initialize(base, _cfg(tmp_path, **extra), lr=LR)
    _train(model, opt, data[:1])
    x, y = data[1]
    opt.backward(GPT.loss(model(x), y))
    before = _values(model, opt)
    with monkeypatch.context() as patch:
        {"prefetch": _fail_in_prefetch, "grad_norm": _fail_in("grad_norm"),
         "prepare_batches": _fail_in("prepare_batches")}[where](patch)
        with pytest.raises(torch.OutOfMemoryError, match="injected"):
            opt.step()
    assert not any(c.io_pending for g in opt._rt.manager.trainable_groups for c in opt._rt.nvme.chunks_of(g))
    _assert_equal(_values(model, opt), before, "after the failed step")
    opt.step()  # the retry
    opt.zero_grad()
    _train(model, opt, data[2:])
    _assert_adamw(model, opt, ref, ref_opt)
    opt.close()


def test_a_read_error_bringing_groups_back_at_the_warmup_end_is_retried(monkeypatch, tmp_path):
    """auto with a margin: the first step moves groups back from NVMe; a read error there raises,
    leaves no read in flight, and the retry moves them and steps as AdamW does."""
    base, ref = clone_pair()
    data = batches(TINY, 3)
    _, _, ref_opt = train_reference(ref, data, lr=LR, weight_decay=0.0)
    cfg = _cfg(tmp_path, placement="auto", device_memory=roomy_budget("4MiB"), gpu_margin_mem_ratio=0.5,
               nvme_offload_fraction=1.0)
    model, opt = gemini.initialize(base, cfg, lr=LR)
    x, y = data[0]
    opt.backward(GPT.loss(model(x), y))
    with monkeypatch.context() as patch:
        def preadv(*args):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        patch.setattr(os, "preadv", preadv)
        with pytest.raises(NvmeStoreError, match="Input/output error"):
            opt.step()
    assert opt._rt.state.name == "ADOPTING"
    opt.step()  # the retry, the drive working again
    opt.zero_grad()
    assert opt._rt.state.name == "PLANNED"
    _train(model, opt, data[1:])
    _assert_adamw(model, opt, ref, ref_opt)
    opt.close()


def _fill_disk_after(monkeypatch, writes: int) -> None:
    real, calls = os.pwritev, [0]

    def pwritev(*args):
        calls[0] += 1
        if calls[0] > writes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args)

    monkeypatch.setattr(os, "pwritev", pwritev)


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_load_that_fails_writing_changes_nothing_and_leaves_no_write_in_flight(sharded, precision, monkeypatch,
                                                                                 tmp_path):
    """A full disk while a checkpoint's states are written to NVMe: the load raises, the model
    and the optimizer are as before it (not half loaded), the next call does not fail on a stale
    write, and once the disk has room the load and the training after it equal AdamW's."""
    (tmp_path / "nvme").mkdir()
    base, ref = clone_pair()
    data = batches(TINY, 4)
    _, _, ref_opt = train_reference(ref, data, lr=LR, weight_decay=0.0)
    model, opt = gemini.initialize(base, _cfg(tmp_path / "nvme", precision=precision, nvme_offload_fraction=1.0),
                                   lr=LR)
    _train(model, opt, data[:2])
    save_checkpoint(tmp_path / "ckpt", model, opt, sharded=sharded)
    saved = _values(model, opt)
    _train(model, opt, data[2:])
    before = _values(model, opt)
    with monkeypatch.context() as patch:
        _fill_disk_after(patch, 6)
        with pytest.raises(NvmeStoreError, match="No space left"):
            load_checkpoint(tmp_path / "ckpt", model, opt, sharded=sharded)
    _assert_equal(_values(model, opt), before, "after the failed load")  # no stale write error either
    load_checkpoint(tmp_path / "ckpt", model, opt, sharded=sharded)
    _assert_equal(_values(model, opt), saved, "after the load")
    _train(model, opt, data[2:])
    if precision == "fp32":
        _assert_adamw(model, opt, ref, ref_opt)
    else:
        _assert_equal(_values(model, opt), before, "trained again from the checkpoint")
    opt.close()


@pytest.mark.parametrize("damage", ["delete", "flip", "folder"])
@pytest.mark.parametrize("sharded", [False, True])
def test_loading_a_checkpoint_repairs_a_lost_or_corrupted_nvme_file(sharded, damage, tmp_path):
    """A load writes every element of the states: it never reads the files it replaces, so it
    repairs one that is gone or damaged, and training goes on as AdamW. The engine's whole
    folder deleted (a tmp cleaner): the step names a lost file, and the load, which failed on a
    bare FileNotFoundError (the folder gone), writes into the folder made again."""
    (tmp_path / "nvme").mkdir()
    base, ref = clone_pair()
    data = batches(TINY, 4)
    _, _, ref_opt = train_reference(ref, data, lr=LR, weight_decay=0.0)
    model, opt = gemini.initialize(base, _cfg(tmp_path / "nvme", nvme_offload_fraction=1.0), lr=LR)
    _train(model, opt, data[:2])
    save_checkpoint(tmp_path / "ckpt", model, opt, sharded=sharded)
    _train(model, opt, data[2:3])
    rt = opt._rt
    path = rt.storage.nvme.path_of(rt.manager.trainable_groups[-1].exp_avg.key)
    if damage == "delete":
        os.remove(path)
    elif damage == "folder":
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)  # the store may be removing an old file meanwhile
        assert not os.path.exists(os.path.dirname(path))
        with pytest.raises(NvmeStoreError, match=r"was deleted underneath the store"):
            _train(model, opt, data[3:4])
        opt.zero_grad()
    else:
        with open(path, "r+b") as f:
            byte = f.read(1)
            f.seek(0)
            f.write(bytes([byte[0] ^ 0x40]))
    load_checkpoint(tmp_path / "ckpt", model, opt, sharded=sharded)
    _train(model, opt, data[2:])
    _assert_adamw(model, opt, ref, ref_opt)
    opt.close()


def test_the_model_keeps_its_weights_when_the_optimizer_is_dropped(tmp_path):
    """bf16 with the masters on NVMe: a train() that returns only the model drops the optimizer;
    the model's state_dict still reads its masters (the files live while the model does), and
    they go with the model."""
    def train():
        base, _ = clone_pair()
        model, opt = gemini.initialize(base, _cfg(tmp_path, precision="bf16", nvme_offload_fraction=1.0), lr=LR)
        _train(model, opt, batches(TINY, 2))
        return model, model.state_dict(), opt._rt.storage.nvme.folder

    model, want, folder = train()
    gc.collect()
    assert_params_close(model.state_dict(), want, rtol=0, atol=0)
    gemini.save_pretrained(model, tmp_path / "out")
    assert os.path.exists(folder)
    del model
    gc.collect()
    assert not os.path.exists(folder)
