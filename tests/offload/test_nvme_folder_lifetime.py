"""The life of a store's folder under ``nvme_dir``: locked while in use, so that no other run's
sweep deletes it, and removed however the process ends (close, exit, SIGTERM) — with real
processes, PID namespaces, signals and full file systems."""

import contextlib
import errno
import os
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import torch

from offload import IoMode, NvmeStore, NvmeStoreError
from offload import stale

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, PYTHONPATH=REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
HOST = socket.gethostname()


def _read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    """The child's next line of stdout, or "" when it ended first; fails after ``timeout``."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready:
        raise AssertionError(f"the child said nothing in {timeout} s")
    return proc.stdout.readline().strip()


@contextlib.contextmanager
def _child(argv: list[str]):
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


# A store that stays open until its stdin closes, then ends as a crash would: no close(), no
# finalizer, no atexit; only the kernel dropping its flock.
_HOLDER = textwrap.dedent("""
    import os, sys, torch
    from offload import NvmeStore
    store = NvmeStore(sys.argv[1])
    store.write("k", torch.ones(100_000)).result()
    print(store.folder, flush=True)
    sys.stdin.read()
    os._exit(0)
""")


def _sweep_finds_nothing_while_held_then_removes_it(tmp_path, folder: str, holder: subprocess.Popen) -> None:
    assert stale.find_stale_folders(str(tmp_path)) == []
    with NvmeStore(tmp_path) as s:
        assert s.stale_folders == []
    assert os.path.isfile(os.path.join(folder, "00000001.bin")), "a live run's folder was swept"

    holder.stdin.close()
    assert holder.wait(timeout=60) == 0, holder.stderr.read()
    # Reporting takes the lock only to judge and gives it back: the folder is found twice.
    for _ in range(2):
        assert [f.path for f in stale.find_stale_folders(str(tmp_path))] == [folder]
    with NvmeStore(tmp_path) as s:
        assert [f.path for f in s.stale_folders] == [folder]
        assert "no process holds its lock" in s.stale_folders[0].reason
    assert not os.path.exists(folder)


def test_a_locked_folder_whose_pid_looks_dead_is_not_swept_until_its_holder_dies(tmp_path):
    with _child([sys.executable, "-c", _HOLDER, str(tmp_path)]) as holder:
        live = _read_line(holder)
        assert live, holder.stderr.read()
        # What a run in another PID namespace looks like from here: its pid is not running
        # (or is another process) and its start time is no process's.
        dead = _dead_pid()
        disguised = os.path.join(tmp_path, re.sub(r"^gemini-\d+-", f"gemini-{dead}-", os.path.basename(live)))
        os.rename(live, disguised)
        with open(os.path.join(disguised, "owner"), "w") as f:
            f.write(f"{dead} 12345.0 {HOST}\n")
        _sweep_finds_nothing_while_held_then_removes_it(tmp_path, disguised, holder)


def test_a_store_in_another_pid_namespace_keeps_its_folder(tmp_path):
    """The real fault: a run in its own PID namespace is pid 1 there; here pid 1 is init,
    started long before, so pid and start time alone call the live folder stale."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) to start a process in a new PID namespace")
    argv = [unshare, "--pid", "--fork", "--mount-proc", "--kill-child", sys.executable, "-c", _HOLDER, str(tmp_path)]
    with _child(argv) as holder:
        live = _read_line(holder)
        if not live:
            pytest.skip(f"cannot make a PID namespace here (needs CAP_SYS_ADMIN): {holder.stderr.read().strip()}")
        pid = int(re.match(r"gemini-(\d+)-", os.path.basename(live))[1])
        with open(os.path.join(live, "owner")) as f:
            owner_pid, owner_start, owner_host = f.read().split()
        assert (int(owner_pid), owner_host) == (pid, HOST)
        here = psutil.Process(pid).create_time()
        assert abs(here - float(owner_start)) > 1.0, "pid and start time alone would call it alive"
        _sweep_finds_nothing_while_held_then_removes_it(tmp_path, live, holder)


# --------------------------------------------------------------------------------- SIGTERM
_SIGTERM_CHILD = textwrap.dedent("""
    import signal, sys, threading, time, torch
    from offload import NvmeStore
    mode, root = sys.argv[1], sys.argv[2]
    stop = []
    if mode == "exit-handler":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(7))
    elif mode == "graceful-handler":
        signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    stores = []
    if mode == "thread":
        worker = threading.Thread(target=lambda: stores.append(NvmeStore(root)))
        worker.start()
        worker.join()
        assert len(stores) == 1 and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    stores.append(NvmeStore(root))
    for i, s in enumerate(stores):
        s.write("k", torch.full((1000,), float(i))).result()
    print(" ".join(s.folder for s in stores), flush=True)
    if mode == "graceful-handler":
        while not stop:
            time.sleep(0.01)
        out = stores[0].read("k", torch.empty(1000)).result()  # still usable after the signal
        print("usable", bool((out == 0).all()), flush=True)
        sys.exit(0)
    time.sleep(60)
    sys.exit(3)
""")


@pytest.mark.parametrize("mode,returncode", [("default", -signal.SIGTERM), ("thread", -signal.SIGTERM),
                                             ("exit-handler", 7), ("graceful-handler", 0),
                                             ("hangup", -signal.SIGHUP)])
