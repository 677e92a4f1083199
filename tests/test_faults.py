"""Faults while training with optimizer states on NVMe: for each fault (a full disk, a write
error, a read error, a corrupted block, an allocation failure, a kill) at each moment (mid-
forward, mid-backward, mid-step, mid-checkpoint) the error is clear, a failed step leaves every
value as before it, and the run recovered as a user would (retry once the cause is fixed, or
load the last checkpoint) ends exactly where the uninterrupted run does.

Disk full is real: the NVMe folder and the checkpoints are on a small tmpfs mounted for the
test, filled by a ballast file when the fault strikes and freed to fix it (skipped where
mounting is not allowed). Write and read errors come from the system calls the store makes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch

import gemini
from gemini.checkpoint import load_checkpoint, save_checkpoint
from gemini.tools.gpt import GPT
from gemini.engine.nvme_tier import NvmeTier
from gemini.engine.transaction import UNDO_KIND
from offload import NvmeStoreError, Tier

from helpers import DEVICE, STATE_CUDA_ATOL, TINY, batches, clone_pair, cpu_copy, tolerance, train_reference

STEPS = 4
FAULT_STEP = 2  # the fault strikes during this step (or the checkpoint saved after it)
LR = 1e-2
MOMENTS = ("forward", "backward", "step", "checkpoint")


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory):
    """A 64 MiB tmpfs: real ENOSPC once a ballast file fills it."""
    where = tmp_path_factory.mktemp("small_disk")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a real full disk: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.fixture(scope="module")
def reference():
    """Plain fused AdamW over the same model and data: parameters and states after the last step
    (on the CPU, where gemini's state dicts are)."""
    _, ref = clone_pair()
    data = batches(TINY, STEPS)
    _, snapshots, ref_opt = train_reference(ref, data, lr=LR, weight_decay=0.0)
    return snapshots[-1], cpu_copy(ref_opt.state_dict())


class Fault:
    """One fault, armed when its moment comes and fixed by the recovering loop."""

    def __init__(self, kind: str, disk: str, monkeypatch) -> None:
        self.kind = kind
        self.disk = disk
        self.armed = False
        self.fired = 0
        self.nvme_file: Callable[[], str] | None = None  # the file a "corrupt" fault damages
        if kind in ("write_error", "read_error"):
            name = "pwritev" if kind == "write_error" else "preadv"
            real = getattr(os, name)

            def failing(*args):
                if self.armed:
                    self.fired += 1
                    raise OSError(errno.EIO, os.strerror(errno.EIO))
                return real(*args)

            monkeypatch.setattr(os, name, failing)
        if kind == "oom":
            from chunks.storage import ChunkStorage
            real_alloc = ChunkStorage.alloc

            def alloc(storage, *args, **kwargs):
                if self.armed:
                    self.fired += 1
                    raise torch.OutOfMemoryError("injected: out of memory")
                return real_alloc(storage, *args, **kwargs)

            monkeypatch.setattr(ChunkStorage, "alloc", alloc)

    @property
    def ballast(self) -> str:
        return os.path.join(self.disk, "ballast")

    def arm(self) -> None:
        if self.armed or self.fired:
            return
        self.armed = True
        if self.kind == "disk_full":
            free = os.statvfs(self.disk).f_bavail * os.statvfs(self.disk).f_frsize
            with open(self.ballast, "wb") as f:
                with contextlib.suppress(OSError):
                    f.write(b"\0" * (free - 4096))  # a few KB left: less than any chunk file
            self.fired = 1
        if self.kind == "corrupt":
            # An Adam state of the last group, read late in the step.
            with open(self.nvme_file(), "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0x10]))
            self.fired = 1

    def fix(self) -> None:
        self.armed = False
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.ballast)

    @property
    def needs_checkpoint(self) -> bool:
        """The cause cannot be fixed in place: the states in the file are lost."""
        return self.kind == "corrupt"


ERRORS = {
    "disk_full": r"ENOSPC|No space left|bytes short|disk full|bytes free",
    "write_error": r"write .* failed: \[Errno 5\]",
    "read_error": r"read .* failed: \[Errno 5\]",
    "corrupt": r"checksum mismatch",
    "oom": r"out of memory",
}


def _values(model, opt):
    return model.state_dict(), opt.state_dict()


def _assert_same(got, want, what):
    params, state = got
    want_params, want_state = want
    for name, w in want_params.items():
        assert torch.equal(params[name], w), f"{what}: {name} changed"
    assert state["state"].keys() == want_state["state"].keys(), what
    for i, entry in want_state["state"].items():
        for key, w in entry.items():
            assert torch.equal(state["state"][i][key], w), f"{what}: state {i} {key} changed"


def _assert_close_to_reference(model, opt, reference):
    want_params, want_state = reference
    params, state = _values(model, opt)
    for name, w in want_params.items():
        torch.testing.assert_close(params[name], w, **tolerance(1e-6, 1e-7), msg=name)
    for i, entry in want_state["state"].items():
        assert int(state["state"][i]["step"]) == int(entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state["state"][i][key], entry[key],
                                       **tolerance(1e-6, 1e-9, cuda_atol=STATE_CUDA_ATOL))


def _arm_at(moment: str, fault: Fault, model, monkeypatch, step_box: list[int]) -> None:
    """Arm ``fault`` at ``moment`` of step FAULT_STEP."""
    when = lambda: step_box[0] == FAULT_STEP  # noqa: E731
    blocks = model.module.blocks
    if moment == "forward":
        blocks[-1].register_forward_pre_hook(lambda *a: fault.arm() if when() else None)
    elif moment == "backward":
        blocks[0].register_full_backward_pre_hook(lambda *a: fault.arm() if when() else None)
    elif moment == "step":
        real_stream = NvmeTier.stream

        def stream(tier, groups):
            for k, g in enumerate(real_stream(tier, groups)):
                if k == 1 and when():
                    fault.arm()  # one group updated and being written, the others not yet
                yield g

        monkeypatch.setattr(NvmeTier, "stream", stream)


@pytest.mark.parametrize("moment", MOMENTS)
@pytest.mark.parametrize("kind", ["disk_full", "write_error", "read_error", "corrupt", "oom"])
def test_a_fault_leaves_a_clear_error_and_the_recovered_run_equals_the_uninterrupted(
        kind, moment, small_disk, reference, monkeypatch, tmp_path):
    if kind == "oom" and moment != "step":
        pytest.skip("an allocation failure is injected into the step only (forward and backward allocate via torch)")
    nvme_dir = small_disk / f"{kind}-{moment}"
    nvme_dir.mkdir()
    base, _ = clone_pair()
    data = batches(TINY, STEPS)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000, nvme_dir=str(nvme_dir),
                              nvme_offload_fraction=1.0, nvme_pipeline_depth=1)
    model, opt = gemini.initialize(base, cfg, lr=LR)
    fault = Fault(kind, str(small_disk), monkeypatch)
    last = opt._rt.manager.trainable_groups[-1]
    fault.nvme_file = lambda: opt._rt.storage.nvme.path_of(last.exp_avg_sq.key)
    step_box = [0]
    _arm_at(moment, fault, model, monkeypatch, step_box)
    checkpoints = {}  # step count -> file
    errors: list[str] = []
    try:
        i = 0
        while i < STEPS:
            step_box[0] = i
            x, y = data[i]
            before = _values(model, opt)  # forward and backward change no value of the step's
            opt.backward(GPT.loss(model(x), y))
            try:
                opt.step()
            except (NvmeStoreError, torch.OutOfMemoryError) as e:
                errors.append(str(e))
                fault.fix()  # reading the states back needs the drive working again
                if fault.needs_checkpoint:  # the corrupted states are lost; the parameters are not
                    _assert_same((model.state_dict(), before[1]), before, f"after the failed step {i}")
                else:
                    _assert_same(_values(model, opt), before, f"after the failed step {i}")
                if fault.needs_checkpoint:
                    i = _restore(model, opt, checkpoints)
                    continue
                opt.step()  # the retry
            opt.zero_grad()
            i += 1
            if moment == "checkpoint" and i == FAULT_STEP + 1:
                fault.arm()
            path = small_disk / f"ckpt-{kind}-{moment}-{i}.pt"
            try:
                save_checkpoint(path, model, opt)
            except (OSError, RuntimeError) as e:
                errors.append(str(e))
                assert not path.exists()
                fault.fix()
                if fault.needs_checkpoint:
                    i = _restore(model, opt, checkpoints)
                    continue
                save_checkpoint(path, model, opt)
            checkpoints[i] = path
        assert fault.fired and errors, f"the {kind} fault never struck at {moment}"
        assert any(re.search(ERRORS[kind], e) for e in errors), errors
        if kind != "oom":
            assert any(str(small_disk) in e for e in errors), errors  # the error names the file
        _assert_close_to_reference(model, opt, reference)
    finally:
        fault.fix()
        opt.close()
        for path in checkpoints.values():
            path.unlink(missing_ok=True)


