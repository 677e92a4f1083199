import gc
import threading
import time

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode

from tracer.monitors import (
    CudaAllocatorMonitor,
    MonitorState,
    NvmlMonitor,
    TensorAccountingMonitor,
    make_monitor,
)
from tracer.nvml_monitor import _PeakSampler

F32 = 4  # bytes per float32


def _nbytes(tensors):
    return sum(t.untyped_storage().nbytes() for t in tensors)


def test_accounting_follows_allocations_and_frees_exactly():
    with TensorAccountingMonitor("cpu") as mon:
        a = torch.empty(1000)
        b = torch.ones(2000)
        del a
        c = torch.zeros(500, dtype=torch.float64)
        view = b[10:]
        del b
        assert (mon.current_bytes(), mon.peak_bytes()) == (12000, 12000)
        del view
        assert mon.current_bytes() == 4000
        mon.reset_peak()
        d = c * 2  # an op output, freed at once: counted in the peak only
        del d
        assert (mon.current_bytes(), mon.peak_bytes()) == (4000, 8000)
    # Frozen at stop().
    del c
    assert (mon.current_bytes(), mon.peak_bytes()) == (4000, 8000)


def test_mlp_forward_peak_matches_hand_arithmetic():
    # x @ w1 -> h1 (B x H); relu -> r (B x H), after which Sequential drops h1 (nothing saved
    # it); r @ w2 -> y (B x D). With H > D the peak is reached during relu:
    #   params + x + h1 + r.
    batch, d_in, hidden = 8, 64, 256
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, hidden, bias=False), nn.ReLU(), nn.Linear(hidden, d_in, bias=False))
    x = torch.randn(batch, d_in)
    params = list(model.parameters())
    param_bytes = _nbytes(params)
    assert param_bytes == 2 * d_in * hidden * F32

    mon = TensorAccountingMonitor("cpu")
    mon.track(params)
    with mon:
        assert mon.current_bytes() == param_bytes  # x not seen yet: no op used it
        y = model(x)
        assert mon.peak_bytes() == param_bytes + F32 * (batch * d_in + 2 * batch * hidden)
        # Still alive: x, r (saved by relu and the second matmul) and y.
        assert mon.current_bytes() == param_bytes + F32 * (2 * batch * d_in + batch * hidden)
        y.sum().backward()  # backward runs under the mode too: it allocates the gradients
        del y
        assert mon.current_bytes() == param_bytes + F32 * batch * d_in + param_bytes


def test_saved_activations_stay_counted_until_the_graph_is_freed():
    lin = nn.Linear(128, 128)
    x = torch.randn(32, 128, requires_grad=True)
    mon = TensorAccountingMonitor("cpu")
    mon.track([x, *lin.parameters()])
    with mon:
        base = mon.current_bytes()
        y = torch.tanh(lin(x))  # tanh saves its output; the linear's output dies at once
        assert mon.current_bytes() - base == y.untyped_storage().nbytes()
        loss = y.sum()
        after_loss = mon.current_bytes()
        del y
        assert mon.current_bytes() == after_loss  # the graph keeps tanh's output alive
        loss.backward()
        del loss
        # graph gone: what is left are the gradients
        grads = _nbytes([x.grad, lin.weight.grad, lin.bias.grad])
        assert mon.current_bytes() - base == grads


def test_baseline_and_count_inputs():
    w = torch.randn(100, 100)
    with TensorAccountingMonitor("cpu", baseline_bytes=1234, count_inputs=False) as mon:
        assert mon.current_bytes() == 1234
        out = w + 1
        assert mon.current_bytes() == 1234 + out.untyped_storage().nbytes()  # w not counted
    with TensorAccountingMonitor("cpu") as mon:
        out = w + 1
        assert mon.current_bytes() == 2 * 100 * 100 * F32  # w seen as an input


def test_other_devices_are_ignored():
    with TensorAccountingMonitor("meta") as mon:
        torch.empty(1000, device="meta")
        keep = torch.empty(10, device="meta")
        torch.empty(1000)  # cpu: not watched
        assert mon.current_bytes() == 40
        del keep


def test_exclude_keeps_host_buffers_out():
    host_payload = torch.empty(4096)
    with TensorAccountingMonitor("cpu") as mon:
        mon.exclude(host_payload)
        host_payload.add_(1)  # seen as an op's input and output, but excluded
        tmp = torch.empty(10)
        assert mon.current_bytes() == 40
        del tmp


