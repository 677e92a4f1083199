"""Each example runs, with small sizes, and does what its docstring says."""

from __future__ import annotations

import importlib.util
import os

import pytest

import gemini

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["train_gpt_larger_than_device", "tune_margin", "memory_reports",
                                  "train_hf_transformers"])
def test_docstring_gives_the_command(name):
    doc = _example(name).__doc__
    assert f"python examples/{name}.py" in doc


def test_train_gpt_larger_than_device(capsys):
    argv = ["--device", "cpu", "--layers", "4", "--embd", "128", "--vocab", "256", "--seq", "16", "--steps", "3"]
    assert _example("train_gpt_larger_than_device").main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("model data") and len([line for line in out if line.startswith("step")]) == 3


def test_tune_margin(capsys):
    argv = ["--device", "cpu", "--layers", "2", "--embd", "128", "--vocab", "256", "--seq", "16",
            "--budget", "6MiB", "--ratios", "0,1", "--steps", "2"]
    assert _example("tune_margin").main(argv) == 0
    assert "recommended: gpu_margin_mem_ratio=" in capsys.readouterr().out


def test_memory_reports(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    argv = ["--out", str(tmp_path), "--device", "cpu", "--steps", "3", "--layers", "2", "--embd", "128",
            "--budget", "8MiB"]
    assert _example("memory_reports").main(argv) == 0
    assert len(gemini.read_reports(tmp_path / "reports.jsonl")) == 3
    assert (tmp_path / "memory.png").stat().st_size > 20_000 and (tmp_path / "timeline.png").exists()
    assert "warm-up" in capsys.readouterr().out


def test_train_hf_transformers_runs_or_skips_cleanly(capsys):
    argv = ["--device", "cpu", "--layers", "2", "--embd", "64", "--vocab", "256", "--seq", "16", "--steps", "2",
            "--budget", "4MiB"]
    assert _example("train_hf_transformers").main(argv) == 0
    out = capsys.readouterr().out
    if importlib.util.find_spec("transformers") is None:
        assert "transformers is not installed: skipping" in out
    else:
        assert len([line for line in out.splitlines() if line.startswith("step")]) == 2
