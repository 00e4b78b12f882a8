"""The KV cache an engine asks for: the one place that picks between the two kinds, and the parts of
a paged one -- each variant's part imported only when the options ask for it."""
from __future__ import annotations

import functools

from .concat import ConcatKVCache
from .manager import KVCacheManager
from .paged import PagedKVCache
from .plugged_cache import PluggedPagedKVCache


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


def make_kv_cache(info, config, pieces: bool = False):
    """The KV cache ``config`` asks for, sized for the model ``info`` describes (``pieces``: one that runs
    a learner's attention and slot mapping, :mod:`cbteach.kv.plugged_cache`)."""
    cache = config.cache
    if cache.kind == "paged":  # with tensor parallelism the ranks hold the K/V: here only the block bookkeeping
        return (PluggedPagedKVCache if pieces else PagedKVCache).for_model(info, cache, max_batch_size=config.scheduler.max_batch_size,
                                      allocate_pool=config.tensor_parallel_size == 1,
                                      manager_cls=manager_class(config))
    # valid paged-pool options are accepted and ignored, so one call can switch kv= back and forth
    return ConcatKVCache(info.num_layers, cache_kwarg=info.cache_kwarg, attn_implementation=info.attn_implementation,
                         dtype=info.dtype)
