"""What each rank runs in the ZeRO tests (tests/test_zero.py), and the shared model and data.

The model has a frozen layer and a layer that is never called (its parameters never get a
gradient), and no parameter whose gradient is zero in exact arithmetic (Adam would turn
rounding noise there into full steps; see the issue's note), so that ranks averaging their
gradients match one process on the global batch to rounding.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.utils.prune
import torch.nn.functional as F
from torch import nn

import gemini

GLOBAL_BATCH = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.frozen = nn.Linear(32, 32)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(32)
        self.hidden = nn.Linear(32, 32)
        self.unused = nn.Linear(32, 8)  # never called
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = self.norm(self.frozen(h))
        return self.head(F.gelu(self.hidden(h)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def make_data(steps: int, micro_batches: int = 1, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps * micro_batches`` global batches of (input, target)."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(GLOBAL_BATCH, 16, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g))
            for _ in range(steps * micro_batches)]


def local(batch, rank: int, world: int):
    """This rank's contiguous part of a global batch."""
    n = GLOBAL_BATCH // world
    return tuple(t[rank * n : (rank + 1) * n] for t in batch)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def train_reference(steps: int, *, micro_batches: int = 1, clip: float = 0.0, lr: float = 1e-2,
                    weight_decay: float = 0.01, model: nn.Module | None = None, data=None, opt_state=None,
                    after_step=None):
    """One process, plain torch.optim.AdamW on the global batch; ``after_step(model, step)``, when
    given, edits the model after each step. Returns per-step state_dicts."""
    model = make_net() if model is None else model
    data = make_data(steps, micro_batches) if data is None else data
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                            fused=True)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    out = []
    for s in range(steps):
        for x, y in data[s * micro_batches : (s + 1) * micro_batches]:
            (loss_fn(model(x), y) / micro_batches).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], clip)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step(model, s)
        out.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return out, model, opt


def train_gemini(model, opt, data, rank: int, world: int, steps: int, *, micro_batches: int = 1,
                 model_clip: float = 0.0):
    """Per step: the consolidated model state_dict and the report. ``model_clip``: clip with
    ``model.clip_grad_norm_`` between backward and step (torch's own clip must refuse loudly)."""
    states, reports = [], []
    for s in range(steps):
        for batch in data[s * micro_batches : (s + 1) * micro_batches]:
            x, y = local(batch, rank, world)
            opt.backward(loss_fn(model(x), y) / micro_batches)
        if model_clip > 0:
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), model_clip)
            except RuntimeError as e:
                assert "under ZeRO" in str(e) and "model.clip_grad_norm_" in str(e), e
            else:
                raise AssertionError("torch's clip_grad_norm_ must not run on ZeRO-sharded gradients")
            model.clip_grad_norm_(model_clip)
        opt.step()
        opt.zero_grad()
        states.append(model.state_dict())
        reports.append(opt.report.to_dict())
    return states, reports


def config(spec: dict, tmp: str) -> gemini.GeminiConfig:
    kwargs = dict(spec.get("config", {}))
    if kwargs.pop("nvme", False):
        kwargs["nvme_dir"] = tmp
    return gemini.GeminiConfig(device=spec.get("device", "cpu"), **kwargs)


def run_specs(rank: int, world: int, specs: list[dict], out_dir: str) -> None:
    """Train each spec's configuration; save (states, reports, the planner's per-rank bytes and
    world, asked inside the process group as a user's script would) per spec and rank."""
    for i, spec in enumerate(specs):
        mb = spec.get("micro_batches", 1)
        plan = gemini.plan_placement(make_net(), config(spec, out_dir))
        model, opt = gemini.initialize(make_net(), config(spec, out_dir), lr=1e-2, weight_decay=0.01)
        device = spec.get("device", "cpu")  # the batches where the model computes
        data = [tuple(t.to(device) for t in batch) for batch in make_data(spec["steps"], mb)]
        states, reports = train_gemini(model, opt, data, rank, world, spec["steps"],
                                       micro_batches=mb, model_clip=spec.get("model_clip", 0.0))
        param_states = {n: opt.param_state(p) for n, p in model.named_parameters()}  # collectives
        torch.save({"states": states, "reports": reports, "plan_bytes": plan.model_bytes_by_tier,
                    "plan_world": plan.world_size, "param_states": param_states}, f"{out_dir}/spec{i}_rank{rank}.pt")
        opt.close()


def checkpoint_round_trip(rank: int, world: int, out_dir: str, phases: str, cfg: dict) -> None:
    """Checkpoint tests, the comma-separated ``phases`` in turn, each with a model and optimizer
    of its own (one process for several saves the ranks' start-up). ``save``: train 2 steps, save
    consolidated (rank 0) and sharded (each rank) checkpoints, train 2 more.
    ``load_consolidated`` / ``load_sharded``: resume from them and train the last 2 steps. Each
    saves its last 2 steps' states."""
    for phase in phases.split(","):
        _checkpoint_phase(rank, world, out_dir, phase, cfg)


