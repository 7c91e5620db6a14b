"""The device's LoRA slots (the model thread's): a `LoRAStacks` on every LoRA-capable linear of the
model (foveal/lora/adapter.py `LoRALayout`), and the slot writes a step asks for. Which adapter goes
to which slot is decided on the scheduling side (foveal/lora/driver.py); the runner applies its
`LoRAStep`: writes queued on the compute stream before the step's forward pass, so a step still
running on the device reads the old weights first. The step's rows reach the stacks as
`StepContext.lora` (a `LoRABatch`), which the model passes to every LoRA-capable linear.

`group_rows` turns a step's per-item slots into the LoRABatch layout (rows grouped by slot, padding
and base rows in the last group) as one host list, so one device copy carries it.
"""

from __future__ import annotations

import torch

from foveal.lora.adapter import HostAdapter, LoRALayout
from foveal.lora.stacks import LoRABatch, LoRAStacks


class LoRASlots:
    def __init__(self, model, num_slots: int, max_rank: int, dtype: torch.dtype, device, fused=None):
        if num_slots < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.layout = LoRALayout(model)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.stacks: dict[str, LoRAStacks] = {}
        for name, target in self.layout.targets.items():
            mod = model.get_submodule(name)
            st = LoRAStacks(target, num_slots, max_rank, dtype, self.device, mod, fused)
            mod.lora = st
            self.stacks[name] = st
        self.num_loads = 0  # slot writes so far

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.stacks.values())

    def load(self, writes) -> None:
        """Write each (slot, adapter) of a step's LoRAStep.loads into the stacks."""
        for slot, adapter in writes:
            self.write(slot, adapter)

    def write(self, slot: int, adapter: HostAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank {self.max_rank}"
            )
        for name, st in self.stacks.items():
            st.write(slot, adapter.weights.get(name, ()))
        self.num_loads += 1

    def batch(self, packed: torch.Tensor, rows: int) -> LoRABatch:
        """The LoRABatch of a `group_rows` list already on the device."""
        return LoRABatch(packed[:rows], packed[rows:].to(torch.int32))


def group_rows(segments: list[tuple[int, int]], num_groups: int, total: int | None = None) -> list[int]:
    """Rows grouped by slot: per item (its group, its rows) in row order, group num_groups - 1 being
    the base (no adapter); rows past the items (graph padding, up to `total`) join the base group.
    Returns perm (total entries) + offs (num_groups cumulative ends), one list."""
    by_group: list[list[tuple[int, int]]] = [[] for _ in range(num_groups)]
    at = 0
    for g, n in segments:
        by_group[g].append((at, n))
        at += n
    total = at if total is None else total
    perm: list[int] = []
    offs: list[int] = []
    for runs in by_group:
        for a, n in runs:
            perm.extend(range(a, a + n))
        offs.append(len(perm))
    perm.extend(range(at, total))  # padding rows: the base group, last
    offs[-1] = len(perm)
    return perm + offs
