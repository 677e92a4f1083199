"""Training-step and optimizer-step time: gemini against plain PyTorch and DeepSpeed, same run.

    python benchmarks/bench_step.py                   # ~50M-parameter GPT on the CPU
    python benchmarks/bench_step.py --device cuda     # the same on a GPU

Contenders are timed in interleaved rounds (A, B, A, B, ...) so that drift of the machine
(other processes, thermal state) hits them alike; the table reports medians.

1. Whole training step (forward, backward, optimizer step, zero_grad) of a GPT:
   gemini with placement "cuda" (all chunks on the compute device) against the same model
   with plain ``torch.optim.AdamW(fused=True)``.
2. The optimizer step alone, over the same parameters with gradients present: gemini's
   HybridAdam over chunks, ``AdamW(fused=True)`` over the model's parameters, and DeepSpeed's
   CPU Adam (``DeepSpeedCPUAdam``, its AVX kernel) when deepspeed is installed (CPU only).

Results go to benchmarks/results/step_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemini  # noqa: E402
from gemini.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402

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
    return info


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
    for _ in range(rounds):
        for name, fn in contenders.items():
            times[name].append(timed(fn, device))
    return times


def bench_training_step(cfg: GPTConfig, args) -> dict:
    torch.manual_seed(0)
    base = GPT(cfg)
    plain = copy.deepcopy(base).to(args.device)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, weight_decay=0.1, fused=True)
    gmodel, gopt = gemini.initialize(
        base, gemini.GeminiConfig(device=args.device, placement="cuda"), lr=1e-4, weight_decay=0.1
    )
    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1), device=args.device)

    def plain_step():
        GPT.loss(plain(x), y).backward()
        plain_opt.step()
        plain_opt.zero_grad()

    def gemini_step():
        gopt.backward(GPT.loss(gmodel(x), y))
        gopt.step()
        gopt.zero_grad()

    times = interleave({"torch AdamW(fused)": plain_step, "gemini placement=cuda": gemini_step},
                       args.rounds, args.warmup, args.device)
    return {"times": times, "chunk_size": gopt._rt.manager.chunk_size, "chunk_groups": len(gopt._rt.manager.groups)}


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
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None, help="result file stem (default step_<device>)")
    args = p.parse_args()
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.embd)
    n_params = cfg.num_params()
    print(f"GPT {n_params / 1e6:.1f}M parameters, batch {args.batch}x{args.seq}, device {args.device}", flush=True)
    train = bench_training_step(cfg, args)
    optim = bench_optimizer_step(cfg, args)
    result = {
        "machine": machine_info(args.device),
        "model": {"params": n_params, **cfg.__dict__},
        "batch": args.batch,
        "seq": args.seq,
        "training_step": {**train, "summary": summarize(train["times"], "torch AdamW(fused)")},
        "optimizer_step": {**optim, "summary": summarize(optim["times"], "torch AdamW(fused)")},
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.out or f"step_{args.device}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    md = [f"# Step time, {n_params / 1e6:.1f}M-parameter GPT, device {args.device}", "",
          f"{result['machine']['date']} on {result['machine']['cpu']} ({result['machine']['cores']} cores, "
          f"torch {result['machine']['torch']}{', ' + result['machine'].get('gpu', '') if args.device == 'cuda' else ''}). "
          f"Batch {args.batch}x{args.seq}; medians of interleaved rounds.", "",
          "Command: `python benchmarks/bench_step.py" + (" --device cuda" if args.device == "cuda" else "") + "`", ""]
    for title, part in (("Whole training step", "training_step"), ("Optimizer step alone", "optimizer_step")):
        md += [f"## {title}", "", "| contender | median s | min s | ratio to torch AdamW(fused) | rounds |", "|---|---|---|---|---|"]
        for row in result[part]["summary"]:
            md.append(f"| {row['contender']} | {row['median_s']:.4f} | {row['min_s']:.4f} | {row['ratio_to_baseline']:.3f} | {row['n']} |")
        md.append("")
    for note in optim["notes"]:
        md.append(f"- {note}")
    (RESULTS / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
