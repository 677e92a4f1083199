"""GeminiTrainer: transformers.Trainer through gemini equals plain Trainer (the hf extra)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("accelerate")

import gemini  # noqa: E402
import hf_trainer_workers  # noqa: E402
from gemini.errors import DeviceBudgetError  # noqa: E402
from gemini.hf import OPTIMIZER_SHARDS_NAME, GeminiTrainer  # noqa: E402
from helpers import DEVICE  # noqa: E402
from multiprocess import run_ranks  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, SEQ = 64, 16


def _llama(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(cfg)


class _Tokens(torch.utils.data.Dataset):
    """Causal-LM rows, with a padded tail (labels -100) so token counting matters."""

    def __init__(self, n: int = 24):
        g = torch.Generator().manual_seed(3)
        self.rows = []
        for i in range(n):
            ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
            labels = ids.clone()
            labels[SEQ - 1 - i % 5 :] = -100
            self.rows.append({"input_ids": ids, "labels": labels, "attention_mask": torch.ones(SEQ, dtype=torch.long),
                              "source": i})  # a column the model does not take: Trainer must drop it

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _args(out, **kw):
    base = dict(output_dir=str(out), per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=6,
                learning_rate=3e-3, weight_decay=0.1, lr_scheduler_type="linear", warmup_steps=2, max_grad_norm=0.5,
                logging_steps=1, save_strategy="no", report_to="none", use_cpu=DEVICE == "cpu", seed=7, data_seed=7,
                dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return transformers.TrainingArguments(**base)


def _load(folder):
    return transformers.LlamaForCausalLM.from_pretrained(folder).state_dict()


def _assert_models_close(got: dict, want: dict, rel: float = 1e-5):
    assert got.keys() == want.keys()
    for k in want:
        diff = (got[k].float() - want[k].float()).norm() / want[k].float().norm().clamp_min(1e-12)
        assert diff < rel, f"{k}: relative difference {diff:.3e}"


@pytest.mark.parametrize("placement", ["cpu", "auto"])
def test_gemini_trainer_saves_the_same_model_as_plain_trainer(tmp_path, placement):
    base = _llama()
    plain = transformers.Trainer(model=copy.deepcopy(base), args=_args(tmp_path / "plain"), train_dataset=_Tokens())
    plain.train()
    plain.save_model(tmp_path / "plain")

    cfg = gemini.GeminiConfig(device=DEVICE, placement=placement, chunk_size=4096)
    trainer = GeminiTrainer(model=copy.deepcopy(base), args=_args(tmp_path / "gemini"), train_dataset=_Tokens(),
                            gemini_config=cfg)
    # What Trainer learns from the model: label names, loss kwargs, the causal-LM label shift.
    assert trainer.label_names == plain.label_names == ["labels"]
    assert trainer.model_accepts_loss_kwargs == plain.model_accepts_loss_kwargs
    assert trainer._loss_shifts_labels and plain._loss_shifts_labels
    trainer.train()
    trainer.save_model(tmp_path / "gemini")
    _assert_models_close(_load(tmp_path / "gemini"), _load(tmp_path / "plain"))

    logs = [h for h in trainer.state.log_history if "loss" in h]
    plain_logs = [h for h in plain.state.log_history if "loss" in h]
    assert len(logs) == len(plain_logs) == 6
    for got, want in zip(logs, plain_logs):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert got["learning_rate"] == pytest.approx(want["learning_rate"], rel=1e-9)
        assert got["gemini_device_peak_mib"] > 0 and "gemini_host_model_mib" in got
    assert max(h["grad_norm"] for h in logs) > 0.5  # clipping was active


@pytest.mark.standin  # the budget in the stand-in's bytes: batch 8 does not fit, 4 does
def test_auto_find_batch_size_halves_the_batch_on_the_budgets_error(tmp_path):
    """Trainer's auto_find_batch_size halves the batch on an out-of-memory error, which it knows
    by its type and message (accelerate's should_reduce_batch_size); gemini's DeviceBudgetError,
    a MemoryError alone, was raised out of train() instead (see [Note: the budget's error is an
    out-of-memory error] in gemini/errors.py). The run then trains as one begun at the half."""
    base = _llama()
    cfg = gemini.GeminiConfig(device=DEVICE, placement="auto", chunk_size=4096, device_memory="0.5MiB")
    kw = dict(gradient_accumulation_steps=1, max_steps=4)
    runs = {}
    for batch, find in ((4, False), (8, True)):
        trainer = GeminiTrainer(model=copy.deepcopy(base), train_dataset=_Tokens(48), gemini_config=cfg,
                                args=_args(tmp_path / str(batch), per_device_train_batch_size=batch,
                                           auto_find_batch_size=find, **kw))
        trainer.train()
        trainer.save_model(tmp_path / str(batch))
        runs[batch] = trainer
    assert runs[8]._train_batch_size == 4
    _assert_models_close(_load(tmp_path / "8"), _load(tmp_path / "4"), rel=1e-6)
    with pytest.raises(DeviceBudgetError):  # the same batch without it: the budget's error, as before
        GeminiTrainer(model=copy.deepcopy(base), train_dataset=_Tokens(48), gemini_config=cfg,
                      args=_args(tmp_path / "8-plain", per_device_train_batch_size=8, **kw)).train()


def test_resume_from_checkpoint_restores_the_optimizer_exactly(tmp_path):
    base = _llama()
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=4096)
    straight = GeminiTrainer(model=copy.deepcopy(base), args=_args(tmp_path / "straight"), train_dataset=_Tokens(),
                             gemini_config=cfg)
    straight.train()
    straight.save_model(tmp_path / "straight")

    first = GeminiTrainer(model=copy.deepcopy(base), args=_args(tmp_path / "run", save_strategy="steps", save_steps=3),
                          train_dataset=_Tokens(), gemini_config=cfg)
    first.train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").exists()
    torch.load(ckpt / "optimizer.pt", weights_only=True)  # data only
    resumed = GeminiTrainer(model=_llama(seed=99), args=_args(tmp_path / "run"), train_dataset=_Tokens(),
                            gemini_config=cfg)
    resumed.train(resume_from_checkpoint=str(ckpt))
    resumed.save_model(tmp_path / "resumed")
    _assert_models_close(_load(tmp_path / "resumed"), _load(tmp_path / "straight"), rel=1e-6)


def test_precision_comes_from_the_training_arguments(tmp_path):
    trainer = GeminiTrainer(model=_llama(), args=_args(tmp_path, bf16=True, max_steps=2), train_dataset=_Tokens(),
                            gemini_config=gemini.GeminiConfig(device=DEVICE, placement="cpu"))
    assert trainer.gemini_config.precision == "bf16"
    assert not trainer.args.bf16  # Trainer's autocast is off: gemini computes in bf16 itself
    trainer.train()
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="precision"):
        GeminiTrainer(model=_llama(), args=_args(tmp_path, fp16=True),
                      gemini_config=gemini.GeminiConfig(device=DEVICE, placement="cpu", precision="bf16"))


def test_fp16_overflow_skips_the_step_and_holds_the_scheduler(tmp_path):
    """fp16 goes through gemini's loss scaler: an overflowing step is skipped, Trainer is told
    (its scheduler does not advance), and the scale backs off until steps land."""
    cfg = gemini.GeminiConfig(device=DEVICE, placement="cpu", initial_scale=2.0**32, hysteresis=1,
                              backoff_factor=2.0**-12)
    trainer = GeminiTrainer(model=_llama(), args=_args(tmp_path, fp16=True, warmup_steps=0, max_steps=4),
                            train_dataset=_Tokens(), gemini_config=cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    skipped = [not torch.isfinite(torch.tensor(h["grad_norm"])) for h in logs]
    assert skipped[0] and not skipped[-1], skipped
    # The linear schedule starts at the full rate and advances only on steps that landed.
    lrs = [h["learning_rate"] for h in logs]
    assert lrs[0] == pytest.approx(3e-3) and lrs[skipped.index(False)] == pytest.approx(3e-3)
    after = trainer.model.state_dict()
    assert any(not torch.equal(after[k], before[k]) for k in before)


def test_a_process_group_other_than_trainers_is_refused(tmp_path, monkeypatch):
    """gemini shards over Trainer's world: a group of another size (Trainer runs one process
    here) would shard over ranks whose batches Trainer does not split."""
    import gemini.hf

    class _TwoRanks:
        world = 2

    monkeypatch.setattr(gemini.hf, "resolve_group", lambda group: _TwoRanks())
    with pytest.raises(ValueError, match=r"process_group has 2 rank\(s\) but Trainer runs 1 process"):
        GeminiTrainer(model=_llama(), args=_args(tmp_path), train_dataset=_Tokens(),
                      gemini_config=gemini.GeminiConfig(device=DEVICE, placement="cpu"))


def _ranks_record(folder):
    return [json.loads((folder / f"record.rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_under_zero_equal_plain_trainer_with_ddp(tmp_path):
    """torchrun's two processes: GeminiTrainer (ZeRO-2 under placement cpu, ZeRO-3 under auto,
    ZeRO-2 under auto compiled by Trainer's torch_compile) trains and saves the model plain Trainer does with DDP, logs the same losses, norms and
    evaluation losses, and is not wrapped in DDP (gemini reduce-scatters the gradients itself)."""
    kinds = ["plain", "zero2-cpu", "zero3-auto", "zero2-compiled"]
    run_ranks(hf_trainer_workers.train_and_save, str(tmp_path), kinds, timeout_seconds=240)
    want = _load(tmp_path / "plain")
    want_logs, want_evals = (_ranks_record(tmp_path / "plain")[0][k] for k in ("logs", "eval_losses"))
    assert len(want_logs) == 6 and len(want_evals) == 2
    for kind in kinds[1:]:
        _assert_models_close(_load(tmp_path / kind), want)
        for rank, record in enumerate(_ranks_record(tmp_path / kind)):
            assert record["unwrapped"], f"{kind} rank {rank}: the model was wrapped (DDP?)"
            assert record["compiled"] == (kind == "zero2-compiled"), (kind, rank)
            assert record["world_size"] == 2 and record["grad_reduce_bytes"] > 0, (kind, rank, record)
            for got, w in zip(record["logs"], want_logs, strict=True):  # Trainer gathers the loss: every rank alike
                assert got["loss"] == pytest.approx(w["loss"], rel=1e-5)
                assert got["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-5)
                assert got["learning_rate"] == pytest.approx(w["learning_rate"], rel=1e-9)
            assert record["eval_losses"] == pytest.approx(want_evals, rel=1e-5)
    assert max(h["grad_norm"] for h in want_logs) > 0.5  # clipping was active


def test_two_ranks_resume_from_their_sharded_checkpoint_exactly(tmp_path):
    """Under ZeRO a checkpoint's optimizer state is one file per rank (no gathering), data only;
    resuming from it on two ranks gives the run that never stopped."""
    run_ranks(hf_trainer_workers.resume, str(tmp_path), timeout_seconds=240)
    ckpt = tmp_path / "run" / "checkpoint-3"
    shards = sorted(p.name for p in (ckpt / OPTIMIZER_SHARDS_NAME).iterdir())
    assert shards == ["rank00000-of-00002.pt", "rank00001-of-00002.pt"]
    for name in shards:
        torch.load(ckpt / OPTIMIZER_SHARDS_NAME / name, weights_only=True)  # data only
    assert not (ckpt / "optimizer.pt").exists()
    _assert_models_close(_load(tmp_path / "resumed"), _load(tmp_path / "straight"), rel=1e-6)
    # One process resumes from the two ranks' shards (made whole): with each rank's batch on its
    # own (2 x 2 rows) it trains as the two ranks did.
    alone = GeminiTrainer(model=_llama(seed=99), args=_args(tmp_path / "run", per_device_train_batch_size=4),
                          train_dataset=_Tokens(),
                          gemini_config=gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=4096))
    alone.train(resume_from_checkpoint=str(ckpt))
    alone.save_model(tmp_path / "alone")
    _assert_models_close(_load(tmp_path / "alone"), _load(tmp_path / "straight"), rel=1e-5)


def test_generate_under_zero3_with_synced_gpus_equals_plain_generate(tmp_path):
    """Under ZeRO-3 every forward gathers parameters with every rank: ranks generating different
    lengths keep step with synced_gpus=True (as under DeepSpeed ZeRO-3 and FSDP) and produce the
    plain model's tokens."""
    run_ranks(hf_trainer_workers.generate, str(tmp_path), timeout_seconds=120)
    for rank in range(2):
        out = json.loads((tmp_path / f"generate.rank{rank}.json").read_text())
        assert out["got"] == out["want"] and len(out["got"][0]) == 4 + rank + 3 + 4 * rank, (rank, out)