def _restore(model, opt, checkpoints) -> int:
    """Load the newest checkpoint; returns its step count (where training resumes)."""
    opt.zero_grad()
    last = max(checkpoints)
    load_checkpoint(checkpoints[last], model, opt)
    return last


_KILLED_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, gemini
    import gemini.checkpoint as ckpt
    from gemini.tools.gpt import GPT
    from gemini.engine.nvme_tier import NvmeTier
    from helpers import DEVICE, TINY, batches, clone_pair

    moment, folder = {moment!r}, {folder!r}
    os.makedirs(os.path.join(folder, "nvme"), exist_ok=True)
    base, _ = clone_pair()
    data = batches(TINY, {steps})
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000, nvme_dir=os.path.join(folder, "nvme"),
                              nvme_offload_fraction=1.0, nvme_pipeline_depth=1)
    model, opt = gemini.initialize(base, cfg, lr={lr})
    step = [0]
    die = lambda *a: os.kill(os.getpid(), signal.SIGKILL) if step[0] == {fault_step} else None
    if moment == "forward":
        model.module.blocks[-1].register_forward_pre_hook(die)
    elif moment == "backward":
        model.module.blocks[0].register_full_backward_pre_hook(die)
    elif moment == "step":
        real = NvmeTier.stream
        def stream(tier, groups):
            for k, g in enumerate(real(tier, groups)):
                if k == 1:
                    die()
                yield g
        NvmeTier.stream = stream
    else:
        real_replace = os.replace
        def replace(src, dst):
            die()  # the new checkpoint is written to its temporary file, not yet renamed
            real_replace(src, dst)
        ckpt.os.replace = replace
    for i, (x, y) in enumerate(data):
        step[0] = i
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        ckpt.save_checkpoint(os.path.join(folder, "ckpt.pt"), model, opt)  # after step i + 1
        with open(os.path.join(folder, "saved"), "w") as f:
            f.write(str(i + 1))
    """
)


@pytest.mark.parametrize("moment", MOMENTS)
def test_a_killed_run_resumes_from_its_checkpoint_to_the_uninterrupted_result(moment, reference, tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = _KILLED_CHILD.format(tests=os.path.join(root, "tests"), moment=moment, folder=str(tmp_path), steps=STEPS, lr=LR,
                                  fault_step=FAULT_STEP)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, cwd=root,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    with open(tmp_path / "saved") as f:
        saved = int(f.read())
    assert saved == FAULT_STEP  # the checkpoint of the step before the kill
    # A new process (here: this one) resumes from the checkpoint the killed run left.
    base, _ = clone_pair()
    data = batches(TINY, STEPS)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000, nvme_dir=str(tmp_path / "nvme"),
                              nvme_offload_fraction=1.0, nvme_pipeline_depth=1)
    model, opt = gemini.initialize(base, cfg, lr=LR)
    try:
        load_checkpoint(tmp_path / "ckpt.pt", model, opt)
        assert int(next(iter(opt.state_dict()["state"].values()))["step"]) == saved
        for x, y in data[saved:]:
            opt.backward(GPT.loss(model(x), y))
            opt.step()
            opt.zero_grad()
        _assert_close_to_reference(model, opt, reference)
    finally:
        opt.close()


def _train_retrying(model, opt, data, fault: Fault | None, step_box: list[int]) -> None:
    """The user's loop around a write error: the failed step changed nothing (the module's own
    parameters included: under bf16 they are cast from the masters), the cause is fixed, the
    step is called again."""
    for i, (x, y) in enumerate(data):
        step_box[0] = i
        params_before = {n: p.detach().to("cpu", copy=True) for n, p in model.module.named_parameters()}
        before = _values(model, opt)
        opt.backward(GPT.loss(model(x), y))
        try:
            opt.step()
        except NvmeStoreError:
            fault.fix()
            assert all(torch.equal(p.cpu(), params_before[n]) for n, p in model.module.named_parameters())
            _assert_same(_values(model, opt), before, f"after the failed step {i}")
            opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("placement", ["cpu", "static"])
def test_a_failed_bf16_step_restores_masters_and_low_precision_params(placement, monkeypatch, tmp_path):
    """bf16: the masters live on NVMe and the bf16 parameters are cast from them group by group
    during the step; a write error part-way puts both back, and the retry equals a run that
    never failed, bit for bit."""
    data = batches(TINY, 3)
    cfg = dict(device=DEVICE, placement=placement, chunk_size=2000, precision="bf16", nvme_offload_fraction=1.0,
               nvme_pipeline_depth=1)
    if placement == "static":
        cfg.update(static_param_device_fraction=1.0, static_optimizer_offload_fraction=1.0)
    runs = []
    for faulty in (False, True):
        (tmp_path / str(faulty)).mkdir()
        base, _ = clone_pair()
        model, opt = gemini.initialize(base, gemini.GeminiConfig(nvme_dir=str(tmp_path / str(faulty)), **cfg), lr=LR)
        fault = Fault("write_error", str(tmp_path), monkeypatch) if faulty else None
        step_box = [0]
        if faulty:
            _arm_at("step", fault, model, monkeypatch, step_box)
        _train_retrying(model, opt, data, fault, step_box)
        if faulty:
            assert fault.fired
            monkeypatch.undo()
        params = {n: p.detach().to("cpu", copy=True) for n, p in model.module.named_parameters()}
        runs.append((_values(model, opt), params))
        opt.close()
    (clean, clean_params), (recovered, recovered_params) = runs
    _assert_same(recovered, clean, "the recovered run against the clean one")
    assert all(torch.equal(recovered_params[n], p) for n, p in clean_params.items())


def test_a_failed_step_is_undone_from_copies_in_nvme_files_under_a_small_host_budget(
        reference, monkeypatch, tmp_path):
    """cpu_memory too small for the step's copies of the parameters: they go to NVMe files, and
    a write error part-way is undone from those files; the retry equals AdamW."""
    base, _ = clone_pair()
    data = batches(TINY, STEPS)
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000, nvme_dir=str(tmp_path),
                              cpu_memory=100_000, nvme_pipeline_depth=1)
    model, opt = gemini.initialize(base, cfg, lr=LR)
    assert opt._rt.nvme.layout.undo_on_nvme and opt._rt.nvme.layout.depth == 0
    fault = Fault("write_error", str(tmp_path), monkeypatch)
    real_stream = NvmeTier.stream
    reads_of_copies = []

    def stream(tier, groups):
        for k, g in enumerate(real_stream(tier, groups)):
            if k == 2 and step_box[0] == FAULT_STEP:
                reads_of_copies.append(opt._rt.storage.ledger.kind_bytes(Tier.NVME, UNDO_KIND))
                fault.arm()  # two groups updated, their copies aside already in files
            yield g

    monkeypatch.setattr(NvmeTier, "stream", stream)
    step_box = [0]
    try:
        _train_retrying(model, opt, data, fault, step_box)
        assert fault.fired and reads_of_copies and reads_of_copies[0] > 0
        _assert_close_to_reference(model, opt, reference)
    finally:
        opt.close()
