"""Block hashing for the prefix cache (hook only; sharing is a later issue).

A full block's key chains its parent's key, its token ids and extra keys (image content hashes, the
tenant salt, an adapter id), so equal keys imply equal prefixes. sha256 is strong enough that a hit
needs no token re-check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[object] = ()) -> bytes:
    h = hashlib.sha256()
    h.update(parent or b"\0" * 32)
    h.update(len(token_ids).to_bytes(4, "little"))
    for t in token_ids:
        h.update(int(t).to_bytes(4, "little"))
    for key in extra_keys:
        h.update(repr(key).encode())
    return h.digest()


def block_hashes(token_ids: Sequence[int], block_size: int, extra_keys: Sequence[object] = ()) -> list[bytes]:
    """Keys of every full block of a sequence (a partial last block has none: it is never shared)."""
    out: list[bytes] = []
    parent = None
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[i : i + block_size], extra_keys)
        out.append(parent)
    return out
