"""The KV cache an engine asks for: the one place that picks between the two kinds."""
from __future__ import annotations

from .concat import ConcatKVCache
from .paged import PagedKVCache
from .plugged_cache import PluggedPagedKVCache


def make_kv_cache(info, config, pieces: bool = False):
    """The KV cache ``config`` asks for, sized for the model ``info`` describes (``pieces``: one that runs
    a learner's attention and slot mapping, :mod:`cbteach.kv.plugged_cache`)."""
    cache = config.cache
    if cache.kind == "paged":  # with tensor parallelism the ranks hold the K/V: here only the block bookkeeping
        return (PluggedPagedKVCache if pieces else PagedKVCache).for_model(info, cache, max_batch_size=config.scheduler.max_batch_size,
                                      allocate_pool=config.tensor_parallel_size == 1,
                                      fork=config.parallel_sampling == "fork")
    # valid paged-pool options are accepted and ignored, so one call can switch kv= back and forth
    return ConcatKVCache(info.num_layers, cache_kwarg=info.cache_kwarg, attn_implementation=info.attn_implementation,
                         dtype=info.dtype)
