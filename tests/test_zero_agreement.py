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


def test_a_rank_that_skips_backward_contributes_zeros(tmp_path):
    """Rank 1 calls step() without a backward at iteration 1: it reduces zeros, so both ranks
    equal plain AdamW on rank 0's half of the batch / 2 there (the mean over ranks, as an unused
    parameter gets) and on the global batch elsewhere (before: gloo aborted the process)."""
    run_ranks(aw.run_uneven_iterations, str(tmp_path), "skip_backward", STEPS, timeout_seconds=120)
    torch.manual_seed(0)
    model = zw.Net()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01,
                            fused=True)
    want = []
    for step, batch in enumerate(zw.make_data(STEPS)):
        x, y = zw.local(batch, 0, 2) if step == 1 else batch
        (zw.loss_fn(model(x), y) / (2 if step == 1 else 1)).backward()
        opt.step()
        opt.zero_grad()
        want.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    for rank in range(2):
        got = torch.load(tmp_path / f"skip_backward_rank{rank}.pt", weights_only=True)
        assert len(got) == STEPS
        for step in range(STEPS):
            _assert_close(got[step], want[step], f"rank {rank} step {step}")


def test_a_forward_error_on_one_rank_stops_every_rank(tmp_path):
    """Rank 1's forward raises at iteration 1 and its loop goes on: the next step's agreement
    raises "out of step" on both ranks (rank 0's iteration 1, rank 1's iteration 2), instead of
    reducing rank 0's batch 1 with rank 1's batch 2 and hanging at the end."""
    run_ranks(aw.run_uneven_iterations, str(tmp_path), "forward_error", STEPS, timeout_seconds=120)
    got = [torch.load(tmp_path / f"forward_error_rank{r}.pt", weights_only=True) for r in range(2)]
    assert isinstance(got[0][0], dict) and isinstance(got[1][0], dict)
    assert len(got[0]) == 2 and "out of step" in got[0][1], got[0][1:]
    assert got[1][1] == "a bad sample on this rank"
    assert len(got[1]) == 3 and "out of step" in got[1][2], got[1][1:]
    assert "1 training forward pass(es) raised since initialize, on another 0" in got[0][1]
