"""The planner against training: predicted peaks, bytes per tier and verdicts, cell by cell.

    python benchmarks/bench_plan.py                  # the CPU standing in for the device
    python benchmarks/bench_plan.py --device cuda    # on a GPU
    python benchmarks/bench_plan.py --quick          # the small GPT only

For each model (a small GPT d 128 L4 batch 8x64, the medium GPT d 256 L8 batch 8x64 with tied
embeddings, and a transformers LlamaForCausalLM), each placement (cuda, cpu, static with half
the parameters and optimizer states on the device, auto at gpu_margin_mem_ratio 0, 0.5 and 1)
and each device budget (fractions of the model's predicted peak under placement cuda), it
plans with ``gemini.plan_placement(meta_model, config, example_inputs=, loss_fn=)`` on the meta
device, then trains ``STEPS`` steps of the real model in a fresh process and compares:

- the predicted device peak with the measured peak of every step (the first step with
  ``first_step_peak_bytes``, the others with ``device_peak_bytes``): goal within 10%;
- the plan's bytes per tier and chunk kind with ``MemoryReport.model_bytes_by_tier`` after the
  last step: goal exact;
- the plan's verdict (fits) with what training did (every step trained, or a
  ``DeviceBudgetError``): goal agreement in every cell.

Writes benchmarks/results/plan_<device>.json and .md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemini  # noqa: E402
from bench_step import RESULTS, command_line, machine_info  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig  # noqa: E402
from gemini.engine.memory import DeviceBudgetError  # noqa: E402

STEPS = 3
TOLERANCE = 0.10
PLACEMENTS = {  # name -> GeminiConfig fields
    "cuda": dict(placement="cuda"),
    "cpu": dict(placement="cpu"),
    "static": dict(placement="static", static_param_device_fraction=0.5, static_optimizer_offload_fraction=0.5),
    "auto r0": dict(placement="auto", gpu_margin_mem_ratio=0.0),
    "auto r0.5": dict(placement="auto", gpu_margin_mem_ratio=0.5),
    "auto r1": dict(placement="auto", gpu_margin_mem_ratio=1.0),
}
# Budgets as fractions of the model's predicted peak under placement cuda (its most): too small
# for anything, room for fetching but not for everything, about everything, everything twice.
BUDGET_FRACTIONS = (0.4, 0.7, 1.05, 2.0)


def _gpt(layers: int, embd: int, heads: int):
    cfg = GPTConfig(vocab_size=1024, block_size=64, n_layer=layers, n_head=heads, n_embd=embd)
    return lambda: GPT(cfg), 1024


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                      attn_implementation="sdpa")
    return lambda: LlamaForCausalLM(cfg), 1024


MODELS = {  # name -> (builder name, args, batch, seq)
    "gpt-small (d128 L4)": ("gpt", (4, 128, 4), 8, 64),
    "gpt-medium (d256 L8)": ("gpt", (8, 256, 8), 8, 64),
    "llama (d256 L4, GQA)": ("llama", (), 4, 64),
}


def _model_fn(name: str):
    kind, args, _, _ = MODELS[name]
    return _gpt(*args) if kind == "gpt" else _llama()


def _logits(output):
    return output if isinstance(output, torch.Tensor) else output.logits


def _loss(output, targets):
    logits = _logits(output)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def _batch(name: str, device: str):
    _, _, batch, seq = MODELS[name]
    _, vocab = _model_fn(name)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def _plan(name: str, config: gemini.GeminiConfig) -> tuple[gemini.PlacementPlan, float]:
    make, _ = _model_fn(name)
    with torch.device("meta"):
        meta_model = make()
    x, y = _batch(name, "cpu")
    y_meta = y.to("meta")
    start = time.perf_counter()
    plan = gemini.plan_placement(meta_model, config, example_inputs=((tuple(x.shape), x.dtype),),
                                 loss_fn=lambda out: _loss(out, y_meta))
    return plan, time.perf_counter() - start


def _train(name: str, config: gemini.GeminiConfig) -> dict:
    """``STEPS`` real steps (run in a fresh process: an engine's memory is not given back)."""
    make, _ = _model_fn(name)
    torch.manual_seed(0)
    try:
        model, opt = gemini.initialize(make(), config, lr=1e-3)
    except (ValueError, gemini.DeviceBudgetError) as e:  # refused before the first step: its chunks do not fit
        return dict(peaks=[], error=f"initialize: {str(e).splitlines()[0][:160]}", tiers=None, os_on_device=None)
    x, y = _batch(name, str(config.resolved_device()))
    peaks, error, tiers, os_on_device = [], None, None, None
    try:
        for _ in range(STEPS):
            opt.backward(_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            peaks.append(opt.report.device_peak_bytes)
        tiers, os_on_device = opt.report.model_bytes_by_tier, opt.report.os_chunks_on_device
    except DeviceBudgetError as e:
        error = f"step {len(peaks)}: {str(e).splitlines()[0][:160]}"
    finally:
        opt.close()
    return dict(peaks=peaks, error=error, tiers=tiers, os_on_device=os_on_device)


def _cell(name: str, placement: str, budget: int, device: str, pool) -> dict:
    config = gemini.GeminiConfig(device=device, device_memory=budget, **PLACEMENTS[placement])
    plan, plan_seconds = _plan(name, config)
    run = pool.submit(_train, name, config).result()
    predicted = [plan.first_step_peak_bytes] + [plan.device_peak_bytes] * (STEPS - 1)
    errors = [m / p - 1 for m, p in zip(run["peaks"], predicted)]
    trained = run["error"] is None
    return dict(
        model=name, placement=placement, budget_bytes=budget, plan_ms=round(1000 * plan_seconds, 1),
        plan_fits=plan.fits, trained=trained, verdict_agrees=plan.fits == trained, error=run["error"],
        predicted_first_step_peak_bytes=plan.first_step_peak_bytes, predicted_peak_bytes=plan.device_peak_bytes,
        measured_peaks_bytes=run["peaks"], peak_errors=[round(e, 4) for e in errors],
        peaks_within_tolerance=all(abs(e) <= TOLERANCE for e in errors),
        tiers_exact=None if run["tiers"] is None else run["tiers"] == plan.model_bytes_by_tier,
        planned_os_on_device=plan.os_groups_on_device, measured_os_on_device=run["os_on_device"],
        margin_bytes=plan.margin_bytes, problems=plan.problems,
    )


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _markdown(results: dict) -> str:
    info = results["machine"]
    lines = [
        f"# Planner vs training ({info['device']}, {info['date']})",
        "",
        f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}. `{results.get('command', 'python benchmarks/bench_plan.py')}`. "
        f"{STEPS} steps a cell; peaks in MiB; "
        f"error = measured / predicted - 1 per step (the first step against the plan's first-step peak).",
        "",
        "| model | placement | budget | plan fits | trained | agree | predicted (1st, later) | measured per step "
        "| worst error | tiers exact | OS groups plan/run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in results["cells"]:
        worst = max(c["peak_errors"], key=abs, default=None)
        lines.append(
            f"| {c['model']} | {c['placement']} | {_mib(c['budget_bytes'])} | {'yes' if c['plan_fits'] else 'no'} | "
            f"{'yes' if c['trained'] else 'no'} | {'yes' if c['verdict_agrees'] else '**NO**'} | "
            f"{_mib(c['predicted_first_step_peak_bytes'])}, {_mib(c['predicted_peak_bytes'])} | "
            f"{', '.join(_mib(p) for p in c['measured_peaks_bytes']) or '-'} | "
            f"{'-' if worst is None else f'{100 * worst:+.1f}%'} | "
            f"{'-' if c['tiers_exact'] is None else ('yes' if c['tiers_exact'] else '**NO**')} | "
            f"{c['planned_os_on_device']}/{'-' if c['measured_os_on_device'] is None else c['measured_os_on_device']} |")
    s = results["summary"]
    lines += [
        "",
        f"**{s['cells']} cells**: verdict agrees in {s['verdict_agrees']}; every step's peak within "
        f"{100 * TOLERANCE:.0f}% in {s['peaks_within_tolerance']} of the {s['trained']} that trained (worst "
        f"{100 * s['worst_peak_error']:+.1f}%); bytes per tier exact in {s['tiers_exact']} of {s['trained']}; "
        f"planning took {s['plan_ms_median']:.0f} ms (median).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="compute device (default: cpu, the stand-in)")
    parser.add_argument("--quick", action="store_true", help="the small GPT only")
    args = parser.parse_args(argv)
    names = list(MODELS)[:1] if args.quick else list(MODELS)
    cells = []
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context, max_tasks_per_child=1) as pool:
        for name in names:
            probe, _ = _plan(name, gemini.GeminiConfig(device=args.device, placement="cuda", device_memory="1TiB"))
            for fraction in BUDGET_FRACTIONS:
                budget = int(fraction * probe.device_peak_bytes)
                for placement in PLACEMENTS:
                    cell = _cell(name, placement, budget, args.device, pool)
                    cells.append(cell)
                    worst = max(cell["peak_errors"], key=abs, default=0.0)
                    print(f"{name:22s} {placement:9s} {_mib(budget):>8s} MiB  plan {'fits' if cell['plan_fits'] else 'NO  '}"
                          f"  trained {'yes' if cell['trained'] else 'no '}  worst peak error {100 * worst:+5.1f}%"
                          f"  tiers exact {cell['tiers_exact']}", flush=True)
    trained = [c for c in cells if c["trained"]]
    summary = dict(
        cells=len(cells), verdict_agrees=sum(c["verdict_agrees"] for c in cells), trained=len(trained),
        peaks_within_tolerance=sum(c["peaks_within_tolerance"] for c in trained),
        worst_peak_error=max((e for c in trained for e in c["peak_errors"]), key=abs, default=0.0),
        tiers_exact=sum(bool(c["tiers_exact"]) for c in trained),
        plan_ms_median=sorted(c["plan_ms"] for c in cells)[len(cells) // 2],
    )
    results = dict(machine=machine_info(args.device), command=command_line("bench_plan.py"),
                   steps=STEPS, tolerance=TOLERANCE, summary=summary, cells=cells)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / (f"plan_{args.device}" + ("_quick" if args.quick else ""))  # the full run's results stay
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(results))
    print(_markdown(results).splitlines()[-1])
    print(f"wrote {out}.json and .md")
    ok = summary["verdict_agrees"] == len(cells) and summary["peaks_within_tolerance"] == len(trained) \
        and summary["tiers_exact"] == len(trained)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
