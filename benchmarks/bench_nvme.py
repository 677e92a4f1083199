"""NVMe store throughput against dd, fio and DeepSpeed's async I/O op, on the same folder.

Run from the repository root:

    python benchmarks/bench_nvme.py                      # 1 GiB in 64 MiB chunks, 5 rounds
    python benchmarks/bench_nvme.py --dir /mnt/nvme/tmp --total 2GiB --rounds 7

Every contender uses O_DIRECT, so the page cache flatters no one, and moves the same bytes
(random, so that a thin-provisioned virtual disk cannot shortcut zeros) in the same chunk
size. Contenders run interleaved, one write and one read each per round, in an order that
rotates every round, because a shared virtual disk's speed drifts a lot within minutes;
each contender's figure is its median over rounds. Writes are timed from the first request
to the last completion (files are new each round, as a swapper's are); reads likewise.

    gemini      offload.NvmeStore: one key per chunk, all chunks submitted at once, buffers
                from offload.PinnedHostPool; --variants adds the store without checksums,
                with 1 MiB pieces and with 8 in flight
    dd          dd bs=<chunk> oflag=direct / iflag=direct: one synchronous stream
    fio         fio --ioengine=libaio --direct=1 --iodepth=8, --bs=1M (DeepSpeed's request size)
                and --bs=4M (the store's), fio's own figures (skipped if fio is absent)
    deepspeed   DeepSpeed's aio_handle (libaio; block 1 MiB, queue depth 8, overlap events),
                async_pwrite/async_pread of every chunk then wait() (skipped if it won't build)

Results go to benchmarks/results/nvme_bench.json and nvme_bench.md (the table plus machine
information); ``--out-prefix`` changes the names.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from offload import IoMode, NvmeStore, PinnedHostPool, parse_size  # noqa: E402
from offload.aligned import byte_view  # noqa: E402

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

NOTES = """## What shaped these numbers

Profiled on this 2-CPU VM (virtio disk, ext4 mounted with `discard`), each step measured with
the contenders interleaved, because the disk's speed drifts by 2-3x within minutes:

- **Preallocation.** Direct writes that extend a file serialise on ext4's inode lock; writing
  into a `posix_fallocate`d file doubled write speed (0.4-0.5 -> ~1 GB/s in the first version).
  fio preallocates too; DeepSpeed does not, and its writes of new files swing between 0.3 and
  2 GB/s from run to run.
- **Huge pages.** With 4 KiB pages a 1 MiB direct request spans 256 scattered pages, more than
  the queue's 254 segments, and every page is pinned per request. `PinnedHostPool` buffers of
  2 MiB or more come from a private mapping advised `MADV_HUGEPAGE`: reads went from
  0.7-1.0 GB/s to 1.4-1.9 GB/s, level with DeepSpeed reading into its mlocked buffers.
  fio reads into its own ordinary (4 KiB-page) buffers, which fits its lower read figures.
- **Request size.** Each piece costs an executor round trip in Python (queue, wake-up,
  `call_soon_threadsafe`): ~0.35 CPU-s per GB at 1 MiB pieces, ~0.1 at 4 MiB (see the
  "1 MiB pieces" variant). The store issues 4 MiB pieces and keeps 1 MiB checksum blocks.
- **Queue depth.** A worker whose syscall has returned keeps its slot until it regains the
  GIL and the loop hears of it, so on 2 CPUs the drive sees fewer requests than there are
  slots. 16 pieces in flight beat 8 in every run (the "8 in flight" variant), and are the
  default.
- **Checksums.** crc32 (zlib) costs ~0.4 CPU-s per GB here (2.5-3.7 GB/s per core). Computed
  inside the I/O slot it halved the effective queue depth (1.2 GB/s); moved to a separate pool
  of checksum threads, alongside the write and after the read, it costs the difference
  between "gemini" and "gemini (no checksum)" in the table, which is CPU time on 2 CPUs.
