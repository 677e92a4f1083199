"""What each rank runs in tests/test_zero_agreement.py: ranks that start apart (different
seeds, configurations or models) and ranks that share one report path."""

from __future__ import annotations

import torch
from torch import nn

import gemini
import zero_workers as zw

CHUNK = 600


def net_with_buffer(seed: int) -> zw.Net:
    """``zw.make_net(seed)`` with a buffer whose value says which seed built it."""
    net = zw.make_net(seed)
    net.register_buffer("offset", torch.full((4,), float(seed)))
    return net


def run_seeded_apart(rank: int, world: int, out_dir: str, steps: int) -> None:
    """Each rank builds its model from its own seed (no common torch.manual_seed): per case, the
    state at initialize and after each step."""
    cases = {"zero2": {}, "zero3": {"shard_params": True}, "bf16-zero3": {"precision": "bf16", "shard_params": True},
             "auto-zero2": {"placement": "auto", "device_memory": "256MiB"}}
    for name, fields in cases.items():
        cfg = gemini.GeminiConfig(**{"device": "cpu", "placement": "cpu", "chunk_size": CHUNK, **fields})
        model, opt = gemini.initialize(net_with_buffer(seed=rank), cfg, lr=1e-2, weight_decay=0.01)
        init = model.state_dict()
        states = [] if fields.get("precision") else zw.train_gemini(model, opt, zw.make_data(steps), rank, world,
                                                                    steps)[0]
        torch.save({"init": init, "states": states}, f"{out_dir}/{name}_rank{rank}.pt")
        opt.close()


# Per case: what rank 1 does differently from rank 0.
MISMATCHES = {
    "chunk_size": lambda rank: ({"chunk_size": 800 if rank else 600}, zw.make_net()),
    "extra layer": lambda rank: ({}, nn.Sequential(zw.make_net(), *([nn.Linear(4, 4)] if rank else []))),
    "precision": lambda rank: ({"precision": "bf16" if rank else "fp32"}, zw.make_net()),
    "shard_params": lambda rank: ({"shard_params": bool(rank)}, zw.make_net()),
}


def run_mismatches(rank: int, world: int, out_dir: str) -> None:
    """Each case of MISMATCHES initialized (then, if that returned, one step): the error's text."""
    got = {}
    for name, make in MISMATCHES.items():
        fields, net = make(rank)
        cfg = gemini.GeminiConfig(**{"device": "cpu", "placement": "cpu", "chunk_size": CHUNK, **fields})
        try:
            model, opt = gemini.initialize(net, cfg, lr=1e-2)
        except ValueError as e:
            got[name] = str(e)
            continue
        x, y = zw.local(zw.make_data(1)[0], rank, world)
        opt.backward(zw.loss_fn(model(x), y))  # the unchecked run: gloo aborts the process here
        opt.step()
        got[name] = None
    torch.save(got, f"{out_dir}/mismatch_rank{rank}.pt")


def run_shared_report_path(rank: int, world: int, path: str, steps: int) -> None:
    """Both ranks given one report_path, as one GeminiConfig for every rank gives it."""
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=CHUNK, report_path=path)
    model, opt = gemini.initialize(zw.make_net(), cfg, lr=1e-2)
    zw.train_gemini(model, opt, zw.make_data(steps), rank, world, steps)


class RaisingNet(zw.Net):
    """``zw.Net`` whose forward raises inside the model while ``fail`` is set."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.fail:
            raise RuntimeError("a bad sample on this rank")
        return out


def run_uneven_iterations(rank: int, world: int, out_dir: str, case: str, steps: int) -> None:
    """Rank 1's iteration 1 goes its own way: ``skip_backward``: it calls step() without a
    backward; ``forward_error``: its forward raises and the loop goes on, as after a bad sample.
    Per iteration: the consolidated state, or the error's text (the loop stops at one of gemini's)."""
    torch.manual_seed(0)
    net = RaisingNet()
    model, opt = gemini.initialize(net, gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=CHUNK),
                                   lr=1e-2, weight_decay=0.01)
    got = []
    for step, batch in enumerate(zw.make_data(steps)):
        odd = rank == 1 and step == 1
        net.fail = odd and case == "forward_error"
        x, y = zw.local(batch, rank, world)
        try:
            if not (odd and case == "skip_backward"):
                opt.backward(zw.loss_fn(model(x), y))
            opt.step()
        except RuntimeError as e:
            got.append(str(e))
            opt.zero_grad()
            if "out of step" in str(e):
                break
            continue
        opt.zero_grad()
        got.append(model.state_dict())
    torch.save(got, f"{out_dir}/{case}_rank{rank}.pt")
