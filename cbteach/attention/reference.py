"""The readable paged attention the engine's is checked against: one sequence at a time, only its own slots.

:func:`~cbteach.attention.paged.vectorised_attention` -- what the engine runs -- attends a whole group of
sequences in one call, over padded block tables and a mask; this loop reads each sequence's context slot
by slot (``block_table[p // B] * B + p % B``) and attends its own queries. Notebook 05 reads it; the tests,
05b's check and the Triton kernels are compared with it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .paged import masked_softmax_attention, written_out


def reference_attention(query, layer: int, meta, scaling=None) -> torch.Tensor:
    """The same result, one sequence at a time: read its context slots, attend its own queries."""
    out = torch.empty_like(query)
    bs = meta.block_size
    for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)):
        start = int(meta.query_start_loc[i])
        pos = torch.arange(c + n, device=query.device)
        slots = meta.block_tables[i, pos // bs] * bs + pos % bs  # block_table[p // B] * B + p % B
        k, v = meta.pool.read_slots(layer, slots)  # [context, kv_heads, D]
        k, v = k.transpose(0, 1)[None].to(query.dtype), v.transpose(0, 1)[None].to(query.dtype)
        # query j (at position c + j) sees keys 0..c+j: the sequence's block of the causal mask
        mask = None if n == 1 else torch.ones(n, c + n, dtype=torch.bool, device=query.device).tril(diagonal=c)
        if written_out(query.device):  # on a GPU, the formula written out (see _attend)
            out[:, :, start:start + n] = masked_softmax_attention(query[:, :, start:start + n], k, v,
                                                                  None if mask is None else mask[None, None], scaling)
            continue
        out[:, :, start:start + n] = F.scaled_dot_product_attention(
            query[:, :, start:start + n], k, v, attn_mask=mask, scale=scaling, enable_gqa=query.shape[1] != k.shape[1])
    return out
