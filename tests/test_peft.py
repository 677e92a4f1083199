"""PEFT (LoRA) models under gemini, against plain PEFT with torch's AdamW and plain Trainer.

Needs ``peft`` (not a dependency of gemini: ``pip install peft``); skipped without it. See
[Note: PEFT models] in gemini/peft.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

import gemini  # noqa: E402
from helpers import DEVICE, cpu_copy  # noqa: E402

CONFIGS = {
    "cuda": dict(placement="cuda", chunk_size=4096),
    "cpu": dict(placement="cpu", chunk_size=4096),
    "auto-evicting": dict(placement="auto", chunk_size=4096, device_memory=330_000),
}
NAMES = [pytest.param(n, marks=pytest.mark.standin) if n == "auto-evicting" else n for n in CONFIGS]
LR = 1e-2


def _lora(task_type: str | None = "CAUSAL_LM"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(config)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                      task_type=task_type))
    with torch.no_grad():  # B starts at 0 in LoRA: make the adapter matter from the first step
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    return model


def _base():
    torch.manual_seed(0)
    return _lora().get_base_model()  # the same base weights, adapters as _lora's before training


def _batches(n: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (2, 16), generator=g).to(DEVICE) for _ in range(n)]


def _trained_pair(name: str, steps: int = 3):
    model = _lora()
    ref = copy.deepcopy(model).to(DEVICE)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, fused=True)
    gmodel, opt = gemini.initialize(model, gemini.GeminiConfig(device=DEVICE, **CONFIGS[name]), lr=LR,
                                    weight_decay=0.01)
    for ids in _batches(steps):
        for m, o in ((ref, ref_opt), (gmodel, opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()
    return (ref, ref_opt), (gmodel, opt)


@pytest.mark.parametrize("name", NAMES)
def test_lora_trains_like_plain_peft_and_saves_peft_s_adapter_files(name, tmp_path):
    """The adapter trains as plain PEFT with AdamW, the frozen base does not move; save_pretrained
    wrote the whole model under PeftModel's keys with the base's config.json (neither PEFT nor
    from_pretrained could load it): now PEFT's own files, equal to plain PEFT's, which
    PeftModel.from_pretrained loads into the trained model's outputs."""
    (ref, _), (gmodel, opt) = _trained_pair(name)
    if "device_memory" in CONFIGS[name]:
        assert opt.report.h2d_bytes > 0  # the budget evicts chunks inside the iteration
    want = cpu_copy(ref.state_dict())
    got = gmodel.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=k)
    assert peft.get_peft_model_state_dict(gmodel).keys() == peft.get_peft_model_state_dict(ref).keys()

    gmodel.save_pretrained(tmp_path / "gemini")
    ref.save_pretrained(tmp_path / "plain")
    files = {p.name for p in (tmp_path / "gemini").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    mine, theirs = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("gemini", "plain"))
    assert mine.keys() == theirs.keys() and len(mine) == 8
    for k in theirs:
        torch.testing.assert_close(mine[k], theirs[k].cpu(), rtol=1e-6, atol=1e-7, msg=k)
    loaded = peft.PeftModel.from_pretrained(_base(), tmp_path / "gemini").to(DEVICE)
    ids = _batches(4)[-1]
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["cpu", pytest.param("auto-evicting", marks=pytest.mark.standin)])
def test_merging_the_adapter_is_refused_and_training_goes_on(name):
    """merge_and_unload() wrote through .data (lost when auto dropped a device copy: logits 0.2
    off) or replaced modules; each merging call is refused, saying how to merge, and changes
    nothing."""
    (ref, ref_opt), (gmodel, opt) = _trained_pair(name, steps=2)
    for method in ("merge_and_unload", "merge_adapter", "unmerge_adapter", "unload"):
        with pytest.raises(RuntimeError, match=rf"model.{method}\(\) on gemini's model is not supported.*"
                                               r"PeftModel.from_pretrained\(base_model, folder\).merge_and_unload"):
            getattr(gmodel, method)()
    ids = _batches(3)[-1]
    for m, o in ((ref, ref_opt), (gmodel, opt)):
        m(input_ids=ids, labels=ids).loss.backward()
        o.step()
    want = cpu_copy(ref.state_dict())
    for k, v in gmodel.state_dict().items():
        torch.testing.assert_close(v, want[k], rtol=1e-6, atol=1e-7, msg=k)


