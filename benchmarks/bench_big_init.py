"""A Llama of ~3B parameters that never exists whole in RAM: built on meta, weights streamed in.

Run from the repository root on a quiet machine (the 2-core, 24 GiB VM: ~25 minutes, most of it
bf16 backward matmuls; needs ~50 GB free under --dir, checked first):

    python benchmarks/bench_big_init.py                      # ~3.0B parameters, 16 tokens a step
    python benchmarks/bench_big_init.py --params 0.05B --out-prefix big_init_tiny   # a quick check

1. The disk's sequential speed under --dir: 2 GiB written (then fsync) and read back cold
   (evicted from the page cache with posix_fadvise), 64 MiB at a time.
2. A LlamaForCausalLM config of about --params parameters (Llama-3.2-3B's shape: hidden 3072,
   intermediate 8192, 24 heads, 8 KV heads, here with a 32000-token vocabulary and untied
   embeddings; --params sets the number of layers). Its weights are written as bf16
   safetensors shards (2 GB each, with model.safetensors.index.json and config.json), tensor
   by tensor from a seeded generator: the names and shapes come from the model built on the
   meta device, and no more than one shard's tensors exist at once. The shards are then
   evicted from the page cache, so that the next step reads them from the disk.
3. In a fresh process (so its peak RSS is its own): the model built under
   ``accelerate.init_empty_weights()``; ``gemini.initialize(model, GeminiConfig(device="cpu",
   placement="cpu", precision="bf16", cpu_memory=--cpu-memory, nvme_dir=--dir,
   nvme_offload_fraction=1.0), weights=folder)``: each chunk group's tensors read from the
   shards, cast into its bf16 parameter chunk (kept in host memory) and fp32 master, and the
   group's master, m and v written to NVMe while the next group is read; 2 training steps of
   batch 1 x --tokens tokens; then ``gemini.save_pretrained(model, dtype=bf16)`` streaming the
   trained weights back out (the masters read from NVMe group by group).
   Recorded: peak RSS per phase (sampled every 20 ms, and the kernel's high-water mark), the
   initialize time against the time the disk needs for the bytes initialize reads and writes
   at the measured speeds, and the same for save_pretrained.
4. Results to benchmarks/results/<out-prefix>.json and .md; the big files are deleted.
   ``--render benchmarks/results/big_init.json`` rewrites the .md from a recorded .json.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import threading

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_step import machine_info  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 32000
BLOCK = 64 * 2**20  # bytes per I/O of the disk measurement


class PhaseRss:
    """The process's resident set size sampled on a thread: the peak of each named phase."""

    def __init__(self, interval_seconds: float = 0.02) -> None:
        self.interval_seconds = interval_seconds
        self.peaks: dict[str, int] = {}
        self.phase = "start"
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self, phase: str) -> None:
        self.phase = phase
        self._sample()

    def _sample(self) -> None:
        phase, rss = self.phase, self._process.memory_info().rss
        self.peaks[phase] = max(self.peaks.get(phase, 0), rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self._sample()

    def __enter__(self) -> PhaseRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


# ---------------------------------------------------------------------------------- the model
def llama_config(target_params: float):
    """Llama-3.2-3B's layer shape (a smaller one for small targets), layers chosen for the target."""
    from transformers import LlamaConfig

    if target_params >= 1e9:
        hidden, inter, heads, kv = 3072, 8192, 24, 8
    else:
        hidden, inter, heads, kv = 512, 1536, 8, 8
    head_dim = hidden // heads
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv * head_dim + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((target_params - 2 * VOCAB * hidden - hidden) / per_layer))
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=False,
                         max_position_embeddings=4096)
    return config, layers * per_layer + 2 * VOCAB * hidden + hidden


def parse_params(text: str) -> float:
    scale = {"B": 1e9, "M": 1e6}.get(text[-1].upper())
    return float(text[:-1]) * scale if scale else float(text)


