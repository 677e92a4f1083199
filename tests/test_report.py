"""MemoryReport byte counts are exact: compared with chunk capacities and a JSON Lines file."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

import gemini
from chunks import ChunkKind, Tier
from gemini.tools.gpt import GPT, GPTConfig
from helpers import DEVICE, TINY, batches, make_gpt


def _payload_bytes(group, kinds):
    return sum(c.capacity * c.payload().element_size() for c in group.chunks if c.kind.value in kinds)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_placement_counts_every_byte(precision, tmp_path):
    model = make_gpt()
    model.blocks[1].mlp.fc.weight.requires_grad_(False)
    path = tmp_path / "r.jsonl"
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=3000, precision=precision, report_path=path)
    gmodel, opt = gemini.initialize(model, cfg)
    mgr = opt._rt.manager
    elem = 4 if precision == "fp32" else 2
    param_bytes = sum(g.param.capacity for g in mgr.groups) * elem
    grad_bytes = sum(g.grad.capacity for g in mgr.trainable_groups) * elem
    low = precision != "fp32"
    # Every flavour on the host: param (elem), and for trainable groups grad (elem), m and v
    # (fp32); the fp32 master under bf16 (frozen groups keep one too).
    host_bytes = sum(
        g.param.capacity * (elem + (elem + 8 if g.trainable else 0) + (4 if low else 0)) for g in mgr.groups
    )
    reports = []
    for x, y in batches(TINY, 3):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
    # The tied embedding's chunk is released between the head's backward and the embedding's
    # (see [Note: a group between its uses in backward]), so it crosses once more.
    tied, _ = mgr.locate(model.wte.weight)
    for r in reports:
        # Each param chunk crosses once for forward and once for backward (the tied one once
        # more); each grad chunk comes back once; nothing else moves.
        assert r.h2d_bytes == 2 * param_bytes + tied.param.capacity * elem
        assert r.d2h_bytes == grad_bytes
        assert r.device_model_bytes == 0 and r.chunks_on_device == 0 and r.os_chunks_on_device == 0
        assert r.host_model_bytes == host_bytes
        # The ledger (counted as storage allocates and frees) agrees with the chunks' own states.
        assert r.model_bytes_by_tier["host"] == {
            k.value: sum(c.nbytes for c in mgr.chunks() if c.kind is k and c.is_on(Tier.HOST)) for k in ChunkKind}
        # The device peak: at least the largest single working set, at most all params + grads
        # (the CPU stand-in without a budget counts chunks; CUDA's allocator counts every tensor
        # on the device, cuBLAS's workspace among them).
        assert 0 < r.device_peak_bytes
        if DEVICE == "cpu":
            assert r.device_peak_bytes <= param_bytes + grad_bytes
        assert r.step_seconds > 0 and r.transfer_seconds > 0 and r.optimizer_cpu_seconds > 0
        assert r.optimizer_device_seconds == 0
    header, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["run"]["config"]["precision"] == precision
    assert rows == [r.to_dict() for r in reports]
    assert [row["step"] for row in rows] == [0, 1, 2]


NON_MODEL_CONFIGS = {
    "cuda": dict(placement="cuda", device_memory="64MiB"),
    "cpu": dict(placement="cpu", device_memory="64MiB"),
    "static": dict(placement="static", device_memory="64MiB", static_param_device_fraction=0.5),
    "auto": dict(placement="auto", device_memory="64MiB"),
    "auto-evicting": dict(placement="auto", device_memory="20MiB"),
}


@pytest.mark.standin  # budgets sized for the stand-in's exact counting
@pytest.mark.parametrize("name", NON_MODEL_CONFIGS)
def test_each_step_measures_its_own_non_model_peak(name):
    """device_non_model_peak_bytes is the step's: a step with 8 MiB more temporaries in the loss
    reports 8 MiB more (it used to repeat the warm-up's figure, or be None without a warm-up),
    and the fields add up: the peak is at most the chunks' peak plus the non-model peak."""
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
    model, opt = gemini.initialize(make_gpt(cfg), gemini.GeminiConfig(device=DEVICE, chunk_size=3000,
                                                                      **NON_MODEL_CONFIGS[name]), lr=1e-3)
    extra_bytes = 8 * 2**20
    reports = []
    for step, (x, y) in enumerate(batches(cfg, 4, batch=4, seq=32)):
        out = model(x)
        loss = GPT.loss(out, y)
        if step == 2:  # a large temporary, alive with the logits: non-model data only
            loss = loss + torch.zeros(extra_bytes // 4, device=out.device).sum() * out.sum() * 0
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
    for r in reports:
        assert r.device_non_model_peak_bytes is not None
        assert r.device_non_model_peak_bytes <= r.device_peak_bytes <= r.device_model_peak_bytes + r.device_non_model_peak_bytes
    plain = [r.device_non_model_peak_bytes for r in (reports[1], reports[3])]
    assert plain[1] == pytest.approx(plain[0], rel=0.01)  # the same step measures about the same
    # The temporary lives while some activations of the other steps' peak are gone already.
    assert reports[2].device_non_model_peak_bytes > max(extra_bytes, plain[0] + extra_bytes // 2)


def test_cuda_placement_keeps_everything_on_device():
    gmodel, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement="cuda", chunk_size=3000))
    x, y = batches(TINY, 1)[0]
    opt.backward(GPT.loss(gmodel(x), y))
    opt.step()
    r = opt.report
    mgr = opt._rt.manager
    assert r.h2d_bytes == 0 and r.d2h_bytes == 0 and r.host_model_bytes == 0
    assert r.os_chunks_on_device == len(mgr.trainable_groups)
    assert r.device_model_bytes == sum(c.nbytes for c in mgr.chunks() if c.is_on(Tier.DEVICE))
    assert r.optimizer_device_seconds > 0 and r.optimizer_cpu_seconds == 0
    assert set(r.to_dict()) >= {
        "step", "device_peak_bytes", "device_model_bytes", "device_non_model_peak_bytes", "host_model_bytes",
        "nvme_bytes", "h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes", "chunks_on_device",
        "os_chunks_on_device", "step_seconds", "transfer_seconds", "optimizer_cpu_seconds",
        "optimizer_device_seconds", "skipped", "loss_scale",
    }


# ----------------------------------------------------------------- reports of a real run
AUTO_BUDGET = 2_200_000  # bytes: room for the warm-up, and a margin that holds some optimizer states
# The tests of the run below are marked standin: its budget is sized for the CPU stand-in, which
# counts exactly the tensors alive (on CUDA the allocator's segments and cuBLAS's workspace alone
# exceed it), and without a GPU there is no NVML reading.


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    """Four steps of TINY under placement auto with a budget below its model data, reported to a file."""
    path = tmp_path_factory.mktemp("auto") / "reports.jsonl"
    cfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=3000, device_memory=AUTO_BUDGET,
                              gpu_margin_mem_ratio=0.5, report_path=path)
    gmodel, opt = gemini.initialize(make_gpt(), cfg, lr=1e-2)
    reports, losses = [], []
    for x, y in batches(TINY, 4):
        loss = GPT.loss(gmodel(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
        losses.append(loss.item())
    return path, reports, losses, opt


@pytest.mark.standin
def test_jsonl_rows_equal_the_reports_with_breakdown_and_timeline(auto_run):
    path, reports, _, opt = auto_run
    _header, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [r.to_dict() for r in reports]
    assert gemini.read_reports(path) == reports  # nested timeline included
    # The warm-up step carries the plan's timeline, period by period; later steps none.
    plan = opt._rt.plan
    timeline = reports[0].timeline
    assert timeline is not None and all(r.timeline is None for r in reports[1:])
    assert [p.non_model_bytes for p in timeline.periods] == list(plan.non_model_bytes)
    assert [(p.phase, p.module) for p in timeline.periods] == [(ph.value, m) for ph, m in plan.keys]
    assert timeline.budget_bytes == AUTO_BUDGET and timeline.reserve_bytes == plan.reserve_bytes
    assert timeline.margin_bytes == plan.margin_bytes > 0
    assert opt.timeline == timeline
    for r in reports:
        # The per-kind breakdown adds up to the per-tier totals of the contract.
        by_tier = r.model_bytes_by_tier
        assert sum(by_tier["device"].values()) == r.device_model_bytes
        assert sum(by_tier["host"].values()) == r.host_model_bytes
        assert sum(by_tier["nvme"].values()) == r.nvme_bytes == 0
        assert r.os_chunks_total == len(opt._rt.manager.trainable_groups)
        assert 0 < r.os_chunks_on_device < r.os_chunks_total  # ratio 0.5 took some, not all
        assert r.host_available_bytes > 0 and r.host_rss_bytes > 0
        assert r.device_used_peak_bytes is None  # NVML: only with a GPU
        assert r.compute_seconds == pytest.approx(r.step_seconds - r.transfer_seconds - r.nvme_wait_seconds)


def test_an_overflowed_step_writes_strict_json(tmp_path):
    """fp16 skips a step whose gradients hold inf: its grad_norm is inf, written as the string
    "inf" (a bare Infinity/NaN line is refused by strict readers: jq, JSON.parse), and read
    back as inf."""
    path = tmp_path / "r.jsonl"
    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement="cpu", precision="fp16",
                                                                   report_path=path), lr=1e-3)
    reports = []
    for scale in (1.0, float("inf"), float("nan")):
        (x, y), = batches(TINY, 1)
        opt.backward(GPT.loss(model(x), y) * scale)
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
    assert [r.skipped for r in reports] == [False, True, True]
    assert [r.grad_norm == float("inf") for r in reports] == [False, True, True]

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    _header, *rows = [json.loads(line, parse_constant=refuse) for line in path.read_text().splitlines()]
    assert [row["grad_norm"] for row in rows[1:]] == ["inf", "inf"]
    assert gemini.read_reports(path) == reports


