"""`MemoryReport`: where every byte went in one step, and where the time went.

Also the warm-up's per-period timeline (:class:`WarmupTimeline`) carried by the report of the step ending a warm-up,
and the JSON Lines file of reports (:class:`ReportWriter`, :func:`read_reports`).
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Any

__all__ = ["MemoryReport", "ReportRun", "ReportWriter", "TimelinePeriod", "WarmupTimeline", "rank_report_path",
           "read_report_runs", "read_reports"]


@dataclass(kw_only=True)
class TimelinePeriod:
    """One period of the traced warm-up iteration: between two module hooks."""

    phase: str  # "forward", "backward" or "recompute" (activation checkpointing)
    module: str  # the module whose hook starts the period ("" is the root module)
    non_model_bytes: int  # the device's peak besides model data (activations, workspaces)
    chunk_groups: list[int]  # chunk groups the period uses


@dataclass(kw_only=True)
class WarmupTimeline:
    """What the warm-up measured, period by period, and the budget it planned against.

    ``margin_bytes`` = budget − reserve − the warm-up's planned peak (see
    ``gemini.policies.plan.MemoryPlan.planned_peak_bytes``): the room ``gpu_margin_mem_ratio`` shares out to
    optimizer-state chunk groups (and, with activation offload, saved activations kept on the device).
    """

    periods: list[TimelinePeriod]
    budget_bytes: int
    reserve_bytes: int  # kept free under the budget (see gemini/engine/memory.py, the safety reserve)
    fixed_bytes: int  # buffers on the device
    warmup_peak_bytes: int  # the device's measured peak over the warm-up iteration
    warmup_model_peak_bytes: int  # the most chunk bytes the warm-up held on the device at once
    margin_bytes: int

    @property
    def max_non_model_bytes(self) -> int:
        return max((p.non_model_bytes for p in self.periods), default=0)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WarmupTimeline:
        values = dict(data)
        values["periods"] = [TimelinePeriod(**p) for p in values["periods"]]
        return cls(**values)


@dataclass(kw_only=True)
class MemoryReport:
    """One training step (forward, backward and optimizer step) as measured.

    Byte counts of chunks are sums of payloads allocated by the chunk storage; transfer counts are summed at each
    copy. ``device_peak_bytes`` is measured by the CUDA allocator on CUDA, by the tensor-accounting monitor on the CPU
    stand-in when one runs (else it is the chunk ledger's peak, and ``device_non_model_peak_bytes`` is None: "not
    measured"). Times are in seconds.
    """

    step: int
    device_peak_bytes: int
    device_model_bytes: int  # chunk payloads on the device at the end of the step
    # The step's most device bytes besides chunks and buffers (see [Note: the step's non-model peak] in
    # gemini/engine/memory.py); None when nothing measures.
    device_non_model_peak_bytes: int | None
    host_model_bytes: int  # chunk payloads in host memory at the end of the step
    nvme_bytes: int
    h2d_bytes: int
    d2h_bytes: int
    nvme_read_bytes: int
    nvme_write_bytes: int
    chunks_on_device: int  # chunk payloads (any kind) with a device copy
    os_chunks_on_device: int  # chunk groups whose optimizer states are on the device
    step_seconds: float  # end of the previous step() to the end of this one
    # Host time in host <-> device copies. On CUDA a copy from or to pinned memory runs on a side stream beside
    # compute, and only its launch counts here (the host's cost of it).
    transfer_seconds: float
    optimizer_cpu_seconds: float
    optimizer_device_seconds: float
    skipped: bool  # fp16 overflow: the step was skipped
    loss_scale: float
    # Beyond the contract:
    device_model_peak_bytes: int = 0  # the chunk ledger's device peak over the step
    device_budget_bytes: int | None = None
    # Global norm before clipping (unscaled), when computed; inf when the gradients held inf or nan (fp16 skips such
    # a step).
    grad_norm: float | None = None
    host_rss_bytes: int | None = None  # the process's resident memory (psutil)
    nvme_wait_seconds: float = 0.0  # time the step waited for NVMe reads and writes
    host_pool_bytes: int = 0  # host buffers held by the pinned pool (in use or idle)
    os_chunks_total: int = 0  # trainable chunk groups, wherever their optimizer states are
    # Chunk payloads at the end of the step: tier ("device", "host", "nvme") -> chunk kind ("param", "grad", "master",
    # "exp_avg", "exp_avg_sq") -> bytes. A chunk with copies on two tiers counts on both, as in the totals above.
    model_bytes_by_tier: dict[str, dict[str, int]] = field(default_factory=dict)
    host_available_bytes: int | None = None  # memory the host can still give (psutil)
    # The whole GPU as NVML (nvidia-smi) sees it: every process, the CUDA context and the allocator's cache, peak
    # over the step; None without a GPU or NVML.
    device_used_peak_bytes: int | None = None
    # ZeRO: this rank among ``world_size`` data-parallel ranks (the bytes above are this rank's), gradient bytes it
    # reduce-scattered, and the parameter chunks it all-gathered this step with their bytes (ZeRO-3: before each
    # module's compute, prefetches included; ZeRO-1/2: after the step). ZeRO-3's own range of a chunk whose shard is
    # in host memory counts in h2d_bytes too (see [Note: what a gather counts] in gemini/parallel/zero.py).
    world_size: int = 1
    rank: int = 0
    grad_reduce_bytes: int = 0
    param_gathers: int = 0
    param_gather_bytes: int = 0
    # GeminiConfig.offload_activations: saved activations copied to host memory this step (each comes back once for
    # backward), the most held there at once, and the bytes the budget kept on the device instead (see
    # gemini/engine/activations.py).
    activation_offload_bytes: int = 0
    activation_host_peak_bytes: int = 0
    activation_kept_bytes: int = 0
    # Files holding the step's copies of parameters aside when cpu_memory sends them to NVMe (see
    # gemini/engine/transaction.py); not model data, so not in ``nvme_bytes``.
    nvme_undo_bytes: int = 0
    # What GeminiConfig.cpu_memory bounds, and that budget: the step's most host bytes of the chunks that may live on
    # NVMe (m, v; the masters under bf16/fp16) and of the step's copies aside (each kind's peak summed: an upper
    # bound of their peak together).
    host_states_peak_bytes: int = 0
    cpu_budget_bytes: int | None = None
    # Only on the report of a step that ended a warm-up trace (the first step under placement="auto", and any step
    # traced again after input shapes changed).
    timeline: WarmupTimeline | None = None

    @property
    def compute_seconds(self) -> float:
        """Step time not spent in transfers or waiting for NVMe: forward, backward, Adam."""
        return max(0.0, self.step_seconds - self.transfer_seconds - self.nvme_wait_seconds)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        """One line of strict JSON (RFC 8259 has no inf or nan): such a field is the string "inf", "-inf" or "nan"."""
        values = {k: str(v) if isinstance(v, float) and not math.isfinite(v) else v for k, v in self.to_dict().items()}
        return json.dumps(values, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryReport:
        """The inverse of :meth:`to_dict`. Keys this version does not know (a file written by a newer one) are ignored;
        missing optional fields take their defaults."""
        known = {f.name for f in fields(cls)}
        values = {k: float(v) if v in _NON_FINITE else v for k, v in data.items() if k in known}
        if values.get("timeline") is not None:
            values["timeline"] = WarmupTimeline.from_dict(values["timeline"])
        return cls(**values)


_NON_FINITE = ("inf", "-inf", "nan")  # how MemoryReport.to_json writes such floats


class ReportWriter:
    """Appends to a JSON Lines file: a run header, then one JSON object per step.

    A file gathers every run given it (re-initializing with the same ``report_path`` keeps the history): each run
    starts with a line ``{"run": {...}}`` (start time, pid, host, rank, the configuration), and :func:`read_reports`
    returns the last run unless asked for another. Each line is written by ``os.write`` on a file opened for
    appending and closed again, so a run killed at any moment leaves at most its last line torn, which the reader
    skips with a warning.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        # Opened here, so a path that cannot be written fails before any work.
        os.close(self._open())

    def _open(self) -> int:
        return os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def start_run(self, info: dict[str, Any]) -> None:
        """Write the header of a new run (``info`` must be JSON-serializable)."""
        line = json.dumps({RUN_KEY: info}) + "\n"
        fd = self._open()
        try:
            size = os.fstat(fd).st_size
            # A run killed mid-line left no newline: end that line, so this header is a line of its own and the torn
            # one stays the last line of its run.
            if size and os.pread(fd, 1, size - 1) != b"\n":
                line = "\n" + line
            _write_all(fd, line.encode())
        finally:
            os.close(fd)

    def write(self, report: MemoryReport) -> None:
        fd = self._open()
        try:
            _write_all(fd, (report.to_json() + "\n").encode())
        finally:
            os.close(fd)


def rank_report_path(path: str | os.PathLike, rank: int) -> str:
    """The file ``GeminiConfig.report_path=path`` names on global rank ``rank`` of a job of several processes.

    ``path`` itself on rank 0 (so ``read_reports(path)`` and ``gemini report path`` show rank 0, as DeepSpeed and
    Colossal-AI log from rank 0), ``<stem>.rank<N><ext>`` beside it on rank N (``reports.rank1.jsonl``), so no two
    ranks append to one file."""
    path = os.fspath(path)
    if rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


RUN_KEY = "run"


@dataclass(kw_only=True)
class ReportRun:
    """One run's part of a reports file."""

    # What its {"run": ...} line held; None for lines with no header (a file from before run headers, or lines
    # written before the first header).
    header: dict[str, Any] | None
    reports: list[MemoryReport]
    first_line: int  # 1-based line number of its header (or of its first line)


def read_report_runs(path: str | os.PathLike) -> list[ReportRun]:
    """Every run of a JSON Lines file written with ``GeminiConfig.report_path``, oldest first.

    A line that is not JSON is skipped with a warning when it is the last line of its run (a process killed while
    writing it); anywhere else it is a ``ValueError`` naming the file and line, as is a JSON line that is neither a
    run header nor a ``MemoryReport``.
    """
    name = os.fspath(path)
    runs: list[ReportRun] = []
    torn: tuple[int, json.JSONDecodeError] | None = None  # a run's torn last line, if nothing follows
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            row, torn = _parse_line(name, number, line, runs, torn)
            if row is None:
                continue
            if not runs:
                runs.append(ReportRun(header=None, reports=[], first_line=number))
            runs[-1].reports.append(row)
    if torn is not None:
        _warn_torn(name, torn[0])
    return runs


def _parse_line(name: str, number: int, line: str, runs: list[ReportRun],
                torn: tuple[int, json.JSONDecodeError] | None
                ) -> tuple[MemoryReport | None, tuple[int, json.JSONDecodeError] | None]:
    """The line's report (None for a header, which starts a run, or a line not JSON) and the pending torn line;
    raises on a damaged line followed by anything but a header."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        if torn is not None:
            raise ValueError(f"{name}:{torn[0]} is not a MemoryReport: {torn[1]}") from None
        return None, (number, e)
    if isinstance(row, dict) and set(row) == {RUN_KEY} and isinstance(row[RUN_KEY], dict):
        if torn is not None:
            _warn_torn(name, torn[0])
        runs.append(ReportRun(header=row[RUN_KEY], reports=[], first_line=number))
        return None, None
    if torn is not None:
        raise ValueError(f"{name}:{torn[0]} is not a MemoryReport: {torn[1]}") from None
    try:
        if not isinstance(row, dict):
            raise TypeError(f"a JSON {type(row).__name__}, not an object")
        return MemoryReport.from_dict(row), None
    except (TypeError, KeyError, ValueError) as e:
        raise ValueError(f"{name}:{number} is not a MemoryReport: {e}") from None


def _warn_torn(name: str, number: int) -> None:
    warnings.warn(f"{name}:{number}: skipped a torn line at the end of a run (the process was killed "
                  f"while writing it?)", RuntimeWarning, stacklevel=2)


def read_reports(path: str | os.PathLike, *, run: int | str = -1) -> list[MemoryReport]:
    """The reports of a JSON Lines file written with ``GeminiConfig.report_path``.

    A file holds one run per ``initialize`` that wrote to it; ``run`` picks one by index (0 the first, -1 the last,
    the default), or ``"all"`` returns every run's reports in order. See :func:`read_report_runs` for the runs with
    their headers and for damaged lines.
    """
    runs = read_report_runs(path)
    if run == "all":
        return [r for one in runs for r in one.reports]
    if isinstance(run, bool) or not isinstance(run, int):
        raise ValueError(f"run={run!r} is invalid: expected an int (0 the first run, -1 the last) or 'all'")
    if not runs:
        if run in (0, -1):
            return []
        raise ValueError(f"run={run!r} is invalid: {os.fspath(path)} holds no runs")
    if not -len(runs) <= run < len(runs):
        raise ValueError(f"run={run!r} is invalid: {os.fspath(path)} holds {len(runs)} run(s), "
                         f"so expected {-len(runs)} to {len(runs) - 1}, or 'all'")
    return runs[run].reports
