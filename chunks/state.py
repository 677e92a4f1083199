"""`ChunkState`: which copies of a chunk's payload exist (the state machine of chunks/chunk.py)."""

from __future__ import annotations

import enum

__all__ = ["ChunkState", "STATE_OF"]


class ChunkState(enum.Enum):
    """Which copies of a chunk's payload exist, and so which memory it uses.

    - ``RELEASED``: no copy; uses no memory (a gradient chunk before the first backward).
    - ``HOST``: one copy in host memory.
    - ``DEVICE``: one copy on the compute device.
    - ``HOST_AND_DEVICE``: a device copy identical to the host copy, both counted; the device
      copy can be dropped without a device-to-host copy (parameters fetched for compute),
      unless torch code wrote into it through the parameters ([Note: writes through the
      parameters] in chunks/edits.py).
    - ``NVME``: one copy, in a file of the NVMe store; uses no memory, only disk.
    - ``HOST_AND_NVME``: a host copy identical to the file (just read, or just written and
      kept); the host copy can be dropped without writing it again.

    A chunk with a read or write in flight stays in the state it had before the request (see
    [Note: NVMe moves are two-phase] in chunks/chunk.py).
    """

    RELEASED = "released"
    HOST = "host"
    DEVICE = "device"
    HOST_AND_DEVICE = "host_and_device"
    NVME = "nvme"
    HOST_AND_NVME = "host_and_nvme"


# (host copy, device copy, current file) -> state. A file next to a device copy never exists:
# only host copies are written to or read from NVMe.
STATE_OF = {
    (False, False, False): ChunkState.RELEASED,
    (True, False, False): ChunkState.HOST,
    (False, True, False): ChunkState.DEVICE,
    (True, True, False): ChunkState.HOST_AND_DEVICE,
    (False, False, True): ChunkState.NVME,
    (True, False, True): ChunkState.HOST_AND_NVME,
}
