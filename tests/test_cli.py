"""The command line, in-process on the CPU with small sizes (and once through ``python -m gemini``)."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest

import gemini
from gemini.cli import main
from gemini.report import ReportWriter

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


BAD_OPTIONS = [
    (["train", "--steps", "-3"], "--steps", "an int >= 1"),
    (["train", "--batch", "0"], "--batch", "an int >= 1"),
    (["train", "--layers", "two"], "--layers", "an int >= 1"),
    (["train", "--chunk-size", "0"], "--chunk-size", "an int >= 1"),
    (["train", "--lr", "nan"], "--lr", "a finite number >= 0"),
    (["train", "--device-memory", "-5"], "--device-memory", "a positive size"),
    (["train", "--cpu-memory", "lots"], "--cpu-memory", "a positive size"),
    (["train", "--nvme-offload-fraction", "1.5"], "--nvme-offload-fraction", "a number in [0, 1]"),
    (["train", "--nvme-pipeline-depth", "0"], "--nvme-pipeline-depth", "an int in [1, 64]"),
    (["train", "--gpu-margin-mem-ratio", "-0.1"], "--gpu-margin-mem-ratio", "a number in [0, 1]"),
    (["train", "--static-param-device-fraction", "2"], "--static-param-device-fraction", "a number in [0, 1]"),
    (["train", "--embd", "100", "--heads", "3"], "--embd", "not a multiple of --heads 3"),
    (["demo", "--steps", "0"], "--steps", "an int >= 1"),
    (["demo", "--model-to-budget", "0.5"], "--model-to-budget", "a finite number >= 1"),
    (["tune-margin", "--steps", "1"], "--steps", "an int >= 2"),
    (["tune-margin", "--headroom-fraction", "1"], "--headroom-fraction", "a number in [0, 1)"),
    (["tune-margin", "--ratios", "0,2"], "--ratios", "numbers in [0, 1]"),
    (["plan", "--seq", "-1"], "--seq", "an int >= 1"),
    (["report", "r.jsonl", "--run", "0"], "--run", "1 is the first run, -1 the last"),
]


@pytest.mark.parametrize("argv,option,accepted", BAD_OPTIONS, ids=[" ".join(a) for a, _, _ in BAD_OPTIONS])
def test_numeric_options_are_checked_before_anything_is_built(argv, option, accepted, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2  # as argparse ends on any bad argument
    out, err = capsys.readouterr()
    assert out == ""  # no model built, no step run
    assert f"argument {option}: " in err and accepted in err, err


def test_python_dash_m_gemini_refuses_negative_steps_at_once():
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run([sys.executable, "-m", "gemini", "train", "--device", "cpu", "--steps", "-3"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2 and done.stdout == ""
    assert "argument --steps: '-3' is not an int >= 1" in done.stderr


def test_report_shows_the_last_run_or_the_one_asked_for_or_all(demo_run, tmp_path, capsys):
    _, _, demo_file, _ = demo_run
    path = tmp_path / "two-runs.jsonl"
    path.write_text(demo_file.read_text())
    first = gemini.read_reports(path)
    second = [dataclasses.replace(r, step=r.step + 100) for r in first[:2]]
    writer = ReportWriter(path)
    writer.start_run({"started": "then", "pid": 42, "host": "elsewhere", "config": {"placement": "cpu"}})
    for r in second:
        writer.write(r)

    def shown(*options: str) -> str:
        assert main(["report", str(path), "--unit", "MiB", *options]) == 0
        return capsys.readouterr().out

    out = shown()
    assert "run 2 of 2: started then, pid 42 on elsewhere, 2 steps; placement cpu" in out
    assert all(gemini.summary_line(r, unit="MiB") in out for r in second)
    assert not any(gemini.summary_line(r, unit="MiB") in out for r in first)
    out = shown("--run", "1")
    assert "run 1 of 2: started " in out and all(gemini.summary_line(r, unit="MiB") in out for r in first)
    assert gemini.run_summary(first, unit="MiB") in out
    out = shown("--all-runs")
    assert out.index("run 1 of 2") < out.index("run 2 of 2")
    assert gemini.run_summary(first, unit="MiB") in out and gemini.run_summary(second, unit="MiB") in out
    assert main(["report", str(path), "--run", "3"]) == 2
    assert "--run 3 is out of range" in capsys.readouterr().err


def test_report_of_a_file_with_a_torn_last_line_still_works(demo_run, tmp_path, capsys):
    _, _, demo_file, _ = demo_run
    path = tmp_path / "torn.jsonl"
    text = demo_file.read_text()
    path.write_text(text + text.splitlines()[-1][:40])  # killed while writing a line
    with pytest.warns(RuntimeWarning, match="skipped a torn line"):
        assert main(["report", str(path), "--unit", "MiB"]) == 0
    reports = gemini.read_reports(demo_file)
    assert gemini.run_summary(reports, unit="MiB") in capsys.readouterr().out
