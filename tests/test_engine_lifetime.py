"""The engine holds no memory it should not: nothing accumulates per iteration, and an engine
is freed with its model and optimizer."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import gemini
from gemini.tools.gpt import GPT
from gemini.engine.backward_uses import BackwardUse
from helpers import DEVICE, TINY, batches, make_gpt, roomy_budget


def _live_backward_uses() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, BackwardUse))


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_no_hook_state_accumulates_over_iterations(placement):
    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000,
                                                                   device_memory=roomy_budget("4MiB")), lr=1e-2)
    (x, y), = batches(TINY, 1)
    counts = []
    for n in (2, 20):
        for _ in range(n):
            opt.backward(GPT.loss(model(x), y))
            opt.step()
            opt.zero_grad()
        counts.append(_live_backward_uses())
    # Before the fix each module call's graph lived on (about 30 closures an iteration).
    assert counts[1] == counts[0], counts
    opt.close()


@pytest.mark.parametrize("close", [True, False])
@pytest.mark.parametrize("placement", ["cuda", "cpu", "auto"])
def test_an_engine_is_freed_with_its_model_and_optimizer(placement, close):
    """Dropped, closed or not, the engine and its chunks go (its parameter hooks hold it weakly)."""
    def run():
        config = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000,
                                     device_memory=roomy_budget("4MiB"))
        model, opt = gemini.initialize(make_gpt(), config, lr=1e-2)
        for x, y in batches(TINY, 2):
            opt.backward(GPT.loss(model(x), y))
            opt.step()
            opt.zero_grad()
        if close:
            opt.close()
        return weakref.ref(opt._rt), weakref.ref(opt._rt.manager)

    runtime, manager = run()
    gc.collect()
    assert runtime() is None and manager() is None


def _stand_in_for_the_cuda_allocator(monkeypatch):
    """torch.cuda's allocator cap and the engine's CUDA monitor, stood in for on the CPU: the
    class whose ``fraction`` is the cap (kept to whole thousandths, as the allocator keeps whole
    bytes) and ``sets`` how often it was set; a card of 80 GiB."""
    from gemini.engine import memory

    class Allocator:
        fraction = 1.0
        sets = 0

        @staticmethod
        def set(fraction, device):
            Allocator.fraction = int(fraction * 1000) / 1000  # not quite the value set
            Allocator.sets += 1

    class Monitor:
        def __init__(self, device):
            pass

        def start(self):
            pass

        def reset_peak(self):
            pass

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", Allocator.set)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device: Allocator.fraction)
    monkeypatch.setattr(memory, "_device_total_bytes", lambda device: 80 * 2**30)
    monkeypatch.setattr(memory, "CudaAllocatorMonitor", Monitor)
    return Allocator


def test_the_budgets_allocator_cap_is_set_once_and_lifted_at_close(monkeypatch):
    """On CUDA a budget below the card caps the process's allocator (process-wide): set when
    measuring first starts, not again at each iteration's window (else the cap "before" it would
    be its own), and lifted when the engine closes, unless something else changed it since.
    The CUDA calls are stood in for: this is the bookkeeping, tests/test_cuda.py the real cap."""
    from gemini.engine import memory

    Allocator = _stand_in_for_the_cuda_allocator(monkeypatch)
    Allocator.fraction = 0.9  # a cap the user set before
    budget = memory.DeviceMemory(torch.device("cuda"), 7 * 2**30, measure=True)
    for _ in range(3):  # three iterations' windows
        budget.start([], lambda: 0)
    assert Allocator.fraction == 0.087 and Allocator.sets == 1
    budget.close()
    assert Allocator.fraction == 0.9
    budget.close()  # twice is harmless
    assert Allocator.fraction == 0.9 and Allocator.sets == 2
    other = memory.DeviceMemory(torch.device("cuda"), 8 * 2**30, measure=True)
    other.start([], lambda: 0)
    Allocator.set(0.5, None)  # changed since by someone else: theirs stays
    other.close()
    assert Allocator.fraction == 0.5
    roomy = memory.DeviceMemory(torch.device("cuda"), 80 * 2**30, measure=True)
    roomy.start([], lambda: 0)
    roomy.close()
    assert Allocator.fraction == 0.5 and Allocator.sets == 4  # a budget of the whole card caps nothing


@pytest.mark.standin  # the stand-in's dispatch-mode monitor
def test_an_engine_collected_with_its_window_open_stops_measuring():
    """A training forward without a step (the loop ended, or raised) leaves the engine's window
    open. Collected so, its monitor had stayed on the dispatch-mode stack counting every later
    operator of the process; now the engine's close takes it off (see [Note: monitors sharing one
    mode] in tracer/accounting_monitor.py)."""
    import tracer.accounting_monitor as accounting

    gc.collect()
    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device="cpu", placement="auto"), lr=1e-2)
    x, y = batches(TINY, 1, device="cpu")[0]
    GPT.loss(model(x), y)  # no backward, no step
    monitor = opt._rt.memory.monitor
    assert monitor.running and monitor in accounting._THREAD.mode.monitors
    del model, opt, x, y
    gc.collect()
    mode = getattr(accounting._THREAD, "mode", None)
    assert not monitor.running and (mode is None or monitor not in mode.monitors)


def test_two_budgets_in_one_process_cap_the_allocator_at_the_smaller_until_both_close(monkeypatch):
    """Two engines in one process (a GAN's generator and discriminator): the cap is the smaller
    live budget whichever started first, stays while either lives, and the cap from before comes
    back when both have closed, in either order (see [Note: one allocator cap for several
    budgets]). The CUDA calls are stood in for."""
    from gemini.engine import memory

    allocator = _stand_in_for_the_cuda_allocator(monkeypatch)
    allocator.fraction = 0.9  # a cap the user set before
    for close_first in ("large", "small"):
        large = memory.DeviceMemory(torch.device("cuda", 0), 8 * 2**30, measure=True)
        small = memory.DeviceMemory(torch.device("cuda", 0), 4 * 2**30, measure=True)
        order = (large, small) if close_first == "large" else (small, large)
        for budget in order:  # the first to start is the first to close
            budget.start([], lambda: 0)
        assert allocator.fraction == 0.05  # 4 of 80 GiB, whichever started first
        order[0].close()
        assert allocator.fraction == (0.05 if close_first == "large" else 0.1), close_first
        order[1].close()
        assert allocator.fraction == 0.9, close_first


class _UserError(Exception):
    pass


def _failing_gradient(model) -> list[bool]:
    """Makes a mid-model Linear's output gradient raise while ``armed[0]`` (a NaN check, say)."""
    armed = [False]

    def fail(grad):
        if armed[0]:
            raise _UserError("a NaN in the gradient, say")

    def hook_output(module, args, out) -> None:  # returns None: the module's output is kept
        out.register_hook(fail)

    linears = [m for m in model.module.modules() if isinstance(m, torch.nn.Linear)]
    linears[len(linears) // 2].register_forward_hook(hook_output)
    return armed


@pytest.mark.parametrize("placement,budget", [
    ("cuda", None), ("cpu", None), ("static", None), ("auto", None),
    pytest.param("auto", "1200KiB", marks=pytest.mark.standin),  # evicting: a budget sized for the stand-in
])
def test_a_forward_that_raises_leaves_the_engine_as_before(placement, budget):
    """A forward that raises part-way (a user's error inside some module; in the warm-up too)
    leaves no chunk referenced and no state behind: the next iterations equal plain AdamW."""
    from helpers import assert_params_close, clone_pair, train_reference

    base, ref = clone_pair()
    data = batches(TINY, 4)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000,
                                                             device_memory=budget), lr=1e-2, weight_decay=0.1)
    armed = [False]

    def fail(module, args):
        if armed[0]:
            raise _UserError("a shape mismatch, say")

    linears = [m for m in model.module.modules() if isinstance(m, torch.nn.Linear)]
    linears[len(linears) // 2].register_forward_pre_hook(fail)  # mid-model: some modules ran
    for step, (x, y) in enumerate(data):
        if step in (0, 2):
            armed[0] = True
            with pytest.raises(_UserError):
                model(x)
            armed[0] = False
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
        assert_params_close(model.state_dict(), want[step], step=step)
    assert not any(opt._rt.residency._compute_refs.values())


@pytest.mark.parametrize("placement,budget", [
    ("cuda", None), ("cpu", None), ("static", None), ("auto", None),
    pytest.param("auto", "1200KiB", marks=pytest.mark.standin),  # evicting: a budget sized for the stand-in
])
def test_a_backward_that_raises_is_recovered_from_as_in_torch(placement, budget):
    """A backward that raises part-way (a user's autograd Function, an anomaly check; in the
    warm-up too), then zero_grad() and the next batch, as torch users recover: the iterations
    equal plain AdamW, p.grad is the gradient again and no chunk stays referenced (see [Note:
    a backward pass that raised])."""
    from helpers import assert_params_close, clone_pair, train_reference

    base, ref = clone_pair()
    data = batches(TINY, 4)
    _, want, _ = train_reference(ref, data, lr=1e-2, weight_decay=0.1)
    model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=2000,
                                                             device_memory=budget), lr=1e-2, weight_decay=0.1)
    armed = _failing_gradient(model)
    for step, (x, y) in enumerate(data):
        if step in (0, 2):
            armed[0] = True
            with pytest.raises(_UserError):
                opt.backward(GPT.loss(model(x), y))
            armed[0] = False
            opt.zero_grad()
        opt.backward(GPT.loss(model(x), y))
        assert all(p.grad is not None for p in model.parameters())  # torch's clip_grad_norm_ sees them
        opt.step()
        opt.zero_grad()
        assert_params_close(model.state_dict(), want[step], step=step)
    assert not any(opt._rt.residency._compute_refs.values())
    assert opt._rt.hooks.backward_passes == len(data) + 2  # the broken passes counted once each


def test_a_backward_that_raises_under_fp16_leaves_the_scaled_count_right():
    """fp16 checks each pass went through optimizer.backward: a pass that raised there was
    scaled, and must count as a pass, or every later step refused to run."""
    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=2000,
                                                                   precision="fp16"), lr=1e-2)
    armed = _failing_gradient(model)
    armed[0] = True
    (x, y), = batches(TINY, 1)
    with pytest.raises(_UserError):
        opt.backward(GPT.loss(model(x), y))
    armed[0] = False
    opt.zero_grad()
    for _ in range(2):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
    assert opt.reports_made == 2
