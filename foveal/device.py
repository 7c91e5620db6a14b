"""Host -> device copies of a step's small tensors that never make the host wait for the device.

A plain `t.to("cuda")` waits for the stream to drain, and a non-blocking copy from pageable memory may
too; either would stall the host while the device runs the previous step (async scheduling). Staging
through pinned memory (PyTorch's caching host allocator, which keeps the block until the copy is done)
makes the copy truly asynchronous. On a CPU device this is the identity.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
