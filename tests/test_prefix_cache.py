"""Prefix caching: exact block ids, ref counts and eviction order in the pool and the KV manager (CPU,
no model), tenant salts, the scheduler's use of hits, and prefix hit == miss on the real model."""

from __future__ import annotations

from foveal.cache.block_pool import BlockPool
from foveal.cache.kv_cache_manager import KVCacheManager
from foveal.config import SchedulerConfig
from foveal.request import Request, SamplingParams
from foveal.sched.scheduler import Scheduler


def req(rid, ids, salt=None):
    return Request(rid, list(ids), SamplingParams(temperature=0, max_tokens=4), cache_salt=salt)


def computed(kv: KVCacheManager, r: Request, n: int, cached=()):
    """Allocate for n more tokens (after any cached prefix), mark them computed, publish."""
    kv.allocate(r, n, list(cached))
    r.num_computed_tokens += n
    kv.publish(r)


def test_pool_evicts_least_recently_freed_cached_block_first():
    pool = BlockPool(5)  # blocks 1..4
    a = pool.allocate(3)
    assert a == [1, 2, 3]
    for b, h in zip(a, (b"h1", b"h2", b"h3")):
        pool.cache_block(b, h)
    pool.free([3, 2, 1])  # tail first, as the KV manager frees a sequence
    assert pool.num_free_blocks == 4 and pool.num_cached_blocks == 3
    # the free queue: 4 (never used), then 3, 2, 1 in free order
    assert pool.allocate(1) == [4] and pool.num_evictions == 0
    assert pool.allocate(1) == [3] and pool.num_evictions == 1
    assert pool.lookup(b"h3") is None and pool.lookup(b"h2") == 2 and pool.lookup(b"h1") == 1
    pool.touch([1])  # a hit on a free cached block takes it out of the free queue
    assert pool.ref_counts[1] == 1 and pool.num_free_blocks == 1
    assert pool.allocate(1) == [2] and pool.lookup(b"h2") is None  # block 1, in use, is never evicted
    pool.check_integrity({"x": [4, 3], "y": [1], "z": [2]})


def test_pool_duplicate_content_keeps_the_first_block_canonical():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same")
    pool.cache_block(b, b"same")
    assert pool.lookup(b"same") == a and pool.block_hashes[b] is None
    pool.check_integrity({"r": [a, b]})


def test_full_blocks_are_shared_partial_last_block_never():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    r1 = req("r1", range(1, 11))  # 10 tokens: blocks [1..4] [5..8] full, [9, 10] partial
    computed(kv, r1, 10)
    assert r1.block_ids == [1, 2, 3] and kv.pool.num_cached_blocks == 2
    r2 = req("r2", list(range(1, 11)) + [50, 51, 52])
    hit = kv.find_cached(r2)
    assert hit == [1, 2]  # the partial third block of r1 is not published, so not shared
    computed(kv, r2, 5, hit)
    assert r2.block_ids == [1, 2, 4, 5] and r2.num_computed_tokens == 13
    assert kv.pool.ref_counts[1:6] == [2, 2, 1, 1, 1]
    kv.check_integrity()
    kv.free(r1)
    kv.free(r2)
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_a_hit_always_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    r1 = req("r1", range(1, 9))  # exactly two full blocks
    computed(kv, r1, 8)
    r2 = req("r2", range(1, 9))
    assert kv.find_cached(r2) == [1]  # not both: the last token must run to give logits
    kv.free(r1)


def test_salts_isolate_tenants():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    computed(kv, req("a1", range(1, 13), salt="tenant-a"), 12)
    assert kv.find_cached(req("b", range(1, 13), salt="tenant-b")) == []
    assert kv.find_cached(req("anon", range(1, 13))) == []
    assert kv.find_cached(req("a2", range(1, 13), salt="tenant-a")) == [1, 2]


