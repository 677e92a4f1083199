"""Step time when the input shape changes every step (dynamic padding, token-budget batches), under placement auto.

    python benchmarks/bench_dynamic_shapes.py                      # the CPU standing in for the device
    python benchmarks/bench_dynamic_shapes.py --batching tokens    # batches cut to a token budget
    python benchmarks/bench_dynamic_shapes.py --device cuda        # on a GPU

A loader that pads each batch to its longest sequence gives the model a new input shape nearly
every step. Auto's plan was traced on one shape; it used to trace again at every change, so such
a run was one warm-up after another (every group released, as placement cpu, plus the tracing)
and its plan never ran. Now a plan traced on longer inputs covers shorter ones ([Note: a trace
covers smaller inputs] in tracer/signature.py). A loader that cuts batches to a token budget
(``--batching tokens``: batch x sequence of 1 x C, 2 x C/2 or 4 x C/4) gives shapes none of which
covers another: each new one replaced the plan in force, so every change was traced; now the last
plans are kept and each shape is traced once ([Note: plans kept per input signature]). Side by
side, one step each in turn on the same sequence of shapes (drawn once, seeded):

- plain PyTorch with fused AdamW, everything on the device (no budget): the compute itself;
- gemini auto under a budget (the largest non-model peak of any shape plus 40% of the model data);
- the same with one plan at a time (the behaviour before plans were kept);
- the same, tracing again at every new shape (the behaviour before covering);
- gemini placement cpu under the same budget (what a warm-up moves).
(The last three are counterfactuals patched in here, not settings.)

Each row: the median step, how many steps were traced, the bytes moved host-to-device per step
(median), and the largest measured device peak against the budget.
Writes benchmarks/results/dynamic_shapes_<device>_<size>[_tokens].json and .md (``--size`` small,
medium or 55m: bench_step.py's GPTs; its batch is the padded batch and 1 x C's multiplier).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gemini  # noqa: E402
from bench_step import SIZES, machine_info, write_results  # noqa: E402
from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402
from tracer import TracedInputs, input_signature  # noqa: E402
from tracer.signature import PlanChoice  # noqa: E402


class _TracesEveryChange(TracedInputs):
    """The behaviour before covering: any other input signature is traced again."""

    def choose(self, args, kwargs, *, planned: bool) -> PlanChoice:
        self.covered = None
        return PlanChoice(trace=input_signature(args, kwargs) != self.signature)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Contender:
    def __init__(self, name: str, cfg: GPTConfig, device: str, *, placement: str | None, budget: int,
                 chunk_size: int, traced_inputs: TracedInputs | None = None) -> None:
        self.name, self.device, self.budget = name, device, budget
        torch.manual_seed(0)
        model = GPT(cfg)
        if placement is None:
            self.model = model.to(device)
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
            self.gemini = False
        else:
            ratio = 1.0 if placement == "auto" else 0.0
            config = gemini.GeminiConfig(device=device, placement=placement, device_memory=budget,
                                         chunk_size=chunk_size, gpu_margin_mem_ratio=ratio)
            self.model, self.opt = gemini.initialize(model, config, lr=1e-4)
            if traced_inputs is not None:
                self.opt._rt.traced_inputs = traced_inputs
            self.gemini = True
        self.times: list[float] = []
        self.traced = 0
        self.h2d: list[int] = []
        self.peak = 0

    def step(self, x: torch.Tensor, y: torch.Tensor, *, timed: bool) -> None:
        _sync(self.device)
        start = time.perf_counter()
        loss = GPT.loss(self.model(x), y)
        (self.opt.backward(loss) if self.gemini else loss.backward())
        self.opt.step()
        self.opt.zero_grad()
        _sync(self.device)
        seconds = time.perf_counter() - start
        if not self.gemini:
            if timed:
                self.times.append(seconds)
            return
        report = self.opt.report
        self.traced += report.timeline is not None
        self.peak = max(self.peak, report.device_peak_bytes)
        if timed:
            self.times.append(seconds)
            self.h2d.append(report.h2d_bytes)

    def row(self) -> dict:
        row = {"contender": self.name, "median_step_s": statistics.median(self.times), "min_step_s": min(self.times),
               "steps_timed": len(self.times)}
        if self.gemini:
            row.update(steps_traced=self.traced, median_h2d_bytes=int(statistics.median(self.h2d)),
                       device_peak_bytes=self.peak, budget_bytes=self.budget, under_budget=self.peak <= self.budget)
        return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--size", default="medium", choices=list(SIZES), help="bench_step's GPT sizes and batches")
    p.add_argument("--steps", type=int, default=24, help="timed steps, after 2 untimed")
    p.add_argument("--lengths", default=None,
                   help="the sequence lengths a batch is padded to (default 5/8, 6/8, 7/8 and all of the context)")
    p.add_argument("--batching", default="padded", choices=["padded", "tokens"],
                   help="padded: the batch padded to one of --lengths; tokens: 1, 2 or 4 times the batch "
                        "of the context, a half or a quarter of it")
    p.add_argument("--chunk-size", type=int, default=2**17)
    p.add_argument("--out", default=None, help="result file stem (default dynamic_shapes_<device>_<size>[_tokens])")
    args = p.parse_args()
    fields, args.batch, context = SIZES[args.size]
    cfg = GPTConfig(**fields)
    if args.batching == "tokens":
        shapes = [(args.batch * k, context // k) for k in (1, 2, 4)]
    else:
        lengths = ([int(n) for n in args.lengths.split(",")] if args.lengths
                   else [context * k // 8 for k in (5, 6, 7, 8)])
        shapes = [(args.batch, n) for n in lengths]
    rng = random.Random(0)
    drawn = [rng.choice(shapes) for _ in range(args.steps + 2)]
    g = torch.Generator().manual_seed(1)
    data = [synthetic_batch(cfg, batch, seq, generator=g, device=args.device) for batch, seq in drawn]

    # The budget: what auto's warm-up of the hungriest shape plans for besides the model data
    # (its non-model peak, buffers and safety reserve), with 10% to spare, plus 40% of the model
    # data. Probed after one warm-up: the later ones run after the device's one-time allocations
    # (cuBLAS's workspace), as every contender's will; on the GPU a probe under placement cpu,
    # whose first step measured the non-model peak alone, left auto's warm-up 55 MB short (H200,
    # 2026-11-26).
    plans = []
    for batch, seq in [shapes[-1]] + shapes:
        probe = Contender("probe", cfg, args.device, placement="auto", budget=2**40, chunk_size=args.chunk_size)
        probe.step(*synthetic_batch(cfg, batch, seq, generator=g, device=args.device), timed=False)
        plans.append(probe.opt._rt.plan)
        probe.opt.close()
        del probe
    plan = max(plans[1:], key=lambda p: p.max_non_model_bytes)
    model_bytes = 16 * cfg.num_params()
    budget = int(plan.max_non_model_bytes * 1.1 + plan.fixed_bytes + plan.reserve_bytes + 0.4 * model_bytes + 2**20)

    contenders = [
        Contender("torch AdamW(fused), no budget", cfg, args.device, placement=None, budget=0, chunk_size=0),
        Contender("gemini auto (plans kept; smaller inputs on a larger trace's plan)", cfg, args.device,
                  placement="auto", budget=budget, chunk_size=args.chunk_size),
        Contender("gemini auto, one plan at a time (before plans were kept)", cfg, args.device, placement="auto",
                  budget=budget, chunk_size=args.chunk_size, traced_inputs=TracedInputs(capacity=1)),
        Contender("gemini auto, traced at every new shape (before covering)", cfg, args.device, placement="auto",
                  budget=budget, chunk_size=args.chunk_size, traced_inputs=_TracesEveryChange()),
        Contender("gemini cpu", cfg, args.device, placement="cpu", budget=budget, chunk_size=args.chunk_size),
    ]
    for i, (x, y) in enumerate(data):
        for c in contenders:
            c.step(x, y, timed=i >= 2)
    rows = [c.row() for c in contenders]
    base = rows[0]["median_step_s"]
    info = machine_info(args.device)
    n_params = cfg.num_params()
    model_name = (f"GPT d{cfg.n_embd} L{cfg.n_layer} H{cfg.n_head} ctx{cfg.block_size} "
                  f"({n_params / 1e6:.1f}M parameters)")
    result = {"machine": info, "size": args.size, "model": model_name, "batching": args.batching,
              "shapes": drawn, "budget_bytes": budget, "model_bytes": model_bytes, "rows": rows}
    title = "Dynamic sequence lengths" if args.batching == "padded" else "Batches cut to a token budget"
    lines = [f"# {title}, device {args.device}", "",
             f"{info['date']} on {info['cpu']} ({info['cores']} cores, torch {info['torch']})"
             + (f", {info.get('gpu')}" if args.device == "cuda" else "") + ".", "",
             f"Command: `python benchmarks/bench_dynamic_shapes.py --device {args.device} --size {args.size} "
             f"--steps {args.steps} --batching {args.batching}`", "",
             f"{model_name}, {model_bytes / 2**20:.0f} MiB of model data, each step's batch x sequence one of "
             f"{[f'{b}x{n}' for b, n in shapes]} (seeded); budget {budget / 2**20:.1f} MiB (the hungriest shape's "
             f"activations plus 40% of the model data). One step of each contender in turn; medians of "
             f"{args.steps} steps after 2.", "",
             "| contender | median step s | / torch | steps traced | h2d MiB / step (median) | peak / budget |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "steps_traced" in r:
            extra = (f"{r['steps_traced']} of {args.steps + 2} | {r['median_h2d_bytes'] / 2**20:.1f} | "
                     f"{r['device_peak_bytes'] / r['budget_bytes']:.3f}")
        else:
            extra = "- | - | -"
        lines.append(f"| {r['contender']} | {r['median_step_s']:.4f} | {r['median_step_s'] / base:.2f} | {extra} |")
    stem = f"dynamic_shapes_{args.device}_{args.size}" + ("_tokens" if args.batching == "tokens" else "")
    write_results(args.out or stem, result, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
