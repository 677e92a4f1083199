"""Run a function on several ranks (gloo on 127.0.0.1), bounded in time; a failing rank fails.

Each rank runs ``fn(rank, world, *args)`` in a process of its own (forked from a server that
imported torch, or spawned beside a GPU: [Note: ranks forked from a server]) after joining a gloo process
group on a free port of 127.0.0.1. The call raises if any rank raises (with its traceback),
exits non-zero, or the whole run outlives ``timeout_seconds`` (every rank is then killed).
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["free_port", "run_ranks"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# [Note: how a rank leaves]
# A rank that has done its work leaves with ``os._exit(0)`` once its process group is
# destroyed, skipping the interpreter's finalization. There gloo's C++ threads (and the TCP
# store's) can still be winding down; a thread that touches Python or a joinable std::thread
# destroyed then aborts the process ("terminate called without an active exception": twice
# in CI's full suite, in two different ZeRO tests; never in 160 runs of one of them alone
# under load) after every result was written, which failed tests whose ranks had done their
# work. Every failure before that point still fails: an exception in ``fn`` propagates
# (torch's spawn wrapper records it and exits 1), and faulthandler prints each thread's
# Python stack if a rank dies of a signal while working.
def _entry(rank: int, world: int, port: int, env: dict[str, str], fn, args) -> None:
    os.environ.clear()  # the caller's environment, not the fork server's: [Note: ranks forked from a server]
    os.environ.update(env)
    faulthandler.enable(all_threads=True)
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # stay on 127.0.0.1
    torch.set_num_threads(1)  # the ranks share the machine's cores
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
    except dist.DistNetworkError as e:
        if rank == 0 and "EADDRINUSE" in str(e):
            os._exit(_PORT_TAKEN)  # see [Note: a port taken before rank 0 listens]
        raise
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # see [Note: how a rank leaves]


# [Note: ranks on the CPU beside a GPU]
# The ranks train on the CPU (gloo, device="cpu"), but code they run asks torch where to put
# tensors: HF Trainer wraps the model in DDP on cuda:<rank> (no cuda:1 on a one-GPU machine),
# PEFT and accelerate move inputs to "cuda". So the ranks see no GPU unless a test asks for one
# (``cuda=True``), and train on the CPU whatever GEMINI_TEST_DEVICE says.
# [Note: a port taken before rank 0 listens]
# free_port() lets the port go before rank 0 binds it: beside other tests starting ranks (12
# pytest-xdist workers on the GPU machine) another process took it in between (EADDRINUSE,
# four tests at once). Rank 0 then leaves with _PORT_TAKEN and the ranks start again on a new port.
_PORT_TAKEN = 75
_PORT_TRIES = 3


def _spawn_env(cuda: bool) -> dict[str, str]:
    return {} if cuda else {"CUDA_VISIBLE_DEVICES": "", "GEMINI_TEST_DEVICE": "cpu"}


# [Note: ranks forked from a server]
# A spawned rank is a fresh interpreter that imports torch and gemini: ~3 s a call on the
# 2-core CI machine (6 s beside another test process), over some 60 calls in the suite. Where no
# GPU is present the ranks are forked instead from multiprocessing's fork server, which imported
# them once (0.07 s a call after the first; transformers' Trainer too where installed: 2.7 s a
# rank of the HF tests). The server is a fresh interpreter that has run no
# parallel region (which a fork does not survive) and no test's code; it keeps the environment it
# started with, so each rank first takes its caller's (a test's monkeypatched variables, and the
# overlay above). Beside a GPU the ranks are spawned as before: hiding the GPU relies on
# CUDA_VISIBLE_DEVICES being set before torch first asks CUDA anything, which a spawn guarantees.
_PRELOAD = ["torch", "torch.distributed", "gemini", "transformers.trainer"]  # the last where installed


def _start_method() -> str:
    if torch.cuda.is_available():
        return "spawn"
    mp.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts, at the first call
    return "forkserver"


def run_ranks(fn, *args, world: int = 2, timeout_seconds: float = 240.0, cuda: bool = False) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise if any rank fails or it hangs.
    The ranks see the GPUs only with ``cuda`` (see [Note: ranks on the CPU beside a GPU])."""
    for attempt in range(_PORT_TRIES):
        try:
            return _run_ranks_once(fn, args, world, timeout_seconds, _spawn_env(cuda))
        except mp.ProcessExitedException as e:
            if e.exit_code != _PORT_TAKEN or attempt == _PORT_TRIES - 1:
                raise


def _run_ranks_once(fn, args, world: int, timeout_seconds: float, env: dict[str, str]) -> None:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # a spawned interpreter inherits it; this process's CUDA is as it was
    try:
        ctx = mp.start_processes(_entry, args=(world, free_port(), dict(os.environ), fn, args), nprocs=world,
                                 join=False, start_method=_start_method())
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.monotonic() + timeout_seconds
    try:
        while not ctx.join(timeout=1.0):  # raises ProcessRaisedException / ProcessExitedException
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world} ranks still running after {timeout_seconds} s (a hang?)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join()
