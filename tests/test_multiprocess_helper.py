"""The two-rank harness itself (tests/multiprocess.py): a port taken before rank 0 listens is
tried again on another, the ranks see no GPU unless asked, and each call's ranks the caller's
environment of the moment."""

from __future__ import annotations

import os
import socket

import pytest
import torch.distributed as dist

import multiprocess
from multiprocess import run_ranks


def _sum_ranks(rank: int, world: int, out_dir: str) -> None:
    import torch
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write(f"{t.item()} {os.environ.get('CUDA_VISIBLE_DEVICES')!r} {os.environ.get('GEMINI_TEST_DEVICE')!r}")


def test_a_port_taken_before_rank_0_listens_is_tried_again(tmp_path, monkeypatch):
    """Before [Note: a port taken before rank 0 listens] the run failed with EADDRINUSE."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("GEMINI_TEST_DEVICE")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = [taken.getsockname()[1]]
        real = multiprocess.free_port
        monkeypatch.setattr(multiprocess, "free_port", lambda: ports.pop(0) if ports else real())
        run_ranks(_sum_ranks, str(tmp_path), timeout_seconds=120)
        assert not ports, "the taken port was never handed out"
    for rank in (0, 1):
        total, cuda_visible, device = (tmp_path / f"rank{rank}.txt").read_text().split()
        assert float(total) == 3.0
        assert cuda_visible == "''" and device == "'cpu'"  # see [Note: ranks on the CPU beside a GPU]
    assert (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("GEMINI_TEST_DEVICE")) == before  # this process's as it was


def test_a_rank_that_fails_otherwise_is_not_tried_again(tmp_path):
    with pytest.raises(Exception, match="boom"):
        run_ranks(_raise, timeout_seconds=120)


def _raise(rank: int, world: int) -> None:
    raise RuntimeError("boom")


def _write_environment(rank: int, world: int, out_dir: str) -> None:
    with open(os.path.join(out_dir, f"env{rank}.txt"), "w") as f:
        f.write(f"{os.environ.get('GEMINI_PROBE_SET')!r} {os.environ.get('GEMINI_PROBE_GONE')!r}")


def test_the_ranks_take_the_callers_environment_of_each_call(tmp_path, monkeypatch):
    """Forked from a server started at an earlier call ([Note: ranks forked from a server]),
    the ranks still see the variables the caller has now, set or removed since."""
    monkeypatch.setenv("GEMINI_PROBE_GONE", "at the first call")
    run_ranks(_write_environment, str(tmp_path), timeout_seconds=120)
    assert (tmp_path / "env1.txt").read_text() == "None 'at the first call'"
    monkeypatch.delenv("GEMINI_PROBE_GONE")
    monkeypatch.setenv("GEMINI_PROBE_SET", "since")
    run_ranks(_write_environment, str(tmp_path), timeout_seconds=120)
    for rank in (0, 1):
        assert (tmp_path / f"env{rank}.txt").read_text() == "'since' None"
