import threading

import pytest

from offload import BudgetExceededError, Tier, TierBudgets, parse_size


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
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "-1", -1, "12XB", "1.5B", "0.3KB7", "1e9", True, 3.0, None, "MiB"])
def test_parse_size_rejects_with_value_and_units(bad):
    with pytest.raises(ValueError) as info:
        parse_size(bad, field="cpu_memory")
    message = str(info.value)
    assert "cpu_memory=" in message and repr(bad) in message
    assert "MiB" in message and "GiB" in message


def test_reserve_release_used_peak_and_reset():
    b = TierBudgets(device_bytes="1KiB")
    b.reserve(Tier.DEVICE, 600)
    b.reserve("device", 300)
    b.release(Tier.DEVICE, 800)
    assert b.used(Tier.DEVICE) == 100 and b.peak(Tier.DEVICE) == 900
    assert b.available("DEVICE") == 924
    b.reset_peak()
    assert b.peak(Tier.DEVICE) == 100
    b.reserve(Tier.HOST, 10**12)  # no limit: counted, never refused
    assert b.usage(Tier.HOST).used_bytes == 10**12 and b.available(Tier.HOST) is None


def test_limit_error_says_how_much_is_missing_and_reserves_nothing():
    b = TierBudgets(nvme_bytes=1000)
    b.reserve(Tier.NVME, 700)
    with pytest.raises(BudgetExceededError) as info:
        b.reserve(Tier.NVME, 500, what="chunk 3")
    err = info.value
    assert isinstance(err, MemoryError)
    assert (err.missing_bytes, err.used_bytes, err.limit_bytes, err.requested_bytes) == (200, 700, 1000, 500)
    assert "200 bytes" in str(err) and "nvme" in str(err) and "chunk 3" in str(err)
    assert b.used(Tier.NVME) == 700 and not b.try_reserve(Tier.NVME, 301) and b.try_reserve(Tier.NVME, 300)


def test_bad_release_tier_and_limit_are_errors():
    b = TierBudgets()
    b.reserve(Tier.HOST, 10)
    with pytest.raises(ValueError, match="only 10 bytes reserved"):
        b.release(Tier.HOST, 11)
    with pytest.raises(ValueError, match="accepted: 'device', 'host', 'nvme'"):
        b.reserve("gpu", 1)
    with pytest.raises(ValueError, match="host_bytes='lots'"):
        TierBudgets(host_bytes="lots")
    assert TierBudgets.from_mapping({"device": "1MiB", Tier.NVME: None}).limit(Tier.DEVICE) == 2**20


def test_concurrent_reservations_never_pass_the_limit():
    b = TierBudgets(device_bytes=50)
    failures = []

    def worker():
        for _ in range(2000):
            if b.try_reserve(Tier.DEVICE, 7):
                if b.used(Tier.DEVICE) > 50:
                    failures.append(b.used(Tier.DEVICE))
                b.release(Tier.DEVICE, 7)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures and b.used(Tier.DEVICE) == 0 and b.peak(Tier.DEVICE) <= 49
