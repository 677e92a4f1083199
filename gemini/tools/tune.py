"""The margin tuner: try ``gpu_margin_mem_ratio`` values, recommend the fastest that keeps headroom.

[Note: what the ratio trades]
Under placement="auto" the margin (budget − reserve − the warm-up's planned peak) times ``gpu_margin_mem_ratio``
holds whole optimizer-state chunk groups on the device, updated there and never copied. A larger ratio moves Adam
work off the host but leaves less room to cache parameter chunks, so more are fetched again each iteration; which
side wins depends on the model, the batch and the machine, so the tuner runs a few steps at each ratio and measures.

[Note: needed memory, not the measured peak]
Under auto the engine fills whatever the budget leaves with cached parameter chunks, evicting them when a period
needs the room: the measured device peak is close to the budget at every ratio and says nothing about how close a
ratio runs to the edge. What a step *needs* is what the engine cannot evict: the warm-up's planned peak
(``MemoryPlan.planned_peak_bytes``: at each decision of the schedule, the chunks in use, the buffers and the
non-model memory, never below the warm-up's measured peak), plus the chunk groups the margin pinned on the device
(each with its parameters, gradients, master, m, v), plus the safety reserve the engine keeps free beside them. That
sum is ``needed_bytes``: the ``device_memory`` the step trains in (an upper bound: a pinned group's parameters may
already be in the planned peak; without the reserve a budget of that size would be refused). A ratio keeps the
headroom when ``needed_bytes <= (1 − headroom_fraction) × budget``: the room left is what longer sequences or
fragmentation can use after the engine evicts its cache. Both figures are reported.

[Note: one engine at a time]
Each trial builds a whole new model and engine. Where ``model_fn`` and ``loss_fn`` pickle, each trial runs in a fresh
``spawn`` process (``isolate=None`` or ``True``): every trial starts from the same clean state (no allocator cache or
pinned pool warmed by the trial before) and its memory goes back to the system when it exits. Otherwise
(``isolate=False``) they run here, each engine closed (which frees it: ``GeminiRuntime.close``) before the next.

How trials become a recommendation ([Note: timing within noise]) is in :mod:`gemini.tools.tune_results`, whose names
this module re-exports.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import multiprocessing
import pickle
import resource
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from gemini.policies import placement_type
from gemini.config import GeminiConfig
from gemini.initialize import initialize
from gemini.tools.loop import train_steps
from gemini.engine.memory import DeviceBudgetError
from gemini.report import MemoryReport
from gemini.tools.tune_results import (MarginTrial, MarginTuning, Measurement, RatioResult, limit_bytes, recommend,
                                       summarize, tied_fastest)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_RATIOS", "MarginTrial", "MarginTuning", "Measurement", "RatioResult", "measure_reports",
           "recommend", "summarize", "tied_fastest", "tune_margin"]

DEFAULT_RATIOS = (0.0, 0.25, 0.5, 0.75, 1.0)


def measure_reports(ratio: float, reports: Sequence[MemoryReport]) -> Measurement:
    """The default measurement: the median step time after the first step (a warm-up, traced and conservative,
    unlike the steps that follow) and the highest device peak of all."""
    timed = reports[1:] or reports
    return Measurement(step_seconds=statistics.median(r.step_seconds for r in timed),
                       device_peak_bytes=max(r.device_peak_bytes for r in reports))


def tune_margin(
    model_fn: Callable[[], nn.Module],
    loss_fn: Callable[[nn.Module], torch.Tensor],
    config: GeminiConfig,
    *,
    ratios: Sequence[float] = DEFAULT_RATIOS,
    steps: int = 4,
    rounds: int = 3,
    headroom_fraction: float = 0.1,
    measure: Callable[[float, Sequence[MemoryReport]], Measurement] = measure_reports,
    on_trial: Callable[[MarginTrial], None] | None = None,
    isolate: bool | None = None,
    **initialize_kwargs: Any,
) -> MarginTuning:
    """Train ``steps`` steps at each ratio, ``rounds`` times interleaved, and recommend the fastest (within noise,
    then the least device memory) that keeps the headroom.

    ``model_fn()`` builds a fresh model for each trial (the same one each time: seed it); ``loss_fn(model)`` runs
    forward and returns the loss. ``config`` needs placement="auto" and a ``device_memory`` budget; its
    ``gpu_margin_mem_ratio`` and ``report_path`` are replaced. ``measure(ratio, reports)`` turns a trial's reports
    into a :class:`Measurement` (inject one to control timing; a ``needed_bytes`` it gives replaces the engine's);
    ``on_trial`` sees each trial as it ends. ``isolate``: run each trial in its own process (None: when ``model_fn``
    and ``loss_fn`` pickle; see [Note: one engine at a time]). ``initialize_kwargs`` (``lr``, ``weight_decay``, ...)
    go to :func:`gemini.initialize`. See
    [Note: timing within noise], [Note: what the ratio trades] and [Note: needed memory, not the measured peak].
    """
    if isinstance(model_fn, nn.Module) or not callable(model_fn):  # each trial needs a fresh model
        raise TypeError(f"model_fn={type(model_fn).__name__} is invalid: expected a function building a fresh model "
                        f"for each trial (e.g. lambda: GPT(cfg), seeded), not a model")
    if not placement_type(config.placement).has_margin:
        raise ValueError(f"GeminiConfig.placement={config.placement!r} is invalid for tune_margin: expected 'auto' "
                         f"(only auto placement has a margin)")
    if config.device_memory is None:
        raise ValueError("GeminiConfig.device_memory=None is invalid for tune_margin: expected a budget (bytes or "
                         "'8GiB') whose headroom the recommendation keeps")
    ratios = list(ratios)
    if not ratios or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r <= 1 for r in ratios):
        raise ValueError(f"ratios={ratios!r} is invalid: expected a non-empty list of numbers in [0, 1]")
    ratios = [float(r) for r in dict.fromkeys(ratios)]
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
        raise ValueError(f"steps={steps!r} is invalid: expected an int >= 2 (the first step is a warm-up)")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: expected an int >= 1")
    if not (isinstance(headroom_fraction, (int, float)) and 0 <= headroom_fraction < 1):
        raise ValueError(f"headroom_fraction={headroom_fraction!r} is invalid: expected a number in [0, 1)")
    if isolate is None:
        isolate = _picklable(model_fn, loss_fn, initialize_kwargs)
    elif isolate and not _picklable(model_fn, loss_fn, initialize_kwargs):
        raise ValueError("isolate=True is invalid here: model_fn, loss_fn and the initialize arguments must pickle "
                         "(module-level functions or objects) to run in their own process; pass isolate=False")
    trials: list[MarginTrial] = []
    total = rounds * len(ratios)
    for round_index in range(rounds):
        shift = round_index % len(ratios)
        for ratio in ratios[shift:] + ratios[:shift]:
            trial_config = dataclasses.replace(config, gpu_margin_mem_ratio=ratio, report_path=None)
            args = (model_fn, loss_fn, trial_config, steps, initialize_kwargs)
            run = _run_isolated if isolate else _run_trial
            trial, reports = run(*args)
            if not trial.failed:
                m = measure(ratio, reports)
                trial.step_seconds, trial.device_peak_bytes = m.step_seconds, m.device_peak_bytes
                if m.needed_bytes is not None:
                    trial.needed_bytes = m.needed_bytes
            trial.round = round_index
            trials.append(trial)
            logger.info("margin trial %d/%d: %s", len(trials), total, trial)
            if on_trial is not None:
                on_trial(trial)
    limit = limit_bytes(config.device_memory, headroom_fraction)
    results = summarize(trials)
    hosts = [t.host_peak_bytes for t in trials if t.host_peak_bytes is not None]
    return MarginTuning(trials=trials, budget_bytes=config.device_memory, headroom_fraction=headroom_fraction,
                        recommended_ratio=recommend(results, limit_bytes=limit), results=results,
                        host_peak_bytes=_max_rss_bytes(), trial_host_peak_bytes=max(hosts) if hosts else None)


def _picklable(*objects) -> bool:
    try:
        pickle.dumps(objects)
    except Exception:  # noqa: BLE001 - any failure means "cannot ship it to another process"
        return False
    return True


def _max_rss_bytes() -> int:
    """This process's peak resident memory (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _run_isolated(model_fn, loss_fn, config, steps, initialize_kwargs):
    """:func:`_run_trial` in a fresh process (spawn: a forked torch can hang in OpenMP)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_run_trial, model_fn, loss_fn, config, steps, initialize_kwargs, isolated=True).result()


def _run_trial(model_fn, loss_fn, config: GeminiConfig, steps: int, initialize_kwargs, *,
               isolated: bool = False) -> tuple[MarginTrial, list[MemoryReport]]:
    ratio = config.gpu_margin_mem_ratio
    model, optimizer = initialize(model_fn(), config, **initialize_kwargs)
    try:
        results = train_steps(model, optimizer, loss_fn, steps=steps)
        needed = _needed_bytes(optimizer)
    except DeviceBudgetError as e:
        return MarginTrial(ratio=ratio, os_chunks_on_device=None, os_chunks_total=None, step_seconds=None,
                           device_peak_bytes=None, error=str(e)), []
    finally:
        optimizer.close()
        del model, optimizer
        gc.collect()
    reports = [r.report for r in results]
    # Placeholders until the caller's measure() runs on the reports.
    trial = MarginTrial(ratio=ratio, os_chunks_on_device=reports[-1].os_chunks_on_device,
                        os_chunks_total=reports[-1].os_chunks_total, step_seconds=0.0,
                        device_peak_bytes=max(r.device_peak_bytes for r in reports), needed_bytes=needed,
                        host_peak_bytes=_max_rss_bytes() if isolated else None)
    return trial, reports


def _needed_bytes(optimizer) -> int | None:
    """The warm-up's planned peak plus every chunk group pinned on the device and the reserve (see
    [Note: needed memory, not the measured peak]); None without a plan."""
    runtime = optimizer._rt
    plan, placement = runtime.plan, runtime.placement
    if plan is None:
        return None
    pinned = getattr(placement, "os_on_device", set())
    return plan.planned_peak_bytes + plan.reserve_bytes + sum(placement.group_device_bytes(g)
                                                              for g in runtime.manager.groups if g.index in pinned)
