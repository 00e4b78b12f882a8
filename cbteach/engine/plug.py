"""Plug points: your own pieces in the real engine, and the rules they are held to while it runs.

``Engine(model, tok, kv="paged", max_batch_size=8, scheduler_cls=MyScheduler, kv_manager=MyKVManager,
attention=my_attention, slot_mapping=my_slot_mapping)`` runs an engine built from a learner's pieces
(notebooks 05, 06 and 12). Each piece was checked alone by its notebook; here, while the engine
runs, :class:`RuleGuard` checks what only the whole engine can see -- every step's plan and every
update -- and stops it with :class:`~cbteach.errors.EngineRuleError` naming the broken rule. An
engine never hands out tokens it cannot vouch for. ``attention="triton"`` plugs in the course's
Triton kernel (:mod:`cbteach.attention.triton_unified`, notebook 05b) at the same point.

The rules (vLLM's scheduler keeps the same ones, by construction rather than by checking):

* a plan stays within the token budget and the batch size, schedules nobody twice, and only
  running requests that have arrived;
* every planned chunk has room in the KV cache (its block table covers it: ``allocate_slots``
  was asked first), and ``num_computed_tokens`` moved on by the plan at the end of ``schedule()``
  (``update_after_schedule``);
* after the update, a finished request is out of ``running`` and holds no blocks, and when nothing
  is left every block is back in the free list.
"""
from __future__ import annotations

from ..errors import EngineRuleError
from ..kv.interface import KVManager
from ..kv.plugged import PluggedKVManager


def plug_pieces(kv, kv_manager=None, attention=None, slot_mapping=None) -> None:
    """Put the given pieces into the paged KV cache ``kv``. ``kv_manager``: a class called as
    ``cls(num_blocks, block_size)``, or an instance; a full :class:`~cbteach.kv.interface.KVManager`
    is used as it is, a learner's (``free_blocks``, ``allocate_slots``, ``free``) through a
    :class:`~cbteach.kv.plugged.PluggedKVManager`."""
    if kv_manager is None and attention is None and slot_mapping is None:
        return
    if kv.kind != "paged":
        raise ValueError("kv_manager, attention and slot_mapping plug into the paged KV cache: use kv='paged'")
    if kv_manager is not None:
        manager = kv_manager
        if isinstance(kv_manager, type):
            try:
                manager = kv_manager(kv.num_blocks, kv.block_size)
            except TypeError as err:
                raise ValueError(f"kv_manager={kv_manager.__name__}: the engine builds the class as "
                                 f"{kv_manager.__name__}(num_blocks, block_size), which raised TypeError: {err}") from err
        if not isinstance(manager, KVManager):
            free = getattr(manager, "free_blocks", None)
            if not isinstance(kv_manager, type) and hasattr(free, "__len__") and len(free) != kv.num_blocks:
                raise ValueError(f"kv_manager is a {type(manager).__name__} with {len(free)} free blocks, but this "
                                 f"engine's pool has {kv.num_blocks} blocks of {kv.block_size} slots: pass the class "
                                 f"itself (kv_manager={type(manager).__name__}) and the engine builds it with the "
                                 "pool's size")
            manager = PluggedKVManager(manager, kv.num_blocks, kv.block_size)
        if getattr(manager, "block_size", None) != kv.block_size or getattr(manager, "num_blocks", 0) > kv.num_blocks:
            raise ValueError(f"the manager has {getattr(manager, 'num_blocks', '?')} blocks of "
                             f"{getattr(manager, 'block_size', '?')} slots; the pool has {kv.num_blocks} of "
                             f"{kv.block_size}")
        kv.manager = manager
    if isinstance(attention, str):
        attention = named_attention(kv, attention)
    if attention is not None or slot_mapping is not None:
        if not hasattr(kv, "plug"):
            raise ValueError("attention and slot_mapping plug into a cache built for them: pass them to Engine(...)")
        kv.plug(attention=attention, slot_mapping=slot_mapping)


