"""Which adapters sit in the device's LoRA slots, and one step's row grouping (the model thread's).

`LoRASlots` attaches a `LoRAStacks` to every LoRA-capable linear of the model (foveal/lora/adapter.py
`LoRALayout`) and binds each forward pass's `StepContext.lora` to them (a forward pre-hook). Before a
step the runner asks `groups(...)` for its items' slots (`hold` and `release` count the held requests
of each adapter): an adapter already resident keeps its slot; a missing one goes to a free slot, else
to the least recently used slot whose adapter no held request uses, else to the least recently used
one the step does not use. The scheduler never runs more distinct adapters than there are slots, so a
slot in use by the step is never taken. Copies are queued on the compute stream before the step's
forward pass: a step still running on the device reads the old weights first.

`group_rows` turns a step's per-item slots into the LoRABatch layout (rows grouped by slot, padding
and base rows in the last group) as one host list, so one device copy carries it.
"""

from __future__ import annotations

from collections import Counter

import torch

from foveal.lora.adapter import HostAdapter, LoRALayout
from foveal.lora.stacks import LoRABatch, LoRAStacks, LoRAState


class LoRASlots:
    def __init__(self, model, num_slots: int, max_rank: int, dtype: torch.dtype, device, fused=None):
        if num_slots < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        self.layout = LoRALayout(model)
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.state = LoRAState()
        self.stacks: dict[str, LoRAStacks] = {}
        for name, target in self.layout.targets.items():
            mod = model.get_submodule(name)
            st = LoRAStacks(target, self.state, num_slots, max_rank, dtype, self.device, mod, fused)
            mod.lora = st
            self.stacks[name] = st
        model.register_forward_pre_hook(self._bind)
        self.resident: list[int | None] = [None] * num_slots  # each slot's adapter uid (not the adapter:
        # an unloaded adapter's host memory goes with its last request, not when its slot is rewritten)
        self._used = [0] * num_slots  # the step that last used each slot (LRU)
        self.held: Counter = Counter()  # adapter uid -> requests the runner holds that use it
        self._tick = 0
        self.num_loads = 0  # slot writes so far

    @property
    def nbytes(self) -> int:
        return sum(st.nbytes for st in self.stacks.values())

    def _bind(self, module, args) -> None:
        self.state.batch = args[1].lora

    def slot_of(self, uid: int) -> int | None:
        return self.resident.index(uid) if uid in self.resident else None

    def slots_for(self, adapters: list[HostAdapter], held: Counter | None = None) -> dict[int, int]:
        """uid -> slot for a step's adapters, loading the missing ones. `held`: uids of the requests the
        runner holds (their slots are taken last)."""
        wanted = {a.uid: a for a in adapters}
        if len(wanted) > self.num_slots:
            raise RuntimeError(
                f"a step uses {len(wanted)} adapters but only {self.num_slots} fit (--max-loras): "
                "the scheduler must not schedule more"
            )
        self._tick += 1
        out: dict[int, int] = {}
        for uid in wanted:
            s = self.slot_of(uid)
            if s is not None:
                out[uid] = s
        for uid, adapter in wanted.items():
            if uid in out:
                continue
            s = self._victim(wanted, held or Counter())
            self._write(s, adapter)
            out[uid] = s
        for s in out.values():
            self._used[s] = self._tick
        return out

    def _victim(self, wanted: dict, held: Counter) -> int:
        if None in self.resident:
            return self.resident.index(None)
        others = [s for s, uid in enumerate(self.resident) if uid not in wanted]
        idle = [s for s in others if not held[self.resident[s]]]
        return min(idle or others, key=self._used.__getitem__)

    def _write(self, slot: int, adapter: HostAdapter) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(
                f"adapter {adapter.name!r} has rank {adapter.rank} > max_lora_rank {self.max_rank}"
            )
        for name, st in self.stacks.items():
            st.write(slot, adapter.weights.get(name, ()))
        self.resident[slot] = adapter.uid
        self.num_loads += 1

    def hold(self, adapter: HostAdapter) -> None:
        """A held request uses `adapter` (its slot is taken last)."""
        self.held[adapter.uid] += 1

    def release(self, adapter: HostAdapter) -> None:
        self.held[adapter.uid] -= 1

    def groups(self, loras: list[HostAdapter | None], rows: list[int]) -> tuple[list[tuple[int, int]], bool]:
        """Per item (its adapter's slot, or the base group; its rows), loading the step's adapters into
        slots; and whether any item has an adapter. `loras[i]`: item i's adapter or None."""
        adapters = [a for a in loras if a is not None]
        slots = self.slots_for(adapters, self.held) if adapters else {}
        base = self.num_slots
        return [(base if a is None else slots[a.uid], n) for a, n in zip(loras, rows)], bool(adapters)

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