# --------------------------------------------------------------------------------------- disk
def _evict(path: Path) -> None:
    """Drop a file's pages from the page cache (they are clean after fsync), so it is read cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed_pass(path: Path, nbytes: int, *, write: bool, direct: bool) -> float:
    """Seconds to write (then fsync) or read ``nbytes`` of ``path`` sequentially, 64 MiB a call;
    ``direct``: O_DIRECT from a page-aligned buffer (as the NVMe store writes), else buffered."""
    buf = mmap.mmap(-1, BLOCK)  # page-aligned, as O_DIRECT wants
    if write:
        buf.write(os.urandom(BLOCK))
    flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC if write else os.O_RDONLY) | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    start = time.perf_counter()
    try:
        for _ in range(nbytes // BLOCK):
            n = os.write(fd, buf) if write else os.readv(fd, [buf])
            assert n == BLOCK, f"short {'write' if write else 'read'} of {n} bytes"
        if write:
            os.fsync(fd)
    finally:
        os.close(fd)
        buf.close()
    return time.perf_counter() - start


def measure_disk(folder: Path, nbytes: int = 2 * 2**30) -> dict:
    """Sequential write (fsync included) and cold read of ``nbytes`` under ``folder``, buffered and
    with O_DIRECT; the best of each is the speed the disk time below assumes."""
    path = folder / "disk-speed.tmp"
    out: dict = {"bytes": nbytes}
    for direct in (False, True):
        mode = "direct" if direct else "buffered"
        try:
            out[f"{mode}_write_seconds"] = _timed_pass(path, nbytes, write=True, direct=direct)
            _evict(path)
            out[f"{mode}_read_seconds"] = _timed_pass(path, nbytes, write=False, direct=direct)
        except OSError as e:  # a file system without O_DIRECT
            out[f"{mode}_error"] = str(e)
        path.unlink(missing_ok=True)
    out["write_bytes_per_s"] = max(nbytes / v for k, v in out.items() if k.endswith("_write_seconds"))
    out["read_bytes_per_s"] = max(nbytes / v for k, v in out.items() if k.endswith("_read_seconds"))
    return out


# ----------------------------------------------------------------------------- the checkpoint
def write_checkpoint(config, folder: Path, shard_bytes: int = 2 * 10**9, seed: int = 0) -> dict:
    """bf16 safetensors shards of a randomly initialized model, a tensor at a time (norms 1,
    the rest N(0, 0.02) as Llama initializes), with the index and config transformers write."""
    from accelerate import init_empty_weights
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    with init_empty_weights():
        meta = LlamaForCausalLM(config)
    shapes = [(k, tuple(v.shape)) for k, v in meta.state_dict().items()]
    del meta
    shards: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for key, shape in shapes:
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((key, shape))
        size += nbytes
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    start = time.perf_counter()
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for key, shape in shard:
            g = torch.Generator().manual_seed(seed * 100_003 + len(weight_map))
            if len(shape) == 1:
                t = torch.ones(shape, dtype=torch.bfloat16)
            else:
                t = torch.empty(shape, dtype=torch.float32).normal_(0.0, 0.02, generator=g).to(torch.bfloat16)
            tensors[key] = t
            weight_map[key] = name
            total += t.numel() * 2
        save_file(tensors, folder / name, metadata={"format": "pt"})
        del tensors
        with open(folder / name, "rb+") as f:
            os.fsync(f.fileno())
        _evict(folder / name)
        print(f"  wrote {name} ({(folder / name).stat().st_size / 1e9:.2f} GB)", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    config.save_pretrained(folder)
    return dict(files=len(shards), bytes=total, seconds=time.perf_counter() - start)


def _file_of(folder: Path, key: str) -> Path:
    """The safetensors file of ``folder`` holding ``key`` (sharded with an index, or one file)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return folder / json.loads(index.read_text())["weight_map"][key]
    return folder / "model.safetensors"


