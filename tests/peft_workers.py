"""What each rank runs in tests/test_peft.py's ZeRO test (the model and data are test_peft's)."""

from __future__ import annotations

import torch

import gemini
from gemini.peft import load_adapter_into
import test_peft as tp


def save_and_load_adapter(rank: int, world: int, out_dir: str, shard_params: bool) -> None:
    """Each rank trains on its half of every batch, saves the adapter (rank 0 writes), and a fresh
    model on each rank loads it back; saves what it trained and what it loaded."""
    config = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=4096, shard_params=shard_params)
    model, opt = gemini.initialize(tp._lora(), config, lr=tp.LR)
    for ids in tp._batches(3):
        part = ids[rank * 2 // world : (rank + 1) * 2 // world].cpu()  # on the CPU beside a GPU too
        model(input_ids=part, labels=part).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(f"{out_dir}/adapter")  # a collective: every rank calls it
    fresh, _ = gemini.initialize(tp._lora(), config, lr=tp.LR)
    load_adapter_into(fresh, f"{out_dir}/adapter")
    torch.save({"trained": model.trainable_state_dict(), "loaded": fresh.trainable_state_dict()},
               f"{out_dir}/rank{rank}.pt")
