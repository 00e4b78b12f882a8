"""The KV cache, one concept per module (notebooks 04, 05, 08, 09).

* :mod:`.interface` -- the seams, declared: what the scheduler calls on a KV manager, the engine on a KV cache
* :mod:`.manager` -- the block allocator and block tables: who owns which block (vLLM's KV cache manager)
* :mod:`.paged` -- the paged pool and the engine's paged cache: slots, block tables
* :mod:`.probe` -- the pool's shape as the model's layers use it, seen in a one-token forward (or why they cannot)
* :mod:`.caches` -- the cache an engine's options ask for, and its parts (the variants below, only when asked for)
* :mod:`.concat` -- the concatenating cache of notebook 04: per-sequence caches copied every step
* :mod:`.int8` -- int8 pools with a scale per token or per block, dequantised on read
* :mod:`.swap` -- requests' blocks in host memory (V0's swap preemption, a disaggregated handover)
* :mod:`.fork` -- parallel sampling by fork: shared blocks, copy on write (V0's)
* :mod:`.watermark` -- a share of the pool admissions leave free (V0's)
* :mod:`.prefix_cache` -- full blocks named by a hash of their tokens, reused across requests
* :mod:`.memory` -- where the bytes go: paged versus a contiguous reservation
"""
