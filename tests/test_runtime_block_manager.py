"""KV block manager on a tiny pool: exact block ids, ref counts, prefix hits, LRU eviction, COW."""
from types import SimpleNamespace

import pytest

from tritium.backend.block_manager import BlockManager, hash_block


def seq(tokens):
    return SimpleNamespace(token_ids=list(tokens), num_computed_tokens=0, block_table=[], block_hashes=[])


def admit(bm, s, num_new=None):
    computed = bm.get_computed_blocks(s)
    n = (len(s.token_ids) - len(computed) * bm.block_size) if num_new is None else num_new
    assert bm.can_allocate(s, n, computed)
    bm.allocate(s, n, computed)
    s.num_computed_tokens += n  # what the engine does after the step ran
    bm.cache_full_blocks(s)
    return computed


def refs(bm):
    return [b.ref_cnt for b in bm.blocks]


def test_allocate_exact_ids_and_free_order():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(range(10))            # 3 blocks: 2 full + 1 partial
    admit(bm, a)
    assert a.block_table == [0, 1, 2]
    b = seq(range(100, 105))      # 2 blocks
    admit(bm, b)
    assert b.block_table == [3, 4]
    assert refs(bm) == [1, 1, 1, 1, 1, 0, 0, 0]
    assert bm.usage() == (5, 3, 0)  # "cached" counts only blocks nobody holds
    bm.free(a)
    # Freed in reverse so the tail is evicted first: queue = 5 6 7 2 1 0
    assert list(bm.free_queue) == [5, 6, 7, 2, 1, 0]
    used, free, cached = bm.usage()
    assert (used, free, cached) == (2, 4, 2)  # a's two full blocks stay cached
    c = seq(range(200, 216))      # 4 fresh blocks: 5, 6, 7, then evicts 2 (uncached partial)
    admit(bm, c)
    assert c.block_table == [5, 6, 7, 2]


def test_prefix_hit_reuses_blocks_and_leaves_one_token():
    bm = BlockManager(num_blocks=10, block_size=4)
    a = seq(list(range(12)) + [50, 51])  # 3 full blocks + 2 tokens
    admit(bm, a)
    assert a.block_table == [0, 1, 2, 3]
    b = seq(list(range(12)) + [60])      # shares the 3 full blocks
    computed = admit(bm, b)
    assert computed == [0, 1, 2]
    assert b.block_table == [0, 1, 2, 4]
    assert refs(bm)[:5] == [2, 2, 2, 1, 1]
    assert bm.num_prefix_hit_tokens == 12
    # A prompt that is exactly the cached 3 blocks recomputes its last block (needs logits).
    c = seq(range(12))
    assert bm.get_computed_blocks(c) == [0, 1]
    # A different first block breaks the chain even if later blocks' tokens agree.
    d = seq([99] + list(range(1, 12)) + [7])
    assert bm.get_computed_blocks(d) == []


def test_lru_eviction_of_cached_blocks():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq([1, 2, 3, 4, 9]), seq([5, 6, 7])
    admit(bm, a)                 # blocks 0 1 2 (0, 1 full)
    bm.free(a)                   # queue: 3 2 1 0 (3 never used)
    admit(bm, b)                 # takes 3 then evicts 2 (partial, no hash) -> [3, 2]
    assert b.block_table == [3, 2]
    bm.free(b)                   # queue: 1 0 2 3 ; cached: 0, 1 ([1,2], [3,4]) and 3 ([5,6])
    assert list(bm.free_queue) == [1, 0, 2, 3]
    # Hit on a's prefix touches 0 and 1 (removes them from the queue) ...
    c = seq([1, 2, 3, 4, 8])
    assert admit(bm, c) == [0, 1]
    assert c.block_table == [0, 1, 2]
    # ... so the next fresh block is the LRU one, 3, and b's cached block is evicted.
    d = seq([5, 6, 1])
    assert bm.get_computed_blocks(d) == [3]
    e = seq([42])
    admit(bm, e)
    assert e.block_table == [3]
    assert bm.get_computed_blocks(d) == []


def test_chained_hash_depends_on_parent():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(h1, [3, 4]) == hash_block(hash_block(None, [1, 2]), [3, 4])
    assert hash_block(None, [1, 2], b"lora1") != h1


def test_can_allocate_counts_evictable_hits():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    bm.free(a)                   # all 3 free; 0 and 1 cached
    b = seq([1, 2, 3, 4, 6, 7, 8])  # hits 0, 1; needs 2 more blocks -> only 1 left
    computed = bm.get_computed_blocks(b)
    assert computed == [0, 1]
    assert not bm.can_allocate(b, 3, computed)
    assert bm.can_allocate(b, 2, computed)


