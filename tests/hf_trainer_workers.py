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
