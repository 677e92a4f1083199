"""What each rank runs in tests/test_zero_loop.py: a ZeRO training loop's budget over later steps,
writes into the parameters between steps, and the report's counters. Model and data are
tests/zero_workers.py's."""

from __future__ import annotations

import torch

import gemini
from gemini.errors import DeviceBudgetError
from zero_workers import local, loss_fn, make_data, make_net

CHUNK = 600


def _zero3_auto(budget: int):
    """ZeRO-3 under placement auto with ``budget`` as device_memory: (model, optimizer)."""
    cfg = gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=CHUNK, shard_params=True,
                              device_memory=budget)
    return gemini.initialize(make_net(), cfg, lr=1e-2, weight_decay=0.01)


def _train_until_refused(model, opt, rank: int, world: int, steps: int) -> dict:
    """Train up to ``steps`` steps: the step (from 0) a DeviceBudgetError came at (None: none
    did) with its message, and each landed step's state and measured peak."""
    out = {"failed_at": None, "message": "", "states": [], "peaks": []}
    for step, batch in enumerate(make_data(steps)):
        x, y = local(batch, rank, world)
        try:
            opt.backward(loss_fn(model(x), y))
            opt.step()
        except DeviceBudgetError as e:
            out["failed_at"], out["message"] = step, str(e)
            break
        opt.zero_grad()
        out["states"].append(model.state_dict())
        out["peaks"].append(opt.report.device_peak_bytes)
    return out


def run_budgets(rank: int, world: int, budgets: list[int], steps: int, out_dir: str) -> None:
    """ZeRO-3 under auto at each budget: per budget, :func:`_train_until_refused`'s record."""
    results = {}
    for budget in budgets:
        model, opt = _zero3_auto(budget)
        results[budget] = _train_until_refused(model, opt, rank, world, steps)
        opt.close()
    torch.save(results, f"{out_dir}/budgets_rank{rank}.pt")


def run_counters(rank: int, world: int, out_dir: str, steps: int) -> None:
    """ZeRO-2 and ZeRO-3 under placement cpu: per step, the report and what the all-gathers that
    torch.distributed ran moved (counted around the collective itself, independently of the
    engine's counters): calls, bytes gathered, bytes of this rank's input."""
    import gemini.parallel.collectives as collectives

    seen = {"calls": 0, "out": 0, "in": 0}
    real = collectives._all_gather

    def counting(out, inp, **kwargs):
        seen["calls"] += 1
        seen["out"] += out.numel() * out.element_size()
        seen["in"] += inp.numel() * inp.element_size()
        return real(out, inp, **kwargs)

    collectives._all_gather = counting  # this rank's process only
    results = {}
    for shard in (False, True):
        cfg = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=CHUNK, shard_params=shard)
        model, opt = gemini.initialize(make_net(), cfg, lr=1e-2, weight_decay=0.01)
        per_step = []
        for batch in make_data(steps):
            x, y = local(batch, rank, world)
            seen.update({"calls": 0, "out": 0, "in": 0})
            opt.backward(loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
            per_step.append({"report": opt.report.to_dict(), "gathers": dict(seen)})
        results[3 if shard else 2] = per_step
        opt.close()
    torch.save(results, f"{out_dir}/counters_rank{rank}.pt")


def run_zero3_writes(rank: int, world: int, out_dir: str, steps: int) -> None:
    """ZeRO-3 between steps 0 and 1: an in-place write (lost on the empty stand-in) is refused at the
    next forward; assigning ``p.data`` trains as the write would in one process."""
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=CHUNK, shard_params=True)
    net = make_net()
    model, opt = gemini.initialize(net, cfg, lr=1e-2, weight_decay=0.01)
    x, y = local(make_data(1)[0], rank, world)
    opt.backward(loss_fn(model(x), y))
    opt.step()
    opt.zero_grad()
    before = model.state_dict()
    with torch.no_grad():
        net.hidden.weight.mul_(0.5)
    try:
        model(x)
        message = ""
    except RuntimeError as e:
        message = str(e)
    out = {"message": message, "before": before, "after_refusal": model.state_dict()}
    opt.close()
    net = make_net()  # the same run again, the write as an assignment
    model, opt = gemini.initialize(net, cfg, lr=1e-2, weight_decay=0.01)
    out["states"] = []
    for step, batch in enumerate(make_data(steps)):
        x, y = local(batch, rank, world)
        opt.backward(loss_fn(model(x), y))
        opt.step()
        opt.zero_grad()
        if step == 0:
            net.hidden.weight.data = model.state_dict()["hidden.weight"] * 0.5
        out["states"].append(model.state_dict())
    opt.close()
    torch.save(out, f"{out_dir}/writes_rank{rank}.pt")


def run_one_rank_short(rank: int, world: int, budgets: list[int], steps: int, out_dir: str) -> None:
    """ZeRO-3 under auto with ``budgets[rank]`` as this rank's device_memory:
    :func:`_train_until_refused`'s record, and whether the parameters were still the initial
    ones after a refusal."""
    model, opt = _zero3_auto(budgets[rank])
    initial = model.state_dict()
    out = _train_until_refused(model, opt, rank, world, steps)
    if out["failed_at"] is not None:
        after = model.state_dict()
        out["unchanged"] = all(torch.equal(after[k], initial[k]) for k in initial)
    opt.close()
    torch.save(out, f"{out_dir}/short_rank{rank}.pt")


# Rows of each rank's batch per step: each rank's longest batch comes at another step, so a rank's
# inputs outgrow its trace while the other's are covered (see [Note: ranks trace together]).
UNEVEN_ROWS = ((4, 2, 4, 2, 3), (2, 4, 2, 3, 4))


