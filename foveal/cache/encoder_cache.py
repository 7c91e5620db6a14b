"""The vision feature cache: projected image embeddings kept in an LRU keyed by the image content hash,
under a byte budget, so a repeated image (multi-turn chat about one picture) skips the encoder.

Owns: lookup, insertion, LRU eviction and hit/miss counters. It does not decide when to encode (the
runner does) and never holds an entry larger than the whole budget. Single-threaded (model thread);
the counters are plain ints that other threads may read for stats.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class EncoderCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes_used: int = 0
    capacity_bytes: int = 0

    def as_dict(self) -> dict:
        lookups = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / lookups if lookups else 0.0,
            "evictions": self.evictions,
            "entries": self.entries,
            "bytes_used": self.bytes_used,
            "capacity_bytes": self.capacity_bytes,
        }


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"vision cache memory must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> torch.Tensor | None:
        """The cached embeddings (and a hit), or None (and a miss)."""
        t = self._entries.get(key)
        if t is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return t

    def put(self, key: str, emb: torch.Tensor) -> None:
        size = emb.numel() * emb.element_size()
        if size > self.capacity_bytes or key in self._entries:
            return
        while self._bytes + size > self.capacity_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
            self.evictions += 1
        self._entries[key] = emb
        self._bytes += size

    def reset(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> EncoderCacheStats:
        return EncoderCacheStats(
            self.hits, self.misses, self.evictions, len(self._entries), self._bytes, self.capacity_bytes
        )
