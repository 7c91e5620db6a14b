"""Maps requests to KV blocks: how many a request needs for its next tokens, allocation, release.

The scheduler asks `can_allocate` then `allocate` (a pair, so a failed check changes nothing);
`free` returns all of a request's blocks. Block ids live on the Request (`req.block_ids`), in order.
"""

from __future__ import annotations

from foveal.cache.block_pool import BlockPool
from foveal.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._owners: dict[str, Request] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    def blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        need = -(-total // self.block_size)
        return max(0, need - len(req.block_ids))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(req, num_new_tokens) <= self.pool.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        n = self.blocks_needed(req, num_new_tokens)
        if n:
            req.block_ids.extend(self.pool.allocate(n))
        self._owners[req.request_id] = req

    def free(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids)
        req.block_ids = []
        self._owners.pop(req.request_id, None)

    def check_integrity(self) -> None:
        self.pool.check_integrity({rid: r.block_ids for rid, r in self._owners.items()})

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_usable_blocks - self.pool.num_free_blocks