def uneven_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: the first UNEVEN_ROWS[rank][step] rows of its part."""
    x, y = local(make_data(len(UNEVEN_ROWS[0]))[step], rank, world)
    n = UNEVEN_ROWS[rank][step]
    return x[:n], y[:n]


def run_uneven_batches(rank: int, world: int, out_dir: str) -> None:
    """ZeRO-2 and ZeRO-3 under auto, the ranks' batches of different sizes: per step, whether
    this rank traced, its measured peak, and the parameters."""
    results = {}
    for shard in (False, True):
        cfg = gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=CHUNK, shard_params=shard,
                                  device_memory=200_000)
        model, opt = gemini.initialize(make_net(), cfg, lr=1e-2, weight_decay=0.01)
        out = {"traced": [], "peaks": [], "states": []}
        for step in range(len(UNEVEN_ROWS[0])):
            x, y = uneven_batch(step, rank, world)
            opt.backward(loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
            out["traced"].append(opt.report.timeline is not None)
            out["peaks"].append(opt.report.device_peak_bytes)
            out["states"].append(model.state_dict())
        results[3 if shard else 2] = out
        opt.close()
    torch.save(results, f"{out_dir}/uneven_rank{rank}.pt")


class TwoTaskNet(torch.nn.Module):
    """A shared layer and a head per task (tests/test_auto_kept_plans.py's idea on ZeRO's data)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(16, 32)
        self.a = torch.nn.Linear(32, 4)
        self.b = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return getattr(self, task)(torch.nn.functional.gelu(self.inp(x)))


def make_two_task_net() -> TwoTaskNet:
    torch.manual_seed(0)
    return TwoTaskNet()


def task_of(step: int, rank: int) -> str:
    """The ranks take the tasks in turn, in opposite phase."""
    return "a" if (step + rank) % 2 == 0 else "b"


TASK_STEPS = 5


def run_alternating_tasks(rank: int, world: int, out_dir: str) -> None:
    """ZeRO-2 under auto, each rank's task changing every step ([Note: plans kept per input
    signature]): per step, whether this rank traced, and the parameters."""
    cfg = gemini.GeminiConfig(device="cpu", placement="auto", chunk_size=CHUNK, device_memory="64MiB")
    model, opt = gemini.initialize(make_two_task_net(), cfg, lr=1e-2, weight_decay=0.01)
    out = {"traced": [], "states": []}
    for step, batch in enumerate(make_data(TASK_STEPS)):
        x, y = local(batch, rank, world)
        opt.backward(loss_fn(model(x, task_of(step, rank)), y))
        opt.step()
        opt.zero_grad()
        out["traced"].append(opt.report.timeline is not None)
        out["states"].append(model.state_dict())
    opt.close()
    torch.save(out, f"{out_dir}/tasks_rank{rank}.pt")


PLANNED = [(placement, shard) for placement in ("cuda", "cpu", "auto") for shard in (False, True)]


def run_planned_peaks(rank: int, world: int, out_dir: str) -> None:
    """Per (placement, shard_params) of PLANNED: plan_placement's predicted device peak for this
    rank (asked inside the process group, with example inputs) and the peaks of 3 real steps."""
    from gemini.tools.gpt import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=4, n_head=2, n_embd=64)
    out = {}
    for placement, shard in PLANNED:
        config = gemini.GeminiConfig(device="cpu", placement=placement, chunk_size=8192, shard_params=shard,
                                     device_memory="64MiB")
        with torch.device("meta"):
            meta = GPT(cfg)
        target = torch.empty(4, 32, dtype=torch.long, device="meta")
        plan = gemini.plan_placement(meta, config, example_inputs=(((4, 32), torch.long),),
                                     loss_fn=lambda logits: GPT.loss(logits, target))
        torch.manual_seed(0)
        model, opt = gemini.initialize(GPT(cfg), config, lr=1e-2)
        g = torch.Generator().manual_seed(rank)
        peaks = []
        for _ in range(3):
            x, y = synthetic_batch(cfg, 4, 32, generator=g)
            opt.backward(GPT.loss(model(x), y))
            del x, y
            opt.step()
            opt.zero_grad()
            peaks.append(opt.report.device_peak_bytes)
        opt.close()
        out[f"{placement}-{int(shard)}"] = {"first": plan.first_step_peak_bytes, "later": plan.device_peak_bytes,
                                            "peaks": peaks}
    torch.save(out, f"{out_dir}/planned_rank{rank}.pt")


def run_state_dict_on_rank0_first(rank: int, world: int, out_dir: str, late_seconds: float) -> None:
    """A DDP habit under ZeRO-2: ``optimizer.state_dict()`` inside ``if rank == 0``. Here rank 1
    calls it ``late_seconds`` later (as another collective of the user's would release it), so
    the run ends; rank 0 records what gemini logged while it waited."""
    import logging
    import time

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("gemini.parallel.watchdog").addHandler(handler)
    model, opt = gemini.initialize(make_net(), gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=CHUNK),
                                   lr=1e-2)
    x, y = local(make_data(1)[0], rank, world)
    opt.backward(loss_fn(model(x), y))
    opt.step()
    if rank == 1:
        time.sleep(late_seconds)
    state = opt.state_dict()
    try:
        with model.join():  # DDP's uneven inputs: refused under ZeRO, before anything runs
            pass
        join = ""
    except RuntimeError as e:
        join = str(e)
    torch.save({"records": records, "steps": sorted(float(s["step"]) for s in state["state"].values()), "join": join},
               f"{out_dir}/waits_rank{rank}.pt")
