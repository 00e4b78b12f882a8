"""An int8 KV pool: a quarter of the memory per token, dequantised on read.

KV-cache memory is what limits how many sequences a server can batch (PagedAttention's whole
argument), so production engines store K and V in 8 bits (vLLM's ``kv_cache_dtype="fp8"``,
TensorRT-LLM's int8/fp8 KV). This pool stores each token's key and value **per head** as int8
with one float32 scale per (token, head) -- symmetric absmax quantisation:

    scale = max(|x|) / 127        q = round(x / scale)        x ~= q * scale

A token-and-head scale is written once with the token and never changes, which suits a cache that
is filled one token at a time. ``kv_dtype="int8_block"`` (:class:`Int8BlockKVPool`) keeps one scale
per *block* and head instead: a sixteenth of the scale memory for 16-token blocks, but when a new
token's values exceed its block's scale the scale grows and the block's earlier tokens are
re-quantised to it -- coarser steps for them, and rounding twice. Notebook 09 measures both.

Memory per token: ``head_dim`` bytes plus a 4-byte scale per head, for K and for V, against
``4 * head_dim`` in fp32 -- about 28% for bierce's 32-dim heads (25.2% with block scales). Attention still computes in the
model's dtype: only the storage is int8. The result is *not* exact: the engine with this pool is
measured against the fp32 engine (agreement, and the model's loss), never claimed equal to it.
Only the pool changes; the KV manager, the scheduler and attention are the same code.
"""
from __future__ import annotations

import torch

from .paged import PagedKVPool


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` -> (int8 values, float32 scales ``[...]``)."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-8) / 127.0
    q = torch.round(x / scale[..., None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale[..., None]).to(dtype)


class Int8KVPool(PagedKVPool):
    """K and V as int8 ``[num_blocks, block_size, kv_heads, head_dim]`` plus float32 scales per (token, head)."""

    kv_dtype = "int8"

    def __init__(self, *, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu"):
        super().__init__(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.int8, device=device)
        self.out_dtype = dtype  # what reads return: the model's dtype
        scale_shape = (num_blocks, block_size, num_kv_heads)
        self.k_scale = [torch.zeros(scale_shape, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(scale_shape, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token_for(num_layers, num_kv_heads, head_dim, block_size=None, dtype=None) -> int:
        """K and V of one token in every layer (``block_size`` and the model's ``dtype`` do not matter:
        scales are per token, values int8)."""
        return 2 * num_layers * num_kv_heads * (head_dim + 4)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_token_for(len(self.k), self.k[0].shape[2], self.k[0].shape[3])

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v + self.k_scale + self.v_scale)

    def write(self, layer, slot_mapping, key, value) -> None:
        for store, scales, x in ((self.k[layer], self.k_scale[layer], key), (self.v[layer], self.v_scale[layer], value)):
            q, s = quantize(x)
            store.view(-1, *store.shape[2:]).index_copy_(0, slot_mapping, q)
            scales.view(-1, scales.shape[2]).index_copy_(0, slot_mapping, s)

    def read(self, layer, block_tables):
        flat, g = block_tables.flatten(), block_tables.shape[0]
        k = dequantize(self.k[layer].index_select(0, flat), self.k_scale[layer].index_select(0, flat), self.out_dtype)
        v = dequantize(self.v[layer].index_select(0, flat), self.v_scale[layer].index_select(0, flat), self.out_dtype)
        return k.view(g, -1, *k.shape[2:]), v.view(g, -1, *v.shape[2:])

    def block_tensors(self):
        return [self.k, self.v, self.k_scale, self.v_scale]

    def read_slots(self, layer, slots):
        k, v, ks, vs = self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
        return (dequantize(k.view(-1, *k.shape[2:])[slots], ks.view(-1, ks.shape[2])[slots], self.out_dtype),
                dequantize(v.view(-1, *v.shape[2:])[slots], vs.view(-1, vs.shape[2])[slots], self.out_dtype))


class Int8BlockKVPool(Int8KVPool):
    """int8 K and V with one float32 scale per (block, head), grown as the block fills.

    A scale must cover every value in its block. Tokens arrive one step at a time, so a write
    first raises each touched block's scale to cover the new values, re-quantises the values
    already stored there to the new scale (``round(q * old / new)``), then stores the new tokens.
    A write at a block's first slot starts the block afresh (its previous owner's scale is
    forgotten): tokens of a sequence are written in order, and cached prefix blocks are never
    written again, so offset 0 means a new owner."""

    kv_dtype = "int8_block"

    def __init__(self, *, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu"):
        super().__init__(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)
        self.block_size = block_size
        self.k_scale = [torch.zeros(num_blocks, num_kv_heads, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(num_blocks, num_kv_heads, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token_for(num_layers, num_kv_heads, head_dim, block_size=16, dtype=None) -> float:
        return 2 * num_layers * num_kv_heads * (head_dim + 4 / block_size)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_token_for(len(self.k), self.k[0].shape[2], self.k[0].shape[3], self.block_size)

    def write(self, layer, slot_mapping, key, value) -> None:
        blocks = slot_mapping // self.block_size
        fresh = blocks[slot_mapping % self.block_size == 0]
        touched = blocks.unique()
        for store, scales, x in ((self.k[layer], self.k_scale[layer], key), (self.v[layer], self.v_scale[layer], value)):
            scales[fresh] = 0.0
            old = scales[touched]
            need = x.float().abs().amax(dim=-1) / 127.0  # [tokens, heads]
            scales.scatter_reduce_(0, blocks[:, None].expand_as(need), need, "amax")
            new = scales[touched].clamp(min=1e-8)
            # Values already in a touched block, re-quantised to its (possibly larger) scale.
            ratio = (old / new)[:, None, :, None]
            store[touched] = torch.round(store[touched].float() * ratio).to(torch.int8)
            q = torch.round(x.float() / scales[blocks].clamp(min=1e-8)[..., None]).clamp(-127, 127)
            store.view(-1, *store.shape[2:]).index_copy_(0, slot_mapping, q.to(torch.int8))

    def _per_token(self, scales, blocks):
        """Block scales ``[blocks, heads]`` repeated for each slot of those blocks."""
        return scales.index_select(0, blocks)[:, None, :].expand(-1, self.block_size, -1)

    def read(self, layer, block_tables):
        flat, g = block_tables.flatten(), block_tables.shape[0]
        k = dequantize(self.k[layer].index_select(0, flat), self._per_token(self.k_scale[layer], flat), self.out_dtype)
        v = dequantize(self.v[layer].index_select(0, flat), self._per_token(self.v_scale[layer], flat), self.out_dtype)
        return k.view(g, -1, *k.shape[2:]), v.view(g, -1, *v.shape[2:])

    def read_slots(self, layer, slots):
        blocks = slots // self.block_size
        k, v = self.k[layer], self.v[layer]
        return (dequantize(k.view(-1, *k.shape[2:])[slots], self.k_scale[layer][blocks], self.out_dtype),
                dequantize(v.view(-1, *v.shape[2:])[slots], self.v_scale[layer][blocks], self.out_dtype))
