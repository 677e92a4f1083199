"""Training with optimizer states on NVMe: equal to plain AdamW, measured, safe on disk faults."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import gemini
from chunks import ChunkKind, ChunkState
from gemini.tools.gpt import GPT
from gemini.engine.transaction import UNDO_KIND
from helpers import DEVICE, TINY, assert_params_close, batches, clone_pair, roomy_budget, train_gemini, train_reference
from offload import NvmeCorruptionError, NvmeStoreError, Tier

STEPS = 6


def _cfg(tmp_path, **kw) -> gemini.GeminiConfig:
    base = dict(device=DEVICE, chunk_size=2000, nvme_dir=str(tmp_path), nvme_pipeline_depth=1)
    base.update(kw)
    return gemini.GeminiConfig(**base)


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_states_on_nvme_train_like_adamw_and_are_reported(tmp_path, placement):
    base, ref = clone_pair()
    data = batches(TINY, STEPS)
    want_losses, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    # A host budget for about three groups' states: the pipeline's staging, nothing else.
    cfg = _cfg(tmp_path, placement=placement, cpu_memory=200_000,
               device_memory=roomy_budget("64MiB") if placement == "auto" else None)
    got_losses, got, _, opt = train_gemini(base, data, cfg, lr=1e-2, weight_decay=0.1)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    assert got_losses == pytest.approx(want_losses, rel=1e-6)
    nvme, manager = opt._rt.nvme, opt._rt.manager
    trainable = manager.trainable_groups
    assert len(nvme.groups) > len(trainable) // 2  # most states live on NVMe
    on_nvme = [c for g in trainable if nvme.holds(g) for c in nvme.chunks_of(g)]
    assert all(c.state is ChunkState.NVME for c in on_nvme)
    # Each step reads and writes every NVMe-resident chunk once, and the report says so.
    nbytes = sum(c.nbytes for c in on_nvme)
    r = opt.report
    assert r.nvme_bytes == nbytes and r.nvme_read_bytes == nbytes
    # 200 KB cannot hold the step's copies of the streamed groups' parameters next to the
    # pipeline: they are written to files too (read only to undo a failed step).
    assert nvme.layout.undo_on_nvme
    streamed = [g for g in trainable if nvme.holds(g)]
    undo = sum(g.param.used_numel * 4 for g in streamed)
    assert r.nvme_undo_bytes == undo and r.nvme_write_bytes == nbytes + undo
    assert r.host_model_bytes == sum(c.nbytes for c in manager.chunks() if c.is_on(Tier.HOST))
    folder = opt._rt.storage.nvme.folder
    deadline = time.monotonic() + 30  # the files the last step replaced are removed behind it
    while len([f for f in os.listdir(folder) if f.endswith(".bin")]) != len(on_nvme) + len(streamed):
        assert time.monotonic() < deadline, os.listdir(folder)
        time.sleep(0.01)
    opt.close()
    assert not os.path.exists(folder) and os.listdir(tmp_path) == []




def test_a_small_host_budget_gets_a_shallower_pipeline_and_keeps_to_it(tmp_path, caplog):
    """cpu_memory too small for 2 * depth + 1 groups: the pipeline runs at the depth that fits
    (here 0: one group at a time), the optimizer states in host memory never exceed the budget
    in any step, and training still equals AdamW. Below one group's states: a clear refusal."""
    base, ref = clone_pair()
    data = batches(TINY, STEPS)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    budget = 100_000  # the largest group's m and v take 64 KiB: room for one group, not three
    cfg = _cfg(tmp_path, placement="cpu", cpu_memory=budget, nvme_pipeline_depth=2)
    model, opt = gemini.initialize(base, cfg, lr=1e-2, weight_decay=0.1)
    nvme = opt._rt.nvme
    # One group's m and v (64 KiB) and one copy of its parameters (32 KiB) at a time: the step's
    # copies aside go to NVMe files, since the budget cannot hold them all.
    assert nvme.layout.depth == 0 and nvme.layout.undo_on_nvme
    assert nvme.layout.staging_bytes + nvme.layout.undo_bytes <= budget
    ledger = opt._rt.storage.ledger
    peaks = []
    real_start_step = ledger.start_step

    def start_step():  # the step's host peak of Adam states, before the next step resets it
        peaks.append(sum(ledger.kind_peak_bytes(Tier.HOST, k) for k in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ,
                                                                           UNDO_KIND)))
        real_start_step()

    ledger.start_step = start_step
    for step, (x, y) in enumerate(data):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        assert_params_close(model.state_dict(), want[step], step=step)
        # The report says it too (host_model_bytes also counts parameters and gradients).
        assert opt.report.host_states_peak_bytes == peaks[-1] and opt.report.cpu_budget_bytes == budget
    assert len(peaks) == STEPS and 0 < max(peaks) <= budget
    said = [r for r in caplog.records if "the NVMe pipeline runs at depth 0" in r.getMessage()]
    assert len(said) == 1, "said once per run, however often the tier chooses"
    opt.close()
    base, _ = clone_pair()
    with pytest.raises(ValueError, match=r"cpu_memory=60000 .*at least one chunk group.*at least 98304"):
        gemini.initialize(base, _cfg(tmp_path, placement="cpu", cpu_memory=60_000), lr=1e-2)


