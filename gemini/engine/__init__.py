"""The engine: one training iteration's moves and the memory they cost.

- ``runtime``: GeminiRuntime, the iteration (warm-up, planned, steady)
- ``hooks``: the one set of module and gradient hooks that drive it
- ``residency``: every move of chunk groups around compute and the step, as the policy decides
- ``warmup``: the warm-up iteration's measurements and the plan made from them
- ``memory``: the device budget, measured (DeviceMemory)
- ``grad_views``: parameters' .grad as views of gradient chunks
- ``transaction``: a step is all or nothing
- ``step_report``: the per-step MemoryReport
- ``activations``: saved activations in host memory
- ``nvme_tier``: the step's pipeline over the optimizer-state groups in NVMe files
- ``system_memory``: host memory, measured
"""

__all__ = ["activations", "grad_views", "hooks", "memory", "nvme_tier", "residency", "runtime", "step_report", "system_memory",
           "transaction", "warmup"]
