"""The errors gemini raises for a budget it cannot keep (engine and policies) and for copies of what it manages."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DeviceBudgetError", "NotCopyable"]


class DeviceBudgetError(torch.OutOfMemoryError, MemoryError):
    """The device memory budget cannot hold what the step needs.

    Raised before any parameter or optimizer state is changed; ``missing_bytes`` says by how much the budget falls
    short.

    [Note: the budget's error is an out-of-memory error]
    On a GPU the budget caps the allocator, and its out-of-memory errors come out as this one. So it subclasses
    ``torch.OutOfMemoryError`` (a ``RuntimeError``) and its message contains torch's words ("out of memory."): code
    that catches torch's error to skip a batch, and tools that halve the batch on it (accelerate's
    ``find_executable_batch_size``, Trainer's ``auto_find_batch_size``, which read the message), handle it too. It
    is also a ``MemoryError``.
    """

    def __init__(self, message: str, *, missing_bytes: int) -> None:
        super().__init__(f"device budget out of memory. {message}")
        self.missing_bytes = missing_bytes


class NotCopyable:
    """Refuses ``copy.deepcopy`` and pickling, saying what to do instead.

    Mixed into the wrapped model, the engine's hooks (so the module given to initialize, which holds them, is refused
    too) and the optimizer (torch's ``Optimizer.__getstate__`` would pickle a shell that fails at its first use)."""

    _copied_as = "model"  # what messages call it

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(_not_copyable(f"copy.deepcopy({self._copied_as})", self._copied_as))

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_not_copyable(f"pickling the {self._copied_as} (torch.save({self._copied_as}))", self._copied_as))


def _not_copyable(what: str, noun: str) -> str:
    if noun == "optimizer":
        return (f"{what} is not supported after gemini.initialize: its states live in chunks that the engine and the "
                f"model share. To save it, use torch.save(optimizer.state_dict()) or gemini.save_checkpoint (it loads "
                f"into the optimizer of another gemini.initialize, or into a torch.optim.AdamW)")
    return (f"{what} is not supported after gemini.initialize: the parameters live in chunks that the engine and "
            f"the optimizer share. For a copy (an EMA, a frozen teacher), deep-copy the module before initialize, "
            f"or build a fresh one and load model.state_dict() into it (full fp32 values, the original keys); "
            f"to save, use torch.save(model.state_dict()) or gemini.save_checkpoint")
