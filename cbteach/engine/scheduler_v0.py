"""vLLM V0's scheduling rules, kept apart from V1's so each reads on its own.

:class:`~cbteach.engine.scheduler.Scheduler` is vLLM V1's. Before V1, vLLM's scheduler (V0) had
rules V1 dropped (swap, preempting to admit) or brought back later in its own form (whole-sequence
admission and a watermark); the course compares them (notebook 06), so they live here, in a subclass the engine
picks when one of them is asked for (``Engine(..., preemption="swap")`` and the others below):

* **swap preemption** (``preemption="swap"``; the vLLM paper, section 4.5): a victim's blocks are
  copied to host memory and back, instead of recomputed. The scheduler only decides: its message
  (:class:`V0SchedulerOutput`) says which blocks go out and which come
  back in (V0's ``blocks_to_swap_out`` / ``blocks_to_swap_in``), and the worker copies them before the
  forward pass. Swapped-out requests wait in :attr:`V0Scheduler.swapped` and come back first, before
  any admission. A disaggregated decode engine takes handed-over K/V the same way
  (:meth:`V0Scheduler.add_swapped`).
* **whole-prompt admission** (``admission="whole_prompt"``; V0's block manager): a request is let in
  only when its whole remaining prompt fits, even when the token budget feeds it in chunks, keeping
  a ``watermark`` of blocks free. (V1 grew the same two rules back: ``SchedulerConfig.scheduler_reserve_full_isl``,
  True by default, which ``vllm/v1/core/sched/scheduler.py`` passes to ``allocate_slots``
  as ``full_sequence_must_fit`` -- it checks the whole sequence fits, and takes blocks for the chunk
  only -- and ``SchedulerConfig.watermark``, 0 by default, applied to waiting and preempted requests
  while others run. This engine's default scheduler follows V1 before them: README, "Which V1".)
  A request admitted whole can still be preempted half-way through its
  prefill, by a decoding neighbour's refused allocation.
* **preempting to admit** (``preempt_to_admit=True``; V0's and SGLang's priority scheduling): an
  urgent waiting request may preempt less urgent running ones to get in -- then nobody else is
  admitted that step, and nobody admitted or swapped in this step is sent away in it. V1 preempts
  only to make room for running requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.records import StepRecord
from ..core.request import RequestStatus, Sequence
from ..core.scheduler_output import SchedulerOutput, StepPlan
from .policies import WaitingQueue
from .scheduler import Scheduler


@dataclass(frozen=True)
class V0SchedulerOutput(SchedulerOutput):
    """vLLM V0's message: V1's fields, plus the blocks the worker moves before the forward pass -- the
    swaps (V0's ``blocks_to_swap_out`` and ``blocks_to_swap_in``, keyed here by request; swap-outs first:
    a block a victim gave up may be handed to someone else in the same step) and the copies on write of
    parallel sampling by fork (V0's ``blocks_to_copy``; :mod:`cbteach.engine.fork`) -- and the samples
    forking from a prompt that ends this step."""

    blocks_to_swap_out: dict = field(default_factory=dict)  # request id -> blocks copied to host memory
    blocks_to_swap_in: dict = field(default_factory=dict)  # request id -> blocks its host copy is written into
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy on write (src, dst), before the forward
    scheduled_forks: dict = field(default_factory=dict)  # request id -> [(sample id, sample index)] forking from it
    swapped_in_req_ids: list = field(default_factory=list)  # for the step record

    def record_fields(self) -> dict:
        return {**super().record_fields(), "swapped_in": list(self.swapped_in_req_ids)}

    @property
    def is_empty(self) -> bool:
        return super().is_empty and not (self.blocks_to_swap_out or self.blocks_to_swap_in or self.block_copies)


@dataclass(repr=False)
class V0StepRecord(StepRecord):
    """A step's record under V0's rules: also who came back from host memory (swapped in)."""

    swapped_in: list = field(default_factory=list)
    more_lists = ("swapped_in",)


@dataclass
class V0StepPlan(StepPlan):
    """The scheduler's notes for one step, with V0's: who comes back in, and the blocks to move."""

    swapped_in: list[Sequence] = field(default_factory=list)
    swap_out: dict = field(default_factory=dict)  # request id -> blocks to copy to host memory
    swap_in: dict = field(default_factory=dict)  # request id -> blocks to copy its host copy into


def uses_v0_rules(config) -> bool:
    """Whether a :class:`~cbteach.core.config.EngineConfig` asks for a rule only V0 has."""
    s = config.scheduler
    return s.preemption == "swap" or s.admission == "whole_prompt" or s.preempt_to_admit or bool(config.cache.watermark)


class V0Scheduler(Scheduler):
    """V1's scheduler with V0's swap preemption, whole-prompt admission and preempting to admit (see the module)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.swapped: list[Sequence] = []  # swapped out (or handed over), waiting for room to come back
        if self.config.preempt_to_admit and type(self.waiting).may_preempt is WaitingQueue.may_preempt:
            raise ValueError(f"preempt_to_admit=True does nothing under the policy {self.waiting.name!r}: no waiting "
                             "request may take a running one's place there; use policy='priority' (or a WaitingQueue "
                             "whose may_preempt says who may)")

    def add_swapped(self, seq: Sequence) -> None:
        """Queue a sequence whose K/V wait in host memory (swapped out, or handed over by another
        engine); it comes back when its ``ready_time`` has passed and its blocks fit. Its status is
        V1's ``PREEMPTED`` (V0 called it ``SWAPPED``): it is out of the batch, and in :attr:`swapped`."""
        seq.status = RequestStatus.PREEMPTED
        self.requests[seq.request_id] = seq
        self.swapped.append(seq)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self.swapped)

    def next_event_time(self, now: float) -> float | None:
        """As V1's, and also when a swapped-out (handed-over) request's K/V become ready."""
        times = [t for t in (super().next_event_time(now), *(s.ready_time for s in self.swapped)) if t is not None]
        return min((t for t in times if t > now), default=None)

    def schedule(self, now: float):
        """Running sequences, then (if nobody was preempted) swapped-out ones, then admissions."""
        plan = V0StepPlan()
        budget = self.token_budget if self.token_budget is not None else float("inf")
        budget = self.schedule_running(plan, budget)
        if not plan.preempted:
            budget = self.schedule_swapped(plan, budget, now)
            if not self.swapped:  # swapped-out requests come back before anyone new is let in
                self.schedule_waiting(plan, budget, now)
        output = self.make_output(plan)
        self.update_after_schedule(output)
        return output

    def schedule_swapped(self, out: StepPlan, budget: float, now: float) -> float:
        """Bring swapped-out sequences back, in policy order, when their blocks fit again."""
        while self.swapped and self.num_slots_taken() < self.max_batch_size and budget > 0:
            ready = [s for s in self.swapped if s.ready_time <= now]  # K/V handed over from elsewhere arrive late
            if not ready:
                break
            seq = min(ready, key=self.waiting.key)
            if self.num_slots_taken() + seq.num_slots > self.max_batch_size:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.kv_manager.num_admittable_tokens(seq) < n:  # room beyond its computed tokens' blocks
                break
            self.swapped.remove(seq)
            if self.kv_manager.allocate_slots(seq, 0) is None:  # fresh blocks for its computed tokens
                raise RuntimeError(f"the KV manager refused to swap {seq!r} back in after reporting room for it")
            out.swap_in[seq.request_id] = list(seq.block_table)  # the worker copies its K/V back into them
            out.swapped_in.append(seq)
            self._start(seq)
            if self.kv_manager.allocate_slots(seq, n) is None:
                raise RuntimeError(f"the KV manager refused {n} tokens of {seq!r} after reporting room for them")
            out.add(seq, n)
            budget -= n
        return budget

    def schedule_waiting(self, out: StepPlan, budget: float, now: float) -> None:
        """Admissions under V0's rules: the whole prompt must fit (``whole_prompt``, keeping the
        watermark), and an urgent request may preempt less urgent ones to get in (``preempt_to_admit``)."""
        whole = self.config.admission == "whole_prompt"
        while self.num_slots_taken() < self.max_batch_size and budget > 0:
            seq = next((s for s in self.waiting if s.arrival_time <= now), None)
            if seq is None or seq in out.preempted:  # never re-admitted in the step that preempted it
                break
            if self.num_slots_taken() + seq.num_slots > self.max_batch_size:  # fork: room for every sample
                break
            cached, num_cached = self.kv_manager.get_computed_blocks(seq)  # prefix caching; changes nothing
            remaining = seq.num_tokens - num_cached
            n = min(remaining, budget)
            preempted = False
            needed = num_cached + (remaining if whole else n)
            if self.config.preempt_to_admit and self._admittable(seq, cached) < needed:
                preempted, refund = self._preempt_for(seq, cached, needed, out)
                budget += refund
                if preempted:  # victims gave their blocks back: look the prefix up again
                    cached, num_cached = self.kv_manager.get_computed_blocks(seq)
                    remaining = seq.num_tokens - num_cached
                    n = min(remaining, budget)
            # The whole-prompt rule: room for all of it, the watermark kept (conservative with cached blocks)
            if (whole and self.kv_manager.num_admittable_tokens(seq) < seq.num_tokens) or \
                    self.allocate_admission(seq, n, cached, remaining - n if whole else 0) is None:
                break  # nobody overtakes it; nothing was taken, the cache's LRU order is untouched
            seq.num_computed_tokens = num_cached
            self.admit(seq, out)
            out.add(seq, n)
            budget -= n
            if preempted:  # it preempted to get in: nobody else is admitted in this step
                break

    def preempt(self, seq: Sequence, out: StepPlan) -> int:
        """With ``preemption="swap"`` the victim's K/V are copied to host memory first, and it waits in
        :attr:`swapped` (a request with nothing computed yet is simply queued again, as in V1)."""
        if self.config.preemption == "swap" and seq.num_computed_tokens > 0:
            refund = self.take_out(seq, out)
            # The worker copies the blocks holding its computed tokens to host memory before the step's
            # forward pass -- before anyone this step was given them writes into them.
            computed_blocks = -(-seq.num_computed_tokens // self.kv_manager.block_size)
            out.swap_out[seq.request_id] = list(seq.block_table[:computed_blocks])
            self.kv_manager.free(seq)
            self.taken_back(seq)
            self.add_swapped(seq)
            return refund
        return super().preempt(seq, out)

    def extra_output_fields(self, plan: StepPlan) -> dict:
        """V0's message: the swaps, for the worker to carry out."""
        return {**super().extra_output_fields(plan), "cls": V0SchedulerOutput, "blocks_to_swap_out": dict(plan.swap_out),
                "blocks_to_swap_in": dict(plan.swap_in), "swapped_in_req_ids": [s.request_id for s in plan.swapped_in]}

    def abort(self, seq: Sequence) -> None:
        """A swapped-out request leaves :attr:`swapped` (the worker drops its host copy when the next
        message says it finished); anywhere else, as V1's."""
        if seq in self.swapped:
            self.swapped.remove(seq)
        super().abort(seq)

    # -- internals ---------------------------------------------------------------------------
    def _admittable(self, seq: Sequence, cached: list) -> float:
        """The room an admission of ``seq`` with prefix-cache hits ``cached`` may use (hits that others
        hold cost nothing). ``cached`` is passed only when not empty (a manager without prefix caching takes ``seq`` alone)."""
        if cached:
            return self.kv_manager.num_admittable_tokens(seq, new_computed_blocks=cached)
        return self.kv_manager.num_admittable_tokens(seq)

    def _preempt_for(self, seq: Sequence, cached: list, needed: int, out: StepPlan) -> tuple[bool, int]:
        """Preempt running requests the policy lets ``seq`` displace (less urgent ones) until it has room
        for ``needed`` tokens (``cached``: its prefix-cache hits). Nobody admitted or swapped in during this
        step is sent away in it -- nor anyone whose blocks an admission of this step shares: its K/V for
        this step would then never be written. Returns (whether it fits now, tokens given back)."""
        shared = {b for a in out.admitted for b in a.block_table}

        def displaceable():
            return [r for r in self.running if self.waiting.may_preempt(seq, r)
                    and r not in out.admitted and r not in out.swapped_in and not shared.intersection(r.block_table)]

        refund, lower = 0, displaceable()
        # Only blocks no one else holds come free (prefix caching shares blocks): if preempting all of
        # them would still not make room, preempt nobody -- victims would lose their work for nothing.
        if not lower or self._admittable(seq, cached) + self.kv_manager.num_freeable_tokens(lower) < needed:
            return False, refund
        while self._admittable(seq, cached) < needed and lower:
            refund += self.preempt(self.waiting.pick_victim(lower), out)
            lower = displaceable()
        return self._admittable(seq, cached) >= needed, refund
