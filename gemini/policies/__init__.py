"""Placement policies: where each chunk group lives, one class per policy.

- ``placement``: the base class and the cuda, cpu, static and auto policies
- ``footprint``: the bytes a placement needs and the margin rules shared with the planner
- ``nvme_choice``: which optimizer-state groups live in NVMe files
"""

__all__ = ["footprint", "nvme_choice", "placement"]
