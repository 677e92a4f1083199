"""Trace names reach a running profiler, and cost nothing without one."""

from __future__ import annotations

import torch

import gemini
from gemini.tools.gpt import GPT
from helpers import TINY, batches, make_gpt


def _steps(n: int, config: gemini.GeminiConfig) -> None:
    """``n`` steps on the CPU stand-in, under a budget sized for it that makes auto evict."""
    model, opt = gemini.initialize(make_gpt(), config, lr=1e-2)
    for x, y in batches(TINY, n, device=config.device):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
    opt.close()


def test_no_profiler_no_record_function(monkeypatch):
    calls = []
    real = torch.profiler.record_function
    monkeypatch.setattr(torch.profiler, "record_function", lambda name, *a: calls.append(name) or real(name, *a))
    # auto with a budget: the warm-up tracer, period hooks, evictions and chunk moves all run
    _steps(3, gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=2000, device_memory="1200KiB"))
    assert calls == []


def test_a_running_profiler_sees_the_trace_names():
    config = gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=2000, device_memory="1200KiB")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _steps(2, config)
    names = {e.key for e in prof.key_averages()}
    for expected in ("gemini::trace", "gemini::transfer", "gemini::post_forward", "gemini::adam_host"):
        assert expected in names, sorted(n for n in names if n.startswith("gemini::"))
