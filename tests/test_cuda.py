"""The equivalence and accounting tests on a real CUDA device (skipped without one)."""

from __future__ import annotations

import pytest
import torch

import gemini
from chunks import Tier
from gemini.tools.gpt import GPT
from helpers import TINY, assert_params_close, batches, clone_pair

pytestmark = pytest.mark.cuda


def _cuda_batches(n):
    return [(x.cuda(), y.cuda()) for x, y in batches(TINY, n)]


@pytest.mark.parametrize("placement", ["cuda", "cpu"])
@pytest.mark.parametrize("chunk_size", [1000, None])
def test_fp32_training_equals_adamw_on_cuda(placement, chunk_size):
    base, ref = clone_pair()
    ref = ref.cuda()
    data = _cuda_batches(10)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    gmodel, opt = gemini.initialize(
        base, gemini.GeminiConfig(device="cuda", placement=placement, chunk_size=chunk_size, clip_grad_norm=1.0),
        lr=1e-2, weight_decay=0.1,
    )
    for step, (x, y) in enumerate(data):
        GPT.loss(ref(x), y).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt_ref.step()
        opt_ref.zero_grad()
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
        want = {k: v.cpu() for k, v in ref.state_dict().items()}
        assert_params_close(gmodel.state_dict(), want, rtol=1e-5, atol=1e-6, step=step)
    r = opt.report
    if placement == "cpu":
        assert r.optimizer_cpu_seconds > 0 and r.os_chunks_on_device == 0 and r.h2d_bytes > 0
        # Host copies are pinned, so copies are DMA and can overlap compute.
        g = opt._rt.manager.groups[0]
        assert g.exp_avg.payload(Tier.HOST).is_pinned()
    else:
        assert r.optimizer_device_seconds > 0 and r.h2d_bytes == 0
    assert r.device_peak_bytes >= r.device_model_bytes


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_on_cuda_tracks_fp32(precision):
    base, ref = clone_pair()
    data = [(x.cuda(), y.cuda()) for x, y in batches(TINY, 1)] * 10
    ref = ref.cuda()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(device="cuda", placement="cpu", precision=precision,
                                                              chunk_size=20_000), lr=3e-3)
    for x, y in data:
        want = GPT.loss(ref(x), y)
        want.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        got = GPT.loss(gmodel(x), y)
        opt.backward(got)
        opt.step()
        opt.zero_grad()
        assert got.item() == pytest.approx(want.item(), rel=0.02)


@pytest.mark.cuda
@pytest.mark.parametrize("placement", ["cpu", "static"])
def test_async_copies_and_nvme_states_on_cuda_equal_adamw(tmp_path, placement):
    """Gradients leave the device asynchronously (events, not a sync per chunk), updated params
    return asynchronously (static keeps params on the device), Adam states stream from NVMe:
    the result is still plain AdamW's."""
    base, ref = clone_pair()
    ref = ref.cuda()
    data = _cuda_batches(6)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    cfg = gemini.GeminiConfig(device="cuda", placement=placement, chunk_size=2000, nvme_dir=str(tmp_path),
                              nvme_offload_fraction=0.5, static_optimizer_offload_fraction=1.0)
    gmodel, opt = gemini.initialize(base, cfg, lr=1e-2, weight_decay=0.1)
    asynchronous = 0
    for step, (x, y) in enumerate(data):
        GPT.loss(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
        opt.backward(GPT.loss(gmodel(x), y))
        asynchronous += sum(g.grad._host_event is not None for g in opt._rt.manager.trainable_groups)
        opt.step()
        opt.zero_grad()
        want = {k: v.detach().cpu() for k, v in ref.state_dict().items()}
        assert_params_close(gmodel.state_dict(), want, step=step)
    assert asynchronous > 0, "no gradient chunk was copied to the host asynchronously"
    assert opt.report.nvme_read_bytes > 0
    opt.close()
