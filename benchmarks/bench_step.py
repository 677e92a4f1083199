"""Training-step and optimizer-step time: gemini against plain PyTorch and DeepSpeed, same run.

    python benchmarks/bench_step.py                   # three GPT sizes on the CPU
    python benchmarks/bench_step.py --device cuda     # the same on a GPU
    python benchmarks/bench_step.py --sizes small     # one size (small, medium, 55m)

Contenders are timed in interleaved rounds (A, B, A, B, ...) so that drift of the machine
(other processes, thermal state) hits them alike; the table reports medians.

1. Whole training step (forward, backward, optimizer step, zero_grad) of a GPT at three sizes
   (per-module costs hide in big models): small (d 128, 4 layers, batch 4x64), medium (d 256,
   8 layers, 8 heads, ctx 64, batch 8, tied embeddings) and 55M (d 768, 6 layers, batch 4x256):
   gemini with placement "cuda" (all chunks on the compute device), and placement "auto" with
   a budget that holds everything (4x the model data) and gpu_margin_mem_ratio 1 (so that, like
   cuda, it keeps the optimizer states on the device: at ratio 0 Adam runs on the host by
   choice, which is not overhead), against the same model with plain
   ``torch.optim.AdamW(fused=True)``. Goals (issue 17): cuda / plain <= 1.05 (small: 1.10),
   auto / cuda <= 1.03. On the CPU stand-in a budget runs the tensor-accounting monitor (a
   Python call per operator) in every step, which a GPU's allocator counters do not need: so
   placement "cuda" also runs with the same budget, and auto is compared with it (the same
   monitor on both sides) as well as with unbudgeted cuda.
2. The optimizer step alone (the 55M GPT), over the same parameters with gradients present: gemini's
   HybridAdam over chunks, ``AdamW(fused=True)`` over the model's parameters, and DeepSpeed's
   CPU Adam (``DeepSpeedCPUAdam``, its AVX kernel) when deepspeed is installed (CPU only;
   ``bash scripts/bench_venv.sh`` makes a venv with it and says how to run this script there).

Results go to benchmarks/results/step_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemini  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (and a hint) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'gemini-offload[plot]')")
        return None
    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


def command_line(script: str) -> str:
    """The command that ran ``benchmarks/<script>``, its arguments quoted for a shell."""
    return " ".join(["python", f"benchmarks/{script}", *map(shlex.quote, sys.argv[1:])])


def machine_info(device: str) -> dict:
    info = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch": torch.__version__,
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        info["driver"] = _driver_version()
    return info


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            v = pynvml.nvmlSystemGetDriverVersion()
            return v.decode() if isinstance(v, bytes) else v
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # NVML missing: the table says "None"
        return None


def write_results(stem: str, result: dict, markdown: str) -> None:
    """benchmarks/results/<stem>.json and .md, and the table on stdout."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (RESULTS / f"{stem}.md").write_text(markdown)
    print(markdown)


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleave(contenders: dict, rounds: int, warmup: int, device: str) -> dict[str, list[float]]:
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    times = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(rounds):
        # Each round starts with another contender: whoever runs right after another's
        # optimizer step finds the caches cold, and a fixed order charged that to the same one.
        for name in names[r % len(names):] + names[: r % len(names)]:
            times[name].append(timed(contenders[name], device))
    return times


SIZES = {  # name -> (GPTConfig fields, batch, seq)
    "small": (dict(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128), 4, 64),
    "medium": (dict(vocab_size=1024, block_size=64, n_layer=8, n_head=8, n_embd=256), 8, 64),
    "55m": (dict(vocab_size=16384, block_size=256, n_layer=6, n_head=12, n_embd=768), 4, 256),
}


CUDA_BUDGETED = "gemini placement=cuda, budget 4x model data"
AUTO_BUDGETED = "gemini placement=auto, ratio 1, budget 4x model data"


