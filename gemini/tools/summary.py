"""Readable summaries of memory reports: one line per step, and a whole run in a few lines."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from gemini.report import MemoryReport

__all__ = ["GiB", "UNITS", "gib", "readable_unit", "run_summary", "summary_line"]

GiB = 2**30
UNITS = {"GiB": GiB, "MiB": 2**20}


def _unit(unit: str) -> str:
    """``unit`` as UNITS spells it ("mib" is "MiB"), or ValueError naming the accepted ones."""
    for name in UNITS:
        if isinstance(unit, str) and unit.lower() == name.lower():
            return name
    raise ValueError(f"unit={unit!r} is invalid: expected one of {list(UNITS)} (case-insensitive)")


def gib(nbytes: int | None, unit: str = "GiB") -> str:
    """Bytes in ``unit`` (GiB by default) with three decimals, "-" for not measured. One unit in every column, so
    that lines of different steps and runs line up and compare at a glance."""
    return "-" if nbytes is None else f"{nbytes / UNITS[unit]:.3f}"


def readable_unit(max_bytes: float) -> tuple[str, int]:
    """A unit for a table or axis whose largest value is ``max_bytes``: GiB from 1 GiB up, else MiB, so that figures
    keep a few significant digits."""
    return ("GiB", GiB) if max_bytes >= GiB else ("MiB", UNITS["MiB"])


def _share_of_budget(nbytes: int, budget_bytes: int | None, unit: str) -> str:
    if not budget_bytes:
        return ""
    return f" = {100 * nbytes / budget_bytes:.0f}% of {gib(budget_bytes, unit)}"


def summary_line(report: MemoryReport, *, loss: float | None = None, unit: str = "GiB",
                 total: int | None = None) -> str:
    """One line: time (transfers vs compute), device peak against the budget, model and non-model bytes, host and
    NVMe, bytes moved, optimizer-state chunks on the device. Sizes are in ``unit`` ("GiB" or "MiB",
    case-insensitive). Steps are counted from 1 ("step   1" is the report with ``step == 0``); with ``total``, the
    step reads as "step   1/4"."""
    if not isinstance(report, MemoryReport):  # optimizer.report is None before the first step
        raise TypeError(f"summary_line takes a MemoryReport (optimizer.report after a step), got {report!r}")
    unit = _unit(unit)
    r = report
    uses_nvme = r.nvme_bytes or r.nvme_read_bytes or r.nvme_write_bytes or r.nvme_wait_seconds
    timing = f"transfers {r.transfer_seconds:.2f}"
    if uses_nvme:
        timing += f", NVMe wait {r.nvme_wait_seconds:.2f}"
    # Text counts steps from 1 (the report's ``step`` is 0-based): "step 1/4" for the first of four, as people count.
    parts = [f"step {r.step + 1:>3}" + (f"/{total}" if total is not None else "")]
    if loss is not None:
        parts.append(f"loss {loss:.4f}")
    parts += [
        f"{r.step_seconds:.2f} s ({timing}, compute {r.compute_seconds:.2f})",
        f"device peak {gib(r.device_peak_bytes, unit)} {unit}"
        f"{_share_of_budget(r.device_peak_bytes, r.device_budget_bytes, unit)}"
        f" (model {gib(r.device_model_bytes, unit)}, non-model {gib(r.device_non_model_peak_bytes, unit)})",
        f"host {gib(r.host_model_bytes, unit)}",
        f"NVMe {gib(r.nvme_bytes, unit)}",
        f"moved h2d {gib(r.h2d_bytes, unit)} d2h {gib(r.d2h_bytes, unit)}"
        + (f" NVMe r {gib(r.nvme_read_bytes, unit)} w {gib(r.nvme_write_bytes, unit)}" if uses_nvme else ""),
        f"OS chunks on device {r.os_chunks_on_device}/{r.os_chunks_total}",
    ]
    if r.world_size > 1:
        parts.append(f"ZeRO rank {r.rank}/{r.world_size}: reduced {gib(r.grad_reduce_bytes, unit)}"
                     + (f", gathered {r.param_gathers} param chunks ({gib(r.param_gather_bytes, unit)})"
                        if r.param_gathers else ""))
    if r.skipped:
        parts.append(f"SKIPPED (fp16 overflow; loss scale {r.loss_scale:g})")
    return " | ".join(parts)


def run_summary(reports: Sequence[MemoryReport], *, unit: str = "GiB") -> str:
    """A few lines over a whole run: step time and its split, peaks, tiers, traffic, skips. Steps are counted from
    1, as in :func:`summary_line`."""
    unit = _unit(unit)
    if not reports:
        return "no reports"
    # The first step is a warm-up (traced, conservative): timed apart from the others.
    several = len(reports) > 1
    steady = list(reports[1:]) if several else list(reports)
    step_s = statistics.median(r.step_seconds for r in steady)
    total_s = sum(r.step_seconds for r in steady) or 1.0
    share = {
        "transfers": sum(r.transfer_seconds for r in steady) / total_s,
        "NVMe waits": sum(r.nvme_wait_seconds for r in steady) / total_s,
        "compute": sum(r.compute_seconds for r in steady) / total_s,
    }
    split = ", ".join(f"{k} {100 * v:.0f}%" for k, v in share.items())
    peak = max(reports, key=lambda r: r.device_peak_bytes)
    skipped = sum(r.skipped for r in reports)
    non_model = [r.device_non_model_peak_bytes for r in reports if r.device_non_model_peak_bytes is not None]
    rss = [r.host_rss_bytes for r in reports if r.host_rss_bytes is not None]
    last = reports[-1]

    def size(nbytes: int | None) -> str:
        return "-" if nbytes is None else f"{gib(nbytes, unit)} {unit}"

    if several:
        timing = (f"step time median {step_s:.3f} s after the first ({reports[0].step_seconds:.3f} s, "
                  f"the warm-up): {split}")
    else:
        timing = f"step time {step_s:.3f} s (the warm-up alone): {split}"
    budget = peak.device_budget_bytes
    against = (f" = {100 * peak.device_peak_bytes / budget:.0f}% of the {size(budget)} budget" if budget
               else " (no device budget)")
    where = "median after the first" if several else "the one step"
    lines = [
        f"{len(reports)} step{'s' if several else ''} ({skipped} skipped); {timing}",
        f"device peak {size(peak.device_peak_bytes)} at step {peak.step + 1}{against}; "
        f"model data on the device at the end {size(last.device_model_bytes)}, "
        f"non-model peak {size(max(non_model) if non_model else None)}",
        f"host: chunks {size(last.host_model_bytes)}, pool {size(last.host_pool_bytes)}, "
        f"process RSS max {size(max(rss) if rss else None)}; NVMe {size(last.nvme_bytes)}",
        f"moved per step ({where}): "
        + ", ".join(f"{name} {size(int(statistics.median(getattr(r, f'{key}_bytes') for r in steady)))}"
                    for name, key in (("h2d", "h2d"), ("d2h", "d2h"), ("NVMe read", "nvme_read"),
                                      ("NVMe write", "nvme_write"))),
    ]
    whole = [r.device_used_peak_bytes for r in reports if r.device_used_peak_bytes is not None]
    if whole:
        lines.append(f"whole GPU (NVML) used peak {size(max(whole))}")
    return "\n".join(lines)
