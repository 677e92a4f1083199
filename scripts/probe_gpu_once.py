"""Session 28's GPU probes (benchmarks/results/gpu_probe_5.log): the accounting monitor against requested bytes per
batch size, and why the compiled model with activation offload compiles nothing on torch 2.11."""
import sys
import torch

sys.path[:0] = ["tests", "tests/tracer", "."]


def accounting():
    import test_tracer_runtime as t
    from tracer import CudaAllocatorMonitor, RuntimeTracer, TensorAccountingMonitor
    for batch in (4, 8, 12, 15, 16):
        torch.manual_seed(0)
        model = t.TinyGPT().cuda()
        idx, tgt = t._batch(batch, device="cuda")
        param_bytes = t._param_bytes(model)
        t._step(model, idx, tgt)
        results = []
        for monitor in (t._RequestedBytesMonitor("cuda"), TensorAccountingMonitor("cuda")):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            base = monitor._current_bytes() - param_bytes if isinstance(monitor, CudaAllocatorMonitor) else 0
            tracer = RuntimeTracer(model, monitor, model_bytes_fn=lambda base=base: param_bytes + base)
            with tracer.trace():
                t._step(model, idx, tgt)
                torch.cuda.synchronize()
            results.append(tracer.periods)
        worst = []
        for r, b in zip(*results):
            if r.non_model_peak_bytes > 1 << 20:
                worst.append((b.non_model_peak_bytes / r.non_model_peak_bytes - 1, r.non_model_peak_bytes - b.non_model_peak_bytes,
                               r.phase.value, r.module_name))
        worst.sort()
        print(f"ACCOUNTING batch {batch}: {len(worst)} periods >1MiB; lowest {worst[:2]}; highest {worst[-1:]}", flush=True)


def compiled():
    import gemini
    from torch import nn
    from torch._dynamo.utils import counters
    for name, extra in (("cpu", dict(placement="cpu")), ("cpu-no-offload", dict(placement="cpu", offload_activations=False))):
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        cfg = dict(device="cuda", chunk_size=2**16, offload_activations=True, activation_offload_min_bytes=1024)
        cfg.update(extra)
        gmodel, opt = gemini.initialize(base, gemini.GeminiConfig(**cfg), lr=1e-2)
        compiled = torch.compile(gmodel, backend="aot_eager")
        for step in range(3):
            x = torch.randn(256, 64, device="cuda")
            opt.backward(compiled(x).square().mean())
            opt.step()
            opt.zero_grad()
        short = lambda c: {" | ".join(k.splitlines()[:3])[:300]: v for k, v in c.items()}
        print(f"COMPILE {name}: graphs {counters['stats']['unique_graphs']}, frames {dict(counters['frames'])}, "
              f"breaks {short(counters['graph_break'])}, unimplemented {short(counters['unimplemented'])}", flush=True)
        opt.close()
    print("torch", torch.__version__, flush=True)


if __name__ == "__main__":
    for f in sys.argv[1:]:
        try:
            globals()[f]()
        except Exception:  # a probe's failure is a finding
            import traceback
            traceback.print_exc()
