"""The GPU benchmarks' logic, checked on the CPU before a lent GPU's scarce minutes depend on it:
the capacity search finds the deepest model that trains and stops cleanly at its deadline, and
the peers' benchmark trains every contender from the same start on the same data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_gpu_capacity  # noqa: E402
import bench_peers  # noqa: E402


def _search_with(monkeypatch, trains, *, start=8, time_limit=1000.0, timeout_after=None):
    """bench_gpu_capacity.search over a fake trial: ``trains(layers)`` says whether it trains;
    after ``timeout_after`` trials every trial runs out of time."""
    asked = []

    def fake_trial(args, layers, placement="auto", timeout=None):
        asked.append(layers)
        if timeout_after is not None and len(asked) > timeout_after:
            return {"layers": layers, "placement": placement, "ok": False, "timed_out": True, "error": "time"}
        return {"layers": layers, "placement": placement, "ok": trains(layers), "error": "over budget"}

    monkeypatch.setattr(bench_gpu_capacity, "trial", fake_trial)
    args = argparse.Namespace(start_layers=start, time_limit=time_limit)
    return bench_gpu_capacity.search(args), asked


@pytest.mark.parametrize("deepest", [8, 9, 37, 63, 64, 300])
def test_capacity_search_finds_the_deepest_model_that_trains(monkeypatch, deepest):
    rows, asked = _search_with(monkeypatch, lambda layers: layers <= deepest)
    trained = [r["layers"] for r in rows if r["ok"]]
    refused = [r["layers"] for r in rows if not r["ok"]]
    assert max(trained) == deepest
    assert min(refused) == deepest + 1  # the boundary was tried from both sides
    assert asked[:2] == [8, 16]  # doubling first
    assert len(asked) == len(set(asked))  # nothing tried twice


def test_capacity_search_stops_at_its_deadline_without_calling_that_a_failure(monkeypatch):
    rows, asked = _search_with(monkeypatch, lambda layers: layers <= 100, timeout_after=3)
    assert [r["layers"] for r in rows] == [8, 16, 32]  # the 4th trial ran out of time
    assert all(r["ok"] for r in rows)
    assert asked == [8, 16, 32, 64]


def test_capacity_search_below_its_start_bisects_down(monkeypatch):
    rows, asked = _search_with(monkeypatch, lambda layers: layers <= 3)
    assert asked == [8, 4, 2, 3]
    assert max(r["layers"] for r in rows if r["ok"]) == 3


def test_capacity_search_where_nothing_trains_says_so_down_to_one_layer(monkeypatch):
    rows, asked = _search_with(monkeypatch, lambda layers: False)
    assert asked == [8, 4, 2, 1]
    assert not any(r["ok"] for r in rows)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_peers_contenders_start_alike_and_gemini_trains_like_plain_adamw(micro_batches):
    """Same initial values, same batches: with fp32, gemini (states on the host, or in the
    margin) gives plain fused AdamW's losses exactly, so the table compares like with like (with
    gradient accumulation too)."""
    args = argparse.Namespace(device="cpu", model="gpt-small", steps=3, warmup=1, device_memory=None, port=0,
                              micro_batches=micro_batches)
    plain = bench_peers.run_one("torch AdamW(fused)", args)
    for name in ("gemini auto (ratio 0)", "gemini auto (ratio 1)"):
        got = bench_peers.run_one(name, args)
        assert got["ok"] and got["n_params"] == plain["n_params"]
        assert got["losses"] == plain["losses"], name
    assert len(set(plain["losses"])) == len(plain["losses"])  # it trains: the loss moves


def test_interleaved_rounds_rotate_who_goes_first():
    """bench_step's rounds: every contender timed once a round, and each round starts with the
    next one, so running right after another's optimizer step (cold caches) is shared out."""
    import bench_step

    calls = []
    contenders = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    times = bench_step.interleave(contenders, rounds=6, warmup=1, device="cpu")
    assert {name: len(ts) for name, ts in times.items()} == {"a": 6, "b": 6, "c": 6}
    timed = calls[3:]  # after the warm-up round
    assert [timed[3 * r] for r in range(6)] == ["a", "b", "c", "a", "b", "c"]
    assert all(sorted(timed[3 * r : 3 * r + 3]) == ["a", "b", "c"] for r in range(6))


def test_capacity_trial_of_a_model_the_host_cannot_hold_is_a_row_not_a_run(monkeypatch):
    """Model data above the host's available memory: no process is started (on the H200 run a
    224-layer trial spent its time pinning 184 GB on a 125 GiB host), the row says why; with
    NVMe the host need not hold it, and the trial runs."""
    started = []
    monkeypatch.setattr(bench_gpu_capacity.subprocess, "run", lambda *a, **k: started.append(a) or _Done())
    args = argparse.Namespace(nvme_dir=None, vocab=50304, seq=1024, heads=16, embd=2048, passthrough=[])
    layers = 2 * psutil.virtual_memory().total // (16 * 12 * 2048 * 2048) + 1  # twice the host, in blocks alone
    row = bench_gpu_capacity.trial(args, layers)
    assert not row["ok"] and "not tried" in row["error"] and not started
    args.nvme_dir = "/tmp/nvme"
    bench_gpu_capacity.trial(args, layers)
    assert started


class _Done:
    stdout = 'RESULT {"ok": true}\n'
    stderr = ""
    returncode = 0


def test_peers_run_gemini_last_at_the_named_peers_measured_peak(monkeypatch):
    """After the contenders, gemini auto (ratio 1) runs once more with device_memory = the peak
    the named peer measured ([Note: gemini at a peer's peak]); without that peer's peak (it
    failed, or the CPU stand-in measures none) no such row."""
    asked, written = [], []

    def fake_run(name, args, *, device_memory=None):
        asked.append((name, device_memory))
        ok = name != "DeepSpeed ZeRO-2 offload"
        return {"contender": name, "ok": ok, "peak_device_bytes": 123456789 if ok else None, "error": "x"}

    monkeypatch.setattr(bench_peers, "run_isolated", fake_run)
    monkeypatch.setattr(bench_peers, "write_results", lambda stem, result, md: written.append(result))
    monkeypatch.setattr(bench_peers, "markdown", lambda result: "")
    for peer, extra in (("torchao CPUOffloadOptimizer", True), ("DeepSpeed ZeRO-2 offload", False)):
        asked.clear()
        monkeypatch.setattr(sys, "argv", ["bench_peers.py", "--device", "cpu", "--model", "gpt-small",
                                          "--at-peak-of", peer])
        assert bench_peers.main() == 0
        names = [r["contender"] for r in written[-1]["rows"]]
        assert names[: len(bench_peers.CONTENDERS)] == bench_peers.CONTENDERS
        if extra:
            assert asked[-1] == ("gemini auto (ratio 1)", 123456789)
            assert names[-1] == f"gemini auto (ratio 1) at {peer}'s peak"
        else:
            assert len(names) == len(bench_peers.CONTENDERS) and all(m is None for _, m in asked)