def test_state_machine_and_errors():
    mon = TensorAccountingMonitor("cpu")
    assert mon.state is MonitorState.NEW
    with pytest.raises(RuntimeError, match="before start"):
        mon.peak_bytes()
    with pytest.raises(RuntimeError, match="running monitor"):
        mon.reset_peak()
    mon.start()
    with pytest.raises(RuntimeError, match="already running"):
        mon.start()
    mon.stop()
    assert mon.state is MonitorState.STOPPED
    with pytest.raises(RuntimeError, match="running monitor"):
        mon.stop()
    mon.start()  # restartable
    mon.stop()
    with pytest.raises(TypeError, match="baseline_bytes"):
        TensorAccountingMonitor("cpu", baseline_bytes=1.5)
    with pytest.raises(ValueError, match="baseline_bytes"):
        TensorAccountingMonitor("cpu", baseline_bytes=-1)
    with pytest.raises(TypeError, match=r"tensors\[1\]"):
        mon.track([torch.empty(1), "x"])


def test_stop_on_another_thread_is_refused():
    mon = TensorAccountingMonitor("cpu")
    mon.start()
    errors = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, mon.stop)))
    worker.start()
    worker.join()
    assert errors and "thread" in str(errors[0].value)
    mon.stop()


def test_make_monitor_picks_by_device():
    assert isinstance(make_monitor("cpu"), TensorAccountingMonitor)
    assert isinstance(make_monitor(torch.device("cpu")), TensorAccountingMonitor)
    with pytest.raises(TypeError, match="device"):
        make_monitor(3)
    with pytest.raises(ValueError, match="not a device"):
        make_monitor("gpu0")
    if torch.cuda.is_available():
        assert isinstance(make_monitor("cuda"), CudaAllocatorMonitor)
    else:
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            make_monitor("cuda")


def test_cuda_allocator_monitor_rejects_other_devices():
    with pytest.raises(ValueError, match="cuda device"):
        CudaAllocatorMonitor("cpu")


@pytest.mark.skipif(NvmlMonitor.is_available(), reason="NVML works here")
def test_nvml_unavailable_without_gpu():
    with pytest.raises(RuntimeError, match="NVML is unavailable"):
        NvmlMonitor(0)


def test_peak_sampler_keeps_the_max_of_polled_readings():
    readings = iter([100, 100, 900, 300] + [200] * 100_000)
    seen = []

    def read():
        value = next(readings)
        seen.append(value)
        return value

    sampler = _PeakSampler(read, interval_s=0.001)
    sampler.start()
    deadline = time.monotonic() + 5
    while len(seen) < 6 and time.monotonic() < deadline:
        time.sleep(0.005)
    sampler.stop()
    assert sampler.peak_bytes() == 900
    sampler.reset_peak()
    assert sampler.peak_bytes() == 200


@pytest.mark.cuda
def test_cuda_allocator_monitor_measures_a_known_allocation():
    with CudaAllocatorMonitor("cuda") as mon:
        base = mon.current_bytes()
        t = torch.empty(1 << 20, device="cuda")  # 4 MiB, a multiple of the 512-byte rounding
        assert mon.current_bytes() - base == 4 << 20
        del t
        assert mon.current_bytes() == base
        assert mon.peak_bytes() - base == 4 << 20
        mon.reset_peak()
        assert mon.peak_bytes() == base


@pytest.mark.cuda
def test_accounting_peak_matches_cuda_allocator_through_forward_and_backward():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(4)])
    model.cuda()
    x = torch.randn(64, 1024, device="cuda", requires_grad=True)
    # A first iteration creates cuBLAS's workspace, which the allocator counts and no
    # tensor shows; measure the second.
    model(x).square().mean().backward()
    model.zero_grad(set_to_none=True)
    x.grad = None
    torch.cuda.synchronize()
    acc = TensorAccountingMonitor("cuda")
    acc.track([*model.parameters(), x])
    alloc = CudaAllocatorMonitor("cuda")
    with alloc, acc:
        acc_base, alloc_base = acc.current_bytes(), alloc.current_bytes()
        model(x).square().mean().backward()  # backward runs on the device's autograd thread
        torch.cuda.synchronize()
        acc_peak = acc.peak_bytes() - acc_base
        alloc_peak = alloc.peak_bytes() - alloc_base
    assert acc_peak == pytest.approx(alloc_peak, rel=0.10)