def test_sigterm_removes_the_folders_and_ends_the_process_as_before(tmp_path, mode, returncode):
    """SIGHUP (the terminal or ssh session closed) ends a process as SIGTERM does: its folder
    was left behind until a later run's sweep."""
    with _child([sys.executable, "-c", _SIGTERM_CHILD, mode, str(tmp_path)]) as child:
        line = _read_line(child)
        assert line, child.stderr.read()
        folders = line.split()
        assert len(folders) == (2 if mode == "thread" else 1) and all(os.path.isdir(f) for f in folders)
        child.send_signal(signal.SIGHUP if mode == "hangup" else signal.SIGTERM)
        if mode == "graceful-handler":
            assert _read_line(child) == "usable True"
        assert child.wait(timeout=60) == returncode, child.stderr.read()
    assert os.listdir(tmp_path) == [], "SIGTERM left files behind"


def test_sigterm_to_a_forked_child_leaves_the_parents_folder(tmp_path):
    # A DataLoader worker inherits the store and the handler; torch ends workers with SIGTERM.
    with NvmeStore(tmp_path) as s:
        s.write("k", torch.arange(1000)).result()
        assert callable(signal.getsignal(signal.SIGTERM))  # the store's handler, inherited by the child
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            # Say so once running Python code: a signal landing before the interpreter's
            # after-fork reset would be dropped by that reset, not by our handler.
            os.write(ready_w, b"1")
            time.sleep(30)
            os._exit(3)
        os.close(ready_w)
        assert select.select([ready_r], [], [], 60)[0] and os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert os.path.isdir(s.folder)
        assert torch.equal(s.read("k", torch.empty(1000, dtype=torch.int64)).result(), torch.arange(1000))
        assert stale.find_stale_folders(str(tmp_path)) == []


# ------------------------------------------------------------------------------ full disk
@contextlib.contextmanager
def _small_filesystem(kind: str, where):
    mnt = where / "mnt"
    mnt.mkdir()
    if kind == "tmpfs":
        mount = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)]
    else:
        if shutil.which("mkfs.ext4") is None:
            pytest.skip("no mkfs.ext4 to make a small ext4 image")
        image = where / "fs.img"
        with open(image, "wb") as f:
            f.truncate(1 << 20)
        done = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", str(image)], capture_output=True,
                              text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        mount = ["mount", "-o", "loop", str(image), str(mnt)]
    done = subprocess.run(mount, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small {kind} here (needs root and mount rights): {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30)


def _supports_o_direct(folder) -> bool:
    try:
        fd = os.open(os.path.join(folder, "odirect"), os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(os.path.join(folder, "odirect"))
    return True


def _fill(folder) -> str:
    """A file taking every free block of ``folder``'s file system; returns its path."""
    path = os.path.join(folder, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    block = bytes(4096)
    try:
        while True:
            os.write(fd, block)
            os.fsync(fd)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    finally:
        os.close(fd)
    os.truncate(path, os.stat(path).st_size // 4096 * 4096)
    return path


@pytest.mark.parametrize("kind", ["tmpfs", "ext4"])
def test_a_full_drive_is_an_error_not_a_fallback_to_buffered_io(tmp_path, kind):
    with _small_filesystem(kind, tmp_path) as mnt:
        if not _supports_o_direct(mnt):
            pytest.skip(f"{kind} refuses O_DIRECT on this kernel: the probe never writes")
        filler = _fill(mnt)
        full = os.stat(filler).st_size
        before = set(os.listdir(mnt))
        # Give back one block at a time until the store's folder fits but the probe's block does not.
        folder_errors = []
        for blocks in range(0, 8):
            os.truncate(filler, full - blocks * 4096)
            try:
                with NvmeStore(mnt) as s:
                    pytest.fail(f"a store opened on a full drive with {blocks} blocks free ({s.io_mode.value} I/O)")
            except NvmeStoreError as exc:
                assert exc.errno == errno.ENOSPC, exc
                assert set(os.listdir(mnt)) == before, "a failed store left files behind"
                if exc.operation == "probe direct I/O":
                    assert "the disk is full" in str(exc) and str(mnt) in str(exc) and "O_DIRECT" in str(exc)
                    break
                assert exc.operation == "create folder", exc
                folder_errors.append(str(exc))
        else:
            pytest.fail("the probe never met the full drive")
        assert all("the disk is full" in e for e in folder_errors), folder_errors


def test_the_probe_reports_a_full_drive_when_emulated(tmp_path, monkeypatch):
    # Runs where no small file system can be mounted: the probe's write fails as on a full disk.
    import offload.direct_io as module  # where the probe writes

    def full_pwrite(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(module.os, "pwrite", full_pwrite)
    with pytest.raises(NvmeStoreError, match="the disk is full") as info:
        NvmeStore(tmp_path)
    assert info.value.errno == errno.ENOSPC and info.value.operation == "probe direct I/O"
    assert os.listdir(tmp_path) == []
    monkeypatch.undo()
    with NvmeStore(tmp_path) as s:  # and a drive with room still gets direct I/O where it works
        assert s.io_mode in (IoMode.DIRECT, IoMode.BUFFERED)
