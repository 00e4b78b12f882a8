"""Notebook 05's memory experiments: a contiguous reservation and the paged pool, same bytes.

Before PagedAttention, a serving system gave each request one **contiguous** region of KV memory
for its worst case, ``prompt + max_new_tokens`` slots, reserved at admission and kept until it
finished (Orca; Kwon et al., SOSP'23, section 3). To compare that with paging *on the real engine*,
this module plugs a different allocator into the engine's paged cache:

* :class:`ReservingKVManager` -- a :class:`~cbteach.kv.manager.KVCacheManager` whose pool has
  one-slot blocks (``block_size=1``, so a block id *is* a slot address) and which, at admission,
  hands a request **one run of adjacent slots** big enough for ``prompt + max_new_tokens``, found
  by **first fit** (the lowest-addressed free run that is long enough). A running request never
  asks again: its room was set aside up front. A request whose reservation finds no long-enough
  run waits -- even when the free slots, added up, would be plenty: that is **external
  fragmentation**, free memory cut into holes too small for the next request.
* :func:`plug` -- puts any such manager (yours too: notebook 05's exercise) into a paged
  :class:`~cbteach.Engine`, so the scheduler asks *it* for room. Attention is untouched: it reads
  through block tables, and a contiguous region is just a block table of consecutive ids.

:func:`run_with_budget` runs a workload under a fixed number of KV bytes with either scheme and
counts what the engine did; :func:`block_size_stats` measures, from a paged run's records, the two
costs a block size trades: empty slots in last blocks against block-table entries per sequence.
"""
from __future__ import annotations

from ..engine.engine import Engine
from ..kv.manager import KVCacheManager

SCHEMES = ("reserve", "paged")


class ReservingKVManager(KVCacheManager):
    """A contiguous KV cache's allocator: one first-fit region of ``prompt + max_new_tokens`` slots
    per request, reserved at admission. ``num_blocks`` one-slot blocks, no watermark."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, block_size=1)

    @staticmethod
    def reservation(seq) -> int:
        """Slots a request reserves: its prompt plus every token it may generate."""
        return len(seq.prompt_ids) + seq.request.max_new_tokens

    def holes(self) -> list[tuple[int, int]]:
        """The free runs of adjacent slots, as ``(start, length)``, lowest address first."""
        runs, start, prev = [], None, None
        for slot in sorted(self.allocator.free_blocks):
            if start is not None and slot == prev + 1:
                prev = slot
                continue
            if start is not None:
                runs.append((start, prev - start + 1))
            start = prev = slot
        if start is not None:
            runs.append((start, prev - start + 1))
        return runs

    def first_fit(self, size: int) -> int | None:
        """Start of the lowest-addressed hole of at least ``size`` slots, or None."""
        return next((start for start, length in self.holes() if length >= size), None)

    def num_allocatable_tokens(self, seq) -> int:
        if seq.block_table:  # a running request: what is left of its own region
            return len(seq.block_table) - seq.num_computed_tokens
        need = self.reservation(seq)
        return need - seq.num_computed_tokens if self.first_fit(need) is not None else 0

    num_admittable_tokens = num_allocatable_tokens  # no watermark: the reservation is the safety margin

    def allocate_slots(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0):
        if seq.block_table:  # room was reserved at admission
            return [] if seq.num_computed_tokens + num_new_tokens <= len(seq.block_table) else None
        need = self.reservation(seq)
        start = self.first_fit(need)
        if start is None or num_new_tokens > need:
            return None
        seq.block_table = [self.allocator.take(slot) for slot in range(start, start + need)]
        self.seqs[seq.request_id] = seq
        return list(seq.block_table)

    def check_fits(self, num_tokens: int, request_id) -> None:
        if num_tokens > self.num_blocks:
            raise ValueError(f"request {request_id!r} reserves {num_tokens} slots but the pool has only "
                             f"{self.num_blocks}; raise the budget or shorten it")


def plug(engine: Engine, manager) -> Engine:
    """Make ``manager`` the engine's KV manager (:meth:`Engine.use_kv_manager`); returns the engine."""
    engine.use_kv_manager(manager)
    return engine


