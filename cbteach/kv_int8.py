"""An int8 KV pool: a quarter of the memory per token, dequantised on read.

KV-cache memory is what limits how many sequences a server can batch (PagedAttention's whole
argument), so production engines store K and V in 8 bits (vLLM's ``kv_cache_dtype="fp8"``,
TensorRT-LLM's int8/fp8 KV). This pool stores each token's key and value **per head** as int8
with one float32 scale per (token, head) -- symmetric absmax quantisation:

    scale = max(|x|) / 127        q = round(x / scale)        x ~= q * scale

A token-and-head scale is written once with the token and never changes, which suits a cache that
is filled one token at a time. (A scale per *block* and head would cost less memory but must be
recomputed, and the block re-quantised, whenever a new token's values exceed it.)

Memory per token: ``head_dim`` bytes plus a 4-byte scale per head, for K and for V, against
``4 * head_dim`` in fp32 -- about 28% for bierce's 32-dim heads. Attention still computes in the
model's dtype: only the storage is int8. The result is *not* exact: the engine with this pool is
measured against the fp32 engine (agreement, and the model's loss), never claimed equal to it.
Only the pool changes; the KV manager, the scheduler and attention are the same code.
"""
from __future__ import annotations

import torch

from .kv_paged import PagedKVPool


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

    def __init__(self, *, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu"):
        super().__init__(num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=torch.int8, device=device)
        self.out_dtype = dtype  # what reads return: the model's dtype
        scale_shape = (num_blocks, block_size, num_kv_heads)
        self.k_scale = [torch.zeros(scale_shape, device=device) for _ in range(num_layers)]
        self.v_scale = [torch.zeros(scale_shape, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token_for(num_layers, num_kv_heads, head_dim) -> int:
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

    def read_slots(self, layer, slots):
        k, v, ks, vs = self.k[layer], self.v[layer], self.k_scale[layer], self.v_scale[layer]
        return (dequantize(k.view(-1, *k.shape[2:])[slots], ks.view(-1, ks.shape[2])[slots], self.out_dtype),
                dequantize(v.view(-1, *v.shape[2:])[slots], vs.view(-1, vs.shape[2])[slots], self.out_dtype))

    def copy_out(self, blocks):
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        return [tuple(t[idx].to("cpu") for t in group)
                for group in zip(self.k, self.v, self.k_scale, self.v_scale)]

    def copy_in(self, blocks, data) -> None:
        idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
        for group, saved in zip(zip(self.k, self.v, self.k_scale, self.v_scale), data):
            for t, h in zip(group, saved):
                t[idx] = h.to(t.device)


@torch.no_grad()
def kv_loss(model, token_ids: list[int], kv_dtype=None, block_size: int = 16) -> float:
    """The model's mean next-token loss on ``token_ids`` when attention reads its K/V from a paged pool
    stored as ``kv_dtype`` (``None``: the model's dtype, ``"int8"``): one prefill pass writes every
    token's K/V into the pool, and every query reads them back from it -- quantised, for int8."""
    from types import SimpleNamespace

    from .kv_paged import PagedKVCache
    from .modelinfo import describe

    if len(token_ids) < 2:
        raise ValueError("kv_loss needs at least two tokens (one prediction)")
    info = describe(model)
    n = len(token_ids)
    cache = PagedKVCache.for_model(info, block_size=block_size, num_blocks=-(-n // block_size), kv_dtype=kv_dtype)
    seq = SimpleNamespace(block_table=list(range(cache.num_blocks)))
    meta = cache.build_metadata(list(token_ids), [seq], [0], [n], info.device)
    with cache.attention(model):
        logits = model(input_ids=meta.input_ids, position_ids=meta.positions, **cache.forward_kwargs(meta)).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1].float(), meta.input_ids[0, 1:]).item()