def test_a_shared_prefix_crosses_salts_only_for_its_whole_blocks():
    """shared_prefix_len (the server's --shared-prefix-cache: a chat's system turn) keys the blocks
    wholly inside it without the salt; the salt enters at the block holding the boundary."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a1", range(1, 13), salt="tenant-a")
    a.shared_prefix_len = 6  # block 0 (tokens 0-3) wholly inside; block 1 (4-7) holds the boundary
    computed(kv, a, 12)
    b = req("b", range(1, 13), salt="tenant-b")
    b.shared_prefix_len = 6
    assert kv.find_cached(b) == [1]
    c = req("c", range(1, 13), salt="tenant-b")  # no shared prefix: nothing crosses
    assert kv.find_cached(c) == []
    a2 = req("a2", range(1, 13), salt="tenant-a")
    a2.shared_prefix_len = 6
    assert kv.find_cached(a2) == [1, 2]


def test_block_in_use_is_never_evicted_and_reset_frees_only_unused():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)  # 5 usable
    holder = req("holder", range(1, 9))
    computed(kv, holder, 8)  # blocks 1, 2 in use and cached
    gone = req("gone", range(100, 109))
    computed(kv, gone, 9)  # blocks 3, 4, 5; 3 and 4 cached
    kv.free(gone)
    assert kv.pool.num_cached_blocks == 4
    # need all 3 free blocks: the free cached ones are evicted (tail first), the held ones never
    filler = req("filler", range(200, 212))
    kv.allocate(filler, 12)
    assert sorted(filler.block_ids) == [3, 4, 5] and kv.pool.num_evictions == 2
    assert kv.find_cached(req("h2", range(1, 10))) == [1, 2]
    kv.free(filler)
    computed(kv, req("again", range(300, 305)), 5)  # publishes one more block, then holds it
    n = kv.reset_prefix_cache()
    assert n == 3 and kv.pool.num_cached_blocks == 0
    assert kv.find_cached(req("h3", range(1, 10))) == []
    assert holder.block_ids == [1, 2] and kv.pool.ref_counts[1] == 1  # in use: still allocated
    kv.check_integrity()


def test_scheduler_starts_a_hit_after_its_cached_prefix():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), kv, 1000)
    a = req("a", range(1, 18))
    s.add(a)
    batch = s.schedule()
    s.update(batch, {"a": [7]})
    b = req("b", list(range(1, 17)) + [99, 98])
    s.add(b)
    batch = s.schedule()
    seq_b = next(x for x in batch.items if x.request_id == b.request_id)
    assert (seq_b.start, seq_b.num_tokens) == (16, 2)
    assert b.num_cached_tokens == 16 and b.block_ids[:4] == a.block_ids[:4]
    assert kv.hit_tokens == 16 and kv.query_tokens == 17 + 18


def test_prefix_hit_equals_miss_on_the_real_model(smollm_path):
    from foveal.engine.llm import LLM

    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    turns = [
        [system, {"role": "user", "content": q}]
        for q in ("Name a color.", "Name a fruit.", "What is 2+2?", "Name a color.")
    ]
    params = SamplingParams(temperature=0, max_tokens=24)
    # dense fp32 weights, the misses batched together (the default path, bit for bit: the test below)
    on = LLM(dtype="float32", quantization="none", kv_cache_memory=64 * 2**20)
    off = LLM(dtype="float32", quantization="none", kv_cache_memory=64 * 2**20, enable_prefix_caching=False)
    got = [on.chat(t, params)[0].outputs[0].token_ids for t in turns]  # one at a time: later ones hit
    want = [o.outputs[0].token_ids for o in off.chat(turns, params)]
    assert got == want
    # turns 2-4 reuse every full block of the prefix they share with turn 1 (the system prompt)
    ids = [on.processor.apply_chat_template(t) for t in turns]
    common = next(i for i, (x, y) in enumerate(zip(ids[0], ids[1])) if x != y)
    bs = on.engine.kv.block_size
    assert on.engine.kv.stats()["hit_tokens"] >= 3 * (common // bs * bs) > 0
    assert off.engine.kv.stats()["hit_tokens"] == 0
    for e in (on.engine, off.engine):
        e.kv.check_integrity()
        assert e.kv.num_used_blocks == 0


def test_default_path_gives_a_token_the_same_logits_hit_or_miss_whole_or_chunked(smollm_path):
    """The embedded model as `foveal serve` runs it on a CPU (Q4_1 weights with int8 activations, bf16):
    a prompt after a prefix hit, cut into chunks, or computed whole gives the same tokens and the same
    logprobs, bit for bit. With the activations quantized, a rounding step of difference in attention
    (SDPA's tiling followed the query and key lengths) grew into logprobs 0.1-0.3 apart and other answers
    (session 46); the native kernel gives each row the same arithmetic whatever the step holds."""
    from foveal.engine.llm import LLM

    system = {"role": "system", "content": "You are a terse assistant. " * 20}
    questions = ("Name a color.", "What is 2+2?", "Name a color.")
    turns = [[system, {"role": "user", "content": q}] for q in questions]
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=2)
    runs = {}
    for name, kw in (
        ("hits", {}),
        ("misses", {"enable_prefix_caching": False}),
        ("chunks of 48", {"enable_prefix_caching": False, "max_num_batched_tokens": 48}),
    ):
        llm = LLM(kv_cache_memory=64 * 2**20, **kw)
        outs = [llm.chat(t, params)[0].outputs[0] for t in turns]  # one at a time: later ones hit
        runs[name] = [(o.token_ids, [(x.token_id, x.logprob, x.top) for x in o.logprobs]) for o in outs]
        if name == "hits":
            assert llm.engine.kv.stats()["hit_tokens"] > 0
    assert runs["hits"] == runs["misses"] == runs["chunks of 48"]
