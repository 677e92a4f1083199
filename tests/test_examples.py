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
                                  "train_hf_transformers", "train_data_parallel", "train_hf_trainer"])
def test_docstring_gives_the_command(name):
    doc = _example(name).__doc__
    launcher = "torchrun --standalone --nproc-per-node 2" if name == "train_data_parallel" else "python"
    assert f"{launcher} examples/{name}.py" in doc


@pytest.mark.parametrize("name, argv, said", [
    ("memory_reports", ["--steps", "0"], "argument --steps: '0' is not an int >= 1"),
    ("train_gpt_larger_than_device", ["--model-to-budget", "0"], "argument --model-to-budget: '0' is not"),
    ("train_hf_transformers", ["--budget", "abc"], "argument --budget: 'abc' is not a positive size"),
    ("tune_margin", ["--ratios", "abc"], "argument --ratios: 'abc' is not a comma-separated list"),
    ("train_hf_trainer", ["--weights", "/no/such/folder"], "--weights '/no/such/folder' is not a folder"),
])
def test_bad_flags_are_refused_by_name(name, argv, said, capsys):
    """An example's bad flag ends in argparse's one line naming it (exit 2), not a traceback from
    deep inside (an IndexError for --steps 0, a ZeroDivisionError for --model-to-budget 0)."""
    with pytest.raises(SystemExit) as exit_info:
        _example(name).main(argv)
    assert exit_info.value.code == 2 and said in capsys.readouterr().err


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


def test_train_data_parallel_under_torchrun(tmp_path):
    """The documented torchrun command, small: 2 gloo ranks train, save both checkpoints, reload."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(EXAMPLES, "train_data_parallel.py"), "--device", "cpu", "--layers", "2", "--embd", "64",
           "--vocab", "256", "--seq", "16", "--steps", "3", "--shard-params", "--checkpoint", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3 and all("ZeRO rank 0/2" in line for line in steps)
    assert sorted(p.name for p in (tmp_path / "sharded").iterdir()) == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    import torch

    from gemini.tools.gpt import GPT, GPTConfig

    plain = GPT(GPTConfig(vocab_size=256, block_size=16, n_layer=2, n_head=4, n_embd=64))
    plain.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True)["model"])


def test_train_hf_trainer_runs_or_skips_cleanly(tmp_path, capsys):
    argv = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--vocab", "256", "--seq", "16", "--steps", "3",
            "--budget", "2MiB", "--out", str(tmp_path)]
    assert _example("train_hf_trainer").main(argv) == 0
    out = capsys.readouterr().out
    if importlib.util.find_spec("transformers") is None:
        assert "skipping" in out
        return
    assert len([line for line in out.splitlines() if line.startswith("step ")]) == 3
    assert "saved and reloaded with from_pretrained" in out
