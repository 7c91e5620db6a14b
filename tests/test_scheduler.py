"""Block pool, KV manager and scheduler: exact block ids, budgets, chunking, preemption without leaks."""

from __future__ import annotations

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
    assert [(x.request.request_id, x.start, x.num_tokens, x.sample) for x in batch.seqs] == [
        ("a", 0, 6, True),
        ("b", 0, 4, False),
    ]
    s.update(batch, {"a": 7})
    batch = s.schedule()  # decode of a first (1 token), then 9 more tokens of b
    assert [(x.request.request_id, x.start, x.num_tokens) for x in batch.seqs] == [("a", 6, 1), ("b", 4, 9)]
    s.update(batch, {"a": 8})
    batch = s.schedule()
    assert [(x.request.request_id, x.start, x.num_tokens, x.sample) for x in batch.seqs] == [
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
    assert [x.request.request_id for x in batch.seqs] == ["r0", "r1"]
    assert len(s.waiting) == 2


def test_preemption_frees_latest_and_requeues_first():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable blocks = 16 tokens
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), kv, 16)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert len(batch.seqs) == 2 and kv.pool.num_free_blocks == 0
    s.update(batch, {"a": 1, "b": 1})
    batch = s.schedule()  # a needs a 3rd block: b (latest) is preempted
    assert batch.preempted == ["b"] and [x.request.request_id for x in batch.seqs] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.all_token_ids == list(range(1, 9)) + [1]
    kv.check_integrity()


def test_finish_is_idempotent_and_frees():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048), kv, 100)
    a = req("a", 5)
    s.add(a)
    s.update(s.schedule(), {"a": 3})
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
        h.sched.update(batch, out.sampled)
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
