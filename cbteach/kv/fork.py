"""Parallel sampling by fork: sibling samples share their blocks until one writes (copy on write).

PagedAttention (Kwon et al., SOSP'23, section 4.4) runs ``n`` samples of one prompt on *one* copy of
the prompt's K/V: each sample's block table lists the same blocks, a reference count says how many
tables list each, and a sample about to write into a block it shares first gets a copy of its own.
vLLM V0's block manager did this (``fork``, copy-on-write in ``append_slots``).

vLLM V1 has no fork: a request with ``n > 1`` becomes ``n`` child requests (``ParentRequest``) that
share the prompt through the prefix cache (:mod:`cbteach.engine.parallel_sampling`, ``"fanout"``).
So fork is not in V1's manager, :class:`~cbteach.kv.manager.KVCacheManager`, but here, in a
subclass the engine uses only with ``parallel_sampling="fork"`` -- through the same plug points a
learner's manager uses (``fork``, ``take_pending_copies``).

Why a copy is cheap to get right: only the block the *next* token goes into can be shared and
written -- every earlier block of the sample is full and never written again. So a copy happens at
most once per sample, at the step after the fork, and only when the prompt did not end on a block
boundary.
"""
from __future__ import annotations

import torch

from .manager import KVCacheManager


class ForkingKVCacheManager(KVCacheManager):
    """:class:`~cbteach.kv.manager.KVCacheManager` plus ``fork`` and copy on write."""

    copy_on_write = True  # fork() shares blocks and allocate_slots() copies a shared one before writing

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False):
        super().__init__(num_blocks, block_size, prefix_caching=prefix_caching)
        self.pending_copies: list[tuple[int, int]] = []  # (src, dst) for the pool to copy before the forward
        self.num_cow_copies = 0  # blocks copied on write so far

    def fork(self, parent, child) -> None:
        """``child`` (a sibling sample) shares every block of ``parent`` -- one more reference each, no
        copy: a shared block is copied only when one of them writes into it (:meth:`allocate_slots`)."""
        child.block_table = [self.allocator.take(b) for b in parent.block_table]
        self.seqs[child.request_id] = child

    def allocate_slots(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0):
        """As the base class's, but if the block the new tokens start in is shared with a sibling, this
        sequence first gets its own copy of it: a fresh block in its place in the block table, and a
        ``(src, dst)`` pair in :attr:`pending_copies` that the pool copies before the forward pass. The
        copy's block counts against the pool like any other: without room for it and for the chunk,
        nothing changes and the answer is ``None``."""
        first = seq.num_computed_tokens // self.block_size  # the block the first new token is written into
        shared = (num_new_tokens > 0 and first < len(seq.block_table)
                  and self.allocator.ref_counts[seq.block_table[first]] > 1)
        if not shared:
            return super().allocate_slots(seq, num_new_tokens, new_computed_blocks, num_lookahead_tokens)
        if 1 + self.num_blocks_to_take(seq, num_new_tokens, new_computed_blocks, num_lookahead_tokens) > \
                self.allocator.num_free:
            return None
        src, dst = seq.block_table[first], self.allocate_block()
        self.allocator.release(src)  # the siblings keep it
        seq.block_table[first] = dst
        self.pending_copies.append((src, dst))
        self.num_cow_copies += 1
        return super().allocate_slots(seq, num_new_tokens, new_computed_blocks, num_lookahead_tokens)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies the pool must make before the next forward pass (and forget them)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def usage(self) -> dict:
        return {**super().usage(), "num_cow_copies": self.num_cow_copies}


def copy_blocks(pool, pairs: list[tuple[int, int]]) -> None:
    """Copy whole blocks inside a paged ``pool``, every layer: ``dst`` becomes a copy of ``src`` -- every
    tensor the pool keeps per block (``pool.block_tensors()``: K and V, and an int8 pool's scales)."""
    if not pairs:
        return
    device = pool.k[0].device
    src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=device)
    dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=device)
    for tensors in pool.block_tensors():
        for t in tensors:
            t[dst] = t[src]


def can_fork(manager) -> bool:
    """Whether ``manager`` can run ``parallel_sampling="fork"``: it has ``fork`` and says it copies on
    write. A subclass that replaces :meth:`ForkingKVCacheManager.allocate_slots` -- where the copy
    happens -- must say so again itself (``copy_on_write = True`` in its own class body): inheriting
    the promise from a method it replaced would let sibling samples write into each other's blocks."""
    cls = type(manager)
    if not callable(getattr(manager, "fork", None)) or not getattr(manager, "copy_on_write", False):
        return False
    if isinstance(manager, ForkingKVCacheManager) and cls.allocate_slots is not ForkingKVCacheManager.allocate_slots:
        return any("copy_on_write" in vars(c) for c in cls.__mro__[:cls.__mro__.index(ForkingKVCacheManager)])
    return True
