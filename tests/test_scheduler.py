"""Block pool, KV manager and scheduler: exact block ids, budgets, chunking, preemption without leaks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from foveal.cache.block_pool import BlockPool
from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import SchedulerConfig
from foveal.request import FinishReason, Request, RequestStatus, SamplingParams
from foveal.sched.scheduler import Scheduler
from tests.tiny import Harness, tiny_hf_model


def req(rid, n, max_tokens=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens))


def test_block_pool_ids_refcounts_and_integrity():
    pool = BlockPool(6)
    assert pool.num_free_blocks == 5  # block 0 is the null block
    a = pool.allocate(2)
    b = pool.allocate(2)
    assert a == [1, 2] and b == [3, 4]
    pool.incref([2])
    pool.check_integrity({"a": a, "b": b, "c": [2]})
    pool.free(a)
    assert pool.ref_counts[1] == 0 and pool.ref_counts[2] == 1
    assert pool.allocate(2) == [5, 1]  # FIFO free list: oldest free first
    with pytest.raises(RuntimeError):
        pool.allocate(5)
    with pytest.raises(AssertionError):
        pool.check_integrity({"b": b})  # blocks 2, 5, 1 are held but not listed
    with pytest.raises(RuntimeError):
        pool.free([0])


def test_kv_manager_allocates_by_block_boundaries():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = req("a", 5)
    assert kv.blocks_needed(r, 5) == 2
    kv.allocate(r, 5)
    r.num_computed_tokens = 5
    assert kv.blocks_needed(r, 3) == 0 and kv.blocks_needed(r, 4) == 1
    assert r.block_ids == [1, 2]
    kv.check_integrity()
    kv.free(r)
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_budget_chunks_prefill_and_mixes_decodes():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=10, max_num_seqs=8), kv, 1000)
    a, b = req("a", 6), req("b", 25)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [(x.request_id, x.start, x.num_tokens, x.num_logits == 1) for x in batch.items] == [
        ("a", 0, 6, True),
        ("b", 0, 4, False),
    ]
    s.update(batch, {"a": [7]})
    batch = s.schedule()  # decode of a first (1 token), then 9 more tokens of b
    assert [(x.request_id, x.start, x.num_tokens) for x in batch.items] == [("a", 6, 1), ("b", 4, 9)]
    s.update(batch, {"a": [8]})
    batch = s.schedule()
    assert [(x.request_id, x.start, x.num_tokens, x.num_logits == 1) for x in batch.items] == [
        ("a", 7, 1, True),
        ("b", 13, 9, False),
    ]
    kv.check_integrity()


def test_max_num_seqs_limits_running():
    kv = KVCacheManager(num_blocks=64, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=2), kv, 1000)
    for i in range(4):
        s.add(req(f"r{i}", 3))
    batch = s.schedule()
    assert [x.request_id for x in batch.items] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_preemption_frees_latest_and_requeues_first():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), kv, 16)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert len(batch.items) == 2 and kv.pool.num_free_blocks == 0
    s.update(batch, {"a": [1], "b": [1]})
    batch = s.schedule()  # a needs a 3rd block: b (latest) is preempted
    assert batch.preempted == ["b"] and [x.request_id for x in batch.items] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.all_token_ids == list(range(1, 9)) + [1]
    kv.check_integrity()


def test_finish_is_idempotent_and_frees():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048), kv, 100)
    a = req("a", 5)
    s.add(a)
    s.update(s.schedule(), {"a": [3]})
    s.finish(a, FinishReason.ABORT)
    s.finish(a, FinishReason.ABORT)
    assert kv.num_used_blocks == 0 and a.finish_reason is FinishReason.ABORT and s.num_unfinished == 0
    kv.check_integrity()


def _greedy_run(h: Harness, prompts, max_tokens):
    reqs = [h.add(f"r{i}", p, max_tokens=max_tokens) for i, p in enumerate(prompts)]
    steps = 0
    while h.sched.num_unfinished:
        batch = h.sched.schedule()
        out = h.runner.execute(batch)
        h.sched.update(batch, out.tokens)
        h.kv.check_integrity()
        steps += 1
        assert steps < 2000, "no progress"
    assert h.kv.num_used_blocks == 0
    return [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_preemption_gives_same_greedy_tokens(family):
    hf = tiny_hf_model(family)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (9, 17, 4, 12, 21, 6)]
    free = _greedy_run(Harness(hf, num_blocks=200, block_size=4), prompts, 24)
    tight = Harness(hf, num_blocks=13, block_size=4, budget=16)  # 48 tokens for 6 seqs of up to 45
    constrained = _greedy_run(tight, prompts, 24)
    assert tight.sched.num_preemptions > 0
    assert constrained == free


def test_block_hash_chain_depends_on_prefix_and_extra_keys():
    from foveal.cache.block_hash import block_hashes

    a = block_hashes(list(range(10)), 4)
    b = block_hashes(list(range(10)), 4, extra_keys=("tenant-b",))
    c = block_hashes([99] + list(range(1, 10)), 4)
    assert len(a) == 2  # the partial third block has no key
    assert a[0] != b[0] and a[1] != c[1]  # a different first block changes every later key
    assert block_hashes(list(range(8)), 4) == a


def test_rewind_frees_blocks_past_the_kept_tokens_and_never_cuts_a_published_block():
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    r = req("a", 5)
    kv.allocate(r, 13)
    r.num_computed_tokens = 13
    assert len(r.block_ids) == 4
    kv.rewind(r, 6)  # positions 0..5 stay: two blocks
    assert r.num_computed_tokens == 6 and len(r.block_ids) == 2 and kv.num_used_blocks == 2
    kv.check_integrity()
    r.num_computed_tokens = 5
    kv.rewind(r, 5)
    with pytest.raises(ValueError, match="cannot rewind"):
        kv.rewind(r, 6)  # past what is computed
    r.all_token_ids = list(range(1, 9))
    r.num_computed_tokens = 8
    kv.allocate(r, 0)
    kv.publish(r)  # the first two blocks are in the prefix cache now
    assert r.num_published_blocks == 2
    with pytest.raises(ValueError, match="published block"):
        kv.rewind(r, 7)
    kv.rewind(r, 8)
    kv.free(r)
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_verify_item_carries_drafts_and_resolve_rewinds_the_rejected():
    kv = KVCacheManager(num_blocks=32, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 100)
    a = req("a", 6, max_tokens=20)
    s.add(a)
    s.update(s.schedule(), {"a": [50]})
    a.draft_ids = [51, 52, 53]
    batch = s.schedule()
    (item,) = batch.items
    assert (item.start, item.token_ids, item.num_logits, item.num_drafts) == (6, (50, 51, 52, 53), 4, 3)
    assert item.is_decode and not item.committed and item.drafts == (51, 52, 53)
    assert len(a.block_ids) == 3  # positions 0..9 need three blocks of 4
    s.update(batch, {"a": [51, 60]})  # one draft accepted, then the target's own token
    assert a.output_token_ids == [50, 51, 60] and a.num_computed_tokens == 8 and a.draft_ids == []
    assert len(a.block_ids) == 2  # the block that held only rejected drafts went back
    a.draft_ids = [61, 62]
    batch = s.schedule()
    s.update(batch, {"a": [61, 62, 7]})  # a stop token ends the run: nothing after it is kept
    assert a.output_token_ids == [50, 51, 60, 61, 62, 7] and not a.is_finished
    a.params = dataclasses.replace(a.params, stop_token_ids=[9])
    a.draft_ids = [9, 10]
    s.update(s.schedule(), {"a": [9, 10, 11]})
    assert a.is_finished and a.output_token_ids[-1] == 9 and kv.num_used_blocks == 0
    kv.check_integrity()
