"""The command line, in-process on the CPU with small sizes (and once through ``python -m gemini``)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

import gemini
from gemini.cli import main

SMALL_GPT = ["--layers", "4", "--embd", "128", "--heads", "4", "--vocab", "256", "--seq", "16"]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``gemini demo`` with a small GPT: its output, reports file and plot folder."""
    folder = tmp_path_factory.mktemp("demo")
    report = folder / "reports.jsonl"
    argv = ["demo", "--device", "cpu", *SMALL_GPT, "--batch", "2", "--steps", "3", "--report", str(report),
            "--plot-dir", str(folder / "plots")]
    out = io.StringIO()
    with redirect_stdout(out):  # capsys is per test; this run serves several
        rc = main(argv)
    return rc, out.getvalue(), report, folder / "plots"


def test_demo_trains_a_gpt_several_times_the_budget_with_per_step_reports(demo_run):
    rc, out, report, plots = demo_run
    assert rc == 0, out
    lines = out.splitlines()
    assert "is 4.0x the device budget" in lines[0]
    assert [line.split("]")[0] for line in lines if line.startswith("[") and "| loss" in line] == ["[1/3", "[2/3",
                                                                                                       "[3/3"]
    assert any("warm-up traced" in line for line in lines)
    assert "done: 3 steps" in out
    reports = gemini.read_reports(report)
    assert len(reports) == 3
    model_bytes = sum(sum(kinds.values()) for kinds in reports[0].model_bytes_by_tier.values())
    budget = reports[0].device_budget_bytes
    assert model_bytes >= 3 * budget  # the model data really is several times the budget
    assert all(r.device_peak_bytes <= budget for r in reports)
    assert {p.name for p in plots.iterdir()} == {"memory.png", "timeline.png"}


def test_report_summarizes_and_plots_a_jsonl_file(demo_run, tmp_path, capsys):
    _, _, report, _ = demo_run
    assert main(["report", str(report), "--plot-dir", str(tmp_path), "--unit", "MiB"]) == 0
    out = capsys.readouterr().out
    reports = gemini.read_reports(report)
    for r in reports:
        assert gemini.summary_line(r, unit="MiB") in out
    assert gemini.run_summary(reports, unit="MiB") in out
    assert (tmp_path / "memory.png").stat().st_size > 20_000
    assert (tmp_path / "timeline.png").stat().st_size > 20_000


def test_report_of_a_file_that_is_not_reports_fails_cleanly(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"hello": 1}) + "\n")
    assert main(["report", str(path)]) == 2
    assert "is not a MemoryReport" in capsys.readouterr().err


def test_train_with_states_on_nvme(tmp_path, capsys):
    report = tmp_path / "r.jsonl"
    argv = ["train", "--device", "cpu", *SMALL_GPT, "--batch", "2", "--steps", "2", "--placement", "cpu",
            "--chunk-size", "40000", "--cpu-memory", "4MiB", "--nvme-dir", str(tmp_path),
            "--nvme-pipeline-depth", "1", "--precision", "bf16", "--report", str(report), "--quiet"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "done: 2 steps" in out and "placement=cpu precision=bf16" in out
    assert "| loss" not in out  # --quiet: no per-step lines
    last = gemini.read_reports(report)[-1]
    assert last.nvme_bytes > 0 and last.nvme_read_bytes > 0 and last.device_model_bytes == 0


def test_train_auto_on_cpu_without_a_budget_plans_against_the_machine(capsys):
    # No --device-memory on the CPU stand-in: the warm-up measures anyway and the budget is the
    # machine's memory, so everything fits and the step reports that budget.
    assert main(["train", "--device", "cpu", *SMALL_GPT, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "step   1" in out


def test_tune_margin_prints_the_table_and_a_recommendation(capsys):
    argv = ["tune-margin", "--device", "cpu", *SMALL_GPT, "--batch", "2", "--device-memory", "6MiB",
            "--ratios", "0,1", "--steps", "2"]
    rc = main(argv)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "ratio 0: " in out and "ratio 1: " in out
    table = out[out.index("  ratio  OS chunks on device"):].splitlines()
    assert table[1].split()[-1] == "yes" or table[1].startswith("*")
    assert sum(row.startswith("*") for row in table[1:3]) == 1
    assert "recommended: gpu_margin_mem_ratio=" in out


def test_plan_prints_where_each_kind_goes_and_whether_it_fits(tmp_path, capsys):
    argv = ["plan", *SMALL_GPT, "--placement", "cpu", "--chunk-size", "40000", "--cpu-memory", "4MiB",
            "--nvme-dir", str(tmp_path), "--nvme-pipeline-depth", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "fits: yes" in out
    rows = {line.split("  ")[0].strip(): line.split()[-3:] for line in out.splitlines()
            if line.startswith(("parameters", "gradients", "optimizer states", "total"))}
    assert float(rows["optimizer states (m, v)"][2]) > 0  # some states planned on NVMe
    assert float(rows["parameters"][2]) == 0  # fp32 parameters (the masters) stay in memory
    assert main(["plan", *SMALL_GPT, "--placement", "cuda", "--device-memory", "1MiB"]) == 1
    assert "fits: NO" in capsys.readouterr().out


def test_python_dash_m_gemini_runs_the_cli():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run([sys.executable, "-m", "gemini", "plan", *SMALL_GPT], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "fits: yes" in done.stdout
