"""Paged attention as a transformers attention function: the model code stays untouched.

transformers lets a model's attention layers call any function registered with
``AttentionInterface``. We register ``"cbteach_paged"`` and switch the model to it. Each layer
then hands us its queries and this step's new keys and values (RoPE already applied), and we:

1. **write** the new K/V into the pool at their ``slot_mapping`` slots (in place, no copies of history);
2. for each sequence of the packed row, **read** its context through its block table (a gather of
   its slots) and **attend** its queries to it with ``scaled_dot_product_attention`` -- causal
   within the sequence, and never looking at another sequence's keys. Together these per-sequence
   calls are exactly the diagonal blocks of the block-diagonal mask
   (:func:`cbteach.packing.per_sequence_causal_mask`), without computing the blocked ones.

The gather in step 2 is where a real paged-attention kernel (vLLM's) differs: it reads the blocks
where they lie inside the attention loop. A gather followed by sdpa computes the same numbers
with stock PyTorch, so it is the honest choice for a CPU course; its cost is reported as
``kv_bytes_copied``.

The engine passes per-step metadata (slot mapping, context slots, mask) through a *forward
context* -- a module-level variable set for the duration of one forward pass, as vLLM does -- so no
extra arguments need to travel through the model's layers. Outside that context (say the user
calls ``model.generate`` on the same model) the function is plain sdpa -- so a model that used
``eager`` attention before an ``Engine(kv="paged")`` uses sdpa afterwards, with the same results up
to float rounding.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "cbteach_paged"


@dataclass
class PagedStep:
    """What one forward pass needs to know, computed once per step (not once per layer)."""

    cache: object  # the PagedKVCache
    slot_mapping: torch.Tensor  # [num_new_tokens]: where each new token's K/V go
    query_spans: list[slice]  # sequence i's queries are query[:, :, query_spans[i]]
    context_slots: list[torch.Tensor]  # sequence i's context (cached + new) slots, in position order
    masks: list[torch.Tensor | None]  # sequence i's causal mask [new, context]; None for one query


_current: PagedStep | None = None


@contextlib.contextmanager
def forward_context(step: PagedStep):
    global _current
    previous, _current = _current, step
    try:
        yield
    finally:
        _current = previous


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``query`` is ``[1, heads, new, head_dim]``; ``key``/``value`` are ``[1, kv_heads, new, head_dim]``."""
    step = _current
    if step is None:  # not inside an engine step: behave like the stock sdpa implementation
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    layer = module.layer_idx
    k_pool, v_pool = step.cache.k[layer], step.cache.v[layer]
    num_kv_heads, head_dim = k_pool.shape[2], k_pool.shape[3]
    flat_k = k_pool.view(-1, num_kv_heads, head_dim)  # slot-major view of the pool
    flat_v = v_pool.view(-1, num_kv_heads, head_dim)

    # 1. write this step's keys and values into their slots
    flat_k[step.slot_mapping] = key[0].transpose(0, 1).to(flat_k.dtype)
    flat_v[step.slot_mapping] = value[0].transpose(0, 1).to(flat_v.dtype)

    # 2. per sequence: read its context through its block table, attend its own queries to it
    out = torch.empty_like(query)
    gqa = query.shape[1] != num_kv_heads  # grouped-query attention: heads share KV heads
    for span, slots, mask in zip(step.query_spans, step.context_slots, step.masks):
        k = flat_k[slots].transpose(0, 1)[None].to(query.dtype)  # [1, kv_heads, context, head_dim]
        v = flat_v[slots].transpose(0, 1)[None].to(query.dtype)
        out[:, :, span] = F.scaled_dot_product_attention(query[:, :, span], k, v, attn_mask=mask,
                                                         scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def install(model) -> None:
    """Register the function with transformers and switch ``model`` to it (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # outside the engine, masks as for sdpa
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
