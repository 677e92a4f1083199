import gc
import threading

import pytest
import torch

from tracer.storage_ledger import StorageLedger, storages_of


def test_counts_each_storage_once_and_drops_it_when_freed():
    ledger = StorageLedger()
    a = torch.empty(1000)  # 4000 bytes
    b = torch.empty(10, 10, dtype=torch.float64)  # 800 bytes
    assert ledger.add(a.untyped_storage()) == 4000
    assert ledger.add(b.untyped_storage()) == 800
    # Views share their base's storage: no new bytes.
    assert ledger.add(a[10:].untyped_storage()) == 0
    assert ledger.add(b.t().untyped_storage()) == 0
    assert (ledger.current_bytes, ledger.peak_bytes, len(ledger)) == (4800, 4800, 2)

    view = a[100:200]
    del a
    gc.collect()
    assert ledger.current_bytes == 4800  # the view keeps the whole storage alive
    del view
    assert ledger.current_bytes == 800
    del b
    assert (ledger.current_bytes, ledger.peak_bytes, len(ledger)) == (0, 4800, 0)


def test_peak_reset_starts_from_current():
    ledger = StorageLedger()
    a = torch.empty(256)
    ledger.add(a.untyped_storage())
    t = torch.empty(1024)
    ledger.add(t.untyped_storage())
    del t
    assert (ledger.current_bytes, ledger.peak_bytes) == (1024, 5120)
    ledger.reset_peak()
    assert ledger.peak_bytes == 1024
    u = torch.empty(512)
    ledger.add(u.untyped_storage())
    assert ledger.peak_bytes == 1024 + 2048


def test_in_place_storage_resize_is_seen_on_refresh_or_re_add():
    ledger = StorageLedger()
    t = torch.empty(1000)
    st = t.untyped_storage()
    ledger.add(st)
    st.resize_(0)  # how chunk payloads are often freed; bypasses the dispatcher
    assert ledger.current_bytes == 4000
    assert ledger.refresh() == -4000
    assert ledger.current_bytes == 0
    st.resize_(2000)
    assert ledger.add(st) == 2000
    assert (ledger.current_bytes, ledger.peak_bytes) == (2000, 4000)


def test_excluded_storage_is_never_counted_while_alive():
    ledger = StorageLedger()
    host = torch.empty(1000)
    ledger.add(host.untyped_storage())
    ledger.exclude(host.untyped_storage())
    assert ledger.current_bytes == 0
    assert ledger.add(host[5:].untyped_storage()) == 0
    assert host.untyped_storage() not in ledger
    del host  # its free must not be subtracted a second time
    assert ledger.current_bytes == 0
    later = torch.empty(10)
    ledger.exclude(later.untyped_storage())
    ledger.add(later.untyped_storage())
    assert ledger.current_bytes == 0


def test_clear_forgets_everything_and_late_frees_are_ignored():
    ledger = StorageLedger()
    a = torch.empty(100)
    ledger.add(a.untyped_storage())
    ledger.clear()
    assert (ledger.current_bytes, ledger.peak_bytes, len(ledger)) == (0, 0, 0)
    b = torch.empty(10)
    ledger.add(b.untyped_storage())
    del a
    assert ledger.current_bytes == 40


def test_frees_on_another_thread_are_subtracted():
    ledger = StorageLedger()
    box = [torch.empty(4096)]
    ledger.add(box[0].untyped_storage())
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert ledger.current_bytes == 0


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_storages_of_sparse_tensor_counts_indices_and_values():
    dense = torch.zeros(50, 50)
    dense[3, 4] = 1.0
    dense[10, 20] = 2.0
    coo = dense.to_sparse()
    ledger = StorageLedger()
    for st in storages_of(coo):
        ledger.add(st)
    expected = coo._indices().untyped_storage().nbytes() + coo._values().untyped_storage().nbytes()
    assert ledger.current_bytes == expected > 0
    csr = dense.to_sparse_csr()
    assert len(list(storages_of(csr))) == 3
