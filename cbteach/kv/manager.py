"""Who owns which KV blocks (vLLM V1's ``KVCacheManager``): bookkeeping only, apart from the memory.

A free list of block ids, a reference count per block, and one **block table** per sequence:
``seq.block_table[i]`` holds its tokens ``i * block_size ... (i + 1) * block_size - 1``. The scheduler
asks for room (:meth:`KVCacheManager.allocate_slots`) before it plans a token; the K/V themselves live in
the worker's pool. So a change to *who gets room* touches this module, never attention.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from .prefix_cache import PrefixCache
from ..core.validation import check_positive_int


class PoolExhausted(RuntimeError):
    """The block pool has no free block left."""


class BlockAllocator:
    """Block ids from a free list, with a reference count each. The free list is in release order and
    hands out its oldest: a freed block keeps its K/V (prefix caching) until reused, so the least recently
    used is overwritten first (LRU)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise PoolExhausted(f"all {self.num_blocks} KV blocks are in use")
        block, _ = self.free_blocks.popitem(last=False)
        self.ref_counts[block] = 1
        return block

    def take(self, block: int) -> int:
        """One more owner for ``block`` (a prefix-cache hit); a free one leaves the free list."""
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} released twice")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None


class KVCacheManager:
    """Block tables and allocation for a pool of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        check_positive_int("block_size", block_size)
        check_positive_int("num_blocks", num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_cache = PrefixCache(block_size) if prefix_caching else None
        self.seqs: dict[object, object] = {}  # sequences holding blocks, by request id

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_allocatable_tokens(self, seq, new_computed_blocks=()) -> int:
        """How many more tokens ``seq`` could be given now: its own blocks' empty slots, every free block,
        and prefix-cache hits another sequence holds (``new_computed_blocks``)."""
        held = sum(1 for b in new_computed_blocks if self.allocator.ref_counts[b] > 0)
        room = (len(seq.block_table) + held + self.allocator.num_free) * self.block_size
        return max(0, room - seq.num_computed_tokens)

    def num_admittable_tokens(self, seq, new_computed_blocks=()) -> int:
        """The room an admission may use: here all of it."""
        return self.num_allocatable_tokens(seq, new_computed_blocks)

    def num_freeable_tokens(self, seqs) -> int:
        """The room freeing all of ``seqs`` would make: their blocks that no one else holds."""
        held: dict[int, int] = {}
        for s in seqs:
            for block in s.block_table:
                held[block] = held.get(block, 0) + 1
        return sum(1 for b, n in held.items() if n == self.allocator.ref_counts[b]) * self.block_size

    def num_blocks_to_take(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0) -> int:
        """Free blocks :meth:`allocate_slots` would take: new ones, and prefix-cache hits on the free list."""
        cached = list(new_computed_blocks)
        have = len(seq.block_table) + len(cached)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        need = max(0, self.blocks_needed(computed + num_new_tokens + num_lookahead_tokens) - have)
        return need + sum(1 for b in cached if self.allocator.ref_counts[b] == 0)

    def allocate_slots(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0):
        """Room for ``num_new_tokens`` more tokens of ``seq`` (V1's ``allocate_slots``): the blocks added
        (often none), or ``None`` -- nothing changed -- when too few are free. ``new_computed_blocks``, an
        admission's prefix-cache hits, are taken only now, so a refusal leaves the LRU order as it was.
        The blocks this step fills become findable at once (V1's ``cache_blocks``): an identical prompt
        admitted later in the same step reads them in the same forward pass, after they are written."""
        if seq.block_table and not new_computed_blocks and not num_lookahead_tokens and \
                seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            # The common case, checked first -- a decode inside its last block: nothing to take.
            if self.prefix_cache is not None:
                self.prefix_cache.register(seq, upto=seq.num_computed_tokens + num_new_tokens)
            return []
        if self.num_blocks_to_take(seq, num_new_tokens, new_computed_blocks, num_lookahead_tokens) > \
                self.allocator.num_free:
            return None
        cached = list(new_computed_blocks)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        seq.block_table.extend(self.allocator.take(b) for b in cached)
        need = max(0, self.blocks_needed(computed + num_new_tokens + num_lookahead_tokens) - len(seq.block_table))
        new = [self.allocate_block() for _ in range(need)]
        seq.block_table.extend(new)
        self.seqs[seq.request_id] = seq
        if self.prefix_cache is not None:
            self.prefix_cache.register(seq, upto=computed + num_new_tokens)
        return new

    def allocate_block(self) -> int:
        """One block off the free list; it stops being findable (it is about to hold other tokens)."""
        block = self.allocator.allocate()
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)
        return block

    def free(self, seq) -> None:
        """Give back every block of ``seq``; blocks past its computed tokens (findable since allocation,
        their K/V perhaps never written) leave the prefix cache first."""
        if self.prefix_cache is not None:
            done = seq.num_computed_tokens // self.block_size
            for block in seq.block_table[done:]:
                self.prefix_cache.evict(block)
            self.prefix_cache.forget(seq)
        for block in reversed(seq.block_table):  # the tail goes to the free list first: evicted first
            self.allocator.release(block)
        seq.block_table = []
        self.seqs.pop(seq.request_id, None)

    def trim(self, seq) -> None:
        """Give back the blocks past ``seq``'s computed tokens (room for tokens the update did not keep)."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block in reversed(seq.block_table[keep:]):
            self.allocator.release(block)
        del seq.block_table[keep:]

    # -- prefix caching --------------------------------------------------------------------------
    def get_computed_blocks(self, seq) -> tuple[list[int], int]:
        """The longest cached prefix of a block-less ``seq``'s known tokens: its blocks and their token count
        (V1's ``get_computed_blocks``). Takes nothing: :meth:`allocate_slots` does."""
        if self.prefix_cache is None or seq.block_table or seq.num_computed_tokens:
            return [], 0
        blocks = self.prefix_cache.lookup(seq.token_ids(0, seq.num_tokens))
        return blocks, len(blocks) * self.block_size

    def on_admitted(self, seq) -> None:
        """Count a first admission's prompt lookup in the hit statistics."""
        if self.prefix_cache is not None and seq.num_preemptions == 0:
            seq.num_cached_prompt_tokens = seq.num_computed_tokens
            self.prefix_cache.record_lookup(len(seq.prompt_ids), seq.num_computed_tokens)

    def on_computed(self, seq) -> None:
        """``seq`` computed more tokens: make its newly full blocks findable."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(seq)

    def check_fits(self, num_tokens: int, request_id) -> None:
        """``ValueError`` for a request that could never fit, even alone (its last token is never stored)."""
        need = self.blocks_needed(num_tokens - 1)
        if need > self.num_blocks:
            raise ValueError(f"request {request_id!r} needs up to {need} KV blocks of {self.block_size} tokens "
                             f"but the pool has only {self.num_blocks}: shorten it (its prompt or its max tokens), "
                             "or give the pool more blocks (num_blocks; --num-blocks on the command line)")

    def usage(self) -> dict:
        """The pool's bookkeeping now: blocks, tokens stored, how well the used blocks are filled."""
        used = self.num_blocks - self.allocator.num_free
        # A shared block holds its tokens once: count its filled slots once (its fullest owner's view).
        filled: dict[int, int] = {}
        for s in self.seqs.values():
            for i, block in enumerate(s.block_table):
                n = min(self.block_size, max(0, s.num_computed_tokens - i * self.block_size))
                filled[block] = max(filled.get(block, 0), n)
        tokens = sum(filled.values())
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.allocator.num_free,
            "num_used_blocks": used,
            "num_shared_blocks": sum(1 for c in self.allocator.ref_counts if c > 1),  # parallel samples, prefixes
            "block_size": self.block_size,
            "num_tokens": tokens,  # tokens whose K/V are in the pool, each stored once
            "num_logical_tokens": sum(s.num_computed_tokens for s in self.seqs.values()),  # per sequence
            "internal_fragmentation": used * self.block_size - tokens,
            "utilisation": tokens / (used * self.block_size) if used else 0.0,
            "block_tables": {rid: tuple(s.block_table) for rid, s in self.seqs.items()},
            "seq_num_tokens": {rid: s.num_computed_tokens for rid, s in self.seqs.items()},
            **(self.prefix_cache.stats() if self.prefix_cache is not None else {}),
        }

