"""What each rank runs in tests/test_hf_trainer.py's two-rank tests: plain Trainer (DDP) and
GeminiTrainer (ZeRO) under the environment torchrun gives a rank. Model, data and arguments are
test_hf_trainer.py's."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _as_torchrun_rank(rank: int, world: int) -> None:
    """The variables torchrun sets, which Trainer (accelerate) reads to see several processes; the
    process group itself is multiprocess.py's, already joined."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")


def _trainer(kind: str, out: Path, *, model_seed: int = 0, eval_rows: int = 0, **args):
    import transformers

    import gemini
    from gemini.hf import GeminiTrainer
    from test_hf_trainer import _args, _llama, _Tokens

    transformers.logging.set_verbosity_error()
    data = dict(train_dataset=_Tokens(), eval_dataset=_Tokens(eval_rows) if eval_rows else None)
    if kind == "plain":
        return transformers.Trainer(model=_llama(model_seed), args=_args(out, **args), **data)
    if kind == "zero2-compiled":  # Trainer's torch_compile: the accelerator compiles the unwrapped model
        args.update(torch_compile=True, torch_compile_backend="aot_eager")
    fields = {"zero2-cpu": dict(placement="cpu"), "zero3-auto": dict(placement="auto", shard_params=True),
              "zero2-compiled": dict(placement="auto")}[kind]
    cfg = gemini.GeminiConfig(device="cpu", chunk_size=4096, **fields)
    return GeminiTrainer(model=_llama(model_seed), args=_args(out, **args), gemini_config=cfg, **data)


def _record(trainer, kind: str, out: Path, rank: int) -> None:
    """The run's log lines and (gemini) what the engine saw of the ranks, one file per rank."""
    record = {"logs": [h for h in trainer.state.log_history if "loss" in h],
              "eval_losses": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]}
    if kind != "plain":
        from gemini.module import GeminiModel

        report = trainer.gemini_optimizer.report
        inner = getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped)  # under torch.compile
        record.update(unwrapped=inner is trainer.model and isinstance(trainer.model, GeminiModel),
                      compiled=inner is not trainer.model_wrapped,
                      world_size=report.world_size, grad_reduce_bytes=report.grad_reduce_bytes)
    (out / f"record.rank{rank}.json").write_text(json.dumps(record))


def train_and_save(rank: int, world: int, root: str, kinds: list[str]) -> None:
    """Each of ``kinds`` trained (evaluated every 3 steps on 7 rows: one rank gets fewer) and saved
    under ``root/<kind>``."""
    _as_torchrun_rank(rank, world)
    for kind in kinds:
        out = Path(root) / kind
        trainer = _trainer(kind, out, eval_rows=7, eval_strategy="steps", eval_steps=3)
        trainer.train()
        trainer.save_model(str(out))
        _record(trainer, kind, out, rank)


def resume(rank: int, world: int, root: str) -> None:
    """A run straight through, one saving a checkpoint at step 3, one resumed from it (a model of
    another seed, so the weights must come from the checkpoint), each saved under ``root``."""
    _as_torchrun_rank(rank, world)
    straight = _trainer("zero2-cpu", Path(root) / "straight")
    straight.train()
    straight.save_model(f"{root}/straight")
    _trainer("zero2-cpu", Path(root) / "run", save_strategy="steps", save_steps=3).train()
    resumed = _trainer("zero2-cpu", Path(root) / "run", model_seed=99)
    resumed.train(resume_from_checkpoint=f"{root}/run/checkpoint-3")
    resumed.save_model(f"{root}/resumed")


def generate(rank: int, world: int, root: str) -> None:
    """ZeRO-3 generation of different lengths per rank with ``synced_gpus=True``, and the same
    with the plain model, token ids saved per rank."""
    import torch
    import transformers

    import gemini
    from test_hf_trainer import VOCAB, _llama

    transformers.logging.set_verbosity_error()
    plain = _llama().eval()
    model, _ = gemini.initialize(_llama(), gemini.GeminiConfig(device="cpu", chunk_size=4096, placement="cpu",
                                                               shard_params=True))
    model.eval()
    prompt = torch.randint(0, VOCAB, (1, 4 + rank), generator=torch.Generator().manual_seed(rank))
    new = 3 + 4 * rank  # rank 0 stops first and keeps running forwards for rank 1's gathers
    with torch.no_grad():
        got = model.generate(prompt, max_new_tokens=new, do_sample=False, synced_gpus=True, pad_token_id=0)
        want = plain.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    (Path(root) / f"generate.rank{rank}.json").write_text(json.dumps({"got": got.tolist(), "want": want.tolist()}))


