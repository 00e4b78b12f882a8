"""Who owns which KV blocks: the allocator and the block tables, apart from the memory that holds K/V.

The paged KV cache has two halves, as in vLLM (its ``KVCacheManager`` and the model runner's KV
tensors):

* this module, the **KV manager**, is bookkeeping only -- a free list of block ids, a reference
  count per block, and one **block table** per sequence (``seq.block_table[i]`` is the block that
  holds the sequence's tokens ``i * block_size ... (i + 1) * block_size - 1``). The scheduler asks
  it for room (:meth:`KVCacheManager.allocate_slots`) before it schedules a single token;
* :mod:`cbteach.kv.paged`'s **pool** is the memory the blocks name, written at a slot mapping and
  read through block tables by the attention function.

Keeping them apart means a change to how K/V are *stored* touches the pool, and a change to *who
gets room* (prefix sharing, say) touches the manager -- never attention, never the scheduler's loop.
"""
from __future__ import annotations

import math
from collections import OrderedDict

from .prefix_cache import PrefixCache
from ..core.validation import check_positive_int


class PoolExhausted(RuntimeError):
    """The block pool has no free block left."""


class BlockAllocator:
    """Hands out block ids from a free list and counts references to each block.

    The free list is kept in release order, and blocks are handed out from its oldest end: with
    prefix caching, a freed block keeps its K/V until it is handed out again, so the least recently
    used cached block is the first to be overwritten (LRU eviction). Every freed block goes to the
    back; newer vLLM V1 versions put a freed block that holds no cached prefix at the front instead,
    so it is reused before any block worth keeping -- a difference of eviction order, not of tokens.
    """

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
        """One more owner for ``block``, free or not (a prefix-cache hit): a free one leaves the free list."""
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
        """``prefix_caching``: reuse full blocks of earlier requests with the same prefix
        (:mod:`cbteach.kv.prefix_cache`)."""
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
        """How many more tokens ``seq`` could be given right now: its last block's empty slots plus
        every free block. (vLLM V1's scheduler does not shrink a chunk to this: it asks for the whole
        chunk and preempts when refused.) ``new_computed_blocks``: an admission's prefix-cache hits --
        one that another sequence holds costs no free block, so it counts as room; one on the free
        list is counted there already."""
        held = sum(1 for b in new_computed_blocks if self.allocator.ref_counts[b] > 0)
        room = (len(seq.block_table) + held + self.allocator.num_free) * self.block_size
        return max(0, room - seq.num_computed_tokens)

    def num_admittable_tokens(self, seq, new_computed_blocks=()) -> int:
        """The room an admission may use: here all of :meth:`num_allocatable_tokens` (a manager that
        keeps some room back from admissions answers less)."""
        return self.num_allocatable_tokens(seq, new_computed_blocks)

    def num_freeable_tokens(self, seqs) -> int:
        """The room that freeing every sequence in ``seqs`` would make: their blocks held by no one else.
        A block shared with a sequence outside ``seqs`` (prefix caching) stays in use."""
        held: dict[int, int] = {}
        for s in seqs:
            for block in s.block_table:
                held[block] = held.get(block, 0) + 1
        return sum(1 for b, n in held.items() if n == self.allocator.ref_counts[b]) * self.block_size

    def num_blocks_to_take(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0) -> int:
        """How many free blocks :meth:`allocate_slots` would take for these arguments: new blocks for
        the tokens, plus prefix-cache hits that sit on the free list (taking one revives it)."""
        cached = list(new_computed_blocks)
        have = len(seq.block_table) + len(cached)
        computed = seq.num_computed_tokens + len(cached) * self.block_size
        need = max(0, self.blocks_needed(computed + num_new_tokens + num_lookahead_tokens) - have)
        return need + sum(1 for b in cached if self.allocator.ref_counts[b] == 0)

    def allocate_slots(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0):
        """Make room for ``num_new_tokens`` more tokens of ``seq``; return the blocks added (often none:
        a new block is taken only when the last one is full), or ``None`` -- with nothing changed --
        when the pool has too few free blocks (vLLM V1's ``allocate_slots``).

        ``new_computed_blocks``: an admission's prefix-cache hits (:meth:`get_computed_blocks`), taken
        only now, with the rest, so a refusal leaves the cache's LRU order as it was.
        ``num_lookahead_tokens``: room for tokens beyond this step's, taken now too.
        With prefix caching, the blocks this step fills become findable at once (V1's ``cache_blocks``):
        an identical prompt admitted later in the *same* step shares them -- its attention reads them
        in the same forward pass, layer by layer, after this step's K/V are written.
        """
        if seq.block_table and not new_computed_blocks and not num_lookahead_tokens and \
                seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) * self.block_size:
            # The common case -- a decode inside its last block: nothing to take (checked first, as it is
            # most of the calls).
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
        """One block off the free list; with prefix caching it stops being findable: it is about to
        hold other tokens."""
        block = self.allocator.allocate()
        if self.prefix_cache is not None:
            self.prefix_cache.evict(block)
        return block

    def free(self, seq) -> None:
        """Give back every block of ``seq`` (finished, aborted or preempted). A block made findable at
        allocation whose K/V this sequence will now never compute (it was preempted in the step that
        planned them) is forgotten by the prefix cache first."""
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
        """Give back the blocks past ``seq``'s computed tokens: room taken for tokens the update did not keep."""
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block in reversed(seq.block_table[keep:]):
            self.allocator.release(block)
        del seq.block_table[keep:]

    # -- prefix caching --------------------------------------------------------------------------
    def get_computed_blocks(self, seq) -> tuple[list[int], int]:
        """The blocks of the longest cached prefix of a block-less ``seq``'s tokens, and how many tokens
        they hold (vLLM V1's ``get_computed_blocks``). Takes nothing: :meth:`allocate_slots` does, if
        the admission goes ahead. (Its known tokens are used: a preempted request finds its own old
        blocks.)"""
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
        """Refuse a request that could never fit, even alone in the pool (its last token is never stored)."""
        need = self.blocks_needed(num_tokens - 1)
        if need > self.num_blocks:
            raise ValueError(f"request {request_id!r} needs up to {need} KV blocks of {self.block_size} tokens "
                             f"but the pool has only {self.num_blocks}: shorten it (its prompt or its max tokens), "
                             "or give the pool more blocks (num_blocks)")

    def usage(self) -> dict:
        """The pool's bookkeeping right now: blocks, tokens stored, how well the used blocks are filled."""
        used = self.num_blocks - self.allocator.num_free
        # A block shared by prefix caching holds its tokens once, however many tables list it: count
        # each used block's filled slots once (the fullest of its owners' views of it).
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

