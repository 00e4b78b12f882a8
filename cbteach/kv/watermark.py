"""An admission watermark: a share of the pool that admitting a request must leave free (vLLM V0).

vLLM V0's block manager admits a request only if that leaves ``watermark`` of the pool's blocks free
(1% by default), so that a request let in now does not force a preemption on the very next step;
later V1 versions have a ``watermark`` option too, 0 by default. Here it goes with V0's whole-prompt
admission (``admission="whole_prompt"``, :class:`~cbteach.engine.scheduler_v0.V0Scheduler`), which
asks :meth:`~cbteach.kv.manager.KVCacheManager.num_admittable_tokens` how much room an admission may
use. The engine builds its manager with :func:`keeping_watermark` only when ``watermark`` is not 0,
so the manager V1's path reads has no watermark in it.
"""
from __future__ import annotations

import functools

from ..core.config import check_watermark


class Watermark:
    """Mixed into a KV manager class (:func:`keeping_watermark`): admissions keep ``watermark`` of the
    blocks free, and a request that could not fit beside the watermark is refused up front."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0, **options):
        """``watermark``: the fraction of blocks an admission must leave free, in [0, 1)."""
        super().__init__(num_blocks, block_size, **options)
        check_watermark(watermark)
        self.watermark_blocks = int(watermark * num_blocks)

    def num_admittable_tokens(self, seq, new_computed_blocks=()) -> int:
        """The room an admission may use: the free room less the watermark."""
        return super().num_admittable_tokens(seq, new_computed_blocks) - self.watermark_blocks * self.block_size

    def check_fits(self, num_tokens: int, request_id) -> None:
        """Refuse a request that could never fit alone in the pool with the watermark kept free."""
        need = self.blocks_needed(num_tokens - 1)
        if self.watermark_blocks and need + self.watermark_blocks > self.num_blocks:
            raise ValueError(f"request {request_id!r} needs up to {need} KV blocks of {self.block_size} tokens (plus "
                             f"a watermark of {self.watermark_blocks} kept free at admission) but the pool has only "
                             f"{self.num_blocks}: shorten it (its prompt or its max tokens), or give the pool more "
                             "blocks (num_blocks)")
        super().check_fits(num_tokens, request_id)


@functools.cache
def keeping_watermark(manager_cls: type) -> type:
    """``manager_cls`` with :class:`Watermark` mixed in: its constructor takes ``watermark=``."""
    return type(f"Watermark{manager_cls.__name__}", (Watermark, manager_cls),
                {"__doc__": f"{manager_cls.__name__} whose admissions keep a watermark of blocks free."})
