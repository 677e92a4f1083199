"""What each rank runs in tests/test_pretrained.py's ZeRO test (kept apart from the test module
so that the spawned ranks do not import transformers)."""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from torch import nn

import gemini
from gemini.pretrained import SafetensorsCheckpoint, load_pretrained_into


def zero_net() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 40), nn.LayerNorm(40), nn.Linear(40, 24), nn.Linear(24, 4))


def zero_load_and_save(rank: int, world: int, weights: str, out: str, other: str) -> None:
    """A meta model loaded with ZeRO-3 under bf16 (parameter and master shards, so only this
    rank's ranges are read), its consolidated state equal to the file, a collective
    save_pretrained, then ``other`` loaded into the running model (each rank its ranges)."""
    counted = {"bytes": 0}
    read = SafetensorsCheckpoint.read

    def counting_read(self, key, start=0, stop=None):
        value = read(self, key, start, stop)
        counted["bytes"] += value.numel() * value.element_size()
        return value

    SafetensorsCheckpoint.read = counting_read
    with torch.device("meta"):
        model = zero_net()
    gmodel, _ = gemini.initialize(model, gemini.GeminiConfig(
        device="cpu", placement="cpu", precision="bf16", chunk_size=600, shard_params=True), weights=weights)
    want = load_file(weights)
    total = sum(v.numel() * v.element_size() for v in want.values())
    # This rank's ranges only: about half of the file (the chunks' padding falls on the last rank).
    assert 0 < counted["bytes"] < 0.6 * total, (rank, counted["bytes"], total)
    got = gmodel.state_dict()  # a collective
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), (rank, k)
    files = gemini.save_pretrained(gmodel, out, max_shard_size="2KB")  # a collective; rank 0 writes
    assert (len(files) > 1) == (rank == 0), (rank, files)
    before = counted["bytes"]
    load_pretrained_into(gmodel, other)
    assert 0 < counted["bytes"] - before < 0.6 * total, (rank, counted["bytes"] - before, total)
    got, want = gmodel.state_dict(), load_file(other)
    for k in want:
        assert torch.equal(got[k], want[k]), (rank, k)
