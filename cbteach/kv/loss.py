"""What storing K/V in a smaller dtype costs: the model's loss with its K/V read back from a paged pool.

Notebook 09 prices int8 KV this way: one prefill pass over a text writes every token's K/V into a
pool of the dtype under test, and every query reads them back from it -- quantised, for int8 -- so
the loss against the model's own (a float32 pool gives exactly that) shows what the smaller pool loses.
"""
from __future__ import annotations

import torch

from ..core.config import CacheConfig
from ..core.model_view import model_view
from ..core.modelinfo import describe
from .caches import paged_cache_for, pool_class


@torch.no_grad()
def kv_loss(model, token_ids: list[int], kv_dtype=None, block_size: int = 16) -> float:
    """The model's mean next-token loss on ``token_ids`` when attention reads its K/V from a paged pool
    stored as ``kv_dtype`` (``None``: the model's dtype, ``"int8"``): one prefill pass writes every
    token's K/V into the pool, and every query reads them back from it -- quantised, for int8."""
    if len(token_ids) < 2:
        raise ValueError("kv_loss needs at least two tokens (one prediction)")
    info = describe(model)
    n = len(token_ids)
    config = CacheConfig(kind="paged", block_size=block_size, num_blocks=-(-n // block_size), kv_dtype=kv_dtype)
    cache = paged_cache_for(info, config, pool_cls=pool_class(kv_dtype))
    meta = cache.build_metadata(list(token_ids), [0], [n], info.device, block_tables=[list(range(cache.num_blocks))])
    view = model_view(model, cache.attn_implementation)  # the model itself is left as it is
    logits = view(input_ids=meta.input_ids, position_ids=meta.positions, **cache.forward_kwargs(meta)).logits[0]
    return torch.nn.functional.cross_entropy(logits[:-1].float(), meta.input_ids[0, 1:]).item()
