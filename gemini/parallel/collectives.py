"""`Collectives`: the few torch.distributed collectives ZeRO needs, on tensors of any tier.

[Note: which tensors a backend takes]
NCCL moves CUDA tensors only; gloo moves CPU tensors (and, for reduce-scatter and all-gather, not CUDA ones). Chunks
live on the device or in host memory depending on placement, so a tensor the backend cannot take goes through a
staging copy on the backend's side, copied back when the caller waits. On NCCL collectives run with
``async_op=True`` on NCCL's stream; ``Pending.wait()`` makes the current stream wait (the host does not block), and
``Pending`` keeps the tensors referenced until then so that no buffer still in use is freed or reused. On gloo an
asynchronous collective runs on gloo's thread and ``wait()`` blocks the host.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gemini.parallel.watchdog import Watchdog

logger = logging.getLogger(__name__)

__all__ = ["Collectives", "Pending"]

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class Pending:
    """A collective in flight; ``wait()`` finishes it (and copies a staged result back)."""

    work: dist.Work | None
    watchdog: Watchdog
    what: str
    finish: Callable[[], None] = lambda: None
    keep: tuple = ()  # tensors the collective uses, alive until it is done

    def wait(self) -> None:
        if self.work is not None:
            with self.watchdog.waiting(self.what):  # see [Note: a collective some ranks never call]
                self.work.wait()
            self.work = None
            self.finish()
            self.keep = ()


class Collectives:
    """The data-parallel process group of one rank."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self._device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                        else torch.device("cpu"))
        self.watchdog = Watchdog(self.rank, self.world)

    def __repr__(self) -> str:
        return f"Collectives({self.backend}, rank {self.rank} of {self.world})"

    def _staged(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` itself if the backend takes it, else a copy on the backend's device."""
        return t if t.device.type == self._device.type else t.to(self._device)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        """Start ``out = sum over ranks of inp[rank's range]`` (``inp`` has ``world * out.numel()``)."""
        assert inp.numel() == out.numel() * self.world, f"{inp.numel()=} != {self.world} * {out.numel()=}"
        s_in, s_out = self._staged(inp), self._staged(out)
        work = _reduce_scatter(s_out, s_in, group=self.group, async_op=True)
        finish = (lambda: out.copy_(s_out)) if s_out is not out else (lambda: None)
        return Pending(work, self.watchdog, "reduce-scatter", finish, keep=(s_in, s_out, inp, out))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor) -> Pending:
        """Start ``out[r's range] = inp of rank r`` for every rank (``inp`` may be a view of ``out``)."""
        assert out.numel() == inp.numel() * self.world, f"{out.numel()=} != {self.world} * {inp.numel()=}"
        s_out, s_in = self._staged(out), self._staged(inp)
        work = _all_gather(s_out, s_in, group=self.group, async_op=True)
        finish = (lambda: out.copy_(s_out)) if s_out is not out else (lambda: None)
        return Pending(work, self.watchdog, "all-gather", finish, keep=(s_in, s_out, inp, out))

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """``t`` reduced over ranks, in place (blocking); returns ``t``."""
        s = self._staged(t)
        with self.watchdog.waiting("all-reduce"):
            dist.all_reduce(s, op=op, group=self.group)
        if s is not t:
            t.copy_(s)
        return t

    def max_over_ranks(self, value: int) -> int:
        """The largest of every rank's ``value`` (blocking)."""
        with self.watchdog.waiting("all-reduce"):  # (NCCL: the host waits at .item())
            return int(self.all_reduce(torch.tensor([value], dtype=torch.int64), op=dist.ReduceOp.MAX).item())

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` set to the group's rank 0's ``t``, in place (blocking); returns ``t``."""
        s = self._staged(t)
        if s.dtype == torch.bool:
            s = s.view(torch.uint8)  # not every backend takes bool
        with self.watchdog.waiting("broadcast"):
            dist.broadcast(s, src=dist.get_global_rank(self.group, 0), group=self.group)
        if s.data_ptr() != t.data_ptr():
            t.copy_(s.view(t.dtype))
        return t

    def barrier(self) -> None:
        with self.watchdog.waiting("barrier"):
            dist.barrier(group=self.group)
