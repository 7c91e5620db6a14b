"""Served adapters by name: what `--lora-modules`, `/v1/load_lora_adapter` and `LoRARequest` register,
and what a request's `model` field resolves to. Request-side: the server's handlers and input threads
call it (a lock guards it); the model thread never does.

Host copies are kept for the `max_cpu_loras` most recently used names; an older one's weights are
dropped and read again from its path when a request names it (outside the model thread). A request
holds its `HostAdapter` until it finishes, so unloading or dropping a name never pulls weights from
under a running request: its memory goes when the last user does. Every load, reload included, gets a
new uid (foveal/lora/adapter.py), so K/V computed under an old copy is never reused for a new one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from foveal.lora.adapter import HostAdapter, LoRALayout, load_adapter
from foveal.lora.peft import AdapterError, resolve


@dataclass(slots=True)
class _Entry:
    path: str  # as given (a folder or a Hub id)
    adapter: HostAdapter | None  # the host copy, None once dropped (read again on use)


class LoRARegistry:
    def __init__(
        self, layout: LoRALayout, dtype: torch.dtype, max_rank: int, max_cpu: int, pin: bool = False
    ):
        self.layout = layout
        self.dtype = dtype
        self.max_rank = max_rank
        self.max_cpu = max_cpu
        self.pin = pin
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._lock = threading.RLock()
        self.num_reads = 0  # adapter folders read (loads and reloads)

    def _read(self, name: str, path: str) -> HostAdapter:
        adapter = load_adapter(name, resolve(path), self.layout, self.dtype, self.max_rank, self.pin)
        self.num_reads += 1
        return adapter

    def load(self, name: str, path: str) -> HostAdapter:
        """Register an adapter (AdapterError if it cannot be used; ValueError if the name is taken).
        Reads the folder: call it off the event loop."""
        if not name or not path:
            raise ValueError("both lora_name and lora_path must be given")
        with self._lock:
            if name in self._entries:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        adapter = self._read(name, path)  # outside the lock: reading may take a while
        with self._lock:
            if name in self._entries:
                raise ValueError(f"The lora adapter '{name}' has already been loaded.")
            self._entries[name] = _Entry(path, adapter)
            self._trim()
        return adapter

    def unload(self, name: str) -> bool:
        with self._lock:
            return self._entries.pop(name, None) is not None

    def get(self, name: str) -> HostAdapter | None:
        """The adapter registered as `name` (read again if its host copy was dropped), or None."""
        with self._lock:
            e = self._entries.get(name)
            if e is None:
                return None
            self._entries.move_to_end(name)
            if e.adapter is not None:
                return e.adapter
            path = e.path
        adapter = self._read(name, path)
        with self._lock:
            e = self._entries.get(name)
            if e is None or e.path != path:  # unloaded (or replaced) meanwhile: this request still runs
                return adapter
            if e.adapter is None:
                e.adapter = adapter
                self._trim()
            return e.adapter

    def get_or_load(self, name: str, path: str) -> HostAdapter:
        """The offline API's LoRARequest: the registered adapter of that name and path, loaded on first
        use; a name registered with another path is an error."""
        with self._lock:
            e = self._entries.get(name)
        if e is None:
            try:
                return self.load(name, path)
            except AdapterError:
                raise
            except ValueError:  # another thread registered the name meanwhile: use or refuse it below
                pass
        with self._lock:
            e = self._entries.get(name)
        if e is not None and e.path != path:
            raise ValueError(
                f"LoRA adapter {name!r} is already registered with path {e.path!r}, not {path!r}"
            )
        adapter = self.get(name)
        if adapter is None:
            raise ValueError(f"LoRA adapter {name!r} was unloaded")
        return adapter

    def _trim(self) -> None:
        kept = [e for e in self._entries.values() if e.adapter is not None]
        for e in kept[: max(0, len(kept) - self.max_cpu)]:
            e.adapter = None

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._entries)

    def cards(self) -> list[tuple[str, str]]:
        """(name, path) of every registered adapter, by name."""
        with self._lock:
            return [(n, e.path) for n, e in sorted(self._entries.items())]

    @property
    def host_bytes(self) -> int:
        with self._lock:
            return sum(e.adapter.nbytes for e in self._entries.values() if e.adapter is not None)