def named_attention(kv, name: str):
    """``attention="triton"``: the paged-attention kernel of :mod:`cbteach.attention.triton_unified`, which
    reads K/V where they lie in the pool (after this step's are written at the slot mapping)."""
    if name != "triton":
        raise ValueError(f"attention must be a function or 'triton' (the Triton kernel), got {name!r}")
    if kv.config.kv_dtype is not None:
        raise ValueError(f"attention='triton' reads the pool in the model's dtype; kv_dtype={kv.config.kv_dtype!r} "
                         "stores int8 values and scales it does not read: leave kv_dtype unset")
    if kv.pool is None:
        raise ValueError("attention='triton' reads the driver's pool; under tensor parallelism the ranks hold the K/V "
                         "and run the engine's own attention: use tensor_parallel_size=1 with the kernel")
    try:
        from ..attention import triton_unified
    except ImportError:
        raise ValueError('attention="triton" needs Triton: pip install "cbteach[kernels]" (or pip install triton)') \
            from None
    triton_unified.check_device(kv.pool.k[0].device, kv.pool.k[0].dtype)
    return triton_unified.kernel_attention()


class RuleGuard:
    """Checks a plugged-in scheduler's plans and updates against the engine's rules (see the module)."""

    def __init__(self, scheduler, kv):
        self.scheduler, self.kv = scheduler, kv

    def after_schedule(self, plan, now: float) -> None:
        s = self.scheduler
        limits = s.config  # frozen: a scheduler cannot move its own limits (self.token_budget = None)
        total = sum(plan.num_scheduled_tokens.values())
        if limits.token_budget is not None and total > limits.token_budget:
            raise EngineRuleError(f"the plan schedules {total} tokens, over the token budget of {limits.token_budget}")
        if s.num_slots_taken() > limits.max_batch_size:
            raise EngineRuleError(f"{s.num_slots_taken()} sequences hold batch slots, over max_batch_size="
                                  f"{limits.max_batch_size}")
        starts = plan.num_computed_tokens_of()
        for rid, n in plan.num_scheduled_tokens.items():
            seq, c = s.requests.get(rid), starts.get(rid)
            if seq is None or c is None:
                raise EngineRuleError(f"{rid!r} is planned but the scheduler does not hold it: plan only requests "
                                      "it was given (add), and build the step's message with make_output(plan)")
            if seq not in s.running:
                raise EngineRuleError(f"{rid!r} is planned but not running: admit() it first (and a preempted "
                                      "request leaves the plan)")
            if seq.arrival_time > now:
                raise EngineRuleError(f"{rid!r} was planned before it arrived")
            if n < 1 or c + n > seq.num_tokens_with_placeholders + len(seq.draft_ids):
                raise EngineRuleError(f"{rid!r} is planned for {n} tokens from {c}, but it has only {seq.num_tokens}")
            if seq.num_computed_tokens != c + n:
                raise EngineRuleError(f"{rid!r}'s num_computed_tokens is {seq.num_computed_tokens} after the plan fed "
                                      f"it {n} tokens from {c}: schedule() must end with update_after_schedule(out), "
                                      "which moves every planned sequence on by its scheduled tokens (vLLM V1)")
            if self.kv.kind == "paged" and len(seq.block_table) * self.kv.block_size < c + n:
                raise EngineRuleError(f"{rid!r} is planned for tokens up to {c + n} but its blocks hold "
                                      f"{len(seq.block_table) * self.kv.block_size}: ask allocate_slots for room "
                                      "before planning a chunk")

    def after_update(self, seqs: list, finished: list) -> None:
        """``seqs``: the step's scheduled sequences; ``finished``: what ``update_from_output`` returned."""
        s = self.scheduler
        for seq in [*seqs, *finished]:
            if seq.finish_reason is not None and seq in s.running:
                raise EngineRuleError(f"{seq.request_id!r} finished ({seq.finish_reason}) but is still in running")
            if seq.finish_reason is not None and seq.block_table:
                raise EngineRuleError(f"{seq.request_id!r} finished but still holds blocks {seq.block_table}: free "
                                      "them after its last token is recorded")
        if self.kv.kind == "paged" and not s.has_unfinished():
            free = self.kv.manager.allocator.num_free
            if free != self.kv.num_blocks:
                raise EngineRuleError(f"every request is done but only {free} of {self.kv.num_blocks} blocks are "
                                      "free: blocks leaked")