def _data():
    return [{"input_ids": ids[0].cpu(), "labels": ids[0].cpu()} for ids in _batches(8)]


def _args(out, **extra):
    return transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=2, max_steps=4, learning_rate=LR, logging_steps=1,
        save_steps=2, report_to=[], use_cpu=DEVICE == "cpu", seed=42, disable_tqdm=True, weight_decay=0.01, **extra)


def test_gemini_trainer_trains_saves_and_resumes_a_peft_model_as_trainer_does(tmp_path):
    """A PeftModel built without task_type forwards (*args, **kwargs): Trainer reads its base
    model's signature, the wrapper showed (*args, **kwargs) and Trainer dropped every column
    ("The batch received was empty"). Now it trains as plain Trainer; checkpoints are PEFT's
    adapter files; resuming from one gives the uninterrupted run."""
    from gemini.hf import GeminiTrainer

    config = gemini.GeminiConfig(device=DEVICE, placement="cpu", chunk_size=4096)
    plain = transformers.Trainer(model=_lora(task_type=None), args=_args(tmp_path / "plain"), train_dataset=_data())
    plain.train()
    ours = GeminiTrainer(model=_lora(task_type=None), args=_args(tmp_path / "ours"), train_dataset=_data(),
                         gemini_config=config)
    ours.train()
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (ours, plain)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6) and len(losses[0]) == 4
    trained = {k: v for k, v in ours.model.trainable_state_dict().items()}
    want = cpu_copy(plain.model.state_dict())
    for k, v in trained.items():
        torch.testing.assert_close(v, want[k], rtol=1e-5, atol=1e-6, msg=k)
    checkpoint = tmp_path / "ours" / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").exists() and not (checkpoint / "model.safetensors").exists()

    resumed = GeminiTrainer(model=_lora(task_type=None), args=_args(tmp_path / "ours"), train_dataset=_data(),
                            gemini_config=config)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for k, v in resumed.model.trainable_state_dict().items():
        torch.testing.assert_close(v, trained[k], rtol=1e-6, atol=1e-7, msg=k)


@pytest.mark.parametrize("shard_params", [False, True], ids=["zero2", "zero3"])
def test_two_ranks_save_and_load_the_adapter_plain_peft_trains(tmp_path, shard_params):
    """Under ZeRO every rank calls save_pretrained (rank 0 writes PEFT's files from the gathered
    values; under ZeRO-3 each rank's parameters hold no values between uses) and loading them
    back gives every rank the trained adapter; the adapter is plain PEFT's with AdamW on the
    global batch (the mean of the two ranks' losses)."""
    import peft_workers
    from multiprocess import run_ranks

    run_ranks(peft_workers.save_and_load_adapter, str(tmp_path), shard_params, timeout_seconds=180)
    ref = _lora()
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, fused=True, weight_decay=0)
    for ids in _batches(3):
        ids = ids.cpu()  # the ranks train on the CPU (gloo), as the reference here
        (sum(ref(input_ids=ids[r : r + 1], labels=ids[r : r + 1]).loss for r in range(2)) / 2).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    plain = {k: v for k, v in ref.state_dict().items() if "lora_" in k}
    files = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    ref.save_pretrained(tmp_path / "plain")
    assert files.keys() == load_file(tmp_path / "plain" / "adapter_model.safetensors").keys()
    for rank in range(2):
        run = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert run["trained"].keys() == plain.keys()
        for k, want in plain.items():
            torch.testing.assert_close(run["trained"][k], want, rtol=1e-5, atol=1e-6, msg=k)
            torch.testing.assert_close(run["loaded"][k], run["trained"][k], rtol=0, atol=0, msg=k)