def test_read_reports_names_the_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1 is not a MemoryReport"):
        gemini.read_reports(path)


@pytest.mark.standin
def test_summary_line_and_run_summary_of_a_real_run(auto_run):
    _, reports, losses, _ = auto_run
    r = reports[1]
    line = gemini.summary_line(r, loss=losses[1])
    share = round(100 * r.device_peak_bytes / AUTO_BUDGET)
    assert f"device peak {r.device_peak_bytes / 2**30:.3f} GiB = {share}% of {AUTO_BUDGET / 2**30:.3f}" in line
    assert f"loss {losses[1]:.4f}" in line and "SKIPPED" not in line
    assert f"{r.step_seconds:.2f} s (transfers {r.transfer_seconds:.2f}, compute {r.compute_seconds:.2f})" in line
    assert f"non-model {r.device_non_model_peak_bytes / 2**20:.3f}" in gemini.summary_line(r, unit="MiB")
    assert f"OS chunks on device {r.os_chunks_on_device}/{r.os_chunks_total}" in line
    skipped = dataclasses.replace(r, skipped=True, loss_scale=1024.0)
    assert "SKIPPED (fp16 overflow; loss scale 1024)" in gemini.summary_line(skipped)
    text = gemini.run_summary([*reports, skipped], unit="MiB")
    peak = max(reports, key=lambda x: x.device_peak_bytes)
    assert text.startswith("5 steps (1 skipped)")
    assert f"device peak {peak.device_peak_bytes / 2**20:.3f} MiB at step {peak.step + 1}" in text