# ---------------------------------------------------------------------- the measured process
def train_phase(args) -> dict:
    """Runs in a fresh process: build on meta, initialize from the shards, train, save."""
    from accelerate import init_empty_weights
    from safetensors import safe_open
    from transformers import LlamaConfig, LlamaForCausalLM

    import gemini
    from chunks import Tier
    from gemini.pretrained import SafetensorsCheckpoint

    torch.manual_seed(0)
    weights, work = Path(args.dir) / "weights", Path(args.dir) / "nvme"
    work.mkdir(parents=True, exist_ok=True)
    read_bytes = {"n": 0}
    read = SafetensorsCheckpoint.read

    def counting_read(self, key, start=0, stop=None):  # the bytes initialize reads from the shards
        value = read(self, key, start, stop)
        read_bytes["n"] += value.numel() * value.element_size()
        return value

    SafetensorsCheckpoint.read = counting_read
    out: dict = {}
    with PhaseRss() as rss:
        phase = rss.start
        phase("build on meta")
        start = time.perf_counter()
        with init_empty_weights():
            model = LlamaForCausalLM(LlamaConfig.from_pretrained(weights))
        out["build_seconds"] = time.perf_counter() - start
        n_params = sum(p.numel() for p in model.parameters())

        phase("initialize")
        config = gemini.GeminiConfig(device="cpu", placement="cpu", precision="bf16", chunk_size=args.chunk,
                                     cpu_memory=args.cpu_memory, nvme_dir=str(work), nvme_offload_fraction=1.0,
                                     nvme_pipeline_depth=args.depth)
        start = time.perf_counter()
        gmodel, opt = gemini.initialize(model, config, weights=weights, lr=1e-4, weight_decay=0.1)
        out["initialize_seconds"] = time.perf_counter() - start
        rt = opt._rt
        out["initialize_read_bytes"] = read_bytes["n"]
        out["initialize_nvme_write_bytes"] = rt.storage.nvme.stats().write_bytes
        out["rss_after_initialize_bytes"] = psutil.Process().memory_info().rss
        out["host_chunk_bytes_after_initialize"] = sum(rt.manager.bytes_by_kind(Tier.HOST).values())
        out["chunk_size"] = rt.manager.chunk_size
        out["chunk_groups"] = len(rt.manager.groups)
        out["nvme_groups"] = len(rt.nvme.groups)
        out["pipeline_depth"] = rt.nvme.layout.depth  # what cpu_memory allowed of --depth
        print(f"initialize: {out['initialize_seconds']:.1f} s, read {read_bytes['n'] / 1e9:.2f} GB of weights, wrote "
              f"{out['initialize_nvme_write_bytes'] / 1e9:.2f} GB to NVMe; RSS "
              f"{out['rss_after_initialize_bytes'] / 2**30:.2f} GiB", flush=True)
        # Spot checks against safetensors' own reader: the bf16 parameters are the file's values.
        params = dict(model.named_parameters())
        for key in ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            with safe_open(_file_of(weights, key), "pt") as f:
                assert torch.equal(params[key].data, f.get_tensor(key)), f"{key} differs from the file"

        gen = torch.Generator().manual_seed(1)
        steps = []
        for step in range(args.steps):
            x = torch.randint(0, VOCAB, (1, args.tokens), generator=gen)
            phase(f"step {step}")
            start = time.perf_counter()
            loss = gmodel(input_ids=x, labels=x).loss
            opt.backward(loss)
            fb = time.perf_counter() - start
            opt.step()
            opt.zero_grad()
            r = opt.report
            steps.append(dict(step=step, loss=loss.item(), step_seconds=time.perf_counter() - start,
                              forward_backward_seconds=fb, nvme_read_bytes=r.nvme_read_bytes,
                              nvme_write_bytes=r.nvme_write_bytes, rss_bytes=r.host_rss_bytes))
            print(f"step {step}: loss {loss.item():.4f}, {steps[-1]['step_seconds']:.1f} s (forward+backward "
                  f"{fb:.1f} s), NVMe read {r.nvme_read_bytes / 1e9:.2f} GB, write {r.nvme_write_bytes / 1e9:.2f} GB",
                  flush=True)
        out["steps"] = steps

        phase("save_pretrained")
        saved = Path(args.dir) / "saved"
        nvme_read_before = rt.storage.nvme.stats().read_bytes
        start = time.perf_counter()
        files = gemini.save_pretrained(gmodel, saved, dtype=torch.bfloat16, max_shard_size="2GB")
        out["save_seconds"] = time.perf_counter() - start
        out["save_write_bytes"] = sum(f.stat().st_size for f in files)
        out["save_nvme_read_bytes"] = rt.storage.nvme.stats().read_bytes - nvme_read_before
        print(f"save_pretrained: {out['save_seconds']:.1f} s, read {out['save_nvme_read_bytes'] / 1e9:.2f} GB from "
              f"NVMe, wrote {out['save_write_bytes'] / 1e9:.2f} GB", flush=True)
        # The bf16 file holds the trained masters in bf16: the same values as the bf16 parameters.
        for key in ("model.norm.weight", "model.layers.0.mlp.down_proj.weight"):
            with safe_open(_file_of(saved, key), "pt") as f:
                assert torch.equal(params[key].data, f.get_tensor(key)), f"saved {key} differs from the model"
        phase("close")
        opt.close()
    peak_phase = max(rss.peaks, key=rss.peaks.__getitem__)
    out.update(params=n_params, phase_peak_rss_bytes=rss.peaks, peak_rss_bytes=rss.peaks[peak_phase],
               peak_rss_phase=peak_phase, ru_maxrss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return out


# -------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="3B", help="target parameter count, e.g. 3B, 0.05B, 800M")
    parser.add_argument("--dir", default="/work/bench_big_init", help="working folder on the disk under test")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per step (batch 1)")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--cpu-memory", default="4GiB", help="host budget for optimizer states (the rest on NVMe)")
    parser.add_argument("--depth", type=int, default=1, help="nvme_pipeline_depth")
    parser.add_argument("--chunk", type=int, default=None, help="chunk size in elements (default: searched)")
    parser.add_argument("--out-prefix", default="big_init")
    parser.add_argument("--keep", action="store_true", help="keep the weights and files under --dir")
    parser.add_argument("--phase", default="all", choices=["all", "train"], help=argparse.SUPPRESS)
    parser.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--render", default=None, help="only rewrite the .md of a recorded .json")
    args = parser.parse_args()
    if args.render:
        render(Path(args.render))
        return
    if args.phase == "train":
        Path(args.phase_out).write_text(json.dumps(train_phase(args)))
        return

    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    target = parse_params(args.params)
    config, n_params = llama_config(target)
    # bf16 weights (2 B/param) + NVMe masters, m, v (12 B/param) + the bf16 save (2 B/param), 5% spare.
    free = shutil.disk_usage(folder).free
    need = int(16 * n_params * 1.05) + 2 * 2**30
    note = ""
    if need > free:
        target = (free - 2 * 2**30) / 1.05 / 16
        config, n_params = llama_config(target)
        note = (f"{args.params} parameters need {need / 1e9:.0f} GB under {folder} but {free / 1e9:.0f} GB are free: "
                f"ran {n_params / 1e9:.2f}B instead")
        print(note, flush=True)
    print(f"Llama of {n_params / 1e9:.3f}B parameters ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"intermediate {config.intermediate_size}, vocab {config.vocab_size}); {free / 1e9:.0f} GB free under "
          f"{folder}", flush=True)

    try:
        print("measuring the disk ...", flush=True)
        disk = measure_disk(folder)
        print("  " + ", ".join(f"{k.removesuffix('_seconds').replace('_', ' ')} {disk['bytes'] / v / 1e9:.2f} GB/s"
                               for k, v in disk.items() if k.endswith("_seconds")), flush=True)
        print("writing the bf16 checkpoint ...", flush=True)
        ckpt = write_checkpoint(config, folder / "weights")
        print(f"  {ckpt['bytes'] / 1e9:.2f} GB in {ckpt['files']} shards, {ckpt['seconds']:.0f} s", flush=True)
        phase_out = folder / "train-phase.json"
        cmd = [sys.executable, __file__, "--phase", "train", "--phase-out", str(phase_out), "--dir", str(folder),
               "--tokens", str(args.tokens), "--steps", str(args.steps), "--cpu-memory", args.cpu_memory,
               "--depth", str(args.depth)] + (["--chunk", str(args.chunk)] if args.chunk else [])
        subprocess.run(cmd, check=True)
        run = json.loads(phase_out.read_text())
    finally:
        if not args.keep:
            for sub in ("weights", "nvme", "saved", "train-phase.json", "disk-speed.tmp"):
                path = folder / sub
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                elif path.exists():
                    path.unlink()
    report(args, config, n_params, disk, ckpt, run, note)


