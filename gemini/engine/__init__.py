"""The engine: one training iteration's moves and the memory they cost.

- ``runtime``: GeminiRuntime, the iteration (warm-up, planned, steady)
- ``hooks``: the one set of module and gradient hooks that drive it
- ``backward_uses``: each module call followed through backward (begun, done), per graph task
- ``residency``: every move of chunk groups around compute and the step, as the policy decides
- ``step_moves``: the step's side of ``Residency`` (a base class of it)
- ``warmup``: the warm-up iteration's measurements and the plan made from them
- ``memory``: the device budget, measured (DeviceMemory)
- ``grad_views``: parameters' .grad as views of gradient chunks
- ``transaction``: a step is all or nothing
- ``step_report``: the per-step MemoryReport
- ``activations``: saved activations in host memory
- ``nvme_tier``: the step's pipeline over the optimizer-state groups in NVMe files
- ``system_memory``: host memory, measured
"""

__all__ = ["activations", "backward_uses", "grad_views", "hooks", "memory", "nvme_tier", "residency", "runtime",
           "step_moves", "step_report", "system_memory", "transaction", "warmup"]
