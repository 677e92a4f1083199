"""ZeRO ranks that start apart: initialize makes them train rank 0's model (DDP's broadcast),
refuses a different layout on every rank with a ValueError naming it, and gives each rank a
report file of its own. 2 gloo ranks (tests/multiprocess.py; see [Note: ranks agree at
initialize] in gemini/parallel/agreement.py)."""

from __future__ import annotations

import pytest
import torch

import gemini
import zero_agreement_workers as aw
import zero_workers as zw
from multiprocess import run_ranks

STEPS = 3


def _assert_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        torch.testing.assert_close(got[k].float(), want[k].float(), rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"{what}, {k}: {m}")


@pytest.fixture(scope="module")
def seeded_apart(tmp_path_factory):
    out = tmp_path_factory.mktemp("apart")
    run_ranks(aw.run_seeded_apart, str(out), STEPS, timeout_seconds=240)
    return lambda name, rank: torch.load(out / f"{name}_rank{rank}.pt", weights_only=True)


@pytest.mark.parametrize("name", ["zero2", "zero3", "auto-zero2"])
def test_ranks_seeded_apart_train_rank_0s_model(seeded_apart, name):
    """Rank r builds its model from seed r: every rank's state, at initialize and after each step,
    is plain AdamW's on rank 0's model (parameters and buffer), not a splice of the ranks' ranges."""
    ref, _, _ = zw.train_reference(STEPS, model=aw.net_with_buffer(seed=0))
    init = aw.net_with_buffer(seed=0).state_dict()
    for rank in range(2):
        run = seeded_apart(name, rank)
        _assert_close(run["init"], init, f"{name} rank {rank} at initialize")
        for step, (got, want) in enumerate(zip(run["states"], ref, strict=True)):
            _assert_close(got, want, f"{name} rank {rank} step {step}")


def test_ranks_seeded_apart_bf16_masters_are_rank_0s(seeded_apart):
    """Under bf16 each rank's fp32 master range (ZeRO-3: with its parameter shard) is rank 0's
    exact fp32 init: the values are sent at fp32, not cast through bf16 first."""
    init = aw.net_with_buffer(seed=0).state_dict()
    for rank in range(2):
        got = seeded_apart("bf16-zero3", rank)["init"]
        for k in init:
            assert torch.equal(got[k].float(), init[k]), f"rank {rank}: {k}"


def test_ranks_disagreeing_on_the_layout_raise_on_every_rank(tmp_path):
    """A different chunk_size, model, precision or shard_params on rank 1: initialize raises the
    same ValueError on both ranks, naming what differs (before: gloo aborted the process in the
    first backward's reduce-scatter, or the ranks trained apart)."""
    run_ranks(aw.run_mismatches, str(tmp_path), timeout_seconds=120)
    got = [torch.load(tmp_path / f"mismatch_rank{r}.pt", weights_only=True) for r in range(2)]
    assert got[0] == got[1]
    want = {"chunk_size": "chunk_size: rank 1 has 800, rank 0 600",
            "extra layer": "parameters: rank 1 has 14 entries, rank 0 12; at #10 rank 1 has ('1.weight', (4, 4), True)",
            "precision": "precision: rank 1 has 'bf16', rank 0 'fp32'",
            "shard_params": "shard_params: rank 1 has True, rank 0 False"}
    for case, text in want.items():
        message = got[0][case]
        assert message is not None, f"{case}: no error"
        assert "ranks of GeminiConfig.process_group disagree" in message and text in message, (case, message)


def test_shared_report_path_gives_each_rank_its_file(tmp_path):
    """One report_path on both ranks: rank 0's run in the file itself (what read_reports and
    `gemini report` show), rank 1's in reports.rank1.jsonl; no file mixes ranks."""
    path = tmp_path / "reports.jsonl"
    run_ranks(aw.run_shared_report_path, str(path), 2, timeout_seconds=120)
    for rank, file in enumerate([path, tmp_path / "reports.rank1.jsonl"]):
        assert gemini.rank_report_path(path, rank) == str(file)
        runs = gemini.read_report_runs(file)
        assert len(runs) == 1 and runs[0].header["rank"] == rank
        assert [(r.rank, r.step) for r in runs[0].reports] == [(rank, 0), (rank, 1)]


def test_rank_report_path_names():
    assert gemini.rank_report_path("out/reports.jsonl", 0) == "out/reports.jsonl"
    assert gemini.rank_report_path("out/reports.jsonl", 3) == "out/reports.rank3.jsonl"
    assert gemini.rank_report_path("out/reports", 1) == "out/reports.rank1"