def _checkpoint_phase(rank: int, world: int, out_dir: str, phase: str, cfg: dict) -> None:
    data = make_data(4)
    model, opt = gemini.initialize(make_net(seed=7 if phase != "save" else 0), config({"config": cfg}, out_dir),
                                   lr=1e-2, weight_decay=0.01)
    if phase == "save":
        train_gemini(model, opt, data, rank, world, 2)
        gemini.save_checkpoint(f"{out_dir}/consolidated.pt", model, opt)
        gemini.save_checkpoint(f"{out_dir}/sharded", model, opt, sharded=True)
    elif phase == "load_consolidated":
        gemini.load_checkpoint(f"{out_dir}/consolidated.pt", model, opt)
    else:
        gemini.load_checkpoint(f"{out_dir}/sharded", model, opt, sharded=True)
    states, _ = train_gemini(model, opt, data[2:], rank, world, 2)
    torch.save(states, f"{out_dir}/{phase}_world{world}_rank{rank}.pt")
    opt.close()


def run_low_precision(rank: int, world: int, out_dir: str) -> None:
    """fp16 with a scale that overflows at first, then bf16 on one repeated batch."""
    res = {}
    data = make_data(6)
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu", precision="fp16", chunk_size=600, initial_scale=2.0**24,
                              max_scale=2.0**24, hysteresis=1, backoff_factor=2.0**-4)
    model, opt = gemini.initialize(make_net(), cfg, lr=1e-2)
    skipped, scales = [], []
    for batch in data:
        x, y = local(batch, rank, world)
        # .float(): torch 2.11's mse_loss backward refuses a half input beside a float target.
        opt.backward(loss_fn(model(x).float(), y))
        opt.step()
        opt.zero_grad()
        skipped.append(opt.report.skipped)
        scales.append(opt.report.loss_scale)
    res.update({"fp16-skipped": skipped, "fp16-scale": scales, "fp16-final": model.state_dict()})
    opt.close()
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu", precision="bf16", chunk_size=600, shard_params=True)
    model, opt = gemini.initialize(make_net(), cfg, lr=1e-2)
    losses = []
    for _ in range(8):
        x, y = local(data[0], rank, world)
        loss = loss_fn(model(x).float(), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    res.update({"bf16-final": model.state_dict(), "bf16-loss-drop": losses[-1] < 0.8 * losses[0]})
    opt.close()
    torch.save(res, f"{out_dir}/low_rank{rank}.pt")


class NetWithIdleBranch(Net):
    """Net plus a branch that only rank 1 runs (``idle.*`` gets a gradient on rank 1 alone)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.idle = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_idle: bool = False) -> torch.Tensor:
        out = super().forward(x)
        return self.idle(out) if use_idle else out


def run_idle_branch(rank: int, world: int, out_dir: str) -> None:
    """Rank 1 alone uses ``idle``: the reduction must not hang, and ``idle`` gets rank 1's
    gradient averaged with rank 0's zeros (DDP's semantics)."""
    torch.manual_seed(0)
    net = NetWithIdleBranch()
    # A param group of its own: a chunk group that gets no gradient at all on rank 0.
    model, opt = gemini.initialize(net, gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=600), lr=1e-2,
                                   param_groups=[{"params": list(net.idle.parameters())}])
    data = make_data(2)
    for batch in data:
        x, y = local(batch, rank, world)
        opt.backward(loss_fn(model(x, use_idle=rank == 1), y))
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), f"{out_dir}/idle_rank{rank}.pt")
    opt.close()


class ClampedLinear(nn.Linear):
    """A Linear that clips its weight in place inside forward (WGAN-style weight clipping)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1)  # init is uniform in +-0.18: it writes
        return super().forward(x)


def clamping_net() -> Net:
    net = make_net()
    net.hidden.__class__ = ClampedLinear
    return net


def edit_between_steps(net: Net, step: int) -> None:
    if step == 0:
        net.inp.weight.data = torch.full_like(net.inp.weight, 0.05)


def run_param_writes(rank: int, world: int, out_dir: str, steps: int) -> None:
    """Writes into the parameters (see tests/test_param_writes.py): in place inside forward under
    ZeRO-2 and ZeRO-3, and (ZeRO-2: ZeRO-3's parameters are empty between uses) ``p.data`` assigned."""
    for shard in (False, True):
        net = clamping_net()
        cfg = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=600, shard_params=shard)
        model, opt = gemini.initialize(net, cfg, lr=1e-2, weight_decay=0.01)
        states = []
        for step, batch in enumerate(make_data(steps)):
            x, y = local(batch, rank, world)
            opt.backward(loss_fn(model(x), y))
            opt.step()
            opt.zero_grad()
            if not shard:
                edit_between_steps(net, step)
            states.append(model.state_dict())
        torch.save(states, f"{out_dir}/writes_zero{3 if shard else 2}_rank{rank}.pt")