MiB = 2**20


def _report(step: int, **values) -> gemini.MemoryReport:
    base = dict(step=step, device_peak_bytes=0, device_model_bytes=0, device_non_model_peak_bytes=None,
                host_model_bytes=0, nvme_bytes=0, h2d_bytes=0, d2h_bytes=0, nvme_read_bytes=0, nvme_write_bytes=0,
                chunks_on_device=0, os_chunks_on_device=0, step_seconds=1.0, transfer_seconds=0.0,
                optimizer_cpu_seconds=0.0, optimizer_device_seconds=0.0, skipped=False, loss_scale=1.0)
    return gemini.MemoryReport(**{**base, **values})


def test_run_summary_reads_right_with_and_without_a_budget():
    reports = [
        _report(0, step_seconds=3.0, transfer_seconds=1.0, device_peak_bytes=100 * MiB, device_budget_bytes=160 * MiB,
                device_non_model_peak_bytes=30 * MiB, host_rss_bytes=500 * MiB, h2d_bytes=64 * MiB),
        _report(1, step_seconds=1.0, transfer_seconds=0.25, device_peak_bytes=120 * MiB,
                device_budget_bytes=160 * MiB, device_model_bytes=40 * MiB, device_non_model_peak_bytes=50 * MiB,
                host_model_bytes=200 * MiB, host_pool_bytes=8 * MiB, host_rss_bytes=600 * MiB,
                h2d_bytes=32 * MiB, d2h_bytes=16 * MiB),
        _report(2, step_seconds=2.0, transfer_seconds=0.5, nvme_wait_seconds=0.5, skipped=True,
                device_peak_bytes=110 * MiB, device_budget_bytes=160 * MiB, device_model_bytes=40 * MiB,
                host_model_bytes=180 * MiB, host_pool_bytes=8 * MiB, nvme_bytes=20 * MiB,
                h2d_bytes=48 * MiB, d2h_bytes=16 * MiB, nvme_read_bytes=20 * MiB, nvme_write_bytes=20 * MiB),
    ]
    assert gemini.run_summary(reports, unit="MiB") == (
        "3 steps (1 skipped); step time median 1.500 s after the first (3.000 s, the warm-up): "
        "transfers 25%, NVMe waits 17%, compute 58%\n"
        "device peak 120.000 MiB at step 2 = 75% of the 160.000 MiB budget; "
        "model data on the device at the end 40.000 MiB, non-model peak 50.000 MiB\n"
        "host: chunks 180.000 MiB, pool 8.000 MiB, process RSS max 600.000 MiB; NVMe 20.000 MiB\n"
        "moved per step (median after the first): h2d 40.000 MiB, d2h 16.000 MiB, NVMe read 10.000 MiB, "
        "NVMe write 10.000 MiB"
    )
    # One step, no budget, nothing measured: no "after the first", no "% of", "-" where unmeasured.
    alone = _report(0, step_seconds=2.0, device_peak_bytes=3 * 2**30, device_model_bytes=2**30)
    assert gemini.run_summary([alone]) == (
        "1 step (0 skipped); step time 2.000 s (the warm-up alone): transfers 0%, NVMe waits 0%, compute 100%\n"
        "device peak 3.000 GiB at step 1 (no device budget); model data on the device at the end 1.000 GiB, "
        "non-model peak -\n"
        "host: chunks 0.000 GiB, pool 0.000 GiB, process RSS max -; NVMe 0.000 GiB\n"
        "moved per step (the one step): h2d 0.000 GiB, d2h 0.000 GiB, NVMe read 0.000 GiB, NVMe write 0.000 GiB"
    )
    assert gemini.run_summary([]) == "no reports"


