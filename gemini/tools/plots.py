"""PNG plots of memory reports: memory per step by tier and kind, and the warm-up timeline.

matplotlib is an optional extra (``pip install 'gemini-offload[plot]'``), imported when a plot is drawn, never at
``import gemini``. Figures are drawn on the Agg canvas without pyplot, so plotting changes no global matplotlib state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from gemini.report import MemoryReport, WarmupTimeline
from gemini.tools.summary import readable_unit

logger = logging.getLogger(__name__)

__all__ = ["plot_memory", "plot_timeline", "require_matplotlib"]

# Chunk kinds as plotted: (label, kinds in MemoryReport.model_bytes_by_tier, colour).
_KINDS = (
    ("parameters", ("param",), "tab:blue"),
    ("gradients", ("grad",), "tab:orange"),
    ("fp32 masters", ("master",), "tab:green"),
    ("Adam m, v", ("exp_avg", "exp_avg_sq"), "tab:purple"),
)
_TIER_TOTALS = {"device": "device_model_bytes", "host": "host_model_bytes", "nvme": "nvme_bytes"}
_PHASE_COLOURS = {"forward": "tab:blue", "backward": "tab:orange", "recompute": "tab:green"}


def _matplotlib() -> SimpleNamespace:
    """The few matplotlib classes the plots use, imported on first use."""
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError(
            f"plots need matplotlib, which is not installed ({e}): pip install 'gemini-offload[plot]'"
        ) from None
    return SimpleNamespace(Figure=Figure, Patch=Patch, MaxNLocator=MaxNLocator)


def require_matplotlib() -> None:
    """Raises now the ImportError (saying how to install matplotlib) that drawing a plot would raise: the CLI calls
    it when ``--plot-dir`` is given, before a model is built or trained."""
    _matplotlib()


def _save(fig, path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.suffix:  # matplotlib would write path + ".png": return the file written
        path = path.with_suffix(".png")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    logger.info("wrote %s", path)
    return path


def _kind_bytes(report: MemoryReport, tier: str) -> list[tuple[str, int, str]]:
    """(label, bytes, colour) per kind on ``tier``; one total when the report has no breakdown (older files)."""
    by_kind = report.model_bytes_by_tier.get(tier)
    if not by_kind:
        return [("chunks (all kinds)", getattr(report, _TIER_TOTALS[tier]), "tab:gray")]
    return [(label, sum(by_kind.get(k, 0) for k in kinds), colour) for label, kinds, colour in _KINDS]


def plot_memory(reports: Sequence[MemoryReport], path: str | os.PathLike) -> Path:
    """Memory per step, one panel per tier (device, host, and NVMe when used): chunk bytes at the end of the step
    stacked by kind; on the device panel the measured peak, the chunks' peak and the budget, on the host panel the
    process's resident memory. Returns the PNG's path."""
    if not reports:
        raise ValueError("plot_memory needs at least one report")
    mpl = _matplotlib()
    tiers = [("device", "device"), ("host", "host memory")]
    if any(r.nvme_bytes for r in reports):
        tiers.append(("nvme", "NVMe"))
    top = max(
        max(r.device_peak_bytes, r.device_budget_bytes or 0, r.host_rss_bytes or 0, r.host_model_bytes, r.nvme_bytes)
        for r in reports
    )
    unit, scale = readable_unit(top)
    fig = mpl.Figure(figsize=(10, 2.8 * len(tiers) + 0.5), layout="constrained")
    axes = fig.subplots(len(tiers), 1, sharex=True, squeeze=False)[:, 0]
    steps = [r.step for r in reports]
    for ax, (tier, title) in zip(axes, tiers):
        bottom = [0.0] * len(reports)
        segments = [_kind_bytes(r, tier) for r in reports]
        for k, (label, _, colour) in enumerate(segments[0]):
            heights = [seg[k][1] / scale for seg in segments]
            ax.bar(steps, heights, bottom=bottom, label=f"{label} (end of step)", color=colour, width=0.8)
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set_title(f"{title}: chunks by kind at the end of each step" + (", and peaks" if tier == "device" else ""))
        ax.set_ylabel(unit)
    device_ax, host_ax = axes[0], axes[1]
    device_ax.plot(steps, [r.device_peak_bytes / scale for r in reports], "k.-", label="measured peak")
    device_ax.plot(steps, [r.device_model_peak_bytes / scale for r in reports], ".--", color="tab:gray",
                   label="chunks, peak in the step")
    budget = reports[0].device_budget_bytes
    if budget:
        device_ax.axhline(budget / scale, color="tab:red", linestyle="--", label="budget")
    rss = [r.host_rss_bytes for r in reports]
    if all(v is not None for v in rss):
        host_ax.plot(steps, [v / scale for v in rss], "k.-", label="process RSS")
    for ax in axes:
        ax.set_ylim(bottom=0)  # after every artist: fixing a limit stops autoscaling
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(mpl.MaxNLocator(integer=True))
    return _save(fig, path)


def plot_timeline(timeline: WarmupTimeline, path: str | os.PathLike) -> Path:
    """The warm-up iteration period by period: each period's non-model peak (coloured by forward / backward /
    recompute) against the budget and the budget less the reserve and buffers. Returns the PNG's path."""
    if not isinstance(timeline, WarmupTimeline):  # report.timeline is None but under placement auto
        raise TypeError(f"plot_timeline takes a WarmupTimeline (report.timeline of the step that ended placement "
                        f"auto's warm-up, or optimizer.timeline), got {type(timeline).__name__}")
    periods = timeline.periods
    if not periods:
        raise ValueError("the timeline has no periods")
    mpl = _matplotlib()
    unit, scale = readable_unit(timeline.budget_bytes)
    fig = mpl.Figure(figsize=(max(10.0, min(24.0, 0.12 * len(periods))), 4.5), layout="constrained")
    ax = fig.subplots()
    xs = range(len(periods))
    ax.bar(xs, [p.non_model_bytes / scale for p in periods], width=1.0,
           color=[_PHASE_COLOURS.get(p.phase, "tab:gray") for p in periods])
    budget = ax.axhline(timeline.budget_bytes / scale, color="tab:red", linestyle="--", label="budget")
    usable = timeline.budget_bytes - timeline.reserve_bytes - timeline.fixed_bytes
    room = ax.axhline(usable / scale, color="tab:red", linestyle=":", label="budget - reserve - buffers")
    phases = [mpl.Patch(color=colour, label=f"non-model peak, {phase}")
              for phase, colour in _PHASE_COLOURS.items() if any(p.phase == phase for p in periods)]
    ax.set_ylim(bottom=0)
    ax.set_xlabel("period of the warm-up iteration (module hooks, forward then backward)")
    ax.set_ylabel(unit)
    ax.set_title(
        f"warm-up: peak {timeline.warmup_peak_bytes / scale:.1f} {unit} of a {timeline.budget_bytes / scale:.1f} "
        f"{unit} budget; margin {max(0, timeline.margin_bytes) / scale:.1f} {unit}"
    )
    ax.legend(handles=[budget, room, *phases], loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    return _save(fig, path)
