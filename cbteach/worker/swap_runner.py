"""V0's swap preemption on the worker's side: the message's swaps, around V1's update of the batch.

vLLM V0 (and the PagedAttention paper, section 4.5) can preempt a request by copying its K/V blocks
to host memory and bring them back later; V1 only recomputes. A scheduler with V0's rules
(:class:`~cbteach.engine.scheduler_v0.V0Scheduler`) sends a
:class:`~cbteach.engine.scheduler_v0.V0SchedulerOutput`, whose ``blocks_to_swap_out`` and
``blocks_to_swap_in`` say which blocks move; the worker, which owns the pool, moves them
(:class:`~cbteach.kv.swap.HostCopies`). The order matters: swap-outs first, before anyone this step
writes into a block a victim gave up; swap-ins last, into blocks the scheduler has just given the
request back. An engine with V0's scheduler builds this runner instead of
:class:`~cbteach.worker.model_runner.ModelRunner` (in every tensor-parallel rank too).
"""
from __future__ import annotations

from .model_runner import ModelRunner


class SwappingModelRunner(ModelRunner):
    """A :class:`ModelRunner` that carries out the message's swaps and drops finished requests' host copies."""

    def update_states(self, msg) -> None:
        kv = self.kv_cache
        for rid, blocks in getattr(msg, "blocks_to_swap_out", {}).items():
            kv.swap_out_blocks(rid, blocks)
        super().update_states(msg)
        if kv.kind == "paged":
            for rid in msg.finished_req_ids:  # (aborted while swapped out: its host copy goes)
                kv.discard(rid)
            for rid, blocks in getattr(msg, "blocks_to_swap_in", {}).items():
                kv.swap_in_blocks(rid, blocks)
