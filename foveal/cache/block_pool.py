r"""The pool of KV-cache blocks: which block ids are free, and how many owners each used block has.

Block 0 is the null block: never handed out, so padded slots in a batch can point at it harmlessly.

    ref_count:  [0]  1  2  0  1 ...      free list (FIFO): 3, 5, 6, ...
                null  \  \___ shared (two owners: a prefix-cache hit, later)
                       one owner

Each block also has a `block_hash` slot: the prefix cache (a later issue) publishes full blocks under
a chained hash and reuses them; here the slot exists and is cleared on free, nothing more.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    NULL_BLOCK = 0

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError("the KV pool needs at least 2 blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free = deque(range(1, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self.ref_counts[b] = 1
        return out

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            self.ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero go back to the free list."""
        for b in block_ids:
            if b == self.NULL_BLOCK or self.ref_counts[b] <= 0:
                raise RuntimeError(f"double free or null free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.block_hashes[b] = None
                self._free.append(b)

    def check_integrity(self, owners: dict[str, list[int]]) -> None:
        """Every block's ref count equals the number of owners listing it; free == zero refs.

        Raises AssertionError describing the first inconsistency.
        """
        expected = [0] * self.num_blocks
        for owner, blocks in owners.items():
            for b in blocks:
                assert 0 < b < self.num_blocks, f"{owner} holds invalid block {b}"
                expected[b] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert self.NULL_BLOCK not in free, "the null block is on the free list"
        for b in range(1, self.num_blocks):
            assert self.ref_counts[b] == expected[b], (
                f"block {b}: ref count {self.ref_counts[b]} but {expected[b]} owner(s)"
            )
            assert (b in free) == (expected[b] == 0), f"block {b}: free={b in free} with {expected[b]} owners"
