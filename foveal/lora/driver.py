"""LoRA's driver, on the scheduling side: which device slot holds which adapter, and so per step each
item's slot and the slot writes the step needs first. The scheduler calls it; the runner receives the
answer as plain values (`ScheduledBatch.lora`). Each request carries its adapter (`Request.lora`), so
the driver keeps nothing per request:

    cap = driver.cap(running)        a step's admission cap: `cap.admits(req)`, then `cap.add(req)`
    driver.plan(items, requests)     -> LoRAStep (per item its slot; (slot, adapter) writes), or None
    driver.report(running, waiting)  the metrics' view

Slots: an adapter already resident keeps its slot; a missing one goes to a free slot, else to the
least recently used slot whose adapter no held request uses, else to the least recently used one the
step does not use. The cap keeps a step's distinct adapters within the slots, so a slot the step uses
is never taken. The runner queues each write on the compute stream before the step's forward pass: a
step still running on the device reads the old weights first (foveal/lora/slots.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from foveal.lora.adapter import HostAdapter
    from foveal.request import Request
    from foveal.sched.batch import ScheduledItem


@dataclass(frozen=True, slots=True)
class LoRAStep:
    """One step's adapters, for the runner: per item its adapter's slot (`num_slots`: the base model),
    and the (slot, adapter) writes to make before the step's forward pass."""

    slots: tuple[int, ...]
    loads: tuple[tuple[int, HostAdapter], ...] = ()


class AdapterCap:
    """The distinct adapters of one step's running requests, at most `limit` of them."""

    def __init__(self, limit: int, in_use: set[int]):
        self.limit = limit
        self.in_use = in_use

    def admits(self, req: Request) -> bool:
        a = req.lora
        return a is None or a.uid in self.in_use or len(self.in_use) < self.limit

    def add(self, req: Request) -> None:
        if req.lora is not None:
            self.in_use.add(req.lora.uid)


class LoRADriver:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("max_loras must be at least 1")
        self.num_slots = num_slots
        self.resident: list[int | None] = [None] * num_slots  # each slot's adapter uid
        self._used = [0] * num_slots  # the step that last used each slot (LRU)
        self._tick = 0

    # -- one step ------------------------------------------------------------------------------------
    def cap(self, running: list[Request]) -> AdapterCap:
        return AdapterCap(self.num_slots, {r.lora.uid for r in running if r.lora is not None})

    def plan(self, items: list[ScheduledItem], requests: dict[str, Request]) -> LoRAStep | None:
        """Each item's slot and the writes the step needs; None when no item runs an adapter.
        `requests`: every unfinished request by id (their adapters' slots are taken last)."""
        adapters = [requests[s.request_id].lora for s in items]
        if not any(a is not None for a in adapters):
            return None
        held = Counter(r.lora.uid for r in requests.values() if r.lora is not None)
        slots, loads = self.slots_for([a for a in adapters if a is not None], held)
        base = self.num_slots
        return LoRAStep(tuple(base if a is None else slots[a.uid] for a in adapters), tuple(loads))

    def slots_for(self, adapters: list[HostAdapter], held: Counter | None = None):
        """(uid -> slot, [(slot, adapter) to write]) for a step's adapters. `held`: the adapters of
        unfinished requests (their slots are taken last)."""
        wanted = {a.uid: a for a in adapters}
        if len(wanted) > self.num_slots:
            raise RuntimeError(
                f"a step uses {len(wanted)} adapters but only {self.num_slots} fit (--max-loras): "
                "the scheduler must not schedule more"
            )
        held = Counter() if held is None else held
        self._tick += 1
        out: dict[int, int] = {uid: self.resident.index(uid) for uid in wanted if uid in self.resident}
        loads: list[tuple[int, HostAdapter]] = []
        for uid, adapter in wanted.items():
            if uid not in out:
                s = self._victim(wanted, held)
                self.resident[s] = uid
                loads.append((s, adapter))
                out[uid] = s
        for s in out.values():
            self._used[s] = self._tick
        return out, loads

    def _victim(self, wanted: dict, held: Counter) -> int:
        if None in self.resident:
            return self.resident.index(None)
        others = [s for s, uid in enumerate(self.resident) if uid not in wanted]
        idle = [s for s in others if not held[self.resident[s]]]
        return min(idle or others, key=self._used.__getitem__)

    def report(self, running: list[Request], waiting) -> dict:
        """Sequences per adapter (its name), running and waiting, and the device's slots."""
        run = Counter(r.lora.name for r in running if r.lora is not None)
        wait = Counter(r.lora.name for r in waiting if r.lora is not None)
        return {"running": dict(run), "waiting": dict(wait), "max_loras": self.num_slots}