def test_fork_and_copy_on_write():
    bm = BlockManager(num_blocks=8, block_size=4)
    p = seq(range(6))            # blocks 0 (full), 1 (2 of 4 used)
    admit(bm, p)
    kids = [seq([]) for _ in range(2)]
    for k in kids:
        k.token_ids = list(p.token_ids)
        bm.fork(p, k)
    assert refs(bm)[:2] == [3, 3]
    for i, s in enumerate([p] + kids):
        s.token_ids.append(100 + i)
    # First two writers copy the shared partial block; the last owner writes in place.
    assert bm.can_append(p, 1)
    assert bm.append_slots(p, 1) == [(1, 2)]
    assert p.block_table == [0, 2]
    assert bm.append_slots(kids[0], 1) == [(1, 3)]
    assert bm.append_slots(kids[1], 1) == []
    assert kids[1].block_table == [0, 1]
    assert refs(bm)[:4] == [3, 1, 1, 1]
    for s in [p] + kids:
        bm.free(s)
    assert all(r == 0 for r in refs(bm))
    assert bm.num_free_blocks == 8


def test_can_append_needs_block_for_cow():
    bm = BlockManager(num_blocks=2, block_size=4)
    p = seq(range(6))
    admit(bm, p)                 # uses both blocks
    k = seq(list(p.token_ids))
    bm.fork(p, k)
    p.token_ids.append(1)
    assert not bm.can_append(p, 1)  # would copy block 1 but no block is free
    with pytest.raises(AssertionError):
        bm.append_slots(p, 1)


def _reference_cache_full_blocks(bm, s):
    """The definition: walk every computed full block of s, register each unhashed one whose
    hash no other block holds (first writer wins)."""
    bm.update_hashes(s)
    for i in range(min(s.num_computed_tokens // bm.block_size, len(s.block_hashes))):
        block = bm.blocks[s.block_table[i]]
        if block.block_hash is None and s.block_hashes[i] not in bm.cached:
            block.block_hash = s.block_hashes[i]
            bm.cached[block.block_hash] = block.block_id


def test_cache_full_blocks_from_its_mark_equals_the_whole_walk():
    """cache_full_blocks starts each step at the first block not known to be hashed; random
    decodes of sequences with shared prompts and mostly equal tokens (blocks whose hash another
    block holds, asked again once that block is evicted), preemptions and re-admissions of the
    same sequences, forks, copy-on-write and resets of the prefix cache give the same
    registrations, step by step, as the whole walk on a twin manager."""
    import random
    rng = random.Random(5)
    got, want = BlockManager(num_blocks=40, block_size=4), BlockManager(num_blocks=40, block_size=4)
    live, parked = [], []  # (sequence in got, its twin in want): running, preempted

    def admit_pair(pair):
        n = len(pair[0].token_ids)
        if not all(bm.can_allocate(s, n, bm.get_computed_blocks(s)) for bm, s in zip((got, want), pair)):
            return False
        for bm, s in zip((got, want), pair):
            computed = bm.get_computed_blocks(s)
            bm.allocate(s, n - len(computed) * bm.block_size, computed)
            s.num_computed_tokens = n
            bm.cache_full_blocks(s) if bm is got else _reference_cache_full_blocks(bm, s)
        live.append(pair)
        return True

    for step in range(600):
        r = rng.random()
        if len(live) < 5 and r < 0.15:
            prompt = [rng.randrange(2)] * rng.randint(1, 9)  # few distinct prompts: shared hashes
            admit_pair((seq(prompt), seq(prompt)))
        elif parked and r < 0.25:
            if admit_pair(parked[0]):  # the same sequences again: a new table
                parked.pop(0)
        elif live and r < 0.30:
            pair = live.pop(rng.randrange(len(live)))
            for bm, s in zip((got, want), pair):
                bm.free(s)
            if rng.random() < 0.5:
                parked.append(pair)  # preempted: recomputed later
        elif live and r < 0.34 and got.num_free_blocks > 2:
            parent = live[rng.randrange(len(live))]
            child = (seq(parent[0].token_ids), seq(parent[1].token_ids))
            for bm, p, c in zip((got, want), parent, child):
                bm.fork(p, c)
            live.append(child)
        if step % 150 == 149:
            got.reset_prefix_cache()
            want.reset_prefix_cache()
        for pair in list(live):  # a decode step: one more token each where blocks allow
            if not (got.can_append(pair[0], 1) and want.can_append(pair[1], 1)):
                continue
            tok = rng.choice((0, 0, 0, 1))
            copies = [bm.append_slots(s, 1) for bm, s in zip((got, want), pair)]
            assert copies[0] == copies[1]
            for s in pair:
                s.token_ids.append(tok)
                s.num_computed_tokens += 1
            got.cache_full_blocks(pair[0])
            _reference_cache_full_blocks(want, pair[1])
        assert got.cached == want.cached, step
        assert [b.block_hash for b in got.blocks] == [b.block_hash for b in want.blocks], step
        assert [s.block_table for s, _ in live] == [t.block_table for _, t in live], step
