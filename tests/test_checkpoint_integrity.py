"""Checkpoint files beyond their tensors: damage anywhere is caught with one error naming the file
([Note: a checkpoint's checksums] in gemini/checkpoint_file.py), a refused load changes nothing,
and the param groups load as torch's do."""

from __future__ import annotations

import re
import zipfile

import pytest
import torch
from torch import nn

import gemini
from gemini.checkpoint import CheckpointCorruptionError
from gemini.tools.gpt import GPT
from helpers import DEVICE, TINY, batches, make_gpt


def _trained(steps: int = 1, **cfg):
    model, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device=DEVICE, placement="cpu", **cfg), lr=1e-2)
    for x, y in batches(TINY, steps):
        opt.backward(GPT.loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return model, opt


def _loaded(model, opt):
    sd = opt.state_dict()
    return (model.state_dict(), {i: dict(e) for i, e in sd["state"].items()},
            [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])


def _same(a, b) -> bool:
    (pa, sa, ga), (pb, sb, gb) = a, b
    return (all(torch.equal(pa[k], pb[k]) for k in pb) and sa.keys() == sb.keys() and ga == gb
            and all(torch.equal(sa[i][k], sb[i][k]) for i in sb for k in sb[i]))


def test_a_flipped_byte_outside_the_tensors_is_caught_or_changes_nothing(tmp_path):
    """Each byte of the pickled structure around the param groups (their hyperparameters, the
    ``params`` lists, the state's keys) flipped in turn: the load raises an error naming the
    file, or loads exactly what the intact file holds; never a changed learning rate or a
    dropped state, and never an error that does not say which file."""
    model, opt = _trained()
    good = tmp_path / "good.pt"
    gemini.save_checkpoint(good, model, opt)
    gemini.load_checkpoint(good, model, opt)
    want = _loaded(model, opt)
    info = next(i for i in zipfile.ZipFile(good).infolist() if i.filename.endswith("data.pkl"))
    data = good.read_bytes()
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    at = data.index(b"betas", start)
    bad = tmp_path / "bad.pt"
    caught = 0
    for offset in range(at - 60, at + 200):
        damaged = bytearray(data)
        damaged[offset] ^= 0x5A
        bad.write_bytes(bytes(damaged))
        try:
            gemini.load_checkpoint(bad, model, opt)
        except Exception as e:  # noqa: BLE001 - any type, as long as it names the file
            assert str(bad) in str(e), f"offset {offset}: {type(e).__name__}: {e}"
            caught += 1
        assert _same(_loaded(model, opt), want), f"offset {offset}: the training state changed"
    assert caught > 100  # most flips break the pickle or its checksum


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint", bytes(range(256)) * 4, "truncated"])
def test_a_file_that_is_not_a_whole_checkpoint_is_named(content, tmp_path):
    model, opt = _trained()
    path = tmp_path / "ckpt.pt"
    if content == "truncated":
        gemini.save_checkpoint(path, model, opt)
        content = path.read_bytes()[: path.stat().st_size // 2]
    path.write_bytes(content)
    with pytest.raises(CheckpointCorruptionError, match=re.escape(str(path)) + ".*(empty|not a checkpoint|damaged)"):
        gemini.load_checkpoint(path, model, opt)


def test_a_checkpoint_with_tensor_checksums_only_still_loads(tmp_path):
    """Written before the structure's checksum existed: loads, its tensors still verified."""
    model, opt = _trained(steps=2)
    path = tmp_path / "ckpt.pt"
    gemini.save_checkpoint(path, model, opt)
    raw = torch.load(path, weights_only=True)
    del raw["structure_crc32"]
    torch.save(raw, path)
    model2, opt2 = _trained(steps=0)
    gemini.load_checkpoint(path, model2, opt2)
    assert _same(_loaded(model2, opt2), _loaded(model, opt))


def test_loading_replaces_the_param_groups_values_as_torch_does(tmp_path):
    """A key the saved groups lack goes, as in torch.optim.Optimizer.load_state_dict."""
    model, opt = _trained()
    saved = opt.state_dict()
    ref = torch.optim.AdamW(make_gpt().parameters(), lr=1e-2)
    ref_saved = ref.state_dict()
    for o in (opt, ref):
        o.param_groups[0]["stray"] = 1
        o.param_groups[0]["lr"] = 5.0
    opt.load_state_dict(saved)
    ref.load_state_dict(ref_saved)
    assert "stray" not in ref.param_groups[0] and ref.param_groups[0]["lr"] == 1e-2  # the premise
    assert "stray" not in opt.param_groups[0] and opt.param_groups[0]["lr"] == 1e-2
    assert opt.param_groups[0]["params"] is opt._layout._lists[0]  # the same list: the step's check stays cheap


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.bn, self.l2 = nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Linear(32, 4)

    def forward(self, x):
        return self.l2(torch.relu(self.bn(self.l1(x))))


def _net_trained(steps: int = 3, weight_decay: float = 0.1, **cfg):
    model, opt = gemini.initialize(_Net(), gemini.GeminiConfig(device=DEVICE, placement="cpu", **cfg), lr=1e-2,
                                   weight_decay=weight_decay)
    x, y = torch.randn(8, 16, device=DEVICE), torch.randn(8, 4, device=DEVICE)
    for _ in range(steps):
        opt.backward(((model(x) - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
    return model, opt


def test_a_refused_sharded_load_leaves_the_buffers_as_they_were(tmp_path):
    """Another weight-decay mode refuses a sharded checkpoint before anything, the module's
    buffers too, is written (as the consolidated load does)."""
    model, opt = _net_trained()
    gemini.save_checkpoint(tmp_path / "sharded", model, opt, sharded=True)
    other, other_opt = gemini.initialize(_Net(), gemini.GeminiConfig(device=DEVICE, placement="cpu"), lr=1e-2,
                                         weight_decay=0.1, adamw_mode=False)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))}.*adamw_mode=True"):
        gemini.load_checkpoint(tmp_path / "sharded", other, other_opt, sharded=True)
    after = other.state_dict()
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    assert int(after["bn.num_batches_tracked"]) == 0 and int(model.state_dict()["bn.num_batches_tracked"]) == 3


@pytest.mark.parametrize("other", [dict(chunk_size=1024), dict(precision="bf16")], ids=["chunk_size", "bf16"])
def test_a_sharded_checkpoint_loads_into_another_layout_as_the_consolidated_one(tmp_path, other):
    """Another chunk layout or precision than the save's: the shards are made whole and loaded
    as the consolidated file of the same step is (before: a ValueError to use state_dict())."""
    model, opt = _net_trained(chunk_size=4096)
    gemini.save_checkpoint(tmp_path / "sharded", model, opt, sharded=True)
    gemini.save_checkpoint(tmp_path / "whole.pt", model, opt)
    loaded = []
    for path, sharded in ((tmp_path / "sharded", True), (tmp_path / "whole.pt", False)):
        m, o = _net_trained(steps=0, **other)
        gemini.load_checkpoint(path, m, o, sharded=sharded)
        loaded.append(_loaded(m, o))
    assert _same(loaded[0], loaded[1])
    assert int(loaded[0][0]["bn.num_batches_tracked"]) == 3 and loaded[0][1]  # buffers and states came


def test_a_sharded_checkpoint_is_made_whole_only_from_one_saves_files(tmp_path):
    """Files of different saves (ranges that do not tile a chunk group) are refused naming the
    file; a file from before the manifest still loads into its own world size, and making it
    whole says why it cannot. Nothing is loaded by a refused load."""
    from gemini.checkpoint_file import atomic_save

    model, opt = _trained(steps=2, chunk_size=3000)
    gemini.save_checkpoint(tmp_path / "one", model, opt, sharded=True)
    mine = (tmp_path / "one" / "rank00000-of-00001.pt").read_bytes()
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    for rank in range(2):  # each "rank" of two the whole group: the second range begins at 0 again
        (mixed / f"rank{rank:05d}-of-00002.pt").write_bytes(mine)
    with pytest.raises(CheckpointCorruptionError, match=r"rank00001-of-00002\.pt: chunk group 0's range begins at "
                                                        r"element 0, the ranks before it end at [1-9]"):
        gemini.consolidate_checkpoint(mixed)
    other, other_opt = _trained(steps=1, chunk_size=3000)
    before = _loaded(other, other_opt)
    with pytest.raises(CheckpointCorruptionError, match="different saves"):
        gemini.load_checkpoint(mixed, other, other_opt, sharded=True)  # another world's files: made whole
    assert _same(_loaded(other, other_opt), before)

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    atomic_save({"buffers": {}, "optimizer": opt.sharded_state_dict()}, legacy / "rank00000-of-00001.pt")
    with pytest.raises(ValueError, match="before sharded checkpoints carried a manifest: load it into 1 rank"):
        gemini.consolidate_checkpoint(legacy)
    gemini.load_checkpoint(legacy, other, other_opt, sharded=True)
    assert _same(_loaded(other, other_opt), _loaded(model, opt))
