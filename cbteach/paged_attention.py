"""Paged attention as a transformers attention function: the model code stays untouched.

transformers lets a model's attention layers call any function registered with
``AttentionInterface``. We register ``"cbteach_paged"`` and switch the model to it. Each layer
then hands us its queries and this step's new keys and values (RoPE already applied), and we:

1. **write** the new K/V into the pool at their ``slot_mapping`` slots (in place, no copies of history);
2. **read** each sequence's whole context through its block table -- here a gather of the slots
   into a temporary packed tensor, ``[A's context | B's context | ...]``;
3. **attend** with ``scaled_dot_product_attention`` and the per-sequence causal mask.

Step 2 is where a real paged-attention kernel (vLLM's) differs: it reads the blocks where they lie
inside the attention loop. A gather followed by sdpa computes the same numbers with stock PyTorch,
so it is the honest choice for a CPU course; its cost is reported as ``kv_bytes_copied``.

The engine passes per-step metadata (slot mapping, context slots, mask) through a *forward
context* -- a module-level variable set for the duration of one forward pass, as vLLM does -- so no
extra arguments need to travel through the model's layers. Outside that context (say the user
calls ``model.generate`` on the same model) the function is plain sdpa.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

NAME = "cbteach_paged"


@dataclass
class PagedStep:
    cache: object  # the PagedKVCache
    slot_mapping: torch.Tensor  # [num_new_tokens]: where each new token's K/V go
    context_slots: torch.Tensor  # [num_context_tokens]: every scheduled sequence's slots, in order
    mask: torch.Tensor  # [1, 1, num_new_tokens, num_context_tokens] additive


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

    # 2. read every scheduled sequence's context through its block table
    k = flat_k[step.context_slots].transpose(0, 1)[None]  # [1, kv_heads, context, head_dim]
    v = flat_v[step.context_slots].transpose(0, 1)[None]

    # 3. attend; grouped-query attention shares each KV head among heads // kv_heads query heads
    groups = query.shape[1] // num_kv_heads
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, k.to(query.dtype), v.to(query.dtype),
                                         attn_mask=step.mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def install(model) -> None:
    """Register the function with transformers and switch ``model`` to it (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, paged_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # outside the engine, masks as for sdpa
    if model.config._attn_implementation != NAME:
        model.set_attn_implementation(NAME)