def make_engine(model, tok, scheme: str, kv_memory_bytes: int, *, block_size: int = 16,
                max_batch_size: int = 64) -> Engine:
    """A paged engine with ``kv_memory_bytes`` of KV pool, allocating by ``scheme``: ``"paged"``
    (blocks of ``block_size`` on demand) or ``"reserve"`` (contiguous first-fit reservations)."""
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "paged":
        return Engine(model, tok, max_batch_size=max_batch_size, kv="paged", block_size=block_size,
                      kv_memory_bytes=kv_memory_bytes)
    engine = Engine(model, tok, max_batch_size=max_batch_size, kv="paged", block_size=1,
                    kv_memory_bytes=kv_memory_bytes)
    return plug(engine, ReservingKVManager(engine.kv.num_blocks))


def run_with_budget(model, tok, requests, scheme: str, kv_memory_bytes: int, **engine_kw) -> dict:
    """Run ``requests`` under ``kv_memory_bytes`` of KV memory and count what the engine did.

    Returns the engine and: ``steps``; ``mean_running`` and ``peak_running`` (sequences in a step);
    ``preemptions``; ``tokens`` generated and ``tokens_per_step`` (throughput per forward pass,
    independent of the machine); ``outputs`` (token ids per request, to compare schemes)."""
    engine = make_engine(model, tok, scheme, kv_memory_bytes, **engine_kw)
    done = engine.run(requests)
    running = [len(r.seqs) for r in engine.records]
    tokens = sum(len(c.output_ids) for c in done)
    return {"scheme": scheme, "budget": kv_memory_bytes, "engine": engine, "steps": len(running),
            "mean_running": sum(running) / len(running), "peak_running": max(running),
            "preemptions": sum(len(r.preempted) for r in engine.records), "tokens": tokens,
            "tokens_per_step": tokens / len(running), "outputs": [c.output_ids for c in done]}


def waiting_for_a_hole(engine) -> list[dict]:
    """Steps of a ``"reserve"`` run where the next request in line waited although the free slots,
    added up, would have held its reservation: every hole was too small (external fragmentation).
    One dict per such step: ``step``, ``request``, ``need`` (its reservation), ``free`` (slots),
    ``holes`` (how many free runs) and ``largest`` (the longest run)."""
    order = sorted(engine.sequences.values(), key=lambda s: s.arrival_time)  # FCFS: admitted in this order
    admitted, out = set(), []
    for prev, rec in zip(engine.records, engine.records[1:]):
        admitted.update(prev.admitted)
        head = next((s for s in order if s.request_id not in admitted and s.request_id not in rec.admitted), None)
        if head is None or len(rec.seqs) >= engine.scheduler.max_batch_size:
            continue
        # The pool as the scheduler saw it when ``head`` did not fit: last step's, plus this step's admissions.
        tables = dict(prev.kv_usage["block_tables"])
        tables.update({rid: t for rid, t in rec.kv_usage["block_tables"].items() if rid in rec.admitted})
        holes = hole_lengths(tables.values(), engine.kv.num_blocks)
        need = ReservingKVManager.reservation(head)
        if sum(holes) >= need > max(holes, default=0):
            out.append({"step": rec.step, "request": head.request_id, "need": need, "free": sum(holes),
                        "holes": len(holes), "largest": max(holes, default=0)})
    return out


def hole_lengths(block_tables, num_blocks: int) -> list[int]:
    """Lengths of the free runs of adjacent blocks in a pool of ``num_blocks``, given who holds what."""
    used = sorted(b for table in block_tables for b in table)
    edges = [-1] + used + [num_blocks]
    return [b - a - 1 for a, b in zip(edges, edges[1:]) if b - a > 1]


def block_size_stats(engine) -> dict:
    """Per live sequence, averaged over a paged run's steps: empty slots in its blocks (internal
    fragmentation: only the last block is ever partly empty) and block-table entries."""
    seq_steps = waste = entries = 0
    for rec in engine.records:
        usage = rec.kv_usage
        seq_steps += len(usage["block_tables"])
        waste += usage["internal_fragmentation"]
        entries += sum(len(t) for t in usage["block_tables"].values())
    return {"block_size": engine.kv.block_size, "wasted_slots_per_seq": waste / seq_steps,
            "table_entries_per_seq": entries / seq_steps}