def accelerate_loop(rank: int, world: int, root: str, kinds: list[str]) -> None:
    """A plain accelerate loop (``accelerate launch``'s): accumulation over 2 micro-batches,
    ``accelerator.clip_grad_norm_``; "plain" is accelerate's Accelerator with DDP and torch's
    AdamW, the others gemini's model and optimizer under GeminiAccelerator. Per kind and rank:
    the losses, norms and final parameters; a gemini kind also saves its state with
    ``save_state`` and loads it into a fresh model and optimizer, recording whether they match.
    Last, plain Accelerator around gemini's model: the error its forward raises."""
    import accelerate
    import torch
    import transformers

    import gemini
    from gemini.hf import GeminiAccelerator
    from test_hf_trainer import _llama, _Tokens

    _as_torchrun_rank(rank, world)
    transformers.logging.set_verbosity_error()

    def engine(kind: str, seed: int = 0):
        model = _llama(seed)
        if kind == "plain":
            return accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2), model, \
                torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        fields = {"zero2-cpu": dict(placement="cpu"), "zero3-auto": dict(placement="auto", shard_params=True)}[kind]
        model, opt = gemini.initialize(model, gemini.GeminiConfig(device="cpu", chunk_size=4096, **fields),
                                       lr=3e-3, weight_decay=0.1)
        return GeminiAccelerator(cpu=True, gradient_accumulation_steps=2), model, opt

    record = {}
    for kind in kinds:
        acc, model, opt = engine(kind)
        loader = torch.utils.data.DataLoader(_Tokens(16), batch_size=2)
        model, opt, loader = acc.prepare(model, opt, loader)
        losses, norms = [], []
        for batch in loader:
            batch.pop("source")
            with acc.accumulate(model):
                loss = model(**batch).loss
                acc.backward(loss)
                losses.append(loss.item())
                if acc.sync_gradients:
                    norms.append(float(acc.clip_grad_norm_(model.parameters(), 0.5)))
                opt.step()
                opt.zero_grad()
        state = acc.unwrap_model(model).state_dict()  # gemini's: a collective, the whole model
        entry = {"losses": losses, "norms": norms, "wrapped": type(model).__name__}
        if kind != "plain":
            acc.save_state(f"{root}/{kind}-state")
            fresh_acc, fresh, fresh_opt = engine(kind, seed=99)
            fresh, fresh_opt = fresh_acc.prepare(fresh, fresh_opt)
            fresh_acc.load_state(f"{root}/{kind}-state")
            again, want = fresh_opt.state_dict(), opt.state_dict()
            entry["state_round_trip"] = (
                all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), state.values(), strict=True))
                and again["state"].keys() == want["state"].keys() and bool(want["state"])
                and all(torch.equal(again["state"][i][k], want["state"][i][k]) for i in want["state"]
                        for k in ("step", "exp_avg", "exp_avg_sq")))
        record[kind] = entry
        if rank == 0:
            torch.save(state, f"{root}/{kind}.pt")
    acc, model, opt = engine("zero2-cpu")
    wrapped, opt = accelerate.Accelerator(cpu=True).prepare(model, opt)
    try:
        wrapped(torch.zeros(1, 4, dtype=torch.long))
        record["plain_accelerator_error"] = None
    except RuntimeError as e:
        record["plain_accelerator_error"] = str(e)
    (Path(root) / f"accelerate.rank{rank}.json").write_text(json.dumps(record))


def save_pretrained_zero3(rank: int, world: int, root: str) -> None:
    """After a step under ZeRO-3, ``model.save_pretrained`` as accelerate scripts call it on the
    unwrapped model (rank 0 the main process), and the state_dict to compare with."""
    import torch

    import gemini
    from test_hf_trainer import _llama, _Tokens

    model, opt = gemini.initialize(_llama(), gemini.GeminiConfig(device="cpu", chunk_size=4096, placement="cpu",
                                                                 shard_params=True), lr=1e-2)
    batch = {k: torch.stack([_Tokens()[i][k] for i in range(2 * rank, 2 * rank + 2)]) for k in ("input_ids", "labels")}
    opt.backward(model(**batch).loss)
    opt.step()
    state = model.state_dict()  # a collective: the whole model on every rank
    model.save_pretrained(f"{root}/saved", is_main_process=rank == 0)
    if rank == 0:
        torch.save(state, f"{root}/state.pt")