- **Timing.** The store's `close()` (which unlinks its files; slow with `discard`) is outside
  the timed read, as everyone's file removal is.

A remaining gap to DeepSpeed on reads, where there is one, is the checksum verification (pure
CPU on a 2-CPU machine) plus Python's per-piece overhead; on a machine with more cores the
checksum threads run beside the I/O without slowing it.
"""


@dataclass(kw_only=True)
class Contender:
    name: str
    setup: Callable[[], None]
    write: Callable[[str], None]   # argument: a fresh folder for this round
    read: Callable[[str], None]
    teardown: Callable[[], None] = lambda: None
    prepare_read: Callable[[], None] = lambda: None   # untimed: scrub the read buffers
    cleanup: Callable[[], None] = lambda: None        # untimed: after the read, before rmtree
    measured: dict | None = None                      # GB/s the tool reported itself, per rw
    verify: Callable[[], bool] | None = None          # untimed: did the read return the data?
    write_gbps: list[float] = field(default_factory=list)
    read_gbps: list[float] = field(default_factory=list)
    note: str = ""


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run_cmd(cmd: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


def machine_info(folder: str) -> dict:
    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "folder": folder,
    }
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        df = run_cmd(["df", "-T", folder]).stdout.splitlines()[-1].split()
        info["device"], info["filesystem"] = df[0], df[1]
        dev = os.path.basename(os.path.realpath(df[0]))
        queue = f"/sys/block/{dev}/queue"
        if os.path.isdir(queue):
            for name in ("logical_block_size", "max_sectors_kb", "nr_requests", "rotational"):
                with open(os.path.join(queue, name)) as f:
                    info[f"queue_{name}"] = f.read().strip()
    except (RuntimeError, OSError, IndexError):
        pass
    return info


# ---------------------------------------------------------------------------------------
# Contenders


def gemini_contender(sources: list[torch.Tensor], src: list[torch.Tensor], dst: list[torch.Tensor], *,
                     name: str = "gemini", **store_kwargs) -> Contender:
    """The store as the library uses it: ``src``/``dst`` come from PinnedHostPool."""
    state: dict = {}

    def write(folder: str) -> None:
        store = NvmeStore(folder, **store_kwargs)
        if store.io_mode is not IoMode.DIRECT:
            raise RuntimeError(f"{folder} does not support O_DIRECT; the comparison needs it")
        state["store"] = store
        for f in [store.write(i, b) for i, b in enumerate(src)]:
            f.result()

    def read(folder: str) -> None:
        store = state["store"]
        for f in [store.read(i, b) for i, b in enumerate(dst)]:
            f.result()

    def cleanup() -> None:
        # Untimed, like everyone's file removal: unlinking 1 GiB on a filesystem mounted with
        # "discard" takes a while.
        if "store" in state:
            state.pop("store").close()

    note = ", ".join(f"{k}={v}" for k, v in store_kwargs.items())
    return Contender(name=name, setup=lambda: None, write=write, read=read, cleanup=cleanup,
                     prepare_read=lambda: [t.zero_() for t in dst],
                     verify=lambda: all(torch.equal(a, b) for a, b in zip(dst, sources)),
                     note=f"NvmeStore({note}), PinnedHostPool buffers")


def dd_contender(source: str, *, chunk_bytes: int, chunks: int) -> Contender:
    bs = f"{chunk_bytes // (1 << 20)}M"

    def write(folder: str) -> None:
        run_cmd(["dd", f"if={source}", f"of={folder}/dd.bin", f"bs={bs}", f"count={chunks}",
                 "oflag=direct", "status=none"])

    def read(folder: str) -> None:
        run_cmd(["dd", f"if={folder}/dd.bin", "of=/dev/null", f"bs={bs}", "iflag=direct", "status=none"])

    return Contender(name="dd", setup=lambda: None, write=write, read=read,
                     note=f"bs={bs}, one synchronous stream, source file in /dev/shm")


def fio_contender(total_bytes: int, *, block: str, iodepth: int) -> Contender:
    measured: dict = {}

    def job(folder: str, rw: str) -> None:
        out = run_cmd(["fio", f"--name={rw}", f"--filename={folder}/fio.bin", f"--rw={rw}", f"--bs={block}",
                       f"--iodepth={iodepth}", "--ioengine=libaio", "--direct=1", f"--size={total_bytes}",
                       "--output-format=json"]).stdout
        result = json.loads(out[out.index("{"):])["jobs"][0]["read" if rw == "read" else "write"]
        measured[rw] = result["bw_bytes"] / 1e9

    return Contender(name=f"fio {block}", setup=lambda: None, write=lambda d: job(d, "write"),
                     read=lambda d: job(d, "read"), measured=measured,
                     note=f"libaio, bs={block}, iodepth={iodepth}, preallocated; fio's own bandwidth figure")


def deepspeed_contender(buffers: list[torch.Tensor]) -> tuple[Contender | None, str]:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        builder = AsyncIOBuilder()
        if not builder.is_compatible(verbose=False):
            return None, "DeepSpeed's AsyncIOBuilder is not compatible here (libaio-dev missing?)"
        aio = builder.load(verbose=False)
    except Exception as exc:  # any build or import failure means: no contender, say why
        return None, f"DeepSpeed aio unavailable: {type(exc).__name__}: {exc}"
    handle = aio.aio_handle(1 << 20, 8, False, True, 1)
    # DeepSpeed's recommended buffers: page-aligned and mlocked by its own allocator.
    src = [handle.new_cpu_locked_tensor(b.numel(), b) for b in buffers]
    dst = [handle.new_cpu_locked_tensor(b.numel(), b) for b in buffers]
    for a, b in zip(src, buffers):
        a.copy_(b)

    def check(rc: int, what: str) -> None:
        if rc < 0:
            raise RuntimeError(f"DeepSpeed aio {what} failed with {rc}")

    def write(folder: str) -> None:
        for i, b in enumerate(src):
            check(handle.async_pwrite(b, f"{folder}/ds{i}.bin"), "async_pwrite")
        check(handle.wait(), "wait")

    def read(folder: str) -> None:
        for i, b in enumerate(dst):
            check(handle.async_pread(b, f"{folder}/ds{i}.bin"), "async_pread")
        check(handle.wait(), "wait")

    def teardown() -> None:
        for b in src + dst:
            handle.free_cpu_locked_tensor(b)

    return Contender(name="deepspeed", setup=lambda: None, write=write, read=read, teardown=teardown,
                     prepare_read=lambda: [t.zero_() for t in dst],
                     verify=lambda: all(torch.equal(a, b) for a, b in zip(dst, buffers)),
                     note="aio_handle(block 1 MiB, queue depth 8, overlap events, 1 thread),"
                          " its mlocked buffers"), ""


# ---------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=os.path.join(RESULTS_DIR, "tmp"),
                        help="folder on the drive to test (default: benchmarks/results/tmp)")
    parser.add_argument("--total", default="1GiB", help="bytes per write/read pass")
    parser.add_argument("--chunk", default="64MiB", help="chunk size")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--in-flight", type=int, default=16, help="NvmeStore max_in_flight")
    parser.add_argument("--block", default="1MiB", help="NvmeStore block_bytes (checksum unit)")
    parser.add_argument("--piece", default="4MiB", help="NvmeStore piece_bytes (I/O request size)")
    parser.add_argument("--variants", action="store_true",
                        help="also time the store without checksums and with other depths")
    parser.add_argument("--no-deepspeed", action="store_true")
    parser.add_argument("--out-prefix", default="nvme_bench")
    args = parser.parse_args()

    total_bytes, chunk_bytes = parse_size(args.total, field="--total"), parse_size(args.chunk, field="--chunk")
    chunks = total_bytes // chunk_bytes
    if chunks < 1 or chunk_bytes % (1 << 20):
        raise SystemExit("--total must hold at least one --chunk, and --chunk be a multiple of 1 MiB")
    total_bytes = chunks * chunk_bytes
    os.makedirs(args.dir, exist_ok=True)
    free = shutil.disk_usage(args.dir).free
    if free < 3 * total_bytes:
        raise SystemExit(f"{args.dir} has {free} bytes free; the benchmark needs {3 * total_bytes}")

    print(f"preparing {chunks} x {chunk_bytes >> 20} MiB of random data ...", flush=True)
    g = torch.Generator().manual_seed(0)
    buffers = [torch.empty(chunk_bytes, dtype=torch.uint8) for _ in range(chunks)]
    for b in buffers:
        b.copy_(torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8, generator=g))
    shm = tempfile.mkdtemp(dir="/dev/shm") if os.path.isdir("/dev/shm") else tempfile.mkdtemp()
    source = os.path.join(shm, "source.bin")
    with open(source, "wb") as f:
        for b in buffers:
            f.write(byte_view(b))  # numpy is not a dependency

    store_kwargs = dict(max_in_flight=args.in_flight, block_bytes=args.block, piece_bytes=args.piece)
    # Our buffers come from the library's pool (4 KiB-aligned, on huge pages), as in training.
    pool = PinnedHostPool()
    src = [pool.acquire(chunk_bytes) for _ in range(chunks)]
    dst = [pool.acquire(chunk_bytes) for _ in range(chunks)]
    for a, b in zip(src, buffers):
        a.copy_(b)
    contenders = [gemini_contender(buffers, src, dst, **store_kwargs),
                  dd_contender(source, chunk_bytes=chunk_bytes, chunks=chunks)]
    if args.variants:
        for label, change in [("no checksum", dict(verify_checksums=False)),
                              ("1 MiB pieces", dict(piece_bytes="1MiB")),
                              ("8 in flight", dict(max_in_flight=8))]:
            contenders.append(gemini_contender(buffers, src, dst, name=f"gemini ({label})",
                                               **dict(store_kwargs, **change)))
    skipped: dict[str, str] = {}
    if shutil.which("fio"):
        contenders.append(fio_contender(total_bytes, block="1M", iodepth=8))   # DeepSpeed's setting
        contenders.append(fio_contender(total_bytes, block="4M", iodepth=8))   # our piece size
    else:
        skipped["fio"] = "fio is not installed (apt-get install -y fio)"
    if not args.no_deepspeed:
        print("loading DeepSpeed's async_io op (builds on first use, minutes) ...", flush=True)
        ds, why = deepspeed_contender(buffers)
        if ds is None:
            skipped["deepspeed"] = why
        else:
            contenders.append(ds)

    try:
        for rnd in range(args.rounds):
            order = contenders[rnd % len(contenders):] + contenders[:rnd % len(contenders)]
            for c in order:
                folder = tempfile.mkdtemp(dir=args.dir, prefix=f"{c.name.split()[0]}-")
                try:
                    t0 = time.perf_counter()
                    c.write(folder)
                    t1 = time.perf_counter()
                    c.prepare_read()
                    t1b = time.perf_counter()
                    c.read(folder)
                    t2 = time.perf_counter()
                finally:
                    c.cleanup()
                    shutil.rmtree(folder, ignore_errors=True)
                if c.verify is not None and not c.verify():
                    raise RuntimeError(f"{c.name} read back different bytes than it wrote")
                if c.measured is not None:
                    c.write_gbps.append(c.measured["write"])
                    c.read_gbps.append(c.measured["read"])
                else:
                    c.write_gbps.append(gbps(total_bytes, t1 - t0))
                    c.read_gbps.append(gbps(total_bytes, t2 - t1b))
                print(f"round {rnd + 1}/{args.rounds} {c.name:24s} write {c.write_gbps[-1]:6.2f} GB/s"
                      f"  read {c.read_gbps[-1]:6.2f} GB/s", flush=True)
    finally:
        for c in contenders:
            c.teardown()
        shutil.rmtree(shm, ignore_errors=True)

    rows = []
    for c in contenders:
        rows.append({"name": c.name, "note": c.note,
                     "write_gbps_median": statistics.median(c.write_gbps),
                     "read_gbps_median": statistics.median(c.read_gbps),
                     "write_gbps_rounds": [round(x, 3) for x in c.write_gbps],
                     "read_gbps_rounds": [round(x, 3) for x in c.read_gbps]})
    peers = [r for r in rows if not r["name"].startswith("gemini")]
    ours = rows[0]
    best_write = max(peers, key=lambda r: r["write_gbps_median"])
    best_read = max(peers, key=lambda r: r["read_gbps_median"])
    summary = {
        "write_ratio_to_best": ours["write_gbps_median"] / best_write["write_gbps_median"],
        "best_write": best_write["name"],
        "read_ratio_to_best": ours["read_gbps_median"] / best_read["read_gbps_median"],
        "best_read": best_read["name"],
    }
    result = {"machine": machine_info(args.dir), "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
              "total_bytes": total_bytes, "chunk_bytes": chunk_bytes, "rounds": args.rounds,
              "store": {"max_in_flight": args.in_flight, "block_bytes": parse_size(args.block),
                        "piece_bytes": parse_size(args.piece)},
              "contenders": rows, "skipped": skipped, "summary": summary}
    os.makedirs(RESULTS_DIR, exist_ok=True)
    json_path = os.path.join(RESULTS_DIR, f"{args.out_prefix}.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=2)
    table = ["| contender | write GB/s (median) | read GB/s (median) | write rounds | read rounds | setup |",
             "|---|---:|---:|---|---|---|"]
    for r in rows:
        table.append(f"| {r['name']} | {r['write_gbps_median']:.2f} | {r['read_gbps_median']:.2f} |"
                     f" {', '.join(f'{x:.2f}' for x in r['write_gbps_rounds'])} |"
                     f" {', '.join(f'{x:.2f}' for x in r['read_gbps_rounds'])} | {r['note']} |")
    verdict = (f"gemini / best peer: write {summary['write_ratio_to_best']:.0%} of {summary['best_write']},"
               f" read {summary['read_ratio_to_best']:.0%} of {summary['best_read']}")
    print("\n".join(table))
    print(verdict)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}")
    md_path = os.path.join(RESULTS_DIR, f"{args.out_prefix}.md")
    machine = result["machine"]
    lines = [
        "# NVMe store throughput",
        "",
        f"Generated by `{result['command']}` on {machine['date']} (see the script's docstring).",
        "",
        f"Machine: {machine.get('cpu', '?')}, {machine['cpu_count']} CPUs, kernel {machine['kernel']},"
        f" Python {machine['python']}, torch {machine['torch']}. Folder {machine['folder']} on"
        f" {machine.get('device', '?')} ({machine.get('filesystem', '?')}; logical block"
        f" {machine.get('queue_logical_block_size', '?')} B, max request"
        f" {machine.get('queue_max_sectors_kb', '?')} KiB).",
        "",
        f"{total_bytes >> 20} MiB per pass in {chunks} chunks of {chunk_bytes >> 20} MiB, O_DIRECT for"
        f" everyone, {args.rounds} interleaved rounds (order rotated each round); medians.",
        "",
        *table,
        "",
        f"**{verdict}.**",
        "",
    ]
    if skipped:
        lines += ["Skipped:", ""] + [f"- {name}: {why}" for name, why in skipped.items()] + [""]
    lines += [NOTES]
    with open(md_path, "w") as f:
        f.write("\n".join(lines))
    print(f"wrote {json_path} and {md_path}")


if __name__ == "__main__":
    main()
