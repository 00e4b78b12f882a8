"""A request's blocks in host memory: V0's swap preemption and a disaggregated handover, the pool's side.

Swap preemption (the vLLM paper, section 4.5; vLLM V0) takes a request out of the batch by copying
its K/V blocks to host memory instead of dropping them, and copies them back into the blocks the
scheduler gives it when room returns. The scheduler decides which blocks go out and come back
(:class:`~cbteach.engine.scheduler_v0.V0SchedulerOutput`); the worker, which owns the pool, makes
the copies before the step's forward pass (:class:`~cbteach.worker.swap_runner.SwappingModelRunner`)
and keeps the host copies here, in :attr:`HostCopies.swap_space`. A disaggregated prefill engine
ships a request's blocks the same way (:func:`host_copy`), and the decode engine holds them until
they come back in (:meth:`HostCopies.hold_swapped`). V1 preempts by recompute only, so the engine
builds a cache with host copies (:class:`SwappingPagedKVCache`) only for a scheduler with V0's rules.

A copy is of every tensor the pool keeps per block (``pool.block_tensors()``: K and V, and an int8
pool's scales), one tuple per layer.
"""
from __future__ import annotations

import time

import torch

from .paged import PagedKVCache
from .plugged_cache import PluggedPagedKVCache


def copy_out(pool, blocks: list[int]) -> list[tuple]:
    """Host copies of ``blocks``: per layer, a tuple of every per-block tensor's rows for them."""
    idx = torch.tensor(blocks, dtype=torch.long, device=pool.k[0].device)
    return [tuple(t[idx].to("cpu") for t in layer) for layer in zip(*pool.block_tensors())]


def copy_in(pool, blocks: list[int], data: list[tuple]) -> None:
    """Write host copies (:func:`copy_out`'s) back into ``blocks``; the blocks need not be the old ones."""
    idx = torch.tensor(blocks, dtype=torch.long, device=pool.k[0].device)
    for layer, saved in zip(zip(*pool.block_tensors()), data):
        for t, h in zip(layer, saved):
            t[idx] = h.to(t.device)


def host_copy(kv, seq) -> tuple[list, int]:
    """Host copies of the blocks holding ``seq``'s computed tokens in the paged cache ``kv``, and their
    bytes (a disaggregated prefill engine ships them, between steps)."""
    blocks = seq.block_table[:kv.manager.blocks_needed(seq.num_computed_tokens)]
    return copy_out(kv.pool, blocks), round(len(blocks) * kv.block_size * kv.pool.bytes_per_token)


class HostCopies:
    """Host copies of requests' blocks, kept by request id; mixed into a paged cache, whose ``pool``,
    ``manager`` and ``block_size`` it uses."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.swap_space: dict = {}  # request id -> per-layer host copies of its K/V blocks
        self.swap_stats = {"bytes_out": 0, "bytes_in": 0, "seconds": 0.0}

    def copy_out(self, seq) -> tuple[list, int]:
        """Host copies of the blocks holding ``seq``'s computed tokens (per layer), and their bytes."""
        return host_copy(self, seq)

    def hold_swapped(self, req_id, data: list) -> None:
        """Keep ``data`` (per-layer host copies of a request's blocks) until :meth:`swap_in_blocks` takes it."""
        self.swap_space[req_id] = data

    def swap_out_blocks(self, req_id, blocks: list[int]) -> None:
        """Copy ``blocks`` (a swapped-out request's) to host memory and keep them for its return."""
        t0 = time.perf_counter()
        self.hold_swapped(req_id, copy_out(self.pool, blocks))
        self.swap_stats["bytes_out"] += round(len(blocks) * self.block_size * self.pool.bytes_per_token)
        self.swap_stats["seconds"] += time.perf_counter() - t0

    def swap_in_blocks(self, req_id, blocks: list[int]) -> None:
        """Write a request's host copy back into ``blocks`` (the ones the scheduler gave it now)."""
        t0 = time.perf_counter()
        copy_in(self.pool, blocks, self.swap_space.pop(req_id))
        self.swap_stats["bytes_in"] += round(len(blocks) * self.block_size * self.pool.bytes_per_token)
        self.swap_stats["seconds"] += time.perf_counter() - t0

    def discard(self, req_id) -> None:
        """Drop a request's host copy, if any (it finished or was aborted while swapped out)."""
        self.swap_space.pop(req_id, None)

    def usage(self) -> dict:
        """The cache's usage, and how many requests' blocks are held in host memory."""
        return {**super().usage(), "num_swapped": len(self.swap_space)}

    def close(self) -> None:
        self.swap_space.clear()
        super().close()


class SwappingPagedKVCache(HostCopies, PagedKVCache):
    """:class:`~cbteach.kv.paged.PagedKVCache` that can hold requests' blocks in host memory."""


class SwappingPluggedPagedKVCache(HostCopies, PluggedPagedKVCache):
    """:class:`~cbteach.kv.plugged_cache.PluggedPagedKVCache` that can hold requests' blocks in host memory."""


def with_host_copies(cache_cls: type) -> type:
    """The paged cache class like ``cache_cls`` that also holds host copies (V0's swaps, a handover)."""
    return {PagedKVCache: SwappingPagedKVCache, PluggedPagedKVCache: SwappingPluggedPagedKVCache}[cache_cls]
