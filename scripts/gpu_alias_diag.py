"""A question for a GPU (not a test): can a parameter whose chunk is on the host stay a CUDA
tensor, by viewing its pinned host memory through the device's mapping, so that torch keeps its
autograd accumulator?

    python scripts/gpu_alias_diag.py

Why it matters: on a GPU, ``p.data`` moved from the device copy to the host copy drops the
parameter's cached AccumulateGrad node (torch's ``set_data`` resets it when the device
changes). That is behind every GPU-only limitation the README lists: ``torch.autograd.grad(loss,
params)`` finds the parameter unused, ``loss.backward(inputs=params)`` computes nothing for it,
two forwards before one backward give it two accumulators (the gradient chunk comes back for the
second: 2.5x the bytes of one forward), and ``parameters_to_vector`` sees two devices. Pinned
memory (the pool's host payloads on CUDA) is mapped into the device's address space under
unified addressing, at the same address: a CUDA tensor over that pointer reads and writes the
host copy (zero-copy, over the link). If ``p.data`` pointed there instead of at a CPU view, a
parameter would never change device and keep one accumulator, as on the CPU stand-in.

Each question prints one line, ``yes``/``no`` and what it saw. Runs anywhere; without CUDA it
says so and stops.
"""
import time
import traceback

import torch


class _Interface:
    """A pointer offered to torch as CUDA memory (``__cuda_array_interface__``, version 2)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.owner = t  # keeps the host memory alive while the alias lives
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<f4", "data": (t.data_ptr(), False),
                                         "strides": None, "version": 2}


def alias(host: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(_Interface(host), device="cuda")


def ask(question: str, fn) -> None:
    try:
        ok, seen = fn()
        print(f"{'yes' if ok else 'no '}  {question}: {seen}", flush=True)
    except Exception:
        print(f"ERR  {question}: {traceback.format_exc()[-500:]}", flush=True)


def q_alias():
    host = torch.ones(1 << 20).pin_memory()
    a = alias(host)
    same = a.device.type == "cuda" and a.data_ptr() == host.data_ptr()
    total = a.sum().item()  # a kernel reading host memory
    a.mul_(2)  # a kernel writing it
    torch.cuda.synchronize()
    return same and total == 1 << 20 and host[3].item() == 2, \
        f"device {a.device}, same pointer {same}, sum {total}, host[3] after x2 {host[3].item()}"


def q_matmul():
    w = torch.randn(1024, 1024)
    host = w.pin_memory()
    dev = w.cuda()
    x = torch.randn(64, 1024, device="cuda")
    diff = (x @ alias(host).view(1024, 1024) - x @ dev).abs().max().item()
    return diff == 0, f"max |x@alias - x@device| = {diff}"


def q_accumulator_kept():
    """forward on the device view, p.data to the alias and back, backward: one accumulator?"""
    host = torch.randn(256, 256).pin_memory()
    dev = host.cuda()
    p = torch.nn.Parameter(dev.clone())
    p.data = dev
    x = torch.randn(8, 256, device="cuda")
    loss = (x @ p).square().sum()
    before = torch.autograd.graph.get_gradient_edge(p).node
    p.data = alias(host)
    p.data = dev
    after = torch.autograd.graph.get_gradient_edge(p).node
    p.data = alias(host)
    (g,) = torch.autograd.grad(loss, [p])  # while p views the host copy
    p.data = dev
    ref = dev.clone().requires_grad_()
    (gr,) = torch.autograd.grad((x @ ref).square().sum(), [ref])
    return before is after and torch.equal(g, gr), f"same node {before is after}, autograd.grad equal {torch.equal(g, gr)}"


def q_accumulator_dropped_by_cpu_view():
    """The control: a CPU view (today's design) drops it."""
    host = torch.randn(16).pin_memory()
    dev = host.cuda()
    p = torch.nn.Parameter(dev.clone())
    loss = (p * 2).sum()
    before = torch.autograd.graph.get_gradient_edge(p).node
    p.data = host
    p.data = dev
    after = torch.autograd.graph.get_gradient_edge(p).node
    del loss
    return before is not after, f"a CPU view in between gives a new node: {before is not after}"


def q_two_forwards_one_accumulation():
    host = torch.randn(128, 128).pin_memory()
    dev = host.cuda()
    p = torch.nn.Parameter(dev.clone())
    p.data = dev
    calls = []
    p.register_post_accumulate_grad_hook(lambda t: calls.append(1))
    x = torch.randn(4, 128, device="cuda")
    a = (x @ p).sum()
    p.data = alias(host)  # released between the forwards
    p.data = dev
    b = (x @ p).square().sum()
    p.data = alias(host)
    p.data = dev
    (a + b).backward()
    return len(calls) == 1, f"post-accumulate hooks fired {len(calls)} time(s)"


def q_stream_order():
    """A device-to-host copy on a side stream, then a read of the alias on the compute stream
    after waiting for the copy's event on the device (no host sync): the new values?"""
    host = torch.zeros(1 << 22).pin_memory()
    dev = torch.full((1 << 22,), 3.0, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        host.copy_(dev, non_blocking=True)
    event = torch.cuda.Event()
    event.record(side)
    torch.cuda.current_stream().wait_event(event)
    total = alias(host).sum().item()
    return total == 3.0 * (1 << 22), f"sum {total} (want {3.0 * (1 << 22)})"


def q_speed():
    n = 1 << 26  # 256 MiB
    host = torch.ones(n).pin_memory()
    dev = host.cuda()
    a = alias(host)
    out = []
    for name, t in (("device", dev), ("alias of pinned host", a)):
        t.sum()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            t.sum()
        torch.cuda.synchronize()
        out.append(f"{name} {5 * n * 4 / (time.perf_counter() - start) / 1e9:.1f} GB/s")
    return True, "reading 256 MiB: " + ", ".join(out)


if not torch.cuda.is_available():
    print("no CUDA device: nothing to ask")
else:
    print(torch.__version__, torch.cuda.get_device_name(), flush=True)
    ask("a CUDA tensor over pinned host memory (same pointer, kernels read and write it)", q_alias)
    ask("a matmul reading weights through the alias equals one on a device copy", q_matmul)
    ask("p.data device view -> alias -> device view keeps the AccumulateGrad; autograd.grad works", q_accumulator_kept)
    ask("control: a CPU view in between drops it", q_accumulator_dropped_by_cpu_view)
    ask("two forwards, released between them through the alias: one accumulation", q_two_forwards_one_accumulation)
    ask("the compute stream waiting on a side stream's d2h event reads the new values", q_stream_order)
    ask("bandwidth of a kernel reading the alias", q_speed)
