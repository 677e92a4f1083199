import ctypes
import errno
import gc
import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from offload import IoMode, NvmeCorruptionError, NvmeStore, NvmeStoreConfig, NvmeStoreError
from offload.aligned import aligned_empty

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BLOCK = 64 << 10  # small checksum blocks and pieces: many of each per request at test sizes
PIECE = 2 * BLOCK


def random_tensor(nbytes: int, dtype: torch.dtype, *, offset_bytes: int = 0, seed: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` with random bytes, starting ``offset_bytes`` past a 4 KiB boundary."""
    g = torch.Generator().manual_seed(seed)
    base = aligned_empty(offset_bytes + nbytes)
    base.copy_(torch.randint(0, 256, (offset_bytes + nbytes,), dtype=torch.uint8, generator=g))
    return base[offset_bytes:].view(dtype)


def raw_bytes(t: torch.Tensor) -> bytes:
    # Read straight from memory (numpy is not a dependency).
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


def file_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(params=[IoMode.DIRECT, IoMode.BUFFERED], ids=["direct", "buffered"])
def store(request, tmp_path):
    s = NvmeStore(tmp_path, block_bytes=BLOCK, piece_bytes=PIECE, max_in_flight=4,
                  use_direct_io=None if request.param is IoMode.DIRECT else False)
    if s.io_mode is not request.param:
        s.close()
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    yield s
    s.close()


CASES = [  # (bytes, dtype, byte offset of the source from a 4 KiB boundary)
    (1, torch.uint8, 0), (7, torch.uint8, 3), (4095, torch.uint8, 0), (4096, torch.float32, 0),
    (4100, torch.float32, 4), (BLOCK - 2, torch.bfloat16, 0), (BLOCK + 4098, torch.float16, 2),
    (3 * BLOCK, torch.int64, 8), ((3 << 20) + 12, torch.float32, 0), (40_000, torch.bool, 1),
]


def test_round_trips_are_byte_exact_with_many_requests_in_flight(store):
    sources = [random_tensor(n, dt, offset_bytes=off, seed=i) for i, (n, dt, off) in enumerate(CASES)]
    snapshots = [raw_bytes(t) for t in sources]
    writes = [store.write(("k", i), t) for i, t in enumerate(sources)]  # all in flight together
    for f in writes:
        assert f.result(timeout=30) is None
    for i, t in enumerate(sources):
        assert raw_bytes(t) == snapshots[i]  # the store never touches the caller's tensor
        on_disk = file_bytes(store.path_of(("k", i)))  # read back independently of the store
        assert on_disk[:len(snapshots[i])] == snapshots[i]
        assert on_disk[len(snapshots[i]):] == bytes(len(on_disk) - len(snapshots[i]))  # zero padding
        assert len(on_disk) == (-(-len(snapshots[i]) // 4096) * 4096 if store.io_mode is IoMode.DIRECT
                                else len(snapshots[i]))
    outs = [random_tensor(n, dt, offset_bytes=off + 8 * dt.itemsize, seed=99) for n, dt, off in CASES]
    reads = [store.read(("k", i), out) for i, out in enumerate(outs)]
    for i, f in enumerate(reads):
        assert f.result(timeout=30) is outs[i]
        assert raw_bytes(outs[i]) == snapshots[i], CASES[i]
    total = sum(n for n, _, _ in CASES)
    assert store.bytes_stored == total and store.write_bytes == total and store.read_bytes == total
    assert store.read_seconds > 0 and store.write_seconds > 0 and len(store) == len(CASES)


def test_read_into_views_of_a_bigger_tensor_leaves_the_neighbours_alone(store):
    n = BLOCK + 1000  # elements: an unaligned tail in every case
    src = random_tensor(n * 4, torch.float32, seed=1)
    store.write("x", src).result()
    big = aligned_empty(4 * (3 * n)).view(torch.float32).fill_(-7.0)
    for start in (1024, 5):  # 4 KiB-aligned (no staging) and unaligned (staged) destinations
        big.fill_(-7.0)
        view = big[start:start + n]
        store.read("x", view).result()
        assert raw_bytes(view) == raw_bytes(src)  # bytes, not values: random bits include NaNs
        assert bool((big[:start] == -7.0).all()) and bool((big[start + n:] == -7.0).all())


def test_requests_on_one_key_keep_their_order_and_delete_removes_the_file(store):
    a, b = random_tensor(10_000, torch.uint8, seed=1), random_tensor(10_000, torch.uint8, seed=2)
    out = torch.empty(10_000, dtype=torch.uint8)
    big = random_tensor(8 << 20, torch.uint8, seed=3)
    store.write("k", big)  # slow
    store.write("k", a)    # fast: must still land after the big one
    store.write("k", b)
    store.read("k", out).result()  # issued before any write finished
    assert torch.equal(out, b)
    path = store.path_of("k")
    assert len([p for p in os.listdir(store.folder) if p.endswith(".bin")]) == 1  # old file replaced
    store.delete("k").result()
    assert "k" not in store and not os.path.exists(path) and store.bytes_stored == 0
    with pytest.raises(KeyError, match="'k'"):
        store.read("k", out).result()


def test_a_cancelled_request_still_completes_safely(store):
    big = random_tensor(4 << 20, torch.uint8, seed=5)
    small = random_tensor(5000, torch.uint8, seed=6)
    future = store.write("big", big)
    future.cancel()
    store.write("small", small).result()  # a new open must not get a descriptor still in use
    out = torch.empty_like(small)
    assert raw_bytes(store.read("small", out).result()) == raw_bytes(small)
    big_out = torch.empty_like(big)  # ordered after the cancelled write, which still landed
    assert raw_bytes(store.read("big", big_out).result()) == raw_bytes(big)
    store.close()  # waits for the cancelled write instead of closing under it
    assert not os.path.exists(store.folder)


def test_a_flipped_byte_is_reported_with_file_and_offset(store):
    src = random_tensor(3 * BLOCK + 100, torch.uint8, seed=3)
    store.write("c", src).result()
    path = store.path_of("c")
    damaged_at = 2 * BLOCK + 777
    with open(path, "r+b") as f:
        f.seek(damaged_at)
        byte = f.read(1)
        f.seek(damaged_at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(NvmeCorruptionError) as info:
        store.read("c", torch.empty_like(src)).result()
    err = info.value
    assert err.path == path and err.offset_bytes == 2 * BLOCK and err.length_bytes == BLOCK
    assert path in str(err) and f"byte offset {2 * BLOCK}" in str(err)


def test_a_file_deleted_or_truncated_underneath_raises_clearly(store):
    src = random_tensor(2 * BLOCK, torch.uint8)
    store.write("gone", src).result()
    store.write("short", src).result()
    os.remove(store.path_of("gone"))
    with pytest.raises(NvmeStoreError, match="deleted underneath") as info:
        store.read("gone", torch.empty_like(src)).result()
    assert info.value.path == store.path_of("gone") and info.value.errno == errno.ENOENT
    os.truncate(store.path_of("short"), BLOCK)
    with pytest.raises(NvmeStoreError, match="truncated"):
        store.read("short", torch.empty_like(src)).result()


def test_bad_arguments_are_refused(tmp_path):
    with NvmeStore(tmp_path) as s:
        s.write("k", torch.zeros(10)).result()
        with pytest.raises(ValueError, match="same dtype and numel"):
            s.read("k", torch.zeros(10, dtype=torch.float64)).result()
        with pytest.raises(ValueError, match="not contiguous"):
            s.write("j", torch.zeros(4, 4).t())
    with pytest.raises(RuntimeError, match="closed"):
        s.write("k", torch.zeros(1))
    for kwargs, field in [(dict(max_in_flight=0), "max_in_flight=0"), (dict(block_bytes=1000), "block_bytes=1000"),
                          (dict(use_direct_io="yes"), "use_direct_io='yes'"),
                          (dict(block_bytes="1MiB", piece_bytes="1.5MiB"), "piece_bytes='1.5MiB'")]:
        with pytest.raises(ValueError, match=field):
            NvmeStoreConfig(**kwargs)


def test_missing_or_unusable_nvme_dir(tmp_path):
    with pytest.raises(NvmeStoreError, match="does not exist") as info:
        NvmeStore(tmp_path / "nope")
    assert info.value.path == str(tmp_path / "nope")
    (tmp_path / "afile").write_text("x")
    for bad in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        with pytest.raises(NvmeStoreError, match="not a directory") as info:
            NvmeStore(bad)
        assert str(bad) in str(info.value) and isinstance(info.value, OSError)


def test_a_filesystem_refusing_o_direct_gets_buffered_io_with_a_warning(tmp_path, monkeypatch, caplog):
    # tmpfs refused O_DIRECT before Linux 6.6; emulate such a filesystem for the probe's open.
    real_open = os.open

    def refusing_open(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    with caplog.at_level(logging.WARNING, logger="offload"):
        with NvmeStore(tmp_path) as s:
            assert s.io_mode is IoMode.BUFFERED
            s.write("k", torch.arange(5)).result()
            assert torch.equal(s.read("k", torch.empty(5, dtype=torch.int64)).result(), torch.arange(5))
    assert "O_DIRECT does not work" in caplog.text and "buffered I/O" in caplog.text
    with pytest.raises(NvmeStoreError, match="use_direct_io=True but O_DIRECT does not work"):
        NvmeStore(tmp_path, use_direct_io=True)
    assert os.listdir(tmp_path) == []


def test_full_disk_is_reported_before_writing(tmp_path, monkeypatch):
    import offload.nvme_files as module  # where a write checks the free space

    with NvmeStore(tmp_path) as s:
        real = module.shutil.disk_usage
        monkeypatch.setattr(module.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
        src = random_tensor(10_000, torch.uint8)
        with pytest.raises(NvmeStoreError, match="needs 12288 bytes.*1000 bytes free") as info:
            s.write("k", src).result()
        assert info.value.errno == errno.ENOSPC and "k" not in s
        assert [p for p in os.listdir(s.folder) if p.endswith(".bin")] == []


def test_files_are_removed_on_close_and_on_garbage_collection(tmp_path):
    s = NvmeStore(tmp_path)
    s.write("k", torch.ones(1000)).result()
    folder = s.folder
    assert os.path.isfile(s.path_of("k"))
    s.close()
    assert not os.path.exists(folder)
    s.close()  # idempotent

    s = NvmeStore(tmp_path)
    s.write("k", torch.ones(1000)).result()
    folder = s.folder
    del s
    gc.collect()
    assert not os.path.exists(folder) and os.listdir(tmp_path) == []


def test_a_forked_child_dropping_the_store_leaves_the_parents_files(tmp_path):
    s = NvmeStore(tmp_path)
    s.write("k", torch.arange(1000)).result()
    pid = os.fork()
    if pid == 0:  # child: drop its copy, run the finalizer, exit without any cleanup of ours
        del s
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    try:
        assert torch.equal(s.read("k", torch.empty(1000, dtype=torch.int64)).result(), torch.arange(1000))
    finally:
        s.close()


_CRASH = textwrap.dedent("""
    import os, sys, torch
    from offload import NvmeStore
    store = NvmeStore(sys.argv[1])
    store.write("k", torch.ones(100_000)).result()
    print(store.folder, flush=True)
    os._exit(9)  # like SIGKILL: no finalizers, no atexit
""")


def test_the_folder_of_a_crashed_run_is_removed_by_the_next_store(tmp_path, caplog):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120)
    left = proc.stdout.strip()
    assert proc.returncode == 9 and os.path.isfile(os.path.join(left, "00000001.bin")), proc.stderr
    with caplog.at_level(logging.WARNING, logger="offload"):
        with NvmeStore(tmp_path) as s:
            assert [f.path for f in s.stale_folders] == [left] and s.stale_folders[0].size_bytes >= 400_000
    assert not os.path.exists(left) and "no process holds its lock" in caplog.text


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_folders_of_dead_processes_are_reported_and_removed(tmp_path, caplog):
    # Folders as versions before the lock made them (no lock file): judged by their pid.
    dead = tmp_path / f"gemini-{_dead_pid()}-rank0-00c0ffee"
    dead.mkdir()
    (dead / "00000001.bin").write_bytes(b"x" * 5000)
    alive = tmp_path / f"gemini-{os.getppid()}-rank0-0000beef"  # our parent: alive, not ours
    alive.mkdir()
    unrelated = tmp_path / "gemini-notes"
    unrelated.mkdir()
    with caplog.at_level(logging.WARNING, logger="offload"):
        with NvmeStore(tmp_path, clean_stale=False) as s:
            assert [f.path for f in s.stale_folders] == [str(dead)]
        assert dead.exists() and "left in place" in caplog.text
        with NvmeStore(tmp_path) as s:
            assert [f.size_bytes for f in s.stale_folders] == [5000]
    assert not dead.exists() and alive.exists() and unrelated.exists()
    assert f"removing stale NVMe offload folder {dead}" in caplog.text


_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys, torch
    from offload import NvmeStore, NvmeStoreError
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    limit = 1 << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    report = {}
    store = NvmeStore(sys.argv[1], block_bytes=256 << 10, preallocate=sys.argv[2] == "prealloc")
    old = torch.full((1000,), 3.0)
    store.write("k", old).result()
    big = torch.arange(400_000, dtype=torch.float32)  # 1.6 MB: over the 1 MiB file-size limit
    before = big.clone()
    try:
        store.write("k", big).result()
        report["raised"] = None
    except NvmeStoreError as e:
        report.update(raised=type(e).__name__, errno=e.errno, message=str(e), path=e.path, op=e.operation)
    report["intact"] = bool(torch.equal(big, before))
    out = torch.empty(1000)
    report["old_value_kept"] = bool(torch.equal(store.read("k", out).result(), old))
    report["files"] = sorted(p for p in os.listdir(store.folder) if p.endswith(".bin"))
    report["folder"] = store.folder
    print(json.dumps(report))
    # exit without close(): the files must still go
""")


@pytest.mark.parametrize("mode", ["prealloc", "no-prealloc"])
def test_write_failure_raises_and_keeps_memory_and_old_file(tmp_path, mode):
    env = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), mode], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["raised"] == "NvmeStoreError", report
    assert report["errno"] == errno.EFBIG and "ulimit -f" in report["message"]
    assert report["path"] in report["message"] and report["path"].startswith(report["folder"])
    assert report["op"] == ("allocate" if mode == "prealloc" else "write")
    assert report["intact"] and report["old_value_kept"] and report["files"] == ["00000001.bin"]
    assert not os.path.exists(report["folder"])  # removed at interpreter exit