# Models whose parameters are read where no call of their own module fetched them: in a forward
# pre-hook the model had before initialize (see [Note: the engine's hooks around the user's] in
# gemini/engine/hooks.py), or by an ancestor's call (see [Note: parameters of a descendant read
# by its ancestor] in gemini/engine/descendant_reads.py). Each maps (B, 16) to (B, 4).
def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _weight_norm() -> nn.Module:
    m = _mlp()
    torch.nn.utils.weight_norm(m[0])
    return m


def _spectral_norm() -> nn.Module:
    m = _mlp()
    torch.nn.utils.spectral_norm(m[0])
    return m


def _pruned() -> nn.Module:
    m = _mlp()
    torch.nn.utils.prune.l1_unstructured(m[0], "weight", amount=0.5)
    return m


class _Tokens(nn.Module):
    """(B, 16) as 4 tokens of 8 features through ``block``, then a head."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = torch.cat([x, x.flip(-1)], -1).view(-1, 4, 8)
        if isinstance(self.block, nn.MultiheadAttention):
            out = self.block(t, t, t, need_weights=False)[0]
        else:
            out = self.block(t)
        return self.head(out.mean(1))


class _TiedProjection(nn.Module):
    """The root reads ``embed.weight`` after ``embed``'s call is over (a tied output projection
    by ``F.linear``), and scales by ``block.scale`` after calling ``block`` (layer scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 8)
        self.block = _Scaled()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x))
        h = self.block(h) * self.block.scale
        return self.head(F.linear(h, self.embed.weight.t()))  # (B, 8) @ (8, 16)


class _RootOwnsAndReads(_TiedProjection):
    """As _TiedProjection, with parameters of the root's own (a nanoGPT-like root owns its
    position embedding) and an ``nn.ParameterList`` entry it reads (the list is never called):
    the root's own hooks ran, in the forward that found the reads, over the groups just found
    ("chunk group 1 released more often than accessed")."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.mix = nn.ParameterList([nn.Parameter(torch.randn(4, 4) * 0.2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (super().forward(x) @ self.mix[0]) * self.gain


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(h))


def _hook_reads_earlier() -> nn.Module:
    """A user's pre-hook on the last layer reads the first layer's bias, whose call is over."""
    m = _mlp()
    m[2].register_forward_pre_hook(lambda module, args: (args[0] * m[0].bias.mean(),))
    return m


class _SelectivelyCheckpointed(nn.Module):
    """Two blocks under selective activation checkpointing with ``policy`` (Dropout at p=0: the
    ranks' masks could not match one process's)."""

    def __init__(self, policy) -> None:
        super().__init__()
        self.policy = policy
        self.inp = nn.Linear(16, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16),
                                                  nn.Dropout(0.0)) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
        h = self.inp(x)
        context_fn = functools.partial(create_selective_checkpoint_contexts, self.policy)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=False, context_fn=context_fn)
        return self.head(h)


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    keep = op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE


def _save_all_but_mutating(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    mutated = op._schema.is_mutable or op in (torch.ops.aten.empty_like.default, torch.ops.aten.empty.memory_format)
    return CheckpointPolicy.PREFER_RECOMPUTE if mutated else CheckpointPolicy.MUST_SAVE


ZOO = {
    "weight_norm": _weight_norm,
    "spectral_norm": _spectral_norm,
    "prune": _pruned,
    "multihead_attention": lambda: _Tokens(nn.MultiheadAttention(8, 2, batch_first=True)),
    "encoder_layer": lambda: _Tokens(nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0,
                                                                batch_first=True)),
    "tied_projection": _TiedProjection,
    "root_owns_and_reads": _RootOwnsAndReads,
    "hook_reads_earlier": _hook_reads_earlier,
    "checkpoint_save_matmuls": lambda: _SelectivelyCheckpointed(_save_matmuls),
    "checkpoint_save_all_but_mutating": lambda: _SelectivelyCheckpointed(_save_all_but_mutating),
}


def make_zoo(name: str) -> nn.Module:
    torch.manual_seed(0)
    return ZOO[name]()


def run_zoo(rank: int, world: int, names: list[str], steps: int, chunk_size: int, out_dir: str) -> None:
    """ZeRO-3 training of each zoo model, then an evaluation forward without grad (the
    encoder layer's fused fast path); save the states per step and that output."""
    for name in names:
        model, opt = gemini.initialize(make_zoo(name), gemini.GeminiConfig(
            device="cpu", placement="cpu", chunk_size=chunk_size, shard_params=True), lr=1e-2, weight_decay=0.01)
        states, _ = train_gemini(model, opt, make_data(steps), rank, world, steps)
        model.eval()
        with torch.no_grad():
            evaluation = model(make_data(1, seed=5)[0][0])
        torch.save({"states": states, "eval": evaluation}, f"{out_dir}/{name}_rank{rank}.pt")
        opt.close()
