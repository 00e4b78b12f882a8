"""The paged pool: the memory the KV blocks name, and nothing else.

Per layer, one key tensor and one value tensor of shape ``[num_blocks, block_size, num_kv_heads,
head_dim]``, allocated once. A block holds the K/V of ``block_size`` consecutive tokens of *one*
sequence; block-major layout makes a block one contiguous chunk of memory, and a token's **slot**
is ``block_id * block_size + offset``. The pool is written at a slot mapping and read through
block tables; who owns which block is the KV manager's business (:mod:`cbteach.kv.manager`).
"""
from __future__ import annotations

import torch


class PagedKVPool:
    """The memory: K and V blocks for every layer. Knows slots and blocks, not sequences."""

    kv_dtype = None  # what it stores K/V as (CacheConfig.kv_dtype): None, the model's dtype

    def __init__(self, *, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu"):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token_for(num_layers, num_kv_heads, head_dim, block_size=None, dtype=torch.float32) -> int:
        """K and V of one token in every layer, for a pool of this shape (sizing a pool before it exists)."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * len(self.k) * self.k[0][0, 0].nbytes

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` (``[tokens, kv_heads, head_dim]``) at their slots, in place."""
        k, v = self.k[layer], self.v[layer]
        k.view(-1, *k.shape[2:]).index_copy_(0, slot_mapping, key.to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, slot_mapping, value.to(v.dtype))

    def read(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather whole blocks: ``block_tables`` ``[G, n]`` gives K and V of ``[G, n * block_size, kv_heads, D]``."""
        flat = block_tables.flatten()  # index_select on the block axis: one contiguous copy per block
        shape = (block_tables.shape[0], -1, *self.k[layer].shape[2:])
        return (self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape))

    def block_tensors(self) -> list[list[torch.Tensor]]:
        """Every per-layer tensor whose first axis is the block (a pool that keeps more per block adds it)."""
        return [self.k, self.v]

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather single slots: ``[n]`` slot ids give K and V of ``[n, kv_heads, D]``."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots]
