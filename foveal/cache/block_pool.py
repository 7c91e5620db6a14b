r"""The pool of KV-cache blocks: ref counts, the free queue, and the prefix cache's hash -> block map.

Block 0 is the null block: never handed out, so padded slots in a batch can point at it harmlessly.

    ref_count:  [0]  1  2  0  0  1 ...
                null  \  \  \  \__ free, cached (hash h7): a later request with that prefix revives it
                       \  \  \____ free, no hash: plain free block
                        \  \______ shared by two requests (a prefix-cache hit)
                         \________ one owner

    free queue (LRU, oldest first):  3 -> 4 -> 9 -> ...     allocate() takes from the front;
                                                            a freed block goes to the back

A full block is published under a chained hash (`cache_block`); when its last owner frees it, it keeps
its hash and waits in the free queue, so a request arriving later with the same prefix takes it back
(`touch`) instead of recomputing it. Only when allocate() hands a cached free block out for new data
is its hash dropped (an eviction). So blocks in use are never evicted, and eviction is LRU by free time.
With caching off nothing is ever published and this is a plain FIFO allocator.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(1, num_blocks))
        self._cached: dict[bytes, int] = {}  # hash -> the block holding it (in use or free)
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks (ref 1) from the front of the free queue, evicting their cached hashes."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            h = self.block_hashes[b]
            if h is not None:
                self.block_hashes[b] = None
                if self._cached.get(h) == b:
                    del self._cached[h]
                self.num_evictions += 1
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.ref_counts[b] += 1

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit); free ones leave the free queue."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go to the back of the free queue,
        in the order given (callers pass a sequence's blocks tail first, so tails are evicted first)."""
        for b in block_ids:
            if b == self.NULL_BLOCK or self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free or null free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free[b] = None

    # -- prefix cache ------------------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Publish a full block under its hash. If another block already holds that content (two equal
        prompts computed at once), the first stays canonical and this one is simply not published."""
        if block_hash in self._cached or self.block_hashes[block_id] is not None:
            return
        self.block_hashes[block_id] = block_hash
        self._cached[block_hash] = block_id

    def num_free_among(self, block_ids: list[int]) -> int:
        """How many of these blocks sit in the free queue (a hit on them shrinks the free count)."""
        return sum(1 for b in block_ids if self.ref_counts[b] == 0)

    def reset_cache(self) -> int:
        """Forget every cached hash (blocks in use stay allocated, just unpublished). Returns how many."""
        n = len(self._cached)
        for b in self._cached.values():
            self.block_hashes[b] = None
        self._cached.clear()
        return n

    def check_integrity(self, owners: dict[str, list[int]]) -> None:
        """Every block's ref count equals the number of owners listing it; free == zero refs; the hash
        map and the per-block hashes agree.

        Raises AssertionError describing the first inconsistency.
        """
        expected = [0] * self.num_blocks
        for owner, blocks in owners.items():
            for b in blocks:
                assert 0 < b < self.num_blocks, f"{owner} holds invalid block {b}"
                expected[b] += 1
        free = self._free
        assert self.NULL_BLOCK not in free, "the null block is on the free list"
        for b in range(1, self.num_blocks):
            assert self.ref_counts[b] == expected[b], (
                f"block {b}: ref count {self.ref_counts[b]} but {expected[b]} owner(s)"
            )
            assert (b in free) == (expected[b] == 0), f"block {b}: free={b in free} with {expected[b]} owners"
        for h, b in self._cached.items():
            assert self.block_hashes[b] == h, f"cached hash of block {b} does not match the map"
        published = sum(1 for h in self.block_hashes if h is not None)
        assert published == len(self._cached), "a block carries a hash that is not in the map"
