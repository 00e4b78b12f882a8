"""A request's blocks in host memory: V0's swap preemption and a disaggregated handover, the pool's side.

Swap preemption (the vLLM paper, section 4.5; vLLM V0) takes a request out of the batch by copying
its K/V blocks to host memory instead of dropping them, and copies them back into the blocks the
scheduler gives it when room returns. The scheduler decides which blocks go out and come back
(:class:`~cbteach.engine.scheduler_v0.V0SchedulerOutput`); the worker, which owns the pool, makes
the copies before the step's forward pass (:class:`~cbteach.worker.swap_runner.SwappingModelRunner`)
and keeps the host copies here, in :attr:`HostCopies.swap_space`. A disaggregated prefill engine
ships a request's blocks the same way (:meth:`HostCopies.copy_out`), and the decode engine holds them
until they come back in (:meth:`HostCopies.hold_swapped`). V1 preempts by recompute only.
"""
from __future__ import annotations

import time


class HostCopies:
    """Host copies of requests' blocks, kept by request id; mixed into
    :class:`~cbteach.kv.paged.PagedKVCache`, whose ``pool``, ``manager`` and ``block_size`` it uses."""

    def __init__(self):
        self.swap_space: dict = {}  # request id -> per-layer host copies of its K/V blocks
        self.swap_stats = {"bytes_out": 0, "bytes_in": 0, "seconds": 0.0}

    def copy_out(self, seq) -> tuple[list, int]:
        """Host copies of the blocks holding ``seq``'s computed tokens (per layer), and their bytes
        (a disaggregated prefill engine ships them, between steps)."""
        return self.copy_out_blocks(seq.block_table[:self.manager.blocks_needed(seq.num_computed_tokens)])

    def copy_out_blocks(self, blocks: list[int]) -> tuple[list, int]:
        """Host copies of ``blocks`` (per layer), and their bytes."""
        return self.pool.copy_out(blocks), round(len(blocks) * self.block_size * self.pool.bytes_per_token)

    def hold_swapped(self, req_id, data: list) -> None:
        """Keep ``data`` (per-layer host copies of a request's blocks) until :meth:`swap_in_blocks` takes it."""
        self.swap_space[req_id] = data

    def swap_out_blocks(self, req_id, blocks: list[int]) -> None:
        """Copy ``blocks`` (a swapped-out request's) to host memory and keep them for its return."""
        t0 = time.perf_counter()
        data, nbytes = self.copy_out_blocks(blocks)
        self.hold_swapped(req_id, data)
        self.swap_stats["bytes_out"] += nbytes
        self.swap_stats["seconds"] += time.perf_counter() - t0

    def swap_in_blocks(self, req_id, blocks: list[int]) -> None:
        """Write a request's host copy back into ``blocks`` (the ones the scheduler gave it now)."""
        t0 = time.perf_counter()
        data = self.swap_space.pop(req_id)
        self.pool.copy_in(blocks, data)
        self.swap_stats["bytes_in"] += round(len(blocks) * self.block_size * self.pool.bytes_per_token)
        self.swap_stats["seconds"] += time.perf_counter() - t0

    def discard(self, req_id) -> None:
        """Drop a request's host copy, if any (it finished or was aborted while swapped out)."""
        self.swap_space.pop(req_id, None)

    def close(self) -> None:
        self.swap_space.clear()