def test_two_ranks_of_an_accelerate_loop_under_gemini_accelerator_equal_ddp(tmp_path):
    """``accelerate launch``'s loop (accumulate, backward, clip_grad_norm_, step) with gemini's
    model and optimizer under GeminiAccelerator, ZeRO-2 and ZeRO-3, trains as accelerate's own
    Accelerator with DDP and torch's AdamW; save_state / load_state round-trip the model and the
    optimizer exactly; accelerate's plain Accelerator around gemini's model is refused at its
    first forward (DDP would reduce gradients ZeRO holds in part), saying what to use instead."""
    kinds = ["plain", "zero2-cpu", "zero3-auto"]
    run_ranks(hf_trainer_workers.accelerate_loop, str(tmp_path), kinds, timeout_seconds=240)
    want = torch.load(tmp_path / "plain.pt", weights_only=True)
    records = [json.loads((tmp_path / f"accelerate.rank{r}.json").read_text()) for r in range(2)]
    assert records[0]["plain"]["wrapped"] == "DistributedDataParallel"
    for kind in kinds[1:]:
        _assert_models_close(torch.load(tmp_path / f"{kind}.pt", weights_only=True), want)
        for rank, record in enumerate(records):
            got, ref = record[kind], record["plain"]
            assert got["wrapped"] != "DistributedDataParallel", (kind, rank)
            assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5), (kind, rank)
            assert got["norms"] == pytest.approx(ref["norms"], rel=1e-5) and max(ref["norms"]) > 0.5, (kind, rank)
            assert got["state_round_trip"], (kind, rank)
    for record in records:
        assert "wrapped in DistributedDataParallel" in record["plain_accelerator_error"]
        assert "gemini.hf.GeminiAccelerator" in record["plain_accelerator_error"]


