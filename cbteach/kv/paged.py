"""The paged KV cache: fixed-size blocks in a preallocated pool, one block table per sequence.

This is PagedAttention's memory layout (Kwon et al., SOSP'23, the paper behind vLLM), in three parts:

* **The pool** (:class:`PagedKVPool`, here) -- per layer, one key and one value tensor of shape
  ``[num_blocks, block_size, num_kv_heads, head_dim]``, allocated once. A block holds the K/V of
  ``block_size`` consecutive tokens of *one* sequence, as one contiguous chunk of memory, and a token's
  **slot** is ``block_id * block_size + offset``. The pool only stores: it is written at a slot mapping
  and read through block tables.
* **The KV manager** (:class:`~cbteach.kv.manager.KVCacheManager`) -- who owns which block: the free
  list, reference counts, block tables. A sequence gets a new block only when its last one is full;
  blocks need not be adjacent, so a sequence grows without moving anyone's history.
* **Paged attention** (:mod:`cbteach.attention.paged`) -- writes each step's new K/V at their slots
  (the ``slot_mapping``) and reads each sequence's context through its block table.

Nothing is concatenated per step. Waste is at most ``block_size - 1`` empty slots per sequence, against a
contiguous ``prompt + max_new_tokens`` reservation that wastes everything the request never generates.
"""
from __future__ import annotations

import torch

from ..attention import metadata as attn_metadata
from ..attention import paged as paged_attention
from .concat import KVTraffic
from .manager import KVCacheManager, PoolExhausted  # noqa: F401  (PoolExhausted: re-exported)
from ..core.config import CacheConfig


