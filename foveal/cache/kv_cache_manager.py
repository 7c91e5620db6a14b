"""Maps requests to KV blocks: prefix-cache lookup, how many blocks the next tokens need, allocation,
publishing full blocks, rewinding rejected drafts, release.

The scheduler asks `find_cached` (the longest cached prefix of a new request), then `can_allocate` and
`allocate` (a pair, so a failed check changes nothing); after each step `publish` puts the request's
newly full blocks into the prefix cache; `free` returns all of a request's blocks, tail first (so the
tail, least likely to be shared, is evicted first). Block ids live on the Request, in order.

Block keys chain (parent key, the block's token ids, extra keys): the tenant salt (first block; the
chain carries it on), the LoRA adapter's per-load id (first block), and the content hash of every
image whose placeholder span overlaps the block, since placeholder ids are the same for every image.
A hit never covers the whole sequence: at least one token is computed, so the step has logits to
sample from.
"""

from __future__ import annotations

from foveal.cache.block_hash import hash_block
from foveal.cache.block_pool import BlockPool
from foveal.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_caching = enable_prefix_caching
        self._owners: dict[str, Request] = {}
        self.query_tokens = 0  # prompt tokens looked up in the prefix cache (at admission)
        self.hit_tokens = 0  # of those, found cached

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_usable_blocks * self.block_size

    # -- prefix cache ------------------------------------------------------------------------------
    def block_keys(self, req: Request, num_blocks: int) -> list[bytes]:
        """The keys of the request's first `num_blocks` full blocks (computed once, kept on it)."""
        keys = req.block_hashes
        bs = self.block_size
        while len(keys) < num_blocks:
            i = len(keys)
            lo, hi = i * bs, (i + 1) * bs
            extra: list[object] = [it.content_hash for it in req.mm_items if it.offset < hi and lo < it.end]
            # the salt enters the chain at the first block not wholly inside the shared prefix (block 0
            # unless a shared prefix is set): every key from there on is the tenant's alone
            if i == req.shared_prefix_len // bs and req.cache_salt is not None:
                extra.insert(0, ("salt", req.cache_salt))
            # a LoRA adapter changes every K/V from the first token: its id (unique per load, so a
            # reloaded adapter of the same name shares nothing with the old one) keys block 0 onwards
            if i == 0 and req.lora is not None:
                extra.insert(0, ("lora", req.lora.uid))
            keys.append(hash_block(keys[-1] if keys else None, req.all_token_ids[lo:hi], extra))
        return keys

    def find_cached(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of a request with nothing computed yet."""
        if not self.prefix_caching or req.num_computed_tokens or req.block_ids:
            return []
        limit = (req.num_tokens - 1) // self.block_size  # leave >= 1 token to compute
        hit: list[int] = []
        for key in self.block_keys(req, limit)[:limit]:
            b = self.pool.lookup(key)
            if b is None:
                break
            hit.append(b)
        return hit

    def publish(self, req: Request) -> None:
        """Put the request's computed full blocks into the prefix cache."""
        if not self.prefix_caching:
            return
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_published_blocks:
            return
        keys = self.block_keys(req, full)
        for i in range(req.num_published_blocks, full):
            self.pool.cache_block(req.block_ids[i], keys[i])
        req.num_published_blocks = full

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    # -- allocation ----------------------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_new_tokens: int, num_cached: int = 0) -> int:
        total = req.num_computed_tokens + num_cached * self.block_size + num_new_tokens
        need = -(-total // self.block_size)
        return max(0, need - len(req.block_ids) - num_cached)

    def can_allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> bool:
        # cached blocks sitting in the free queue leave it on a hit: they count against the free blocks
        need = self.blocks_needed(req, num_new_tokens, len(cached)) + self.pool.num_free_among(cached)
        return need <= self.pool.num_free_blocks

    def allocate(self, req: Request, num_new_tokens: int, cached: list[int] = ()) -> None:
        """Attach the cached prefix blocks (the request's computed tokens start after them), then fresh
        blocks for `num_new_tokens` more tokens."""
        if cached:
            self.pool.touch(cached)
            req.block_ids = list(cached)
            req.num_computed_tokens = len(cached) * self.block_size
            req.num_published_blocks = len(cached)
        n = self.blocks_needed(req, num_new_tokens)
        if n:
            req.block_ids.extend(self.pool.allocate(n))
        if n or cached:
            req.block_table = tuple(req.block_ids)
        self._owners[req.request_id] = req

    def rewind(self, req: Request, num_tokens: int) -> None:
        """Keep only the request's first num_tokens computed positions (rejected drafts): blocks past
        them go back to the pool. Published blocks hold accepted tokens only, so a rewind never reaches
        into one (that is a caller's bug: ValueError)."""
        if not 0 <= num_tokens <= req.num_computed_tokens:
            raise ValueError(
                f"cannot rewind {req.request_id} to {num_tokens} of {req.num_computed_tokens} tokens"
            )
        if num_tokens < req.num_published_blocks * self.block_size:
            raise ValueError(
                f"{req.request_id}: rewinding to {num_tokens} tokens would cut a published block"
            )
        keep = -(-num_tokens // self.block_size)
        if keep < len(req.block_ids):
            self.pool.free(req.block_ids[keep:][::-1])
            del req.block_ids[keep:]
            req.block_table = tuple(req.block_ids)
        req.num_computed_tokens = num_tokens

    def record_lookup(self, req: Request, num_cached_tokens: int) -> None:
        if self.prefix_caching:
            self.query_tokens += req.num_tokens
            self.hit_tokens += num_cached_tokens

    def free(self, req: Request) -> None:
        if req.block_ids:
            self.pool.free(req.block_ids[::-1])
        req.block_ids, req.block_table = [], ()
        req.num_published_blocks = 0
        self._owners.pop(req.request_id, None)

    def check_integrity(self) -> None:
        for r in self._owners.values():
            if r.block_table != tuple(r.block_ids):
                raise AssertionError(f"{r.request_id}: table {r.block_table} != block_ids {r.block_ids}")
        self.pool.check_integrity({rid: r.block_ids for rid, r in self._owners.items()})

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_usable_blocks - self.pool.num_free_blocks

    def stats(self) -> dict:
        return {
            "enabled": self.prefix_caching,
            "query_tokens": self.query_tokens,
            "hit_tokens": self.hit_tokens,
            "hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
            "cached_blocks": self.pool.num_cached_blocks,
            "free_blocks": self.pool.num_free_blocks,
            "used_blocks": self.num_used_blocks,
            "evictions": self.pool.num_evictions,
            "block_size": self.block_size,
        }