@pytest.mark.cuda
def test_nvml_sees_a_large_allocation():
    if not NvmlMonitor.is_available(0):
        pytest.skip("NVML is not available")
    with NvmlMonitor(0, sample_interval_s=0.001) as mon:
        before = mon.current_bytes()
        t = torch.empty(256 << 20, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        assert mon.current_bytes() - before >= 200 << 20
        assert mon.peak_bytes() >= before + (200 << 20)
        del t


def test_stop_out_of_order_with_another_dispatch_mode_is_refused():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    gc.collect()  # engines of earlier tests left with their window open leave (DeviceMemory.close)
    mon = TensorAccountingMonitor("cpu")
    mon.start()
    inner = Passthrough()
    inner.__enter__()
    try:
        with pytest.raises(RuntimeError, match="innermost mode"):
            mon.stop()
    finally:
        inner.__exit__(None, None, None)
    keep = torch.empty(8)
    assert mon.current_bytes() == 32
    mon.stop()
    del keep


def test_two_monitors_stop_in_either_order_and_each_counts_what_its_window_saw():
    """[Note: monitors sharing one mode]: two engines' windows interleave (a GAN's generator and
    discriminator); the first started may stop first. Each counts the storages made while it runs;
    a host payload one excludes is excluded for both, and an in-place resize one is told of is
    re-read by both."""
    gc.collect()  # engines of earlier tests left with their window open leave (DeviceMemory.close)
    first, second = TensorAccountingMonitor("cpu"), TensorAccountingMonitor("cpu")
    first.start()
    a = torch.empty(1000)  # 4000 bytes: the first's only
    second.start()
    b = torch.empty(500)  # 2000 bytes: both
    with _disable_current_modes():  # as the engine allocates host payloads: quietly
        host = torch.empty(250)  # a host payload where the CPU stands in for the device
    second.exclude(host)
    host.add_(1)  # an operator touching it later counts for neither
    shell = torch.empty(100)  # 400 bytes: both
    first.resized(shell)
    shell.untyped_storage().resize_(0)  # freed in place (resize_ bypasses the dispatcher)
    first.resized(shell)
    assert first.current_bytes() == 6000 and second.current_bytes() == 2000
    first.stop()  # out of order: the second's window goes on
    c = torch.empty(50)
    assert second.current_bytes() == 2200 and first.current_bytes() == 6000
    second.stop()
    d = torch.empty(10)  # no monitor runs: no mode left on the stack
    assert _get_current_dispatch_mode() is None
    assert second.peak_bytes() == 2400 and first.peak_bytes() == 6400  # the shell while it was 400
    del a, b, c, d, host, shell


def test_cuda_monitors_keep_their_own_peak_across_each_others_resets(monkeypatch):
    """[Note: one device peak, several monitors]: torch's peak is one per device; one monitor's
    reset (a new window) no longer clears what another's window saw. The allocator is stood in."""
    import tracer.memory_monitor as mm
    from helpers import FakeCudaAllocator

    allocator = FakeCudaAllocator(monkeypatch)

    def alloc(n):
        allocator.use(allocator.allocated + n)

    generator, discriminator = mm.CudaAllocatorMonitor("cuda"), mm.CudaAllocatorMonitor("cuda")
    generator.start()
    alloc(1000)
    alloc(-1000)  # the generator's forward peaked at 1000
    discriminator.start()  # its window begins: the device's peak is reset
    alloc(300)
    assert generator.peak_bytes() == 1000 and discriminator.peak_bytes() == 300
    discriminator.reset_peak()
    mm.reset_cuda_peak(torch.device("cuda", 0))  # the engine's own reset at a step
    assert generator.peak_bytes() == 1000 and discriminator.peak_bytes() == 300
    generator.stop()
    discriminator.reset_peak()
    assert discriminator.peak_bytes() == 300 and generator.peak_bytes() == 1000


def test_a_monitor_discarded_inside_a_move_that_keeps_its_mode_leaves_no_mode_behind():
    """[Note: a mode kept through a move] (chunks/storage.py): an engine collected during another's
    chunk move (its finalizer discards its monitor) popped the mode the move had re-entered; the
    move's end then failed ("trying to pop from empty mode stack", a GAN's second engine at
    initialize in the full suite) and the stack restored after it held the mode, monitorless, for
    every later operator of the thread."""
    from chunks.storage import unseen_by_dispatch_modes

    gc.collect()
    dying = TensorAccountingMonitor("cpu")
    dying.start()
    with unseen_by_dispatch_modes(TensorAccountingMonitor.counts_in):
        torch.empty(10)
        dying.discard()  # as DeviceMemory's finalizer does
        torch.empty(10)
    assert _get_current_dispatch_mode() is None
    after = TensorAccountingMonitor("cpu")  # a later engine's monitor starts and stops cleanly
    after.start()
    a = torch.empty(100)
    assert after.current_bytes() == 100 * F32
    after.stop()
    assert _get_current_dispatch_mode() is None
    del a