def test_summary_line_counts_steps_from_one():
    r = _report(0, device_peak_bytes=MiB)
    assert gemini.summary_line(r, unit="MiB").startswith("step   1 | 1.00 s (transfers 0.00, compute 1.00) | ")
    assert gemini.summary_line(_report(9), total=10).startswith("step  10/10 | ")


def test_summary_mistakes_are_named():
    """optimizer.report before the first step (None), and a unit spelled another way, ended in
    AttributeError / KeyError; "mib" is MiB, as config sizes are case-insensitive."""
    with pytest.raises(TypeError, match=r"summary_line takes a MemoryReport \(optimizer.report after a step\), got None"):
        gemini.summary_line(None)
    r = _report(0, device_peak_bytes=MiB)
    assert gemini.summary_line(r, unit="mib") == gemini.summary_line(r, unit="MiB")
    assert gemini.run_summary([r], unit="gib") == gemini.run_summary([r])
    for call in (lambda: gemini.summary_line(r, unit="KiB"), lambda: gemini.run_summary([r], unit="KB")):
        with pytest.raises(ValueError, match=r"unit='K\w+' is invalid: expected one of \['GiB', 'MiB'\]"):
            call()


@pytest.mark.standin
def test_a_plot_path_without_a_suffix_returns_the_png_written(auto_run, tmp_path):
    """matplotlib writes "memory" as memory.png: the path returned is that file (it was "memory",
    which does not exist); a report's None timeline (not placement auto) is named."""
    pytest.importorskip("matplotlib")
    _, reports, _, _ = auto_run
    path = gemini.plot_memory(reports, tmp_path / "memory")
    assert path == tmp_path / "memory.png" and path.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory.png"]
    with pytest.raises(TypeError, match="plot_timeline takes a WarmupTimeline .* got NoneType"):
        gemini.plot_timeline(None, tmp_path / "timeline.png")


