"""The paged KV cache: fixed-size blocks in a preallocated pool, one block table per sequence.

This is PagedAttention's memory manager (Kwon et al., SOSP'23, the paper behind vLLM), small
enough to read in one sitting.

* **The pool** -- per layer, one key tensor and one value tensor of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``, allocated once. A block holds the K/V of
  ``block_size`` consecutive tokens of *one* sequence. Block-major layout means a block is one
  contiguous chunk of memory and a token's slot is simply ``block_id * block_size + offset``.
* **The allocator** -- a free list and a reference count per block. A sequence gets a new block
  only when its last one is full, and gives all back when it finishes. (Reference counts above
  one are how prefix caching will share blocks later.)
* **Block tables** -- ``seq.block_table[i]`` is the block holding the sequence's tokens
  ``i * block_size ... (i + 1) * block_size - 1``. Blocks need not be adjacent in the pool: a
  sequence can grow without moving anyone's history.
* **Slot mapping** -- for each token of this step's packed row, the slot its new K/V are written to.

Nothing is concatenated per step. Waste is at most ``block_size - 1`` empty slots per sequence
(internal fragmentation), against a contiguous ``prompt + max_new_tokens`` reservation that wastes
everything the request never generates.
"""
from __future__ import annotations

import math
from collections import deque

import torch

from . import paged_attention
from .kv_concat import CopyStats
from .packing import PackedBatch
from .request import check_positive_int


class PoolExhausted(RuntimeError):
    """The block pool has no free block left."""


