"""Sizes as people write them: parse_size accepts the units and says what is accepted when it refuses."""

import pytest

from offload import format_size, parse_size


@pytest.mark.parametrize("text, expected", [
    (0, 0),
    (4096, 4096),
    ("4096", 4096),
    ("1B", 1),
    ("2KB", 2000),
    ("2 KiB", 2048),
    ("512MiB", 512 * 2**20),
    ("512mib", 512 * 2**20),
    (" 8GB ", 8 * 10**9),
    ("1.5GiB", 3 * 2**29),
    ("1TiB", 2**40),
    ("3tb", 3 * 10**12),
    (".5KiB", 512),
    ("2.7GiB", 2899102924),  # rounded down to whole bytes (2.7 * 2**30 = 2899102924.8)
    ("1.6MiB", 1677721),
    ("0.0001KB", 0),
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "-1", -1, "12XB", "1.5B", "1.5", "0.3KB7", "1e9", True, 3.0, None, "MiB"])
def test_parse_size_rejects_with_value_and_units(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad, field="cpu_memory")
    message = str(info.value)
    assert "cpu_memory=" in message and repr(bad) in message
    assert "MiB" in message and "GiB" in message


def test_format_size_is_binary_and_readable():
    assert [format_size(n) for n in (0, 1023, 1536, 5 * 2**30)] == ["0 B", "1023 B", "1.50 KiB", "5.00 GiB"]
