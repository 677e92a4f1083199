"""The engine: one training iteration's moves and the memory they cost.

- ``runtime``: GeminiRuntime, the iteration (warm-up, planned, steady)
- ``hooks``: the one set of module and gradient hooks that drive it
- ``backward_hooks``: a backward pass begun and ended, each gradient moved into its chunk
- ``backward_uses``: each module call followed through backward (begun, done), per graph task
- ``descendant_reads``: parameters read by code outside their own module's call
- ``residency``: every move of chunk groups around compute and the step, as the policy decides
- ``step_moves``: the step's side of ``Residency`` (a base class of it)
- ``warmup``: the warm-up iteration's measurements and the plan made from them
- ``memory``: the device budget, measured (DeviceMemory)
- ``grad_views``: parameters' .grad as views of gradient chunks
- ``transaction``: a step is all or nothing
- ``load_transaction``: a checkpoint load is all or nothing
- ``interrupts``: Ctrl-C held while a step cannot stop part-way (its in-memory update, an undo)
- ``measurement``: the iteration's measurement window and budget checks
- ``evaluation_room``: what an evaluation forward borrows of auto's margin
- ``iteration_state``: IterationState, the warm-up -> planned -> steady enum
- ``step_report``: the per-step MemoryReport
- ``activations``: saved activations in host memory
- ``nvme_tier``: the step's pipeline over the optimizer-state groups in NVMe files
- ``system_memory``: host memory, measured
"""

__all__ = ["activations", "backward_hooks", "backward_uses", "descendant_reads", "evaluation_room", "grad_views",
           "hooks", "interrupts", "iteration_state", "load_transaction", "measurement", "memory", "nvme_tier",
           "residency", "runtime", "step_moves", "step_report", "system_memory", "transaction", "warmup"]
