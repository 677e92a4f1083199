"""Step time against the device budget, and against gpu_margin_mem_ratio, under placement "auto".

    python benchmarks/bench_budget.py                  # the CPU standing in for the device
    python benchmarks/bench_budget.py --device cuda    # on a GPU

1. The budget falls from 120% to 10% of the model data (fp32 parameters, gradients and Adam
   states: 16 bytes a parameter); each run reports the median step time after warm-up and its
   cost against the same model with no budget pressure (a budget of 4x the model data), the
   measured device peak, evictions and the bytes moved each step (h2d, d2h). Each budget runs
   twice: with the engine's Belady eviction order and with least-recently-used, so the bytes
   the recorded order saves are measured, not estimated.
2. With a budget that fits everything (160%), "auto" at margin ratio 1 against "cuda".
   Both run with the same budget, so both are measured by the same monitor.
3. At a fixed budget, step time at each gpu_margin_mem_ratio, with the number of
   optimizer-state chunk groups it put on the device.

Writes benchmarks/results/budget_<device>.json, .md and, when matplotlib is installed, .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemini  # noqa: E402
from bench_step import RESULTS, command_line, machine_info, pyplot, save_figure  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from tracer import EvictionRule  # noqa: E402


def timed_step(gmodel, opt, x, y, device: str) -> float:
    """One training step (forward, backward, step, zero_grad), in seconds."""
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    opt.backward(GPT.loss(gmodel(x), y))
    opt.step()
    opt.zero_grad()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def run(cfg: GPTConfig, args, *, placement: str, budget: int, ratio: float = 0.0,
        rule: EvictionRule = EvictionRule.BELADY) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    gcfg = gemini.GeminiConfig(device=args.device, placement=placement, device_memory=budget,
                               gpu_margin_mem_ratio=ratio, chunk_size=args.chunk_size)
    gmodel, opt = gemini.initialize(model, gcfg, lr=1e-4)
    if rule is not EvictionRule.BELADY:
        opt._rt.placement.eviction_rule = rule  # a benchmark's counterfactual, not a user setting
    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1), device=args.device)
    times, reports = [], []
    for i in range(args.steps + 1):  # the first is the warm-up
        seconds = timed_step(gmodel, opt, x, y, args.device)
        if i > 0:
            times.append(seconds)
            reports.append(opt.report)
        else:
            warmup_evictions = opt._rt.residency.evictions
    r = reports[-1]
    evictions = opt._rt.residency.evictions
    return {
        "placement": placement,
        "budget_bytes": budget,
        "ratio": ratio,
        "median_step_s": statistics.median(times),
        "device_peak_bytes": max(rep.device_peak_bytes for rep in reports),
        "under_budget": all(rep.device_peak_bytes <= budget for rep in reports),
        "h2d_bytes": r.h2d_bytes,
        "d2h_bytes": r.d2h_bytes,
        "h2d_bytes_per_step": [rep.h2d_bytes for rep in reports],
        "d2h_bytes_per_step": [rep.d2h_bytes for rep in reports],
        "eviction_rule": rule.value,
        "os_chunks_on_device": r.os_chunks_on_device,
        "chunk_groups": len(opt._rt.manager.trainable_groups),
        "evictions_total": evictions,
        "evictions_per_step": (evictions - warmup_evictions) / len(reports),
    }


def interleaved(cfg: GPTConfig, args, *, budget: int, rounds: int = 9) -> tuple[dict, dict]:
    """"cuda" and "auto" (ratio 1) side by side, one step each in turn, after their warm-ups."""
    contenders = {}
    for placement in ("cuda", "auto"):
        torch.manual_seed(0)
        gcfg = gemini.GeminiConfig(device=args.device, placement=placement, device_memory=budget,
                                   gpu_margin_mem_ratio=1.0 if placement == "auto" else 0.0, chunk_size=args.chunk_size)
        contenders[placement] = gemini.initialize(GPT(cfg), gcfg, lr=1e-4)
    x, y = synthetic_batch(cfg, args.batch, args.seq, generator=torch.Generator().manual_seed(1), device=args.device)
    times = {name: [] for name in contenders}
    peaks = {name: 0 for name in contenders}
    for i in range(rounds + 2):  # the first two are warm-up
        for name, (gmodel, opt) in contenders.items():
            seconds = timed_step(gmodel, opt, x, y, args.device)
            if i >= 2:
                times[name].append(seconds)
                peaks[name] = max(peaks[name], opt.report.device_peak_bytes)
    rows = []
    for name, (_, opt) in contenders.items():
        rows.append({"placement": name, "budget_bytes": budget, "median_step_s": statistics.median(times[name]),
                     "min_step_s": min(times[name]), "rounds": rounds, "device_peak_bytes": peaks[name],
                     "os_chunks_on_device": opt.report.os_chunks_on_device, "h2d_bytes": opt.report.h2d_bytes})
    return rows[0], rows[1]


def plot(result: dict, path: Path) -> None:
    """Step time against the budget and against the margin ratio, as PNG (matplotlib optional)."""
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in result["budget_sweep"] if "error" not in r]
    ratios = result["margin_ratio_sweep"]["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot([100 * r["fraction_of_model_data"] for r in ok], [r["median_step_s"] for r in ok], "o-")
    a.set_xlabel("device budget, % of model data")
    a.set_ylabel("step time, s")
    a.invert_xaxis()
    a.set_title("auto placement: step time vs budget")
    b.plot([r["ratio"] for r in ratios], [r["median_step_s"] for r in ratios], "o-")
    b.set_xlabel("gpu_margin_mem_ratio")
    b.set_ylabel("step time, s")
    b.set_title(f"budget {result['margin_ratio_sweep']['budget_bytes'] / 2**20:.0f} MiB")
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--no-checkpointing", action="store_true", help="keep every activation (larger non-model peak)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--chunk-size", type=int, default=None, help="elements per chunk (default: searched)")
    p.add_argument("--fractions", default="1.2,1.0,0.8,0.6,0.45,0.3,0.2,0.1")
    p.add_argument("--ratios", default="0,0.25,0.5,0.75,1")
    p.add_argument("--out", default=None, help="results' name under benchmarks/results (default budget_<device>, "
                   "the committed run's: name another for other options)")
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps {args.steps}: at least 1 (the median of the steps after the warm-up)")
    cfg = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd,
                    activation_checkpointing=not args.no_checkpointing)
    model_data = 16 * cfg.num_params()
    print(f"GPT {cfg.num_params() / 1e6:.2f}M parameters, model data {model_data / 2**20:.1f} MiB", flush=True)

    run(cfg, args, placement="auto", budget=2 * model_data)  # process warm-up (allocator, kernels): not timed
    unpressed = run(cfg, args, placement="auto", budget=4 * model_data)
    sweep = []
    for frac in (float(f) for f in args.fractions.split(",")):
        try:
            row = run(cfg, args, placement="auto", budget=int(frac * model_data))
            lru = run(cfg, args, placement="auto", budget=int(frac * model_data), rule=EvictionRule.LRU)
            row["lru"] = {k: lru[k] for k in ("median_step_s", "h2d_bytes", "d2h_bytes", "evictions_total",
                                               "device_peak_bytes", "under_budget")}
            row["bytes_saved_by_belady_per_step"] = (lru["h2d_bytes"] + lru["d2h_bytes"]
                                                     - row["h2d_bytes"] - row["d2h_bytes"])
            row["cost_vs_no_pressure"] = row["median_step_s"] / unpressed["median_step_s"]
        except gemini.engine.memory.DeviceBudgetError as e:
            row = {"placement": "auto", "budget_bytes": int(frac * model_data), "error": str(e)[:160]}
        row["fraction_of_model_data"] = frac
        sweep.append(row)
        print(row, flush=True)

    fits = int(1.6 * model_data)  # all chunks (padding included) and the activations
    cuda_row, auto_row = interleaved(cfg, args, budget=fits)
    ratio_budget = int(0.8 * model_data)
    ratios = [run(cfg, args, placement="auto", budget=ratio_budget, ratio=float(r)) for r in args.ratios.split(",")]

    result = {"machine": machine_info(args.device), "command": command_line("bench_budget.py"), "model": {"params": cfg.num_params(), **cfg.__dict__},
              "model_data_bytes": model_data, "no_pressure": unpressed, "budget_sweep": sweep,
              "fits_everything": {"cuda": cuda_row, "auto_ratio_1": auto_row,
                                  "ratio_auto_to_cuda": auto_row["median_step_s"] / cuda_row["median_step_s"]},
              "margin_ratio_sweep": {"budget_bytes": ratio_budget, "rows": ratios}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = args.out or f"budget_{args.device}"
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    md = [f"# Step time against the device budget (placement auto, device {args.device})", "",
          f"{m['date']} on {m['cpu']} ({m['cores']} cores, torch {m['torch']}). GPT {cfg.num_params() / 1e6:.2f}M "
          f"parameters, model data {model_data / 2**20:.1f} MiB, batch {args.batch}x{args.seq}, "
          f"chunk size {args.chunk_size or 'searched'}, activation checkpointing {'off' if args.no_checkpointing else 'on'}; median of {args.steps} steps after warm-up.", "",
          f"Command: `{result['command']}`", "",
          "## Budget sweep", "",
          f"No budget pressure (budget 4x model data): {unpressed['median_step_s']:.3f} s a step, "
          f"h2d {unpressed['h2d_bytes'] / 2**20:.1f} MiB, d2h {unpressed['d2h_bytes'] / 2**20:.1f} MiB a step. "
          "Cost = step time / that. Bytes are per step after the warm-up; LRU = the same run evicting the least "
          "recently used group first; saved = LRU's h2d+d2h less Belady's.", "",
          "| budget (% of model data) | model data / budget | step s | cost | device peak MiB | under budget "
          "| h2d MiB/step | d2h MiB/step | evictions/step | LRU h2d+d2h MiB/step | LRU step s | saved by Belady MiB/step |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in sweep:
        if "error" in row:
            md.append(f"| {row['fraction_of_model_data']:.0%} | {1 / row['fraction_of_model_data']:.1f}x | — | — | — | "
                      f"error: {row['error'][:80]}… | | | | | | |")
        else:
            lru = row["lru"]
            md.append(f"| {row['fraction_of_model_data']:.0%} | {1 / row['fraction_of_model_data']:.1f}x | "
                      f"{row['median_step_s']:.3f} | {row['cost_vs_no_pressure']:.2f} | "
                      f"{row['device_peak_bytes'] / 2**20:.1f} | {row['under_budget']} | {row['h2d_bytes'] / 2**20:.1f} | "
                      f"{row['d2h_bytes'] / 2**20:.1f} | {row['evictions_per_step']:.1f} | "
                      f"{(lru['h2d_bytes'] + lru['d2h_bytes']) / 2**20:.1f} | {lru['median_step_s']:.3f} | "
                      f"{row['bytes_saved_by_belady_per_step'] / 2**20:.1f} |")
    md += ["", "## A budget that fits everything (160% of model data), interleaved rounds", "",
           "| placement | median step s | min step s | device peak MiB |", "|---|---|---|---|",
           f"| cuda | {cuda_row['median_step_s']:.3f} | {cuda_row['min_step_s']:.3f} | {cuda_row['device_peak_bytes'] / 2**20:.1f} |",
           f"| auto, ratio 1 | {auto_row['median_step_s']:.3f} | {auto_row['min_step_s']:.3f} | {auto_row['device_peak_bytes'] / 2**20:.1f} |",
           "", f"auto / cuda = {result['fits_everything']['ratio_auto_to_cuda']:.3f}", "",
           f"## Margin ratio at {ratio_budget / 2**20:.1f} MiB (80%)", "",
           "| gpu_margin_mem_ratio | optimizer-state groups on device | step s | device peak MiB | h2d MiB/step |", "|---|---|---|---|---|"]
    for row in ratios:
        md.append(f"| {row['ratio']} | {row['os_chunks_on_device']}/{row['chunk_groups']} | {row['median_step_s']:.3f} | "
                  f"{row['device_peak_bytes'] / 2**20:.1f} | {row['h2d_bytes'] / 2**20:.1f} |")
    (RESULTS / f"{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    plot(result, RESULTS / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