@pytest.mark.parametrize("offload_fraction", [0.0, 0.5])
def test_static_counts_only_the_states_it_leaves_on_the_host_against_cpu_memory(tmp_path, offload_fraction):
    """placement static keeps the first groups' optimizer states on the device, yet registration
    checked cpu_memory against every group's (fraction 0.0 and cpu_memory 1 KiB: refused, "the
    host cannot hold 327680 bytes"), and wrote groups to NVMe only to read them back; the planner
    said the same. Now only the host's states count: training fits, equal to AdamW, nothing goes
    to NVMe, and plan_placement agrees."""
    base, ref = clone_pair()
    data = batches(TINY, 2)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    host_states = 0 if offload_fraction == 0 else None
    cfg = _cfg(tmp_path, placement="static", static_optimizer_offload_fraction=offload_fraction, cpu_memory=1024)
    if host_states is None:  # half the groups' states on the host: a budget just above them
        probe = gemini.initialize(clone_pair()[0], _cfg(tmp_path, placement="static", nvme_dir=None,
                                                       static_optimizer_offload_fraction=offload_fraction))[1]
        host_states = sum(c.nbytes for g in probe._rt.manager.trainable_groups for c in (g.exp_avg, g.exp_avg_sq)
                          if c.is_on(Tier.HOST))
        probe.close()
        assert host_states > 0
        cfg = dataclasses.replace(cfg, cpu_memory=host_states + 1024)
    assert gemini.plan_placement(clone_pair()[0], cfg).fits
    model, opt = gemini.initialize(base, cfg, lr=1e-2, weight_decay=0.1)
    for step, (x, y) in enumerate(data):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        assert_params_close(model.state_dict(), want[step], step=step)
    assert not opt._rt.nvme.groups and opt.report.nvme_bytes == 0
    opt.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_with_masters_on_nvme_is_bit_identical_to_host_states(tmp_path, precision):
    data = batches(TINY, STEPS)
    base, _ = clone_pair()
    host_cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", precision=precision, chunk_size=2000)
    _, want, _, _ = train_gemini(base, data, host_cfg, lr=1e-2)
    base, _ = clone_pair()
    cfg = _cfg(tmp_path, placement="cpu", precision=precision, nvme_offload_fraction=1.0, nvme_pipeline_depth=2)
    _, got, model, opt = train_gemini(base, data, cfg, lr=1e-2)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, rtol=0, atol=0, step=step)
    groups = opt._rt.manager.trainable_groups
    assert groups[0].master.state is ChunkState.NVME  # masters, m and v all streamed
    # The model's state_dict reads the masters from NVMe, and nothing else (not m and v).
    transfers = opt._rt.storage.ledger.transfers
    transfers.reset()
    model.state_dict()
    assert transfers.nvme_read_bytes == sum(g.master.nbytes for g in groups)
    assert transfers.nvme_write_bytes == 0
    opt.close()


def test_checkpoint_with_states_on_nvme_resumes_exactly(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    data = batches(TINY, 2 * STEPS)
    base, _ = clone_pair()
    _, want, _, _ = train_gemini(base, data, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000), lr=1e-2)

    base, fresh = clone_pair()
    _, _, model, opt = train_gemini(base, data[:STEPS], _cfg(tmp_path / "a", placement="cpu", nvme_offload_fraction=0.7),
                                    lr=1e-2)
    model_sd, opt_sd = model.state_dict(), opt.state_dict()
    assert len(opt_sd["state"]) == len(list(fresh.parameters()))
    opt.close()
    # Resume into a fresh NVMe-backed run (different groups on NVMe) and into one without NVMe.
    for cfg in (_cfg(tmp_path / "b", placement="cpu", nvme_offload_fraction=0.3),
                gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000)):
        m = clone_pair()[0]
        gm, o = gemini.initialize(m, cfg, lr=1e-2)
        gm.load_state_dict(model_sd)
        o.load_state_dict(opt_sd)
        for step, (x, y) in enumerate(data[STEPS:]):
            o.backward(GPT.loss(gm(x), y))
            o.step()
            o.zero_grad()
            assert_params_close(gm.state_dict(), want[STEPS + step], rtol=0, atol=0, step=STEPS + step)
        o.close()


