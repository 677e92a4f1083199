"""Markers and the compute device of the run.

``GEMINI_TEST_DEVICE`` (see tests/helpers.py) names the device the training tests run on:
"cpu" (the default: the CPU stands in for the device) or "cuda". Under "cuda" a session
without CUDA stops before any test runs, and tests marked ``standin`` (they test the CPU
stand-in itself) are skipped. Tests marked ``cuda`` run wherever CUDA is available.
``GEMINI_TEST_MOVES=gpu`` makes the CPU stand-in move parameters as a GPU does (see [Note: a
GPU's parameter moves, emulated] in tests/helpers.py).
"""

import gc

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "standin: tests the CPU stand-in itself (its dispatch monitor, its exact byte counts); "
                   "skipped when GEMINI_TEST_DEVICE=cuda")
    try:
        from helpers import DEVICE
    except ValueError as e:  # an unknown device or moves name
        pytest.exit(str(e), returncode=pytest.ExitCode.USAGE_ERROR)
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.exit(f"GEMINI_TEST_DEVICE=cuda but torch.cuda.is_available() is False (torch {torch.__version__}, "
                    f"CUDA build {torch.version.cuda}): no test was run; unset GEMINI_TEST_DEVICE to test on the CPU",
                    returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_collection_modifyitems(config, items):
    from helpers import DEVICE

    if DEVICE == "cuda":
        standin = pytest.mark.skip(reason="tests the CPU stand-in itself; GEMINI_TEST_DEVICE=cuda")
        for item in items:
            if item.get_closest_marker("standin") is not None:
                item.add_marker(standin)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _moves_as_configured():
    """Under GEMINI_TEST_MOVES=gpu, every test of the session moves parameters as a GPU does."""
    from helpers import EMULATED_GPU_MOVES, emulate_gpu_moves

    if not EMULATED_GPU_MOVES:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        emulate_gpu_moves(patch)
        yield


@pytest.fixture(autouse=True)
def _no_dispatch_mode_left():
    """No test leaves a dispatch mode on (gemini's accounting mode, left on, made every later
    test's operators run through it; torch.export failed under it). An engine whose backward
    raised is collected only after the next backward on the thread (see [Note: a mode left by a
    backward that raised] in tracer/accounting_monitor.py): one is run first where a mode is left."""
    yield
    if torch._C._len_torch_dispatch_stack():
        torch.ones(1, requires_grad=True).sum().backward()
        gc.collect()
        assert torch._C._len_torch_dispatch_stack() == 0, "the test left a dispatch mode on"


@pytest.fixture(autouse=True)
def _cuda_left_as_found():
    """After a test that used CUDA: its tensors freed, the allocator's cache emptied and no
    memory cap left behind (gemini caps the process at a budget below the card's memory with
    ``set_per_process_memory_fraction`` and does not lift it), so that the next test's
    measurements and budget start from a clean device. Nothing happens where CUDA was not used."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
