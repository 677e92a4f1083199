"""Diagnostics for the first CUDA run's findings (not a test): why the engine sees no backward
pass on CUDA, and whether plain torch on CUDA is bit-reproducible across copies of the model.

    python scripts/gpu_diag.py
"""
import copy
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
import gemini  # noqa: E402
from gemini.engine import hooks as H  # noqa: E402
from gemini.tools.gpt import GPT  # noqa: E402
from helpers import TINY, batches, clone_pair  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
log = []
orig_begin, orig_comp, orig_end = (H.ModuleHooks._begin_backward_pass, H.ModuleHooks._computes_parameter_gradients,
                                   H.ModuleHooks._end_of_backward)


def begin(self):
    if torch._C._current_graph_task_id() != self._task_seen:
        log.append(("begin", torch._C._current_graph_task_id(), self._task_seen, self._backward_task, self._iteration_pass))
    return orig_begin(self)


def comp(self):
    out = []
    for group in self.manager.trainable_groups:
        for p in group.params[:2]:
            try:
                node = torch.autograd.graph.get_gradient_edge(p).node
                out.append((type(node).__name__, torch._C._will_engine_execute_node(node), p.is_leaf, p.device))
            except Exception as e:
                out.append(repr(e)[:200])
    r = orig_comp(self)
    log.append(("computes", r, out[:4]))
    return r


def end(self):
    log.append(("end", self._iteration_pass, torch._C._current_graph_task_id()))
    return orig_end(self)


H.ModuleHooks._begin_backward_pass, H.ModuleHooks._computes_parameter_gradients, H.ModuleHooks._end_of_backward = \
    begin, comp, end

for placement in ("cpu", "auto", "cuda"):
    log.clear()
    try:
        base, _ = clone_pair()
        model, opt = gemini.initialize(base, gemini.GeminiConfig(device=DEV, placement=placement, chunk_size=8192),
                                       lr=1e-2)
        for x, y in batches(TINY, 2, device=DEV):
            loss = GPT.loss(model(x), y)
            log.append(("loss", type(loss.grad_fn).__name__))
            opt.backward(loss)
            log.append(("after backward", opt._rt.hooks.backward_passes))
            opt.step()
            opt.zero_grad()
        print(placement, "OK")
    except Exception:
        print(placement, "FAILED:", traceback.format_exc()[-600:])
    for e in log:
        print("   ", e)

# Plain torch on CUDA, two copies of one model: bit-equal after 3 steps? And with every
# parameter a view at an odd offset of one flat buffer (what chunks do)?
def train(model, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    for x, y in data:
        GPT.loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


data = batches(TINY, 3, device=DEV)
base, _ = clone_pair()
a = train(copy.deepcopy(base).to(DEV), data)
b = train(copy.deepcopy(base).to(DEV), data)


def flat_views(align_elements: int, start: int):
    """The model with every parameter a view into one flat buffer, each view's first element at
    ``start`` plus a multiple of ``align_elements`` (1 and 1: chunks' packing today)."""
    model = copy.deepcopy(base).to(DEV)
    sizes = [-(-p.numel() // align_elements) * align_elements for p in model.parameters()]
    flat = torch.zeros(start + sum(sizes), device=DEV)
    off = start
    for p, size in zip(model.parameters(), sizes):
        view = flat[off:off + p.numel()].view_as(p)
        view.copy_(p.data)
        p.data = view
        off += size
    return model


# Does aligning each view as the caching allocator aligns a tensor (512 bytes) make torch on
# views bit-equal to torch on standalone tensors? (If so, chunk slots aligned so would make
# gemini bit-identical to torch on a GPU too: [Note: equal to torch on a GPU] in tests/helpers.py.)
for name, align, start in (("copy", None, 0), ("views, packed at an odd offset", 1, 1),
                           ("views, 16-byte aligned", 4, 0), ("views, 512-byte aligned", 128, 0),
                           ("views, 4 KiB aligned", 1024, 0)):
    other = b if align is None else train(flat_views(align, start), data)
    diffs = {k: (a[k] - other[k]).abs().max().item() for k in a}
    worst = max(diffs, key=diffs.get)
    print(f"torch vs torch ({name}): {sum(v > 0 for v in diffs.values())}/{len(diffs)} tensors differ; worst {worst} "
          f"{diffs[worst]:.3g}")


# gemini with its slots aligned ([Note: aligned slots] in chunks/layout.py) against torch: if no
# tensor differs under any placement, [Note: equal to torch on a GPU] in tests/helpers.py can go.
def train_gemini(placement: str):
    gmodel, opt = gemini.initialize(copy.deepcopy(base), gemini.GeminiConfig(device=DEV, placement=placement,
                                                                             chunk_size=4096),
                                    lr=1e-2, weight_decay=0.1)
    for x, y in data:
        opt.backward(GPT.loss(gmodel(x), y))
        opt.step()
        opt.zero_grad()
    out = {k: v.detach().cpu() for k, v in gmodel.state_dict().items()}
    opt.close()
    return out


for placement in ("cuda", "cpu", "auto"):
    try:
        g = train_gemini(placement)
        diffs = {k: (a[k] - g[k]).abs().max().item() for k in a}
        worst = max(diffs, key=diffs.get)
        print(f"gemini {placement} (aligned slots) vs torch: {sum(v > 0 for v in diffs.values())}/{len(diffs)} tensors "
              f"differ; worst {worst} {diffs[worst]:.3g}")
    except Exception:
        print(f"gemini {placement} vs torch FAILED:", traceback.format_exc()[-600:])
torch.use_deterministic_algorithms(True, warn_only=True)
d = train(copy.deepcopy(base).to(DEV), data)
e = train(copy.deepcopy(base).to(DEV), data)
diffs = {k: (d[k] - e[k]).abs().max().item() for k in d}
print("deterministic, two copies:", sum(v > 0 for v in diffs.values()), "differ")
