"""MemoryReport byte counts are exact: compared with chunk capacities and a JSON Lines file."""

from __future__ import annotations

import json

import pytest
import torch

import gemini
from chunks import Tier
from gemini.gpt import GPT
from helpers import TINY, batches, make_gpt


def _payload_bytes(group, kinds):
    return sum(c.capacity * c.payload().element_size() for c in group.chunks if c.kind.value in kinds)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_placement_counts_every_byte(precision, tmp_path):
    model = make_gpt()
    model.blocks[1].mlp.fc.weight.requires_grad_(False)
    path = tmp_path / "r.jsonl"
    cfg = gemini.GeminiConfig(device="cpu", placement="cpu", chunk_size=3000, precision=precision, report_path=path)
    gmodel, opt = gemini.initialize(model, cfg)
    mgr = opt._rt.manager
    elem = 4 if precision == "fp32" else 2
    param_bytes = sum(g.param.capacity for g in mgr.groups) * elem
    grad_bytes = sum(g.grad.capacity for g in mgr.trainable_groups) * elem
    low = precision != "fp32"
    # Every flavour on the host: param (elem), and for trainable groups grad (elem), m and v
    # (fp32); the fp32 master under bf16 (frozen groups keep one too).
    host_bytes = sum(
        g.param.capacity * (elem + (elem + 8 if g.trainable else 0) + (4 if low else 0)) for g in mgr.groups
    )
    reports = []
    for x, y in batches(TINY, 3):
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        reports.append(opt.report)
    for r in reports:
        # Each param chunk crosses once for forward and once for backward; each grad chunk
        # comes back once; nothing else moves.
        assert r.h2d_bytes == 2 * param_bytes
        assert r.d2h_bytes == grad_bytes
        assert r.device_model_bytes == 0 and r.chunks_on_device == 0 and r.os_chunks_on_device == 0
        assert r.host_model_bytes == host_bytes
        assert r.host_model_bytes == sum(mgr.bytes_by_kind(Tier.HOST).values())  # ledger == chunks
        # The device peak: at least the largest single working set, at most all params + grads.
        assert 0 < r.device_peak_bytes <= param_bytes + grad_bytes
        assert r.step_seconds > 0 and r.transfer_seconds > 0 and r.optimizer_cpu_seconds > 0
        assert r.optimizer_device_seconds == 0
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [r.to_dict() for r in reports]
    assert [row["step"] for row in rows] == [0, 1, 2]


def test_cuda_placement_keeps_everything_on_device():
    gmodel, opt = gemini.initialize(make_gpt(), gemini.GeminiConfig(device="cpu", placement="cuda", chunk_size=3000))
    x, y = batches(TINY, 1)[0]
    opt.backward(GPT.loss(gmodel(x), y))
    opt.step()
    r = opt.report
    mgr = opt._rt.manager
    assert r.h2d_bytes == 0 and r.d2h_bytes == 0 and r.host_model_bytes == 0
    assert r.os_chunks_on_device == len(mgr.trainable_groups)
    assert r.device_model_bytes == sum(c.nbytes for c in mgr.chunks() if c.is_on(Tier.DEVICE))
    assert r.optimizer_device_seconds > 0 and r.optimizer_cpu_seconds == 0
    assert set(r.to_dict()) >= {
        "step", "device_peak_bytes", "device_model_bytes", "device_non_model_peak_bytes", "host_model_bytes",
        "nvme_bytes", "h2d_bytes", "d2h_bytes", "nvme_read_bytes", "nvme_write_bytes", "chunks_on_device",
        "os_chunks_on_device", "step_seconds", "transfer_seconds", "optimizer_cpu_seconds",
        "optimizer_device_seconds", "skipped", "loss_scale",
    }