@pytest.mark.standin
def test_plots_of_a_real_run_are_non_trivial_pngs(auto_run, tmp_path):
    mpl_image = pytest.importorskip("matplotlib.image")
    _, reports, _, _ = auto_run
    memory = gemini.plot_memory(reports, tmp_path / "memory.png")
    timeline = gemini.plot_timeline(reports[0].timeline, tmp_path / "timeline.png")
    for path in (memory, timeline):
        assert path.stat().st_size > 20_000
        pixels = mpl_image.imread(path)
        colours = {tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}
        assert len(colours) > 20  # bars, lines and text, not a blank canvas


@pytest.mark.standin
def test_plots_without_matplotlib_say_how_to_install_it(auto_run, tmp_path, monkeypatch):
    _, reports, _, _ = auto_run
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"pip install 'gemini-offload\[plot\]'"):
        gemini.plot_memory(reports, tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()


# ------------------------------------------------------------- the file across runs and kills
def _run(path, steps: int, **config) -> list[gemini.MemoryReport]:
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=3000, report_path=path, **config)
    gmodel, opt = gemini.initialize(make_gpt(), cfg)
    reports = []
    for x, y in batches(TINY, steps):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
    opt.close()
    return reports


def test_initializing_again_with_the_same_report_path_appends_a_run(tmp_path):
    path = tmp_path / "r.jsonl"
    first = _run(path, 2)
    second = _run(path, 3, precision="bf16")
    lines = path.read_text().splitlines()
    assert len(lines) == 1 + 2 + 1 + 3  # the first run's history is still there
    assert gemini.read_reports(path) == second  # the last run by default: what callers had before
    assert gemini.read_reports(path, run=0) == first
    assert gemini.read_reports(path, run="all") == first + second
    runs = gemini.read_report_runs(path)
    assert [r.first_line for r in runs] == [1, 4]
    assert [r.header["config"]["precision"] for r in runs] == ["fp32", "bf16"]
    for r in runs:
        assert r.header["pid"] == os.getpid() and r.header["chunk_size"] == 3000 and r.header["started"]
    with pytest.raises(ValueError, match=r"run=2 is invalid: .*r.jsonl holds 2 run\(s\), so expected -2 to 1"):
        gemini.read_reports(path, run=2)