class BlockAllocator:
    """Hands out block ids from a free list and counts references to each block."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def allocate(self) -> int:
        if not self.free_blocks:
            raise PoolExhausted(f"all {self.num_blocks} KV blocks are in use")
        block = self.free_blocks.popleft()
        self.ref_counts[block] = 1
        return block

    def fork(self, block: int) -> int:
        """Share ``block`` with one more owner (for prefix caching)."""
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} is free; only an allocated block can be shared")
        self.ref_counts[block] += 1
        return block

    def release(self, block: int) -> None:
        if self.ref_counts[block] < 1:
            raise ValueError(f"block {block} released twice")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_blocks.append(block)


class PagedKVCache:
    """A block pool for every layer, with block tables kept on each :class:`~cbteach.request.Sequence`."""

    kind = "paged"

    def __init__(self, *, num_layers, num_kv_heads, head_dim, num_blocks, block_size=16,
                 dtype=torch.float32, device="cpu"):
        check_positive_int("block_size", block_size)
        check_positive_int("num_blocks", num_blocks)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)
        self.seqs: dict[object, object] = {}  # live sequences by request id
        self.last_copy = CopyStats()
        self._step: paged_attention.PagedStep | None = None

    @classmethod
    def for_model(cls, model, info, *, block_size=16, num_blocks=None, kv_memory_bytes=None, max_batch_size=8):
        """Size a pool for ``model``: ``num_blocks`` directly, or as many as ``kv_memory_bytes`` holds,
        or by default enough for ``max_batch_size`` sequences of the model's full length (capped at
        4,096 positions each, so a long-context hub model does not ask for hundreds of GB; pass
        ``num_blocks`` or ``kv_memory_bytes`` to size it yourself)."""
        if num_blocks is not None and kv_memory_bytes is not None:
            raise ValueError("give num_blocks or kv_memory_bytes, not both")
        check_positive_int("block_size", block_size)  # before it divides the memory budget
        if kv_memory_bytes is not None:
            num_blocks = int(kv_memory_bytes // (info.kv_bytes_per_token * block_size))
            if num_blocks < 1:
                raise ValueError(f"kv_memory_bytes={kv_memory_bytes} holds no block of {block_size} tokens "
                                 f"({info.kv_bytes_per_token * block_size} bytes each)")
        if num_blocks is None:
            num_blocks = max_batch_size * math.ceil(min(info.max_positions or 4096, 4096) / block_size)
        cache = cls(num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                    num_blocks=num_blocks, block_size=block_size, dtype=info.dtype, device=info.device)
        paged_attention.install(model)  # only once the pool exists: a failed Engine leaves the model alone
        return cache

    # -- allocation -------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def can_allocate(self, seq, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= self.allocator.num_free

    def allocate(self, seq, num_new_tokens: int) -> None:
        """Give ``seq`` the blocks it needs to hold ``num_new_tokens`` more tokens (new block only when full)."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self.allocator.allocate())
        self.seqs[seq.request_id] = seq

    def free(self, seq) -> None:
        for block in seq.block_table:
            self.allocator.release(block)
        seq.block_table = []
        self.seqs.pop(seq.request_id, None)

    def check_fits(self, num_tokens: int, request_id) -> None:
        """Refuse a request that could never fit, even alone in the pool (its last token is never stored)."""
        need = self.blocks_needed(num_tokens - 1)
        if need > self.num_blocks:
            raise ValueError(f"request {request_id!r} needs up to {need} KV blocks of {self.block_size} tokens "
                             f"but the pool has only {self.num_blocks}; raise num_blocks or shorten it")

    # -- one step ---------------------------------------------------------------------------
    def slots(self, seq, start: int, end: int) -> torch.Tensor:
        """Pool slots of the sequence's tokens ``start..end-1``: ``block_table[p // B] * B + p % B``."""
        pos = torch.arange(start, end)
        table = torch.tensor(seq.block_table, dtype=torch.long)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def prepare(self, seqs, batch: PackedBatch, dtype) -> dict:
        """Work out where this step's K/V go (slot mapping) and what each sequence's queries read."""
        device = batch.input_ids.device
        slot_mapping, context_slots, masks = [], [], []
        for seq, c, n in zip(seqs, batch.num_cached, batch.num_new):
            ctx = self.slots(seq, 0, c + n).to(device)
            context_slots.append(ctx)
            slot_mapping.append(ctx[c:])
            # This sequence's diagonal block of per_sequence_causal_mask: query j sees keys 0..c+j.
            masks.append(None if n == 1 else
                         torch.ones(n, c + n, dtype=torch.bool, device=device).tril(diagonal=c))
        cu = batch.cu_seqlens
        self._step = paged_attention.PagedStep(
            cache=self, slot_mapping=torch.cat(slot_mapping), context_slots=context_slots, masks=masks,
            query_spans=[slice(a, b) for a, b in zip(cu[:-1], cu[1:])])
        return {}

    def forward_context(self, seqs, batch):
        return paged_attention.forward_context(self._step)

    def after_forward(self, seqs, batch) -> None:
        # Nothing to scatter: the attention function already wrote the new K/V into their slots.
        # What we do count is the gather inside attention, which a fused kernel would read in place.
        n = sum(len(s) for s in self._step.context_slots)
        per_token = 2 * self.k[0][0, 0].nbytes  # K and V of one token in one layer
        self.last_copy = CopyStats(bytes_gathered=n * per_token * len(self.k))
        self._step = None

    # -- accounting -------------------------------------------------------------------------
    def usage(self) -> dict:
        """The pool right now: blocks, tokens stored, and how well the used blocks are filled."""
        used = self.num_blocks - self.allocator.num_free
        tokens = sum(s.num_computed_tokens for s in self.seqs.values())
        return {
            "num_blocks": self.num_blocks,
            "num_free_blocks": self.allocator.num_free,
            "num_used_blocks": used,
            "block_size": self.block_size,
            "num_tokens": tokens,
            "internal_fragmentation": used * self.block_size - tokens,
            "utilisation": tokens / (used * self.block_size) if used else 0.0,
            "block_tables": {rid: list(s.block_table) for rid, s in self.seqs.items()},
            "seq_num_tokens": {rid: s.num_computed_tokens for rid, s in self.seqs.items()},
        }