class PagedKVPool:
    """The memory: K and V blocks for every layer. Knows slots and blocks, not sequences; who owns
    which block is the KV manager's business."""

    kv_dtype = None  # what it stores K/V as (CacheConfig.kv_dtype): None, the model's dtype
    may_hold_nan = False  # set once a request the model failed on may have left NaN (or inf) K/V in some block

    def __init__(self, *, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float32,
                 device="cpu"):
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token_for(num_layers, num_kv_heads, head_dim, block_size=None, dtype=torch.float32) -> int:
        """K and V of one token in every layer, for a pool of this shape (sizing a pool before it exists)."""
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return self.bytes_per_token_for(len(self.k), *self.k[0].shape[2:], dtype=self.k[0].dtype)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    def write(self, layer: int, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store ``key``/``value`` (``[tokens, kv_heads, head_dim]``) at their slots, in place."""
        k, v = self.k[layer], self.v[layer]
        k.view(-1, *k.shape[2:]).index_copy_(0, slot_mapping, key.to(k.dtype))
        v.view(-1, *v.shape[2:]).index_copy_(0, slot_mapping, value.to(v.dtype))

    def read(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather whole blocks: ``block_tables`` ``[G, n]`` gives K and V of ``[G, n * block_size, kv_heads, D]``."""
        flat = block_tables.flatten()  # index_select on the block axis: one contiguous copy per block
        shape = (block_tables.shape[0], -1, *self.k[layer].shape[2:])
        return (self.k[layer].index_select(0, flat).view(shape), self.v[layer].index_select(0, flat).view(shape))

    def block_tensors(self) -> list[list[torch.Tensor]]:
        """Every per-layer tensor whose first axis is the block (a pool that keeps more per block adds it)."""
        return [self.k, self.v]

    def read_slots(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather single slots: ``[n]`` slot ids give K and V of ``[n, kv_heads, D]``."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots]


class PagedKVCache:
    """The engine's view of the paged cache: the manager that hands out blocks, and the pool.

    Built from a validated :class:`~cbteach.core.config.CacheConfig` (``kind="paged"``); it
    implements :class:`cbteach.kv.interface.KVCache`.
    """

    kind = "paged"
    attn_implementation = paged_attention.NAME  # the engine's model view calls paged attention

    def __init__(self, config: CacheConfig, *, num_layers, num_kv_heads, head_dim, num_blocks,
                 dtype=torch.float32, device="cpu", allocate_pool: bool = True, manager_cls=KVCacheManager,
                 pool_cls=PagedKVPool):
        """``manager_cls``: the KV manager's class (or a function taking its arguments), called with
        ``(num_blocks, block_size, prefix_caching=...)``; ``pool_cls``: the pool's, which must store
        ``config.kv_dtype``. :mod:`cbteach.kv.caches` picks both for an engine's options."""
        if not isinstance(config, CacheConfig):
            raise ValueError(f"PagedKVCache takes a CacheConfig, got {type(config).__name__}")
        if pool_cls.kv_dtype != config.kv_dtype:
            raise ValueError(f"kv_dtype={config.kv_dtype!r} needs a pool that stores it, not {pool_cls.__name__} "
                             f"(kv_dtype={pool_cls.kv_dtype!r}): cbteach.kv.caches.pool_class picks it")
        self.config = config
        self.manager = manager_cls(num_blocks, config.block_size, prefix_caching=config.prefix_caching)
        # allocate_pool=False: the K/V live in other processes (each holds its share); this keeps the bookkeeping
        self.pool = pool_cls(num_layers=num_layers, num_blocks=num_blocks, block_size=config.block_size,
                             num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device) if allocate_pool else None
        self.last_traffic = KVTraffic()
        # Padding attention shapes to powers of two pays on CUDA, where a new shape costs a one-off setup;
        # on a CPU the padding would only cost compute.
        self.bucket_shapes = (torch.device(device).type == "cuda" if config.bucket_shapes is None
                              else config.bucket_shapes)
        paged_attention.register()

    block_size = property(lambda self: self.manager.block_size)
    num_blocks = property(lambda self: self.manager.num_blocks)

    def slots(self, seq, start: int, end: int) -> torch.Tensor:
        """Pool slots of the sequence's tokens ``start..end-1``: ``block_table[p // B] * B + p % B``.
        (The engine computes the same for a whole step at once, on the device: ``slot_mapping``.)"""
        device = self.pool.k[0].device
        pos = torch.arange(start, end, device=device)
        table = torch.tensor(seq.block_table, dtype=torch.long, device=device)
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    # -- one step ---------------------------------------------------------------------------
    def build_metadata(self, token_ids, num_computed, num_scheduled, device, block_tables=None, num_blocks=None,
                       request_ids=None):
        """The step's metadata for rows with these block tables: lists, or the worker's block-table array
        with ``num_blocks`` per row (``request_ids``: only the concat cache needs them)."""
        meta = attn_metadata.build(token_ids, num_computed, num_scheduled, device, block_tables=block_tables,
                                   block_size=self.block_size, bucket_shapes=self.bucket_shapes, num_blocks=num_blocks)
        meta.pool = self.pool
        return meta

    def forward_kwargs(self, meta) -> dict:
        return {paged_attention.STEP_KWARG: meta, "use_cache": False}  # the pool is the cache

    def after_forward(self, meta) -> KVTraffic:
        # Nothing to scatter: the attention function already wrote the new K/V into their slots.
        # What we count is what attention read through the block tables (padding included: the
        # vectorised gather reads whole blocks of every sequence in a group).
        per_token = self.pool.bytes_per_token
        read = sum(g.block_tables.numel() * self.block_size for g in meta.groups)
        self.last_traffic = KVTraffic(bytes_read=round(read * per_token),
                                      bytes_written=round(meta.num_tokens * per_token))
        return self.last_traffic

    def close(self) -> None:
        """Let go of the pool's memory (:meth:`cbteach.Engine.close`)."""
        self.pool = None

    # -- the manager's side -----------------------------------------------------------------
    def check_fits(self, num_tokens: int, request_id) -> None:
        self.manager.check_fits(num_tokens, request_id)

    def usage(self) -> dict:
        """Blocks, tokens stored and utilisation now, plus the pool's bytes."""
        pool = self.pool
        return {**self.manager.usage(), "pool_bytes": pool.nbytes if pool is not None else 0,
                "kv_bytes_per_token": pool.bytes_per_token if pool is not None else 0}