def report(args, config, n_params, disk, ckpt, run, note) -> None:
    """Write the JSON record, then the markdown rendered from it."""
    w, r = disk["write_bytes_per_s"], disk["read_bytes_per_s"]
    result = dict(
        machine=machine_info("cpu"), command=" ".join(["python", "benchmarks/bench_big_init.py", *sys.argv[1:]]),
        note=note, params=n_params,
        model=dict(layers=config.num_hidden_layers, hidden=config.hidden_size, intermediate=config.intermediate_size,
                   heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, vocab=config.vocab_size),
        config=vars(args), disk=disk, checkpoint=ckpt, run=run,
        initialize_disk_floor_seconds=run["initialize_read_bytes"] / r + run["initialize_nvme_write_bytes"] / w,
        save_disk_floor_seconds=run["save_nvme_read_bytes"] / r + run["save_write_bytes"] / w,
        ram_bytes=psutil.virtual_memory().total,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out_prefix}.json").write_text(json.dumps(result, indent=2))
    render(RESULTS / f"{args.out_prefix}.json")


def render(json_path: Path) -> None:
    """The markdown table of a recorded run (``--render results/big_init.json`` redoes it)."""
    result = json.loads(Path(json_path).read_text())
    m, model, args, disk, ckpt, run = (result[k] for k in ("machine", "model", "config", "disk", "checkpoint", "run"))
    n_params, ram, note = result["params"], result["ram_bytes"], result["note"]
    w, r = disk["write_bytes_per_s"], disk["read_bytes_per_s"]
    init_floor, save_floor = result["initialize_disk_floor_seconds"], result["save_disk_floor_seconds"]
    gb = 1e9
    peaks = run["phase_peak_rss_bytes"]
    speeds = ", ".join(f"{k.removesuffix('_seconds').replace('_', ' ')} {disk['bytes'] / v / gb:.2f}"
                       for k, v in disk.items() if k.endswith("_seconds"))
    lines = [
        "# Meta init, streamed weights: a Llama that never exists whole in RAM",
        "",
        f"Generated by `{result['command']}` on {m['date']}; {m['cpu']}, {m['cores']} cores, "
        f"{ram / 2**30:.1f} GiB RAM, torch {m['torch']}." + (f" {note}." if note else ""),
        "",
        f"LlamaForCausalLM of **{n_params / gb:.2f}B parameters** ({model['layers']} layers, hidden "
        f"{model['hidden']}, intermediate {model['intermediate']}, {model['heads']} heads / {model['kv_heads']} KV "
        f"heads, vocab {model['vocab']}, untied): {ckpt['bytes'] / gb:.2f} GB of bf16 safetensors in "
        f"{ckpt['files']} shards, evicted from the page cache before they are read. Whole in RAM it would be "
        f"{2 * n_params / gb:.1f} GB in bf16, {4 * n_params / gb:.1f} GB in fp32, and its training state "
        f"{16 * n_params / gb:.0f} GB. Built under `init_empty_weights()` in {run['build_seconds']:.1f} s, then "
        f"`gemini.initialize(..., weights=folder)` with placement cpu, bf16, cpu_memory {args['cpu_memory']}, all "
        f"{run['nvme_groups']} chunk groups' masters and Adam states on NVMe (chunks of {run['chunk_size']} "
        f"elements, pipeline depth {run.get('pipeline_depth', args['depth'])}); {args['steps']} steps of batch 1 x "
        f"{args['tokens']} tokens; "
        f"`gemini.save_pretrained(model, folder, dtype=torch.bfloat16)`.",
        "",
        f"Disk under `{args['dir']}` ({disk['bytes'] / 2**30:.0f} GiB sequential, 64 MiB a call, the best of "
        f"buffered and O_DIRECT): write {w / gb:.2f} GB/s (fsync included), read {r / gb:.2f} GB/s ({speeds} GB/s). "
        + ("Buffered reads of a file evicted from the guest's page cache run faster than O_DIRECT ones: the VM's host "
           "probably caches the disk too, so the read speed is optimistic, and reads are a small part of the bytes here."
           if disk.get("buffered_read_seconds", 0) < disk.get("direct_read_seconds", 0) else ""),
        "",
        "| phase | seconds | read GB | written GB | disk time at measured speeds s | seconds / disk time | peak RSS GiB |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| initialize (weights → chunks, states → NVMe) | {run['initialize_seconds']:.1f} | "
        f"{run['initialize_read_bytes'] / gb:.2f} | {run['initialize_nvme_write_bytes'] / gb:.2f} | {init_floor:.1f} | "
        f"{run['initialize_seconds'] / init_floor:.2f} | {peaks['initialize'] / 2**30:.2f} |",
    ]
    for st in run["steps"]:
        lines.append(f"| step {st['step']} (loss {st['loss']:.3f}; forward+backward {st['forward_backward_seconds']:.0f}"
                     f" s) | {st['step_seconds']:.1f} | {st['nvme_read_bytes'] / gb:.2f} | "
                     f"{st['nvme_write_bytes'] / gb:.2f} | {st['nvme_read_bytes'] / r + st['nvme_write_bytes'] / w:.1f}"
                     f" | | {peaks['step ' + str(st['step'])] / 2**30:.2f} |")
    lines += [
        f"| save_pretrained (masters from NVMe → bf16 shards) | {run['save_seconds']:.1f} | "
        f"{run['save_nvme_read_bytes'] / gb:.2f} | {run['save_write_bytes'] / gb:.2f} | {save_floor:.1f} | "
        f"{run['save_seconds'] / save_floor:.2f} | {peaks['save_pretrained'] / 2**30:.2f} |",
        "",
        f"After initialize the process held {run['rss_after_initialize_bytes'] / 2**30:.2f} GiB, of which chunks in "
        f"host memory (the bf16 parameters, kept there under placement cpu) are "
        f"{run['host_chunk_bytes_after_initialize'] / 2**30:.2f} GiB; the rest of initialize's peak is the groups "
        f"in flight to NVMe and the host pool's buffers. **Peak RSS {run['peak_rss_bytes'] / 2**30:.2f} GiB** (during "
        f"{run['peak_rss_phase']}: bf16 parameters and gradients, and the NVMe pipeline's staging; kernel "
        f"high-water mark {run['ru_maxrss_bytes'] / 2**30:.2f} GiB) against {ram / 2**30:.1f} GiB of RAM. "
        "'Disk time' is read bytes / read speed + written bytes / write speed: what the bytes cost at the "
        "disk's measured sequential speeds, one after the other; the steps' remaining time is bf16 compute on 2 "
        "cores (forward+backward).",
        "",
    ]
    md = Path(json_path).with_suffix(".md")
    md.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