def test_a_flipped_byte_on_disk_is_a_clear_error(tmp_path):
    base, _ = clone_pair()
    data = batches(TINY, 2)
    _, _, model, opt = train_gemini(base, data[:1], _cfg(tmp_path, placement="cpu", nvme_offload_fraction=1.0), lr=1e-2)
    store = opt._rt.storage.nvme
    g = opt._rt.manager.trainable_groups[0]
    path = store.path_of(g.exp_avg_sq.key)
    with open(path, "r+b") as f:
        f.seek(100)
        b = f.read(1)
        f.seek(100)
        f.write(bytes([b[0] ^ 0x01]))
    from gemini.tools.gpt import GPT

    x, y = data[1]
    opt.backward(GPT.loss(model(x), y))
    with pytest.raises(NvmeCorruptionError) as err:
        opt.step()
    assert path in str(err.value) and "offset" in str(err.value)
    assert g.exp_avg_sq.state is ChunkState.NVME  # never used: no silent wrong numbers
    opt.close()


def test_config_and_folder_errors_are_clear(tmp_path):
    with pytest.raises(ValueError, match="GeminiConfig.placement='cuda'"):
        gemini.GeminiConfig(placement="cuda", nvme_dir=str(tmp_path))
    with pytest.raises(ValueError, match="nvme_pipeline_depth=0"):
        gemini.GeminiConfig(placement="cpu", nvme_dir=str(tmp_path), nvme_pipeline_depth=0)
    base, _ = clone_pair()
    with pytest.raises(ValueError, match=r"cpu_memory=1000 .*nvme_dir is None"):
        gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000, cpu_memory=1000))
    base, _ = clone_pair()
    with pytest.raises(NvmeStoreError, match="does not exist"):
        gemini.initialize(base, _cfg(tmp_path / "missing", placement="cpu", nvme_offload_fraction=1.0))


def test_files_go_when_the_optimizer_and_the_model_are_garbage_collected(tmp_path):
    """The files go with the runtime, which the model holds too (under bf16/fp16 they hold its
    masters): not while the model lives (tests/test_nvme_recovery.py), once both are gone."""
    base, _ = clone_pair()
    _, _, model, opt = train_gemini(base, batches(TINY, 1), _cfg(tmp_path, placement="cpu", nvme_offload_fraction=1.0),
                                    lr=1e-2)
    folder = opt._rt.storage.nvme.folder
    assert os.listdir(folder)
    del opt
    gc.collect()
    assert os.listdir(folder)
    del model, base  # the wrapped module (base) carries gemini's hooks: it is the model too
    gc.collect()
    assert not os.path.exists(folder)


_FSIZE_CHILD = textwrap.dedent(
    """
    import json, os, resource, signal, sys, time
    sys.path.insert(0, {tests!r})
    import torch, gemini
    from chunks import ChunkState
    from gemini.tools.gpt import GPT
    from helpers import DEVICE, TINY, batches, clone_pair, STATE_CUDA_ATOL, tolerance
    from offload import NvmeStoreError

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    data = batches(TINY, 3)
    model, ref = clone_pair()
    ref.to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    snapshots = []  # per step, on the CPU: parameters and Adam states of the reference
    for x, y in data:
        GPT.loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        snapshots.append({{n: (p.detach().cpu().clone(), ref_opt.state[p]["exp_avg"].cpu().clone(),
                               ref_opt.state[p]["exp_avg_sq"].cpu().clone()) for n, p in ref.named_parameters()}})
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000, nvme_dir={nvme_dir!r},
                              nvme_offload_fraction=1.0, nvme_pipeline_depth=1)
    gm, opt = gemini.initialize(model, cfg, lr=1e-2)
    for x, y in data[:2]:
        opt.backward(GPT.loss(gm(x), y)); opt.step(); opt.zero_grad()
    store = opt._rt.storage.nvme
    n_files = sum(len(opt._rt.nvme.chunks_of(g)) for g in opt._rt.manager.trainable_groups)

    def chunk_files():  # once the files a step replaced are gone (removed behind the caller)
        deadline = time.monotonic() + 30
        while True:
            names = sorted(n for n in os.listdir(store.folder) if n.endswith(".bin"))
            if len(names) == n_files or time.monotonic() > deadline:
                return names
            time.sleep(0.01)

    names = [n for n, _ in ref.named_parameters()]

    def values():  # per parameter: value, m and v, on the CPU
        sd, params = opt.state_dict(), gm.state_dict()
        return {{name: (params[name], sd["state"][i]["exp_avg"], sd["state"][i]["exp_avg_sq"])
                 for i, name in enumerate(names)}}

    files_before = chunk_files()
    before = values()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # every new chunk file is larger
    x, y = data[2]
    opt.backward(GPT.loss(gm(x), y))
    out = {{}}
    try:
        opt.step()
        out["error"] = None
    except NvmeStoreError as e:
        out["error"] = str(e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    groups = opt._rt.manager.trainable_groups
    out["in_files"] = all(c.state is ChunkState.NVME for g in groups for c in opt._rt.nvme.chunks_of(g))
    out["same_files"] = chunk_files() == files_before

    def steps():
        return sorted({{int(s["step"]) for s in opt.state_dict()["state"].values()}})

    def differences(got, want, params, states):  # what differs beyond the bounds (value; m and v)
        bad = []
        for name in names:
            for a, b, bounds in zip(got[name], want[name], (params, states, states)):
                try:
                    torch.testing.assert_close(a, b, **bounds)
                except AssertionError as e:
                    bad.append(f"{{name}}: {{str(e).splitlines()[-2:]}}")
        return bad

    # Nothing of the failed step landed: every parameter and state is bit for bit step 2's.
    out["steps"], out["changed"] = steps(), differences(values(), before, *[dict(rtol=0, atol=0)] * 2)
    opt.step()  # the retry, with the gradients still there, once the cause is gone
    # ... and its result is the uninterrupted one: AdamW's (to the device's bounds).
    out["retry_steps"] = steps()
    out["retry_differs"] = differences(values(), snapshots[2], tolerance(1e-6, 1e-7),
                                      tolerance(1e-6, 1e-12, cuda_atol=STATE_CUDA_ATOL))
    opt.close()
    print(json.dumps(out))
    """
)


