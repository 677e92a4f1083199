"""The command line, in-process on the CPU with small sizes (and once through ``python -m gemini``)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
import torch

import gemini
from gemini.tools import cli, cli_commands
from gemini.tools.cli import build_parser, main
from gemini.report import ReportWriter

SMALL_GPT = ["--layers", "4", "--embd", "128", "--heads", "4", "--vocab", "256", "--seq", "16"]


def _have_matplotlib() -> bool:
    # An import, not a look-up of installed packages: a test hiding matplotlib (None in
    # sys.modules) is seen as "not installed", as the CLI sees it.
    try:
        importlib.import_module("matplotlib.figure")
    except ImportError:
        return False
    return True


# Plotting is optional: without matplotlib the CLI refuses --plot-dir at once, so the runs below
# plot only where it is installed and test everything else either way.
HAVE_MATPLOTLIB = _have_matplotlib()


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``gemini demo`` with a small GPT: its output, reports file and plot folder (plots only
    with matplotlib)."""
    folder = tmp_path_factory.mktemp("demo")
    report = folder / "reports.jsonl"
    argv = ["demo", "--device", "cpu", *SMALL_GPT, "--batch", "2", "--steps", "3", "--report", str(report)]
    if HAVE_MATPLOTLIB:
        argv += ["--plot-dir", str(folder / "plots")]
    out = io.StringIO()
    with redirect_stdout(out):  # capsys is per test; this run serves several
        rc = main(argv)
    return rc, out.getvalue(), report, folder / "plots"


def test_demo_trains_a_gpt_several_times_the_budget_with_per_step_reports(demo_run):
    rc, out, report, plots = demo_run
    assert rc == 0, out
    lines = out.splitlines()
    assert "is 4.0x the device budget" in lines[0]
    # Steps counted from 1 everywhere: the warm-up notice, each step's line, the summary.
    assert "step   1/3: warm-up, tracing the first iteration ..." in lines
    assert [line.split(" | ")[0] for line in lines if "| loss" in line] == ["step   1/3", "step   2/3", "step   3/3"]
    assert any("warm-up traced" in line for line in lines)
    assert "done: 3 steps" in out
    reports = gemini.read_reports(report)
    assert len(reports) == 3
    model_bytes = sum(sum(kinds.values()) for kinds in reports[0].model_bytes_by_tier.values())
    budget = reports[0].device_budget_bytes
    assert model_bytes >= 3 * budget  # the model data really is several times the budget
    assert all(r.device_peak_bytes <= budget for r in reports)
    peak = max(reports, key=lambda r: r.device_peak_bytes)
    assert f"at step {peak.step + 1} = " in out and "MiB budget;" in out
    if HAVE_MATPLOTLIB:
        assert {p.name for p in plots.iterdir()} == {"memory.png", "timeline.png"}
    else:
        assert not plots.exists() and "plot: " not in out


def test_report_summarizes_and_plots_a_jsonl_file(demo_run, tmp_path, capsys):
    _, _, report, _ = demo_run
    plot = ["--plot-dir", str(tmp_path / "plots")] if HAVE_MATPLOTLIB else []
    assert main(["report", str(report), "--unit", "MiB", *plot]) == 0
    out = capsys.readouterr().out
    reports = gemini.read_reports(report)
    for r in reports:
        assert gemini.summary_line(r, unit="MiB") in out
    assert gemini.run_summary(reports, unit="MiB") in out
    if HAVE_MATPLOTLIB:
        assert (tmp_path / "plots" / "memory.png").stat().st_size > 20_000
        assert (tmp_path / "plots" / "timeline.png").stat().st_size > 20_000


def test_report_of_a_file_that_is_not_reports_fails_cleanly(tmp_path, capsys):
    path = tmp_path / "x.jsonl"
    path.write_text(json.dumps({"hello": 1}) + "\n")
    assert main(["report", str(path)]) == 2
    assert "is not a MemoryReport" in capsys.readouterr().err


