"""The KV cache an engine asks for: the one place that picks between the two kinds, and the parts of
a paged one -- each variant's part imported only when the options ask for it."""
from __future__ import annotations

import functools

from .concat import ConcatKVCache
from .manager import KVCacheManager
from .memory import check_pool_fits
from .paged import PagedKVCache
from .plugged_cache import PluggedPagedKVCache
from .paged import PagedKVPool


def pool_class(kv_dtype) -> type:
    """The pool that stores K/V as ``kv_dtype``: the model's dtype (``None``), or int8
    (:mod:`cbteach.kv.int8`) with a scale per token and head (``"int8"``) or per block and head
    (``"int8_block"``)."""
    if kv_dtype is None:
        return PagedKVPool
    from .int8 import Int8BlockKVPool, Int8KVPool  # (imported only where it is used)

    return {"int8": Int8KVPool, "int8_block": Int8BlockKVPool}[kv_dtype]


def manager_class(config):
    """The KV manager ``config`` (an :class:`~cbteach.core.config.EngineConfig`) asks for: V1's
    :class:`~cbteach.kv.manager.KVCacheManager`, with fork's copy on write (:mod:`cbteach.kv.fork`)
    for ``parallel_sampling="fork"`` and an admission watermark (:mod:`cbteach.kv.watermark`) when
    ``watermark`` is not 0. Returns something called like the class."""
    cls = KVCacheManager
    if config.parallel_sampling == "fork":
        from .fork import ForkingKVCacheManager as cls  # (imported only where it is used)
    if config.cache.watermark:
        from .watermark import keeping_watermark

        return functools.partial(keeping_watermark(cls), watermark=config.cache.watermark)
    return cls


def paged_cache_class(pieces: bool = False, swaps: bool = False) -> type:
    """The paged cache class: :class:`~cbteach.kv.paged.PagedKVCache`, running a learner's attention
    and slot mapping (``pieces``, :mod:`cbteach.kv.plugged_cache`), holding host copies of blocks for
    a scheduler with V0's swaps (``swaps``, :mod:`cbteach.kv.swap`)."""
    cls = PluggedPagedKVCache if pieces else PagedKVCache
    if swaps:
        from .swap import with_host_copies  # (imported only where it is used)

        cls = with_host_copies(cls)
    return cls


def paged_cache_for(info, config, max_batch_size: int = 8, cache_cls=PagedKVCache, allocate_pool: bool = True,
                    manager_cls=KVCacheManager, pool_cls=PagedKVPool) -> PagedKVCache:
    """A paged cache (``cache_cls``) for the model ``info`` describes, its pool sized as ``config`` (a
    :class:`~cbteach.core.config.CacheConfig`) says: :meth:`~cbteach.core.config.CacheConfig.pool_num_blocks`."""
    if info.v_head_dim is not None:
        raise ValueError(f"this model's value heads ({info.v_head_dim}) are not as wide as its key heads "
                         f"({info.head_dim}) -- latent attention, as in DeepSeek-V2/V3 -- and the paged pool keeps "
                         "one head size for both: use kv='concat'")
    per_token = pool_cls.bytes_per_token_for(info.num_layers, info.num_kv_heads, info.head_dim,
                                             block_size=config.block_size, dtype=info.dtype)
    num_blocks = config.pool_num_blocks(info.max_positions, max_batch_size, config.block_size * per_token)
    return cache_cls(config, num_layers=info.num_layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                     num_blocks=num_blocks, dtype=info.dtype, device=info.device, allocate_pool=allocate_pool,
                     manager_cls=manager_cls, pool_cls=pool_cls)


def make_kv_cache(info, config, pieces: bool = False, swaps: bool = False):
    """The KV cache ``config`` asks for, sized for the model ``info`` describes (``pieces`` and
    ``swaps``: see :func:`paged_cache_class`)."""
    cache = config.cache
    if cache.kind == "paged":  # with tensor parallelism the ranks hold the K/V: here only the block bookkeeping
        if info.max_positions and cache.block_size > info.max_positions:
            raise ValueError(f"block_size={cache.block_size:,} is more than the model's {info.max_positions:,} positions: "
                             "no sequence could fill one block, and every block would hold that many slots -- give "
                             f"at most {info.max_positions:,} (vLLM's default is 16)")
        pool_cls, max_batch_size = pool_class(cache.kv_dtype), config.scheduler.max_batch_size
        per_block = cache.block_size * pool_cls.bytes_per_token_for(info.num_layers, info.num_kv_heads, info.head_dim,
                                                                    block_size=cache.block_size, dtype=info.dtype)
        why = (f"num_blocks={cache.num_blocks:,}" if cache.num_blocks else f"kv_memory_bytes={cache.kv_memory_bytes:g}"
               if cache.kv_memory_bytes else f"num_blocks not given: room for max_batch_size={max_batch_size:,} "
               f"sequences of {min(info.max_positions or 4096, 4096):,} positions")
        check_pool_fits(cache.pool_num_blocks(info.max_positions, max_batch_size, per_block), per_block, info.device,
                        config.tensor_parallel_size, why)
        return paged_cache_for(info, cache, max_batch_size=max_batch_size, cache_cls=paged_cache_class(pieces, swaps),
                               allocate_pool=config.tensor_parallel_size == 1, manager_cls=manager_class(config),
                               pool_cls=pool_cls)
    # valid paged-pool options are accepted and ignored, so one call can switch kv= back and forth
    return ConcatKVCache(info.num_layers, cache_kwarg=info.cache_kwarg, attn_implementation=info.attn_implementation,
                         dtype=info.dtype)