def bench_training_step(cfg: GPTConfig, batch: int, seq: int, args) -> dict:
    torch.manual_seed(0)
    base = GPT(cfg)
    plain = copy.deepcopy(base).to(args.device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    engines = {}
    model_data = 16 * cfg.num_params()  # fp32 parameters, gradients, m and v
    for label, extra in (("gemini placement=cuda", dict(placement="cuda")),
                         (CUDA_BUDGETED, dict(placement="cuda", device_memory=4 * model_data)),
                         (AUTO_BUDGETED, dict(placement="auto", device_memory=4 * model_data, gpu_margin_mem_ratio=1.0))):
        engines[label] = gemini.initialize(copy.deepcopy(base), gemini.GeminiConfig(device=args.device, **extra),
                                           lr=1e-4, weight_decay=0.1)
    x, y = synthetic_batch(cfg, batch, seq, generator=torch.Generator().manual_seed(1), device=args.device)

    def plain_step():
        GPT.loss(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def gemini_step(model, opt):
        def step():
            opt.backward(GPT.loss(model(x), y))
            opt.step()
            opt.zero_grad()
        return step

    contenders = {"torch AdamW(fused)": plain_step}
    contenders.update({label: gemini_step(*engine) for label, engine in engines.items()})
    times = interleave(contenders, args.rounds, args.warmup, args.device)
    manager = engines["gemini placement=cuda"][1]._rt.manager
    return {"times": times, "chunk_size": manager.chunk_size, "chunk_groups": len(manager.groups)}


def bench_optimizer_step(cfg: GPTConfig, args) -> dict:
    torch.manual_seed(0)
    base = GPT(cfg)
    x, y = synthetic_batch(cfg, 1, 16, generator=torch.Generator().manual_seed(1), device=args.device)
    plain = copy.deepcopy(base).to(args.device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    GPT.loss(plain(x), y).backward()
    contenders = {"torch AdamW(fused)": plain_opt.step}
    gmodel, gopt = gemini.initialize(
        copy.deepcopy(base), gemini.GeminiConfig(device=args.device, placement="cuda"), lr=1e-4, weight_decay=0.1
    )
    gopt.backward(GPT.loss(gmodel(x), y))  # gradients stay in the chunks until zero_grad
    contenders["gemini HybridAdam"] = gopt.step
    notes = []
    if args.device == "cpu":
        try:
            os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read at deepspeed's import; else it warns
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            ds_model = copy.deepcopy(base)
            GPT.loss(ds_model(x), y).backward()
            ds_opt = DeepSpeedCPUAdam(ds_model.parameters(), lr=1e-4, weight_decay=0.1, adamw_mode=True)
            contenders["DeepSpeed CPUAdam"] = ds_opt.step
        except Exception as e:  # not installed, or its op failed to build
            notes.append(f"DeepSpeed CPU Adam skipped: {type(e).__name__}: {str(e)[:200]}")
    times = interleave(contenders, args.rounds * 3, args.warmup, args.device)
    return {"times": times, "notes": notes}


def summarize(times: dict[str, list[float]], baseline: str) -> list[dict]:
    base = statistics.median(times[baseline])
    rows = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"contender": name, "median_s": med, "min_s": min(ts), "ratio_to_baseline": med / base, "n": len(ts)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {', '.join(SIZES)}")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="result file stem (default step_<device>)")
    args = p.parse_args()
    sizes = args.sizes.split(",")
    unknown = [n for n in sizes if n not in SIZES]
    if unknown:
        p.error(f"--sizes: unknown {unknown}; choose from {list(SIZES)}")
    result = {"machine": machine_info(args.device), "sizes": {}}
    for name in sizes:
        fields, batch, seq = SIZES[name]
        cfg = GPTConfig(**fields)
        print(f"{name}: GPT {cfg.num_params() / 1e6:.1f}M parameters, batch {batch}x{seq}, device {args.device}",
              flush=True)
        train = bench_training_step(cfg, batch, seq, args)
        rows = summarize(train["times"], "torch AdamW(fused)")
        cuda = next(r for r in rows if r["contender"] == "gemini placement=cuda")["median_s"]
        cuda_budgeted = next(r for r in rows if r["contender"] == CUDA_BUDGETED)["median_s"]
        for r in rows:
            r["ratio_to_gemini_cuda"] = r["median_s"] / cuda
        auto = next(r for r in rows if r["contender"] == AUTO_BUDGETED)
        auto["ratio_to_gemini_cuda_same_budget"] = auto["median_s"] / cuda_budgeted
        result["sizes"][name] = {"model": {"params": cfg.num_params(), **cfg.__dict__}, "batch": batch, "seq": seq,
                                 "training_step": {**train, "summary": rows}}
    optim = None
    if "55m" in sizes:
        optim = bench_optimizer_step(GPTConfig(**SIZES["55m"][0]), args)
        result["optimizer_step"] = {**optim, "summary": summarize(optim["times"], "torch AdamW(fused)")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.out or f"step_{args.device}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    info = result["machine"]
    md = [f"# Step time, device {args.device}", "",
          f"{info['date']} on {info['cpu']} ({info['cores']} cores, torch {info['torch']}"
          f"{', ' + info.get('gpu', '') if args.device == 'cuda' else ''}). Medians of interleaved rounds.", "",
          "Command: `python benchmarks/bench_step.py" + "".join(f" {a}" for a in sys.argv[1:]) + "`", ""]
    for name, part in result["sizes"].items():
        m = part["model"]
        md += [f"## Whole training step: {name} ({m['params'] / 1e6:.1f}M parameters, d {m['n_embd']}, "
               f"{m['n_layer']} layers, batch {part['batch']}x{part['seq']})", "",
               "| contender | median s | min s | / torch AdamW(fused) | / gemini cuda | rounds |", "|---|---|---|---|---|---|"]
        for row in part["training_step"]["summary"]:
            md.append(f"| {row['contender']} | {row['median_s']:.4f} | {row['min_s']:.4f} | "
                      f"{row['ratio_to_baseline']:.3f} | {row['ratio_to_gemini_cuda']:.3f} | {row['n']} |")
        auto = next(r for r in part["training_step"]["summary"] if r["contender"] == AUTO_BUDGETED)
        md += ["", f"auto / cuda under the same budget (both measured by the same monitor): "
                   f"**{auto['ratio_to_gemini_cuda_same_budget']:.3f}**", ""]
    if optim is not None:
        md += ["## Optimizer step alone (55m)", "", "| contender | median s | min s | ratio to torch AdamW(fused) | rounds |",
               "|---|---|---|---|---|"]
        for row in result["optimizer_step"]["summary"]:
            md.append(f"| {row['contender']} | {row['median_s']:.4f} | {row['min_s']:.4f} | "
                      f"{row['ratio_to_baseline']:.3f} | {row['n']} |")
        md.append("")
        md += [f"- {note}" for note in optim["notes"]]
    (RESULTS / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