def test_save_pretrained_on_the_model_under_zero3_writes_the_whole_model(tmp_path):
    """accelerate scripts save with ``unwrapped.save_pretrained(dir, is_main_process=...)``: it
    reached the wrapped model's own, which under ZeRO-3 wrote each parameter's .data, empty
    between uses. It writes the fp32 masters now, every rank calling it."""
    run_ranks(hf_trainer_workers.save_pretrained_zero3, str(tmp_path), timeout_seconds=120)
    want = torch.load(tmp_path / "state.pt", weights_only=True)
    got = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "saved").state_dict()
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_save_pretrained_on_the_model_refuses_what_it_cannot_write(tmp_path):
    model, _ = gemini.initialize(_llama(), gemini.GeminiConfig(device=DEVICE, placement="cpu"))
    with pytest.raises(ValueError, match="push_to_hub"):
        model.save_pretrained(tmp_path, push_to_hub=True)
    with pytest.raises(ValueError, match="safe_serialization=False"):
        model.save_pretrained(tmp_path, safe_serialization=False)
    model.save_pretrained(tmp_path / "ok", max_shard_size="50KB")  # shards, an index, the config
    assert (tmp_path / "ok" / "model.safetensors.index.json").exists() and (tmp_path / "ok" / "config.json").exists()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ok").state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(reloaded[k], v), k


def test_gemini_accelerator_refuses_accelerates_fp16_scaler():
    """accelerate's fp16 (on a GPU) steps through torch's GradScaler, which would unscale gradients
    gemini's backward never scaled: refused, pointing at gemini's own fp16."""
    from gemini.hf import GeminiAccelerator

    acc = GeminiAccelerator(cpu=DEVICE == "cpu")  # on a GPU its device is the model's
    acc.scaler = torch.amp.GradScaler(DEVICE)  # what mixed_precision="fp16" makes on a GPU
    model, opt = gemini.initialize(_llama(), gemini.GeminiConfig(device=DEVICE, placement="cpu"))
    with pytest.raises(ValueError, match=r"GeminiConfig\(precision='fp16'\)"):
        acc.prepare(model, opt)
