"""gemini-offload: train models whose parameters, gradients and Adam states exceed the device."""

from gemini.checkpoint import consolidate_checkpoint, load_checkpoint, save_checkpoint
from gemini.config import GeminiConfig
from gemini.errors import DeviceBudgetError
from gemini.initialize import initialize
from gemini.optim.loss_scaler import DynamicLossScaler
from gemini.module import GeminiModel
from gemini.optim.hybrid_adam import HybridAdam
from gemini.tools.planner import PlacementPlan, plan_placement
from gemini.tools.plots import plot_memory, plot_timeline
from gemini.pretrained import save_pretrained
from gemini.report import (MemoryReport, ReportRun, TimelinePeriod, WarmupTimeline, rank_report_path, read_report_runs,
                           read_reports)
from gemini.tools.summary import run_summary, summary_line
from gemini.tools.tune import MarginTrial, MarginTuning, Measurement, tune_margin

__all__ = [
    "DeviceBudgetError",
    "DynamicLossScaler",
    "GeminiConfig",
    "GeminiModel",
    "HybridAdam",
    "MarginTrial",
    "MarginTuning",
    "Measurement",
    "MemoryReport",
    "PlacementPlan",
    "ReportRun",
    "TimelinePeriod",
    "WarmupTimeline",
    "consolidate_checkpoint",
    "initialize",
    "load_checkpoint",
    "plan_placement",
    "plot_memory",
    "plot_timeline",
    "rank_report_path",
    "read_report_runs",
    "read_reports",
    "run_summary",
    "save_checkpoint",
    "save_pretrained",
    "summary_line",
    "tune_margin",
]