def test_a_torn_last_line_is_skipped_with_a_warning_and_the_next_run_starts_clean(tmp_path):
    path = tmp_path / "r.jsonl"
    first = _run(path, 2)
    # What a kill in the middle of writing the third report leaves: a line cut short.
    whole = json.dumps(dataclasses.replace(first[-1], step=2).to_dict())
    with open(path, "a") as f:
        f.write(whole[: len(whole) // 2])
    with pytest.warns(RuntimeWarning, match=r"r.jsonl:4: skipped a torn line at the end of a run"):
        assert gemini.read_reports(path) == first
    second = _run(path, 1)
    assert path.read_text().splitlines()[4].startswith('{"run": ')  # a line of its own
    with pytest.warns(RuntimeWarning, match=r"r.jsonl:4: skipped a torn line"):
        assert gemini.read_reports(path, run="all") == first + second


def test_damage_before_the_end_of_a_run_is_an_error_naming_the_line(tmp_path):
    path = tmp_path / "r.jsonl"
    reports = _run(path, 3)
    header, *rows = path.read_text().splitlines()
    for lines, bad in [([header, rows[0], "{\"step\": 1, \"dev", rows[2]], 3),  # torn, then more reports
                       ([header, rows[0], rows[1], "garbage", "garbage"], 4),  # two bad lines at the end
                       ([header, rows[0], "[1, 2]", rows[2]], 3),  # JSON, not a report
                       ([header, rows[0], "{\"step\": 1}"], 3)]:  # a whole line missing its fields
        path.write_text("\n".join(lines) + "\n")
        with pytest.raises(ValueError, match=rf"r.jsonl:{bad} is not a MemoryReport"):
            gemini.read_reports(path)
    path.write_text("\n".join(rows) + "\n")  # a file of a version before run headers: one run
    assert gemini.read_reports(path) == reports
    assert gemini.read_report_runs(path)[0].header is None


def test_host_readings_are_psutils():
    """The reports' host figures, read from /proc on Linux ([Note: host readings every step]),
    are what psutil reads: resident memory grows by a tensor's pages, availability shrinks."""
    import mmap

    import psutil
    import torch

    from gemini.engine.system_memory import SystemMemory

    system = SystemMemory(torch.device("cpu"))
    before = system.host_rss_bytes()
    assert abs(before - psutil.Process().memory_info().rss) < 4 * 2**20
    assert abs(system.host_available_bytes() - psutil.virtual_memory().available) < 256 * 2**20
    # Fresh pages, touched (an allocator may hand back memory that is resident already).
    big = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(big), mmap.PAGESIZE):
        big[offset] = 1
    assert system.host_rss_bytes() - before >= 60 * 2**20
    assert abs(system.host_rss_bytes() - psutil.Process().memory_info().rss) < 4 * 2**20
    big.close()


def _child_rss_reading(system, conn) -> None:
    import mmap

    import psutil

    big = mmap.mmap(-1, 128 * 2**20)  # the child's own pages: the parent's reading would miss them
    for offset in range(0, len(big), mmap.PAGESIZE):
        big[offset] = 1
    conn.send((system.host_rss_bytes(), psutil.Process().memory_info().rss))
    conn.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and fork are Linux's")
def test_host_readings_follow_fork_and_close_their_files():
    """The /proc files stay open between readings: a forked child reads its own resident memory,
    not its parent's, and closing (or dropping) the reader closes them."""
    import gc
    import multiprocessing

    import torch

    from gemini.engine.system_memory import SystemMemory

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    gc.collect()  # an earlier test's engine, collected later in this test, would close its files here
    before = open_fds()
    system = SystemMemory(torch.device("cpu"))
    system.host_rss_bytes()
    system.host_available_bytes()
    assert open_fds() == before + 2
    ctx = multiprocessing.get_context("fork")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_child_rss_reading, args=(system, child_conn))
    child.start()
    assert parent_conn.poll(60), "the forked child did not answer"
    reading, psutils = parent_conn.recv()
    child.join(30)
    assert child.exitcode == 0
    assert abs(reading - psutils) < 4 * 2**20
    for end in (parent_conn, child_conn, child):
        end.close()
    system.close()
    assert open_fds() == before
    dropped = SystemMemory(torch.device("cpu"))
    dropped.host_rss_bytes()
    del dropped
    gc.collect()
    assert open_fds() == before


def test_a_hybrid_step_times_both_halves():
    """Optimizer states split between the tiers: each half's Adam time is reported, and the
    device half runs first (see [Note: both halves of a hybrid step at once])."""
    from chunks import Tier
    from gemini.optim.adam_batches import AdamBatch, device_first

    host, dev = AdamBatch(tier=Tier.HOST, members=[]), AdamBatch(tier=Tier.DEVICE, members=[])
    assert device_first([host, dev, host]) == [dev, host, host]
    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(
        device=DEVICE, placement="static", chunk_size=2000, static_optimizer_offload_fraction=0.5), lr=1e-2)
    for x, y in batches(TINY, 2):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
    r = opt.report
    assert 0 < r.os_chunks_on_device < r.os_chunks_total
    assert r.optimizer_cpu_seconds > 0 and r.optimizer_device_seconds > 0
