"""The errors gemini raises for a budget it cannot keep (raised by the engine and the policies)."""

from __future__ import annotations

__all__ = ["DeviceBudgetError"]


class DeviceBudgetError(MemoryError):
    """The device memory budget cannot hold what the step needs.

    Raised before any parameter or optimizer state is changed; ``missing_bytes`` says by how
    much the budget falls short.
    """

    def __init__(self, message: str, *, missing_bytes: int) -> None:
        super().__init__(message)
        self.missing_bytes = missing_bytes
