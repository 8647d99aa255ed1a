"""Paged KV-cache block manager: block tables, ref counts, prefix caching, copy-on-write.

Blocks are indices into the model runner's KV pool; this class only does bookkeeping.
The design follows PagedAttention (Kwon et al., "Efficient Memory Management for Large
Language Model Serving with PagedAttention", SOSP 2023) and vLLM v1's block pool:
- every state change is a check/act pair (`can_allocate`/`allocate`, `can_append`/`append_slots`,
  `free`); the act asserts what the check promised;
- a block holds `ref_cnt` owners; a block is writable only while its ref_cnt is 1, so a shared
  partial block is copied on write (n > 1 samples forked from one prompt);
- a *full* block is keyed by a hash chained over (parent hash, its token ids, extra keys), so a
  key identifies the whole prefix up to and including that block;
- freed blocks keep their hash ("cached") and sit in an LRU free queue; they are evicted lazily,
  least recently used first, only when a fresh block is needed.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence as Seq, Tuple

import numpy as np


def hash_block(parent_hash: Optional[bytes], token_ids: Seq[int], extra_keys: Optional[bytes] = None) -> bytes:
    """Chained block hash: blake2b(parent_hash | token ids as int64 | extra_keys), 16 bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent_hash or b"\0" * 16)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(extra_keys)
    return h.digest()


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[bytes] = None  # set once the block is full and registered

    def __repr__(self):
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Owns `num_blocks` KV blocks of `block_size` tokens.

    A sequence object passed in must have: `token_ids` (list), `num_computed_tokens` (int),
    `block_table` (list of block ids) and `block_hashes` (list of bytes for its full blocks).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._resets = 0  # reset_prefix_cache calls (cache_full_blocks' marks hold the count they saw)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # LRU order of blocks with ref_cnt == 0 (never used, or freed and possibly cached):
        # allocation pops from the front, freeing appends to the back.
        self.free_queue: "OrderedDict[int, None]" = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: Dict[bytes, int] = {}  # block hash -> block id (ref_cnt may be 0 or more)
        self.num_prefix_hit_tokens = 0  # statistics: prompt tokens served from the cache

    # ---------------------------------------------------------------- counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (fresh or evictable cached)."""
        return len(self.free_queue)

    def usage(self) -> Tuple[int, int, int]:
        """(used, free, cached): used = ref_cnt > 0; cached = ref_cnt 0 but still holding a prefix."""
        used = self.num_blocks - len(self.free_queue)
        cached = sum(1 for b in self.free_queue if self.blocks[b].block_hash is not None)
        return used, len(self.free_queue) - cached, cached

    # ---------------------------------------------------------------- prefix hashes
    def update_hashes(self, seq, extra_keys: Optional[bytes] = None) -> None:
        """Extend seq.block_hashes to cover every full block of seq.token_ids. A request with a
        LoRA adapter adds the adapter's digest, so two adapters never share KV."""
        bs = self.block_size
        if extra_keys is None:
            lora = getattr(getattr(seq, "request", None), "lora", None)
            extra_keys = lora.digest if lora is not None else None
        for i in range(len(seq.block_hashes), len(seq.token_ids) // bs):
            parent = seq.block_hashes[i - 1] if i else None
            seq.block_hashes.append(hash_block(parent, seq.token_ids[i * bs:(i + 1) * bs], extra_keys))

    def get_computed_blocks(self, seq) -> List[int]:
        """Check only: the longest run of seq's leading full blocks already in the cache.

        At least one prompt token is always left to compute, so the step has logits to sample.
        """
        if not self.enable_prefix_caching:
            return []
        self.update_hashes(seq)
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hit: List[int] = []
        for h in seq.block_hashes[:max_blocks]:
            bid = self.cached.get(h)
            if bid is None:
                break
            hit.append(bid)
        return hit

    # ---------------------------------------------------------------- allocate (new sequence)
    def _num_evictable_in(self, block_ids: List[int]) -> int:
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def can_allocate(self, seq, num_new_tokens: int, computed_blocks: List[int]) -> bool:
        """Check: can seq, starting from `computed_blocks`, get blocks for num_new_tokens more tokens?"""
        num_computed = len(computed_blocks) * self.block_size
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - len(computed_blocks)
        # Cache hits with ref_cnt 0 sit in the free queue; taking them shrinks what is left.
        return needed <= self.num_free_blocks - self._num_evictable_in(computed_blocks)

    def allocate(self, seq, num_new_tokens: int, computed_blocks: List[int]) -> None:
        """Act: give seq the cached blocks plus fresh ones for num_new_tokens; sets num_computed_tokens."""
        assert not seq.block_table, "allocate() is for sequences holding no blocks"
        assert self.can_allocate(seq, num_new_tokens, computed_blocks)
        for bid in computed_blocks:
            self._touch(bid)
        seq.block_table = list(computed_blocks)
        seq.num_computed_tokens = len(computed_blocks) * self.block_size
        self.num_prefix_hit_tokens += seq.num_computed_tokens
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(computed_blocks)
        seq.block_table.extend(self._pop_free() for _ in range(needed))

    # ---------------------------------------------------------------- append (running sequence)
    def _needs_cow(self, seq) -> bool:
        """Writing the next token would touch a partially filled block shared with another sequence."""
        if seq.num_computed_tokens % self.block_size == 0:
            return False  # the next token starts a new block
        last = self.blocks[seq.block_table[seq.num_computed_tokens // self.block_size]]
        return last.ref_cnt > 1

    def can_append(self, seq, num_new_tokens: int) -> bool:
        """Check: are there blocks for seq's next num_new_tokens tokens (and a copy-on-write)?"""
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        return max(needed, 0) + int(self._needs_cow(seq)) <= self.num_free_blocks

    def append_slots(self, seq, num_new_tokens: int) -> List[Tuple[int, int]]:
        """Act: extend seq's table for num_new_tokens more tokens.

        Returns the (src, dst) block copies the runner must do before writing (copy-on-write).
        """
        assert self.can_append(seq, num_new_tokens)
        copies: List[Tuple[int, int]] = []
        if self._needs_cow(seq):
            idx = seq.num_computed_tokens // self.block_size
            src = seq.block_table[idx]
            dst = self._pop_free()
            self.blocks[src].ref_cnt -= 1  # still > 0: another sequence holds it
            seq.block_table[idx] = dst
            copies.append((src, dst))
        needed = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size) - len(seq.block_table)
        seq.block_table.extend(self._pop_free() for _ in range(max(needed, 0)))
        return copies

    def truncate(self, seq, num_tokens: int) -> None:
        """Speculative rollback: seq keeps the K/V of its first num_tokens tokens (sets
        num_computed_tokens); the blocks past them, written only by rejected proposals, are freed.
        They were never registered as full prefix blocks (only computed, verified tokens are)."""
        assert num_tokens <= seq.num_computed_tokens
        keep = cdiv(num_tokens, self.block_size)
        for bid in reversed(seq.block_table[keep:]):
            block = self.blocks[bid]
            assert block.ref_cnt > 0, f"double free of block {bid}"
            assert block.block_hash is None, f"block {bid} past the verified tokens is cached"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[bid] = None
        del seq.block_table[keep:]
        seq.num_computed_tokens = num_tokens

    def fork(self, parent, child) -> None:
        """child shares all of parent's blocks (ref_cnt + 1 each); writes diverge by copy-on-write."""
        assert not child.block_table
        for bid in parent.block_table:
            self.blocks[bid].ref_cnt += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens
        # Only hashes of computed blocks are common to both; later tokens may differ.
        child.block_hashes = list(parent.block_hashes[:parent.num_computed_tokens // self.block_size])

    # ---------------------------------------------------------------- cache / free
    def cache_full_blocks(self, seq) -> None:
        """Register seq's computed full blocks under their prefix hashes (first writer wins).

        Runs every step: it starts at the first block of seq's table not known to be hashed (a
        mark kept on seq with its table; a hashed block keeps its hash while seq holds it), so a
        long decode does not walk all its blocks every step."""
        if not self.enable_prefix_caching:
            return
        self.update_hashes(seq)
        table = seq.block_table
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        mark = getattr(seq, "hashed_blocks_mark", None)
        ok = mark is not None and mark[0] is table and mark[2] == self._resets
        start = min(mark[1], num_full) if ok else 0
        new_mark, done = start, True  # done: every block before i is hashed
        for i in range(start, num_full):
            block = self.blocks[table[i]]
            if block.block_hash is None:
                h = seq.block_hashes[i]
                if h in self.cached:
                    done = False  # another block holds this hash: asked again next step
                    continue
                block.block_hash = h
                self.cached[h] = block.block_id
            if done:
                new_mark = i + 1
        try:
            seq.hashed_blocks_mark = (table, new_mark, self._resets)
        except AttributeError:  # a sequence without the attribute (__slots__): the whole walk each step
            pass

    def free(self, seq) -> None:
        """Drop seq's hold on its blocks; tail blocks go first into the LRU queue so they are evicted first."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            assert block.ref_cnt > 0, f"double free of block {bid}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[bid] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self._resets += 1  # the sequences' marks of hashed blocks (cache_full_blocks) are stale
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    # ---------------------------------------------------------------- internals
    def _touch(self, bid: int) -> None:
        block = self.blocks[bid]
        if block.ref_cnt == 0:
            del self.free_queue[bid]
        block.ref_cnt += 1

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.block_hash is not None:  # lazy eviction of the least recently used cached block
            if self.cached.get(block.block_hash) == bid:
                del self.cached[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return bid