def test_train_with_states_on_nvme(tmp_path, capsys):
    report = tmp_path / "r.jsonl"
    argv = ["train", "--device", "cpu", *SMALL_GPT, "--batch", "2", "--steps", "2", "--placement", "cpu",
            "--chunk-size", "40000", "--cpu-memory", "4MiB", "--nvme-dir", str(tmp_path),
            "--nvme-pipeline-depth", "1", "--precision", "bf16", "--report", str(report), "--quiet", "--unit", "GiB"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "done: 2 steps" in out and "placement=cpu precision=bf16" in out
    assert "| loss" not in out  # --quiet: no per-step lines
    summary = out[out.index("2 steps (0 skipped)"):]
    assert " GiB" in summary and " MiB" not in summary  # --unit GiB, though MiB fits this scale
    last = gemini.read_reports(report)[-1]
    assert last.nvme_bytes > 0 and last.nvme_read_bytes > 0 and last.device_model_bytes == 0


def test_train_auto_on_cpu_without_a_budget_plans_against_the_machine(capsys):
    # No --device-memory on the CPU stand-in: the warm-up measures anyway and the budget is the
    # machine's memory, so everything fits and the step reports that budget.
    assert main(["train", "--device", "cpu", *SMALL_GPT, "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "step   2/2 | loss" in out


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


def test_plan_of_a_zero_run_gives_one_ranks_share(capsys):
    """``--world-size`` (and ``--shard-params``): one rank's figures, [Note: a plan under ZeRO]."""
    totals = {}
    for extra in ([], ["--world-size", "4"], ["--world-size", "4", "--shard-params"]):
        assert main(["plan", *SMALL_GPT, "--placement", "cpu", *extra]) == 0
        out = capsys.readouterr().out
        rows = {line.split("  ")[0].strip(): float(line.split()[-2]) for line in out.splitlines()
                if line.startswith(("parameters", "gradients", "optimizer states"))}
        totals[len(extra)] = rows
        assert ("ZeRO across 4 ranks (4 on this host)" in out) == bool(extra)
    one, zero2, zero3 = totals[0], totals[2], totals[3]
    assert zero2["gradients"] == pytest.approx(one["gradients"] / 4, rel=0.01)
    assert zero2["optimizer states (m, v)"] == pytest.approx(one["optimizer states (m, v)"] / 4, rel=0.01)
    assert zero2["parameters"] == one["parameters"] and zero3["parameters"] == pytest.approx(one["parameters"] / 4,
                                                                                             rel=0.01)


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
    (["train", "--device-memory", "1.5B"], "--device-memory", "not a whole number of bytes"),
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
    assert main(["report", str(path), "--unit", "MiB"]) == 0
    reports = gemini.read_reports(demo_file)
    out, err = capsys.readouterr()
    assert gemini.run_summary(reports, unit="MiB") in out
    # One line, as the CLI's errors: not Python's "report.py:262: RuntimeWarning" and its source line.
    (line,) = err.splitlines()
    assert line.startswith("gemini report: warning: ") and "skipped a torn line" in line


# ------------------------------------------------------------------ the CLI explains itself
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"gemini": parser, **sub.choices}


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _help_blocks(parser: argparse.ArgumentParser) -> dict[str, str]:
    """--help's text per option: from the line that names it to the next option's."""
    blocks, current = {}, None
    for line in parser.format_help().splitlines():
        stripped = line.strip()
        if line.startswith("  -") and stripped.split()[0].rstrip(",").startswith("-"):
            current = stripped.split()[0].rstrip(",")
            blocks[current] = ""
        elif not line.startswith("  ") or not stripped:
            current = None
        if current is not None:
            blocks[current] += " " + stripped
    return {k: " ".join(v.split()) for k, v in blocks.items()}


@pytest.mark.parametrize("command", list(_subparsers()))
def test_every_option_has_a_help_that_shows_its_default(command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    parser = _subparsers()[command]
    blocks = _help_blocks(parser)
    for action in _options(parser):
        assert action.help and action.help.strip(), f"{command} {action.option_strings[0]} has no help"
        text = blocks[action.option_strings[0]]
        if action.nargs == 0:  # a flag: off unless given
            continue
        assert "default" in text, f"{command} {action.option_strings[0]}: {text}"
        if action.default is not None and not isinstance(action.default, list):
            assert f"(default: {action.default})" in text, f"{command} {action.option_strings[0]}: {text}"
    if command == "demo":  # the demo's model size, in the help
        assert "(default: 6)" in blocks["--layers"] and "(default: 512)" in blocks["--embd"]
    if command == "tune-margin":
        assert "(default: 0,0.25,0.5,0.75,1)" in blocks["--ratios"]


def test_demo_help_states_its_models_size():
    # The description says "19.5M parameters, about 300 MiB of model data": hold it to the model
    # (about: chunk padding moves the bytes a little as the chunk-size search changes).
    import torch

    from gemini.tools.gpt import GPT

    args = build_parser().parse_args(["demo", "--device", "cpu"])
    cfg = cli_commands._gpt_config(args)
    with torch.device("meta"):
        n = sum(p.numel() for p in GPT(cfg).parameters())
    assert f"{n / 1e6:.1f}M parameters" == "19.5M parameters"
    assert cli_commands._model_data_bytes(cfg, args) / 2**20 == pytest.approx(300, abs=10)
    assert "19.5M parameters, about 300 MiB of model data" in _subparsers()["demo"].description


def test_plan_train_and_demo_default_to_the_librarys_placement_and_knobs(monkeypatch):
    library = {f.name: f.default for f in dataclasses.fields(gemini.GeminiConfig)}
    for command, parser in _subparsers().items():
        for action in _options(parser):
            if action.dest in library:
                assert action.default == library[action.dest], (command, action.dest)
    parsers = _subparsers()
    assert parsers["plan"].get_default("placement") == parsers["train"].get_default("placement") == "auto"
    assert library["placement"] == "auto"
    # The demo has no --placement: it runs the library's default.
    assert _built(monkeypatch, ["demo"]).config.placement == library["placement"]
    assert _built(monkeypatch, ["train"]).config.placement == library["placement"]
    assert _built(monkeypatch, ["plan"]).config.placement == library["placement"]


def test_demo_and_tune_margin_have_no_options_they_would_ignore():
    parsers = _subparsers()
    for command in ("demo", "tune-margin"):
        names = {s for a in _options(parsers[command]) for s in a.option_strings}
        assert not {n for n in names if n.startswith("--static-")}, command
        assert "--placement" not in names  # both run placement auto
    for command in ("train", "plan"):
        names = {s for a in _options(parsers[command]) for s in a.option_strings}
        assert {"--static-param-device-fraction", "--static-optimizer-offload-fraction", "--placement"} <= names
    with pytest.raises(SystemExit):
        main(["demo", "--static-param-device-fraction", "0.5"])


class _Built(Exception):
    """Raised in place of the step a command would run, once everything it passes is captured."""


@dataclasses.dataclass
class Built:
    gpt: object  # GPTConfig of the model the command built
    config: gemini.GeminiConfig
    kwargs: dict  # what else went in: lr (initialize, tune_margin), ratios/steps/headroom (tune_margin)
    batch: int | None  # sequences per step of the synthetic batch, where one was made


def _built(monkeypatch, argv: list[str]) -> Built:
    """Runs ``gemini`` with ``argv`` (small GPT, cpu) up to the call that would train or plan,
    and returns what went into it."""
    seen = {}

    def capture(name, real=None):
        def fake(*args, **kwargs):
            seen.setdefault(name, (args, kwargs))
            if real is not None:
                return real(*args, **kwargs)
            raise _Built

        return fake

    monkeypatch.setattr(cli_commands, "initialize", capture("initialize"))
    monkeypatch.setattr(cli_commands, "tune_margin", capture("tune_margin"))
    monkeypatch.setattr(cli_commands, "synthetic_batch", capture("batch", cli_commands.synthetic_batch))
    if argv[0] == "plan":  # the other commands plan too (the model's size), through the real planner
        monkeypatch.setattr(cli_commands, "plan_placement", capture("plan"))
    with pytest.raises(_Built), redirect_stdout(io.StringIO()):
        main([argv[0], "--device", "cpu", *SMALL_GPT, *argv[1:]])
    batch = seen["batch"][0][1] if "batch" in seen else None
    if "plan" in seen:  # the plan's example inputs: (batch, seq) tokens
        batch = seen["plan"][1]["example_inputs"][0][0][0]
    if "tune_margin" in seen:
        (factory, _, config), kwargs = seen["tune_margin"]
        return Built(factory().cfg, config, kwargs, batch)
    (model, config), kwargs = seen.get("initialize") or seen["plan"]
    return Built(model.cfg, config, kwargs, batch)


MiB = 2**20
# option -> (extra argv, what it must change in what the command runs), "{tmp}" standing for a
# fresh folder. Every option of demo/train/tune-margin/plan is here or in END_TO_END: a new
# option that the command ignores fails below.
EFFECTS = {
    "--layers": (["--layers", "3"], lambda b, tmp: b.gpt.n_layer == 3),
    "--embd": (["--embd", "64"], lambda b, tmp: b.gpt.n_embd == 64),
    "--heads": (["--heads", "2"], lambda b, tmp: b.gpt.n_head == 2),
    "--vocab": (["--vocab", "300"], lambda b, tmp: b.gpt.vocab_size == 300),
    "--seq": (["--seq", "24"], lambda b, tmp: b.gpt.block_size == 24),
    "--batch": (["--batch", "3"], lambda b, tmp: b.batch == 3),
    "--activation-checkpointing": (["--activation-checkpointing"], lambda b, tmp: b.gpt.activation_checkpointing),
    "--device": (["--device", "cpu"], lambda b, tmp: b.config.device == "cpu"),
    "--placement": (["--placement", "static"], lambda b, tmp: b.config.placement == "static"),
    "--precision": (["--precision", "bf16"], lambda b, tmp: b.config.precision == "bf16"),
    "--chunk-size": (["--chunk-size", "12345"], lambda b, tmp: b.config.chunk_size == 12345),
    "--device-memory": (["--device-memory", "7MiB"], lambda b, tmp: b.config.device_memory == 7 * MiB),
    "--cpu-memory": (["--cpu-memory", "9MiB"], lambda b, tmp: b.config.cpu_memory == 9 * MiB),
    "--nvme-dir": (["--nvme-dir", "{tmp}", "--cpu-memory", "9MiB"],
                   lambda b, tmp: str(b.config.nvme_dir) == str(tmp)),
    "--nvme-offload-fraction": (["--nvme-offload-fraction", "0.5", "--nvme-dir", "{tmp}"],
                                lambda b, tmp: b.config.nvme_offload_fraction == 0.5),
    "--nvme-pipeline-depth": (["--nvme-pipeline-depth", "3"], lambda b, tmp: b.config.nvme_pipeline_depth == 3),
    "--static-param-device-fraction": (["--placement", "static", "--static-param-device-fraction", "0.5"],
                                       lambda b, tmp: b.config.static_param_device_fraction == 0.5),
    "--static-optimizer-offload-fraction": (["--placement", "static", "--static-optimizer-offload-fraction", "0.25"],
                                            lambda b, tmp: b.config.static_optimizer_offload_fraction == 0.25),
    "--gpu-margin-mem-ratio": (["--gpu-margin-mem-ratio", "0.5"],
                               lambda b, tmp: b.config.gpu_margin_mem_ratio == 0.5),
    "--model-to-budget": (["--model-to-budget", "8"], None),  # half the budget of the default 4: below
    "--lr": (["--lr", "0.25"], lambda b, tmp: b.kwargs["lr"] == 0.25),
    "--report": (["--report", "{tmp}/r.jsonl"], lambda b, tmp: str(b.config.report_path) == f"{tmp}/r.jsonl"),
    "--ratios": (["--ratios", "0,0.5"], lambda b, tmp: list(b.kwargs["ratios"]) == [0.0, 0.5]),
    "--steps": (["--steps", "3"], lambda b, tmp: b.kwargs["steps"] == 3),  # tune-margin's
    "--rounds": (["--rounds", "2"], lambda b, tmp: b.kwargs["rounds"] == 2),
    "--headroom-fraction": (["--headroom-fraction", "0.2"], lambda b, tmp: b.kwargs["headroom_fraction"] == 0.2),
    "--world-size": (["--world-size", "4"], lambda b, tmp: b.kwargs["world_size"] == 4),  # plan's
    "--ranks-per-host": (["--world-size", "4", "--ranks-per-host", "2"], lambda b, tmp: b.kwargs["ranks_per_host"] == 2),
    "--shard-params": (["--shard-params", "--world-size", "2"], lambda b, tmp: b.config.shard_params),
}
# What only a whole training run shows (demo and train), and the test that checks it there.
END_TO_END = {
    "--steps": "test_demo_trains_a_gpt_several_times_the_budget_with_per_step_reports (done: 3 steps)",
    "--quiet": "test_train_with_states_on_nvme (no per-step lines)",
    "--unit": "test_train_with_states_on_nvme (GiB)",
    "--plot-dir": "test_demo_trains_a_gpt_several_times_the_budget_with_per_step_reports (the PNGs)",
}
COMMAND_OPTIONS = [(command, action.option_strings[0]) for command in ("demo", "train", "tune-margin", "plan")
                   for action in _options(_subparsers()[command])
                   if not (command in ("demo", "train") and action.option_strings[0] in END_TO_END)
                   and action.option_strings[0] != "-v"]  # every command's: test_verbose_is_taken_before_or_after


@pytest.mark.parametrize("command,option", COMMAND_OPTIONS, ids=[f"{c} {o}" for c, o in COMMAND_OPTIONS])
def test_every_option_changes_what_the_command_runs(command, option, monkeypatch, tmp_path):
    assert option in EFFECTS, f"{command} {option}: neither checked here nor in END_TO_END (is it ignored?)"
    extra, effect = EFFECTS[option]
    built = _built(monkeypatch, [command, *(a.replace("{tmp}", str(tmp_path)) for a in extra)])
    if option == "--model-to-budget":
        default = _built(monkeypatch, [command])
        assert built.config.device_memory == pytest.approx(default.config.device_memory / 2, abs=1)
    else:
        assert effect(built, tmp_path), (command, option, built)


def test_the_end_to_end_options_are_those_of_a_training_run():
    # END_TO_END covers exactly the run options of demo and train that the capture above cannot see.
    for command in ("demo", "train"):
        names = {a.option_strings[0] for a in _options(_subparsers()[command])}
        assert set(END_TO_END) <= names, command


def _hide_matplotlib(monkeypatch):
    # None in sys.modules makes `import matplotlib` (and its submodules, even ones imported
    # before) fail as if it were not installed.
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)


@pytest.mark.parametrize("command", ["demo", "train", "report"])
def test_plot_dir_without_matplotlib_fails_at_once(command, monkeypatch, tmp_path, capsys):
    _hide_matplotlib(monkeypatch)
    # The model would train for minutes (default sizes) if --plot-dir were checked after it.
    argv = [command, str(tmp_path / "r.jsonl")] if command == "report" else [command, "--device", "cpu"]
    with pytest.raises(SystemExit) as info:
        main([*argv, "--plot-dir", str(tmp_path / "plots")])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing built, nothing read
    assert f"gemini {command}: error: argument --plot-dir: '{tmp_path / 'plots'}' asks for plots" in err
    assert "matplotlib" in err and "pip install 'gemini-offload[plot]'" in err
    assert not (tmp_path / "plots").exists()


def test_plot_dir_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    with pytest.raises(SystemExit) as info:
        main(["train", "--device", "cpu", "--plot-dir", str(tmp_path / "f")])
    assert info.value.code == 2
    assert f"argument --plot-dir: '{tmp_path / 'f'}' is a file, not a folder" in capsys.readouterr().err


def test_ratios_out_of_range_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["tune-margin", "--ratios", "0,2"])
    assert info.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and "argument --ratios: '0,2' is not a comma-separated list of numbers in [0, 1]" in err


def test_readable_sizes_follow_raw_byte_counts():
    text = ("placement='cuda' needs 1851392 bytes of chunks on the device but GeminiConfig.device_memory=100000: "
            "1751392 bytes are missing; only 0 of 39960 bytes can be freed; 512 bytes; 2048 bytes (2.00 KiB)")
    assert cli.readable_sizes(text) == (
        "placement='cuda' needs 1851392 bytes (1.77 MiB) of chunks on the device but "
        "GeminiConfig.device_memory=100000 (97.66 KiB): 1751392 bytes (1.67 MiB) are missing; "
        "only 0 of 39960 bytes (39.02 KiB) can be freed; 512 bytes; 2048 bytes (2.00 KiB)")


def test_a_budget_error_gives_sizes_in_bytes_and_readable_units(capsys):
    argv = ["train", "--device", "cpu", *SMALL_GPT, "--steps", "1", "--placement", "cuda", "--device-memory", "100000"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemini train: error: ")
    assert "device_memory=100000 (97.66 KiB)" in err
    assert re.search(r"\d+ bytes \(\d+\.\d\d MiB\) are missing", err), err


@pytest.mark.parametrize("budget,fits", [("20MiB", False), ("48MiB", True)])
def test_plan_counts_activations_and_agrees_with_train(budget, fits, capsys):
    """12.8 MiB of model data and about 19 MiB of activations: at 20 MiB the plan (a meta-device
    run of the batch) refuses, as training does; at 48 MiB both go ahead."""
    model = ["--device", "cpu", "--layers", "4", "--embd", "128", "--heads", "4", "--vocab", "256", "--seq", "64",
             "--batch", "8", "--placement", "cuda", "--device-memory", budget]
    assert main(["plan", *model]) == (0 if fits else 1)
    out = capsys.readouterr().out
    assert "activations and temporaries" in out and "predicted device peak" in out
    try:
        trained = main(["train", *model, "--steps", "2", "--quiet"]) == 0
    except SystemExit as e:
        trained = e.code == 0
    capsys.readouterr()
    assert trained == fits


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["train", "demo"])
def test_device_cuda_without_cuda_is_a_one_line_error(command, capsys):
    """The batch was made on the device before initialize checked it: torch's AssertionError."""
    argv = [command, "--device", "cuda", "--steps", "1"] + (SMALL_GPT if command == "train" else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"gemini {command}: error: GeminiConfig.device='cuda' is invalid" in err and "Traceback" not in err


@pytest.mark.parametrize("argv,field", [
    (["--placement", "cpu", "--gpu-margin-mem-ratio", "0.5"], "gpu_margin_mem_ratio=0.5 needs placement='auto'"),
    (["--static-optimizer-offload-fraction", "0.5"], "static_optimizer_offload_fraction=0.5 needs placement='static'"),
])
def test_plan_refuses_what_train_refuses(argv, field, capsys):
    """A plan said 'fits: yes' for a combination initialize refuses."""
    assert main(["plan", "--device", "cpu", *SMALL_GPT, *argv]) == 2
    assert field in capsys.readouterr().err
    assert main(["train", "--device", "cpu", *SMALL_GPT, "--steps", "1", *argv]) == 2
    assert field in capsys.readouterr().err


def test_consolidate_writes_the_consolidated_checkpoint_of_a_sharded_one(tmp_path, capsys):
    """``gemini consolidate FOLDER OUT`` (DeepSpeed's zero_to_fp32.py): the file save_checkpoint
    writes unsharded, checksums included; it resumes a fresh model and optimizer exactly."""
    from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)

    def engine(seed):
        torch.manual_seed(seed)
        return gemini.initialize(GPT(cfg), gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=2048),
                                 lr=1e-2, weight_decay=0.1)

    model, opt = engine(0)
    x, y = synthetic_batch(cfg, 2, 16)
    for _ in range(2):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
    gemini.save_checkpoint(tmp_path / "shards", model, opt, sharded=True)
    assert main(["consolidate", str(tmp_path / "shards"), str(tmp_path / "whole.pt")]) == 0
    assert "whole.pt" in capsys.readouterr().out
    assert set(torch.load(tmp_path / "whole.pt", weights_only=True)) >= {"model", "optimizer", "checksums"}
    other, other_opt = engine(1)
    gemini.load_checkpoint(tmp_path / "whole.pt", other, other_opt)
    for a, b in zip(other.state_dict().values(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    want, got = opt.state_dict(), other_opt.state_dict()
    assert got["state"].keys() == want["state"].keys() and want["state"]
    for i in want["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["state"][i][key], want["state"][i][key]), (i, key)

    (tmp_path / "empty").mkdir()
    assert main(["consolidate", str(tmp_path / "empty"), str(tmp_path / "out.pt")]) == 2
    assert "holds no sharded checkpoint" in capsys.readouterr().err
    assert main(["consolidate", str(tmp_path / "nothing"), str(tmp_path / "out.pt")]) == 2
    assert "nothing does not exist: expected the folder of a sharded checkpoint" in capsys.readouterr().err
    # The output in the input's folder (a rank's file name, say) would have replaced a shard: refused.
    shard = next((tmp_path / "shards").iterdir())
    before = shard.read_bytes()
    assert main(["consolidate", str(tmp_path / "shards"), str(shard)]) == 2
    assert "is inside the sharded checkpoint's folder" in capsys.readouterr().err
    assert shard.read_bytes() == before
    # An output folder that does not exist yet is made (the error named a temporary file).
    assert main(["consolidate", str(tmp_path / "shards"), str(tmp_path / "new" / "dir" / "whole.pt")]) == 0
    assert (tmp_path / "new" / "dir" / "whole.pt").stat().st_size == (tmp_path / "whole.pt").stat().st_size


def test_verbose_is_taken_before_or_after_the_command():
    """``gemini plan -v ...`` was refused ("unrecognized arguments: -v"): only ``gemini -v plan``
    was understood."""
    from gemini.tools.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["consolidate", "-v", "in", "out"]).verbose is True
    assert parser.parse_args(["-v", "consolidate", "in", "out"]).verbose is True
    assert parser.parse_args(["consolidate", "in", "out"]).verbose is False


def test_plan_with_shard_params_needs_a_world_size(capsys):
    """``gemini plan --shard-params`` without --world-size planned one rank, which shards nothing."""
    from gemini.tools.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--shard-params"])
    assert exit_info.value.code == 2
    assert "--shard-params: ZeRO-3 shards the parameters over the data-parallel ranks" in capsys.readouterr().err
