"""Capacity: the smallest device budget each model trains under, against its lower bound.

    python benchmarks/bench_capacity.py                   # the CPU standing in for the device
    python benchmarks/bench_capacity.py --device cuda     # on a GPU
    python benchmarks/bench_capacity.py --quick           # fewer search steps, the GPT only

For each model — a 24-layer GPT (d 256, 8 heads, ctx 64, batch 4, tied embeddings), a
transformers LlamaForCausalLM of about the same size, and the "medium" GPT (8 layers, batch 8)
— and each of: no checkpointing, activation checkpointing (every block, non-reentrant),
checkpointing + ``offload_activations``, ``offload_activations`` alone, it binary-searches the
smallest ``device_memory`` under which placement "auto" trains 3 steps with every step's
measured peak under the budget (a ``DeviceBudgetError`` is a failure), and reports

- model data (fp32 parameters, gradients, Adam m and v: 16 bytes a parameter) / that budget;
- the lower bound: the warm-up's measured non-model peak + the largest module's parameters and
  gradients + buffers (what must be on the device at once, whatever the placement), and the
  ratio model data / bound; the smallest budget must be within 1.05x of the bound;
- the step time at that budget against the same model with a budget that holds everything;
- the cost of budget pressure alone (issue 17: <= 1.3x): where the model trains at 10x model
  data per budget, the step time at that budget against the same model and configuration
  (same checkpointing, same offload, same chunk size) under a budget of 4x model data, which
  holds everything (on the CPU stand-in any budget measures every allocation), alternated and timed
  over PRESSURE_STEPS steps after the warm-up, with the bytes moved each way per step and what
  the Belady eviction order saves against LRU at that budget;
- the largest difference from plain ``torch.optim.AdamW(fused=True)`` over the 3 steps at every
  budget tried that trained.

``chunk_size`` is, of the three largest modules' parameter counts, the one whose warm-up plans the least device memory, so that a module waits for
little more than its own chunk group; one row per model shows the searched default for
comparison. Writes benchmarks/results/capacity_<device>.json, .md and .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemini  # noqa: E402
from bench_step import RESULTS, command_line, machine_info, pyplot, save_figure  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig  # noqa: E402
from gemini.engine.memory import DeviceBudgetError  # noqa: E402
from tracer import EvictionRule  # noqa: E402

STEPS = 3
CONFIGS = {  # name -> (activation checkpointing, offload_activations)
    "none": (False, False),
    "checkpointing": (True, False),
    "checkpointing+offload": (True, True),
    "offload": (False, True),
}
OFFLOAD_MIN_BYTES = 64 * 1024
PRESSURE_RATIO = 10  # model data / budget of the pressure-cost measurement
PRESSURE_STEPS = 6  # timed steps (after the warm-up step) of each pressure-cost trial


@dataclass
class Workload:
    name: str
    make: object  # (checkpointing: bool) -> nn.Module
    loss: object  # (module, x, y) -> loss
    batch: int
    seq: int
    vocab: int


def gpt_workload(name: str, layers: int, batch: int, seq: int = 64) -> Workload:
    def make(checkpointing: bool) -> nn.Module:
        torch.manual_seed(0)
        return GPT(GPTConfig(vocab_size=1024, block_size=64, n_layer=layers, n_head=8, n_embd=256,
                             activation_checkpointing=checkpointing))

    return Workload(name, make, lambda m, x, y: GPT.loss(m(x), y), batch, seq, 1024)


def llama_workload() -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    def make(checkpointing: bool) -> nn.Module:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=24,
                          num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64,
                          tie_word_embeddings=False, attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg)
        model.train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    return Workload("llama-24", make, lambda m, x, y: m(input_ids=x, labels=y).loss, 4, 64, 1024)


def data(w: Workload, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, w.vocab, (w.batch, w.seq + 1), generator=g)
        x = tokens[:, :-1].to(device)
        y = (x if w.name.startswith("llama") else tokens[:, 1:]).to(device)  # HF shifts labels itself
        out.append((x, y))
    return out


def model_data_bytes(model: nn.Module) -> int:
    return 16 * sum(p.numel() for p in model.parameters())


def largest_module_params(model: nn.Module) -> int:
    return max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())


def reference(w: Workload, batches, device: str) -> dict[str, torch.Tensor]:
    """Plain AdamW (fused) on the model without checkpointing: the parameters after STEPS steps."""
    model = w.make(False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    for x, y in batches:
        w.loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def trial(w: Workload, batches, device: str, *, budget: int | None, checkpointing: bool, offload: bool,
          chunk_size: int | None, want: dict | None = None, rule: EvictionRule = EvictionRule.BELADY) -> dict:
    """Train STEPS steps under ``budget``; the measured peaks, step times and the distance from AdamW."""
    model = w.make(checkpointing)
    cfg = gemini.GeminiConfig(device=device, placement="auto", device_memory=budget, chunk_size=chunk_size,
                              offload_activations=offload, activation_offload_min_bytes=OFFLOAD_MIN_BYTES)
    gmodel, opt = gemini.initialize(model, cfg, lr=1e-3)
    opt._rt.placement.eviction_rule = rule  # a benchmark's counterfactual, not a user setting
    reports, seconds = [], []
    try:
        for x, y in batches:
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            opt.backward(w.loss(gmodel, x, y))
            opt.step()
            opt.zero_grad()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - start)
            reports.append(opt.report)
    except DeviceBudgetError as e:
        opt.close()
        return {"ok": False, "error": str(e)[:200], "failed_step": len(reports)}
    plan = opt._rt.plan
    out = {
        "ok": all(budget is None or r.device_peak_bytes <= budget for r in reports),
        "peaks": [r.device_peak_bytes for r in reports],
        "step_seconds": seconds,
        "non_model_peak_bytes": plan.max_non_model_bytes if plan is not None else None,
        "fixed_bytes": plan.fixed_bytes if plan is not None else 0,
        "activation_offload_bytes": reports[-1].activation_offload_bytes,
        "activation_kept_bytes": reports[-1].activation_kept_bytes,
        "h2d_bytes": reports[-1].h2d_bytes,
        "d2h_bytes": reports[-1].d2h_bytes,
        "evictions": opt._rt.residency.evictions,
    }
    if want is not None:
        got = {k: v.detach().cpu() for k, v in gmodel.state_dict().items()}
        out["max_abs_diff"] = max(float((got[k].float() - want[k].float()).abs().max()) for k in want)
        out["max_rel_diff"] = max(float(((got[k].float() - want[k].float()).abs()
                                         / want[k].float().abs().clamp_min(1e-3)).max()) for k in want)
    opt.close()
    return out


def chunk_candidates(model: nn.Module, n: int = 3) -> list[int]:
    """The ``n`` largest distinct per-module parameter counts (exact: a chunk that a module fills
    to the element leaves no room for the next module's tensors)."""
    sizes = {sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()}
    return sorted((s for s in sizes if s), reverse=True)[:n]


def choose_chunk_size(w: Workload, batches, device: str, *, checkpointing: bool, offload: bool) -> int:
    """Of the candidates, the chunk size whose warm-up plans the least device memory: a chunk
    that also takes the next module's small tensors (a LayerNorm after a Linear) makes its
    gradient chunk arrive a module early, so the largest module is not always the best size."""
    best = None
    for size in chunk_candidates(w.make(False)):
        model = w.make(checkpointing)
        cfg = gemini.GeminiConfig(device=device, placement="auto", chunk_size=size, offload_activations=offload,
                                  activation_offload_min_bytes=OFFLOAD_MIN_BYTES)
        gmodel, opt = gemini.initialize(model, cfg, lr=1e-3)
        x, y = batches[0]
        opt.backward(w.loss(gmodel, x, y))
        opt.step()
        planned = opt._rt.plan.planned_peak_bytes
        opt.close()
        print(f"    chunk_size {size}: the warm-up plans {planned / 2**20:.2f} MiB", flush=True)
        if best is None or planned < best[0]:
            best = (planned, size)
    return best[1]


def smallest_budget(w, batches, device, *, checkpointing, offload, chunk_size, lo, hi, rel_precision, want):
    """Binary search over budgets in [lo, hi] (hi must train); every trial that trains is checked."""
    tried = []
    while True:  # grow ``hi`` until it trains (a large chunk size needs more than the bound)
        first = trial(w, batches, device, budget=hi, checkpointing=checkpointing, offload=offload,
                      chunk_size=chunk_size, want=want)
        tried.append((hi, first))
        if first["ok"]:
            break
        if hi > 4 * model_data_bytes(w.make(False)):
            raise RuntimeError(f"{w.name}: even {hi} bytes do not train: {first.get('error')}")
        lo, hi = hi, 2 * hi
    best = (hi, first)
    while hi - lo > rel_precision * hi:
        mid = (lo + hi) // 2
        r = trial(w, batches, device, budget=mid, checkpointing=checkpointing, offload=offload,
                  chunk_size=chunk_size, want=want)
        tried.append((mid, r))
        print(f"    {mid / 2**20:8.2f} MiB: {'trains' if r['ok'] else 'refused'}", flush=True)
        if r["ok"]:
            hi, best = mid, (mid, r)
        else:
            lo = mid
    return best, tried


def pressure_cost(w: Workload, batches, device: str, *, checkpointing: bool, offload: bool,
                  chunk_size: int | None) -> dict:
    """Step time at PRESSURE_RATIO x model data per budget / the same configuration under a
    budget of 4x model data, which holds everything: only what the pressure adds (evictions,
    refetches), not what checkpointing or offload cost, nor the CPU stand-in's measuring of
    every allocation, which any budget turns on there (a GPU's allocator counts for free).
    The two alternate twice; each keeps its faster mean, so a burst of noise on the shared
    machine does not land on one side only."""
    md = model_data_bytes(w.make(False))
    budget = md // PRESSURE_RATIO
    steps = (batches * (PRESSURE_STEPS // len(batches) + 2))[: PRESSURE_STEPS + 1]
    means: dict[str, list[float]] = {"free": [], "pressed": []}
    pressed = None
    for _ in range(2):
        for side, b in (("free", 4 * md), ("pressed", budget)):
            r = trial(w, steps, device, budget=b, checkpointing=checkpointing, offload=offload, chunk_size=chunk_size)
            if not r["ok"]:
                return {"budget_bytes": budget, "trains": False, "error": r.get("error")}
            means[side].append(statistics.mean(r["step_seconds"][1:]))
            if b is not None:
                pressed = r
    free, press = min(means["free"]), min(means["pressed"])
    # The same budget evicting the least recently used group first: what the Belady order saves.
    lru = trial(w, steps, device, budget=budget, checkpointing=checkpointing, offload=offload, chunk_size=chunk_size,
                rule=EvictionRule.LRU)
    moved = pressed["h2d_bytes"] + pressed["d2h_bytes"]
    return {"budget_bytes": budget, "trains": True, "step_seconds_free": free, "step_seconds_pressed": press,
            "cost": press / free, "h2d_bytes_per_step": pressed["h2d_bytes"], "d2h_bytes_per_step": pressed["d2h_bytes"],
            "evictions": pressed["evictions"], "peaks": pressed["peaks"],
            "lru_moved_bytes_per_step": lru["h2d_bytes"] + lru["d2h_bytes"] if lru["ok"] else None,
            "saved_by_belady_bytes_per_step": lru["h2d_bytes"] + lru["d2h_bytes"] - moved if lru["ok"] else None}


def measure(w: Workload, device: str, config: str, *, chunk_size: int | None, rel_precision: float,
            want: dict) -> dict:
    """One row: the bound, the smallest budget, and the step-time cost against the same model
    without checkpointing or offload and with no budget, timed in the same process."""
    checkpointing, offload = CONFIGS[config]
    batches = data(w, device)
    if chunk_size == -1:
        chunk_size = choose_chunk_size(w, batches, device, checkpointing=checkpointing, offload=offload)
    model = w.make(checkpointing)
    md = model_data_bytes(model)
    largest = largest_module_params(model)
    del model
    # The warm-up offloads every eligible activation, so its non-model peak is the bound's even
    # though, with the whole device, the plan then keeps them all.
    ample = trial(w, batches, device, budget=None, checkpointing=checkpointing, offload=offload,
                  chunk_size=chunk_size, want=want)
    bound = ample["non_model_peak_bytes"] + 8 * largest + ample["fixed_bytes"]
    print(f"  {w.name} {config}: model data {md / 2**20:.1f} MiB, bound {bound / 2**20:.2f} MiB "
          f"({md / bound:.1f}x)", flush=True)
    (budget, best), tried = smallest_budget(w, batches, device, checkpointing=checkpointing, offload=offload,
                                            chunk_size=chunk_size, lo=bound // 2, hi=int(bound * 1.6),
                                            rel_precision=rel_precision, want=want)
    ok_runs = [r for _, r in tried if r["ok"]] + [ample]
    plain = trial(w, batches, device, budget=None, checkpointing=False, offload=False, chunk_size=chunk_size)
    again = trial(w, batches, device, budget=budget, checkpointing=checkpointing, offload=offload,
                  chunk_size=chunk_size)
    base_seconds = statistics.mean(plain["step_seconds"][1:])
    best = min(best, again, key=lambda r: statistics.mean(r["step_seconds"][1:])) if again["ok"] else best
    step_seconds = statistics.mean(best["step_seconds"][1:])
    pressure = None
    if md / budget >= PRESSURE_RATIO:
        pressure = pressure_cost(w, batches, device, checkpointing=checkpointing, offload=offload,
                                 chunk_size=chunk_size)
    return {
        "model": w.name, "config": config, "chunk_size": chunk_size, "model_data_bytes": md,
        "largest_module_params": largest, "non_model_peak_bytes": ample["non_model_peak_bytes"],
        "bound_bytes": bound, "bound_ratio": md / bound, "smallest_budget_bytes": budget,
        "ratio": md / budget, "budget_over_bound": budget / bound,
        "peaks_at_smallest": best["peaks"], "step_seconds_at_smallest": step_seconds,
        "step_seconds_ample": base_seconds, "step_time_cost": step_seconds / base_seconds,
        "h2d_bytes_at_smallest": best["h2d_bytes"], "activation_offload_bytes": best["activation_offload_bytes"],
        "max_abs_diff_from_adamw": max(r["max_abs_diff"] for r in ok_runs),
        "max_rel_diff_from_adamw": max(r["max_rel_diff"] for r in ok_runs),
        "budgets_tried": [(b, r["ok"]) for b, r in tried],
        "pressure_at_10x": pressure,
    }


def run_row(args, name: str, config: str, chunk: int, rel: float) -> dict:
    """One row in a fresh process: each trial builds an engine, and a process that built dozens
    would measure (and swap) what the earlier ones left behind."""
    cmd = [sys.executable, __file__, "--device", args.device, "--precision", str(rel), "--row", f"{name}:{config}:{chunk}"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if not line.startswith("ROW "):
            print(line, flush=True)
    row = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("ROW "))[4:])
    print(json.dumps({k: v for k, v in row.items() if k != "budgets_tried"}), flush=True)
    return row


def _pressure_cells(p: dict | None) -> str:
    if p is None:
        return "- | - | -"
    if not p["trains"]:
        return "refused | - | -"
    saved = p.get("saved_by_belady_bytes_per_step")
    return (f"**{p['cost']:.2f}** | {p['h2d_bytes_per_step'] / 2**20:.1f} / {p['d2h_bytes_per_step'] / 2**20:.1f} | "
            + ("LRU refused" if saved is None else f"{saved / 2**20:.1f}"))


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == name]
        labels = [r["config"] + ("" if r["chunk_size"] else "\n(searched chunk)") for r in mine]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r["bound_ratio"] for r in mine], 0.4, label="bound", color="#bbb")
        ax.bar([x + 0.2 for x in xs], [r["ratio"] for r in mine], 0.4, label="achieved", color="#27a")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("model data / device budget")
        ax.set_title(name)
        ax.legend()
    save_figure(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true", help="the 24-layer GPT only, coarser search")
    p.add_argument("--precision", type=float, default=None,
                   help="binary search stops at this share of the budget (default 0.005; 0.02 with --quick)")
    p.add_argument("--row", default=None, help=argparse.SUPPRESS)  # model:config:chunk, run by run_row
    p.add_argument("--reuse-log", default=None, help="take the rows an interrupted run printed to this log")
    args = p.parse_args()
    rel = args.precision if args.precision is not None else 0.02 if args.quick else 0.005
    workloads = [gpt_workload("gpt-24", 24, 4)]
    if not args.quick:
        workloads.append(llama_workload())
    if args.row is not None:  # one row, in a process of its own (see run_row)
        name, config, chunk = args.row.split(":")
        w = {"gpt-24": lambda: gpt_workload("gpt-24", 24, 4), "llama-24": llama_workload}[name]()
        want = reference(w, data(w, args.device), args.device)
        row = measure(w, args.device, config, chunk_size=int(chunk) if int(chunk) else None, rel_precision=rel,
                      want=want)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    rows = []
    done = {}  # rows printed by an earlier, interrupted run (--reuse-log)
    if args.reuse_log:
        for line in Path(args.reuse_log).read_text().splitlines():
            if line.startswith('{"model"') and '"config"' in line:
                r = json.loads(line)
                done[(r["model"], r["config"], r["chunk_size"] is None)] = r
    for w in workloads:
        for config, chunk in [(c, -1) for c in CONFIGS] + ([] if args.quick else [("checkpointing", 0)]):
            # chunk -1: the row chooses among the largest modules' sizes; 0: the searched default
            key = (w.name, config, chunk == 0)
            rows.append(done[key] if key in done else run_row(args, w.name, config, chunk, rel))
    medium = None
    if not args.quick:
        # The medium GPT at 40% of its model data, without checkpointing, searched chunk size.
        w = gpt_workload("gpt-medium", 8, 8, seq=32)
        batches = data(w, args.device)
        md = model_data_bytes(w.make(False))
        want = reference(w, batches, args.device)
        r = trial(w, batches, args.device, budget=int(0.4 * md), checkpointing=False, offload=False, chunk_size=None,
                  want=want)
        medium = {"model": w.name, "model_data_bytes": md, "budget_bytes": int(0.4 * md), "trains": r["ok"],
                  "peaks": r.get("peaks"), "max_abs_diff_from_adamw": r.get("max_abs_diff"), "error": r.get("error")}
        print(json.dumps(medium), flush=True)

    result = {"machine": machine_info(args.device), "steps": STEPS, "rows": rows, "medium_gpt_at_40_percent": medium,
              "command": command_line("bench_capacity.py"), "precision": rel}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"capacity_{args.device}" + ("_quick" if args.quick else "")
    (RESULTS / f"{stem}.json").write_text(json.dumps(result, indent=2))
    m = result["machine"]
    md_lines = [
        f"# Capacity: smallest device budget that trains, against the bound (placement auto, device {args.device})",
        "",
        f"{m['date']} on {m['cpu']} ({m['cores']} cores, torch {m['torch']}). {STEPS} steps per trial, every step's "
        f"measured peak under the budget; binary search to {rel:.1%}. Chunk size: of the three largest modules' "
        f"parameter counts, the one whose warm-up plans the least. Bound = warm-up non-model peak + the largest "
        f"module's parameters and gradients + buffers. Step-time cost = mean step time (after the warm-up) at the "
        f"smallest budget / the same model without checkpointing or offload and no budget. |Δ AdamW| = the largest absolute difference of any parameter from fused "
        f"torch AdamW over every budget that trained. Pressure cost at {PRESSURE_RATIO}x = mean step time at "
        f"model data / {PRESSURE_RATIO} / the same configuration and chunk size at 4x model data, which holds "
        f"everything (on the CPU both run the allocation monitor) ({PRESSURE_STEPS} "
        f"steps after the warm-up, the better of two alternated runs each); '-' where the model does not train "
        f"at {PRESSURE_RATIO}x. Saved by Belady = h2d+d2h per step of the same budget evicting the least recently "
        f"used group first, less the Belady order's.",
        "",
        f"Command: `{result['command']}`",
        "",
        "| model | config | chunk size | model data MiB | bound MiB | bound ratio | smallest budget MiB | ratio | "
        f"budget / bound | step-time cost | pressure cost at {PRESSURE_RATIO}x | h2d / d2h MiB/step at {PRESSURE_RATIO}x | "
        "saved by Belady over LRU MiB/step | activations offloaded MiB/step | max abs Δ AdamW |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        md_lines.append(
            f"| {r['model']} | {r['config']} | {r['chunk_size'] or 'searched'} | {r['model_data_bytes'] / 2**20:.1f} | "
            f"{r['bound_bytes'] / 2**20:.2f} | {r['bound_ratio']:.1f}x | {r['smallest_budget_bytes'] / 2**20:.2f} | "
            f"**{r['ratio']:.1f}x** | {r['budget_over_bound']:.3f} | {r['step_time_cost']:.2f} | "
            f"{_pressure_cells(r.get('pressure_at_10x'))} | "
            f"{r['activation_offload_bytes'] / 2**20:.2f} | {r['max_abs_diff_from_adamw']:.1e} |")
    if medium is not None:
        md_lines += ["", f"Medium GPT (d 256, 8 layers, batch 8, ctx 32, no checkpointing, searched chunk size) at 40% of its "
                         f"model data ({medium['budget_bytes'] / 2**20:.1f} MiB): "
                         f"{'trains' if medium['trains'] else 'refused: ' + str(medium['error'])}"
                         + (f", peaks {[round(p / 2**20, 2) for p in medium['peaks']]} MiB, max abs Δ AdamW "
                            f"{medium['max_abs_diff_from_adamw']:.1e}" if medium['trains'] else "") + "."]
    (RESULTS / f"{stem}.md").write_text("\n".join(md_lines) + "\n")
    print("\n".join(md_lines))
    plot(rows, RESULTS / f"{stem}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
