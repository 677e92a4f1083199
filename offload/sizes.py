"""Byte sizes as people write them ("512MiB", "8GB") and as messages show them ("1.50 KiB")."""

from __future__ import annotations

import re

__all__ = ["format_size", "parse_size"]

# [Note: size units]
# "KB"/"MB"/... are decimal (10**3 steps) and "KiB"/"MiB"/... binary (2**10 steps), as the SI
# and IEC define them; users who write "8GB" for a GPU's 8 GiB get 7% less budget, which is
# the safe direction for a budget. Matching is case-insensitive ("512mib" works). A fractional
# number of a unit of KB or more is rounded down to whole bytes, also the safe direction
# ("2.7GiB" is 2899102924 bytes); a fractional number of bytes ("0.3B", "1.5") is a mistake.
_UNIT_BYTES: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_ACCEPTED_SIZES = (
    "a non-negative int of bytes or a string like '4096', '512MiB', '1.5 GiB', '8GB' "
    "(units B, KB, KiB, MB, MiB, GB, GiB, TB, TiB; case-insensitive)"
)
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, field: str = "size") -> int:
    """Return ``value`` as a whole number of bytes.

    ``field`` names the setting in the error message, so that a config can say which of its
    fields was wrong: ``parse_size(cfg.cpu_memory, field="cpu_memory")``.
    """
    if isinstance(value, bool):  # bool is an int subclass; True bytes is a mistake
        raise ValueError(f"{field}={value!r} is not a size; accepted: {_ACCEPTED_SIZES}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{field}={value!r} is negative; accepted: {_ACCEPTED_SIZES}")
        return value
    if not isinstance(value, str):
        raise ValueError(
            f"{field}={value!r} ({type(value).__name__}) is not a size; accepted: {_ACCEPTED_SIZES}"
        )
    match = _SIZE_RE.match(value)
    if match is None:
        raise ValueError(f"{field}={value!r} is not a size; accepted: {_ACCEPTED_SIZES}")
    number_text, unit_text = match.groups()
    unit = unit_text.lower() or "b"
    if unit not in _UNIT_BYTES:
        raise ValueError(
            f"{field}={value!r} has unknown unit {unit_text!r}; accepted: {_ACCEPTED_SIZES}"
        )
    scale = _UNIT_BYTES[unit]
    if "." in number_text:
        # Exact decimal arithmetic: float("1.1") * 10**9 is not a whole number of bytes.
        whole, _, frac = number_text.partition(".")
        numerator = int(whole or "0") * 10 ** len(frac) + int(frac or "0")
        denominator = 10 ** len(frac)
        total, remainder = divmod(numerator * scale, denominator)
        if remainder and scale == 1:
            raise ValueError(
                f"{field}={value!r} is not a whole number of bytes; accepted: {_ACCEPTED_SIZES}"
            )
        return total  # rounded down
    return int(number_text) * scale


def format_size(nbytes: int) -> str:
    """Human-readable binary size for messages: 1536 -> '1.50 KiB'."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.2f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