def test_a_write_failure_undoes_the_whole_step_and_a_retry_completes_it(tmp_path):
    """A write past RLIMIT_FSIZE (EFBIG, as a full disk) fails the step part-way: every
    parameter, m, v and step count is as before the step, the files are the ones from before,
    and calling step() again gives exactly the uninterrupted result."""
    here = os.path.dirname(os.path.abspath(__file__))
    script = _FSIZE_CHILD.format(tests=here, nvme_dir=str(tmp_path))
    root = os.path.dirname(here)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["error"] is not None and "File too large" in out["error"] and str(tmp_path) in out["error"]
    assert out["in_files"] and out["same_files"]
    assert out["steps"] == [2] and out["changed"] == []
    assert out["retry_steps"] == [3] and out["retry_differs"] == []
    assert os.listdir(tmp_path) == []


def test_margin_takes_groups_back_from_nvme_and_training_stays_exact(tmp_path):
    """auto: after the warm-up the margin holds every group's states on the device; the NVMe
    tier hands those groups back (files deleted) and the result is still AdamW's."""
    base, ref = clone_pair()
    data = batches(TINY, STEPS)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    cfg = _cfg(tmp_path, placement="auto", device_memory=roomy_budget("256MiB"), gpu_margin_mem_ratio=1.0,
               nvme_offload_fraction=1.0)
    _, got, _, opt = train_gemini(base, data, cfg, lr=1e-2, weight_decay=0.1)
    for step, (g, w) in enumerate(zip(got, want)):
        assert_params_close(g, w, step=step)
    assert opt.report.os_chunks_on_device == len(opt._rt.manager.trainable_groups)
    assert opt._rt.nvme.groups == set() and opt.report.nvme_bytes == 0
    assert [f for f in os.listdir(opt._rt.storage.nvme.folder) if f.endswith(".bin")] == []
    opt.close()


def test_exit_without_close_removes_the_files_quietly(tmp_path):
    """Deletes still queued when the interpreter exits (its thread pools refuse work from then
    on) are left to the store's exit cleanup, which removes the folder: no warning per file."""
    script = textwrap.dedent(f"""
        import torch, gemini
        from torch import nn
        m = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64))
        config = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=4096, nvme_dir={str(tmp_path)!r},
                                     nvme_offload_fraction=1.0)
        model, opt = gemini.initialize(m, config, lr=1e-3)
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        print("trained")
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == 0 and "trained" in proc.stdout, proc.stderr[-3000:]
    assert "could not delete" not in proc.stderr, proc.stderr[-3000:]
    assert os.listdir(tmp_path) == []


def test_after_close_a_bf16_model_whose_masters_were_on_nvme_says_to_save_before(tmp_path):
    """Under bf16 the fp32 masters state_dict() reads lived in the NVMe files close() deletes: the
    error said only "the optimizer was closed"; it now says what went and to save before close."""
    model, opt = gemini.initialize(clone_pair()[0], _cfg(tmp_path, placement="cpu", precision="bf16",
                                                         nvme_offload_fraction=1.0), lr=1e-2)
    x, y = batches(TINY, 1)[0]
    opt.backward(GPT.loss(model(x), y))
    opt.step()
    saved = model.state_dict()  # before close: the masters
    opt.close()
    with pytest.raises(RuntimeError, match=r"optimizer was closed.*fp32 masters.*Save before optimizer.close\(\)"):
        model.state_dict()
    assert all(v.dtype == torch.float32 for v in saved.values())  # what saving before close gave: the masters
