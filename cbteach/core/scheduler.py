"""Iteration-level scheduling: decide, before *every* forward step, who runs and with how many tokens.

This is Orca's idea (Yu et al., OSDI'22). A static batcher decides once per batch; an
iteration-level scheduler decides once per step, so a sequence that finished on step ``t`` leaves
and a queued request takes its slot on step ``t + 1`` -- nobody waits for the longest member of a
batch.

The step is split the way vLLM V1 splits it:

* :meth:`Scheduler.schedule` plans one step and returns a :class:`SchedulerOutput` -- for each
  sequence in the batch, ``num_scheduled_tokens``: how many of its tokens go through the model;
* a model runner executes that plan and samples one token per sequence that completed;
* :meth:`Scheduler.update_from_output` is the *one* place where ``num_computed_tokens``, outputs
  and request status change, and where finished requests leave.

Planning a step:

1. **Running sequences first**, oldest first. A decoding sequence needs one token (the one it
   sampled last step). A sequence whose prompt was cut short continues its prefill with as much as
   the **token budget** allows -- chunked prefill, as in Sarathi-Serve.
2. If the KV cache cannot hold a sequence's tokens, a prefill chunk is first **shrunk** to the
   room that is free (our choice: vLLM V1 preempts at once); only a sequence that cannot get even
   one token forces a **preemption**: the
   policy (:mod:`cbteach.policies`) picks a victim, whose blocks are freed. With
   ``preemption="recompute"`` it is queued again and later recomputed from its prompt plus what it
   generated; with ``preemption="swap"`` its blocks are first copied to host memory and copied back
   when room returns (the two modes of the vLLM paper, section 4.5). Nothing it produced is lost.
3. **Swapped-out sequences come back** before anyone new is admitted, when their blocks fit again.
4. **Then admissions**, in the waiting queue's order, while there is a free slot
   (``max_batch_size``), token budget left and KV room for the *whole* prompt (plus any output a
   preempted request must recompute), even when the budget feeds it in chunks (vLLM V0's check;
   V1 allocates chunk by chunk) -- but **never in a step that had to preempt** (vLLM V1's rule):
   the room is clearly short, and a request admitted now would only be preempted again. An
   admission also leaves a small **watermark** of blocks free (V0's block manager has one; V1 has
   none). Under ``policy="priority"`` an urgent request that does not fit may preempt less urgent
   running ones to get in (V0's priority scheduling), and then nobody else is admitted that step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .policies import make_queue
from .request import RequestStatus, Sequence, check_positive_int
from .sampling import stop_reason

PREEMPTION_MODES = ("recompute", "swap")


def check_batch_size(max_batch_size) -> None:
    check_positive_int("max_batch_size", max_batch_size)


def check_token_budget(token_budget) -> None:
    if token_budget is not None:
        check_positive_int("token_budget (or None)", token_budget)


@dataclass
class SchedulerOutput:
    """The plan for one step. ``seqs[i]`` feeds ``num_scheduled_tokens[i]`` tokens, starting at
    position ``num_computed_tokens[i]`` (a snapshot taken when the step was planned)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)  # recomputed later or swapped out
    swapped_in: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(int(n))
        self.num_computed_tokens.append(seq.num_computed_tokens)

    def remove(self, seq: Sequence) -> int:
        """Take ``seq`` out of the plan (it was preempted after being scheduled); returns its tokens."""
        if seq not in self.seqs:
            return 0
        i = self.seqs.index(seq)
        self.seqs.pop(i)
        self.num_computed_tokens.pop(i)
        return self.num_scheduled_tokens.pop(i)


class Scheduler:
    """An iteration-level scheduler: a policy's waiting queue, the running batch, swapped-out requests."""

    def __init__(self, max_batch_size: int, kv_manager, token_budget: int | None = None, eos_ids=frozenset(),
                 policy="fcfs", preemption: str = "recompute", swapper=None):
        check_batch_size(max_batch_size)
        check_token_budget(token_budget)
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"preemption must be one of {PREEMPTION_MODES}, got {preemption!r}")
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.kv = kv_manager
        self.eos_ids = eos_ids
        self.waiting = make_queue(policy)
        self.preemption = preemption
        self.swapper = swapper  # the paged cache: copies a sequence's blocks to host memory and back
        self.running: list[Sequence] = []  # in admission order
        self.swapped: list[Sequence] = []  # swapped out, waiting for room to come back

    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running or self.swapped)

    def next_arrival(self) -> float | None:
        """Earliest time something can start: a waiting request's arrival or a handed-over request's
        ``ready_time`` (None if nobody waits)."""
        times = [s.arrival_time for s in self.waiting] + [s.ready_time for s in self.swapped]
        return min(times, default=None)

    def schedule(self, now: float) -> SchedulerOutput:
        """Plan one step at engine time ``now``."""
        out = SchedulerOutput()
        budget = self.token_budget if self.token_budget is not None else math.inf

        # 1. Running sequences, in admission order; 2. shrink chunks, preempt only when nothing fits.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not RequestStatus.RUNNING:  # preempted a moment ago to make room
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens + len(seq.draft_ids), budget)  # + speculative guesses
            while (room := self.kv.num_allocatable_tokens(seq)) < 1:
                victim = self.waiting.pick_victim(self.running)
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is RequestStatus.RUNNING:
                budget -= self._schedule(seq, min(n, room), out)
        pressure = bool(out.preempted)

        # 3. Swapped-out sequences come back first, in policy order, when their blocks fit again.
        while not pressure and self.swapped and len(self.running) < self.max_batch_size and budget > 0:
            ready = [s for s in self.swapped if s.ready_time <= now]  # K/V handed over from elsewhere arrive late
            if not ready:
                break
            seq = min(ready, key=self.waiting.key)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.kv.num_admittable_tokens(seq) < n:  # room beyond its computed tokens' blocks
                break
            self.swapped.remove(seq)
            self.swapper.swap_in(seq)
            out.swapped_in.append(seq)
            self._start(seq)
            budget -= self._schedule(seq, n, out)

        # 4. Admissions, in policy order -- not in a step that had to preempt, nor while any is swapped out.
        while not pressure and not self.swapped and len(self.running) < self.max_batch_size and budget > 0:
            seq = next((s for s in self.waiting if s.arrival_time <= now), None)
            if seq is None or seq in out.preempted:  # never re-admitted in the step that preempted it
                break
            self.kv.take_cached_prefix(seq)  # prefix caching: start past the blocks already computed
            remaining = seq.num_tokens - seq.num_computed_tokens
            # Admit only when the whole prompt (plus any output to recompute) fits, watermark kept,
            # even if the budget feeds it in chunks: a request let in on a sliver of room would fill
            # it and be preempted again before its prefill ends.
            if self.kv.num_admittable_tokens(seq) < remaining:
                fits, refund = self._preempt_for(seq, remaining, out)
                budget += refund
                if not fits:
                    self.kv.free(seq)  # give back any cached-prefix blocks it took
                    seq.num_computed_tokens = 0
                    break  # nobody overtakes it
                pressure = True  # it preempted to get in: nobody else is admitted in this step
            self.waiting.remove(seq)
            self._start(seq)
            self.kv.on_admitted(seq)
            out.admitted.append(seq)
            budget -= self._schedule(seq, min(remaining, budget), out)
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: list, now: float) -> list[Sequence]:
        """Advance every scheduled sequence by what the step computed; append its sampled tokens
        (``sampled[i]``: a list, several after speculative decoding, or None), stop the finished ones
        and free their KV. Returns the sequences that finished on this step."""
        finished = []
        for seq, c, n, tokens in zip(out.seqs, out.num_computed_tokens, out.num_scheduled_tokens, sampled):
            drafts = max(0, c + n - seq.num_tokens)  # speculative guesses fed past the known tokens
            # K/V stay valid for the known tokens and the accepted guesses; rejected ones are forgotten.
            seq.num_computed_tokens = c + n - drafts + (len(tokens) - 1 if drafts else 0)
            seq.draft_ids = []
            if drafts:
                self.kv.trim(seq)  # blocks that held only rejected guesses go back to the pool
            if tokens is not None:  # None: a prefill chunk that did not reach the end of the known tokens
                if seq.first_token_time is None:
                    seq.first_token_time = now
                for token in tokens:
                    seq.output_ids.append(token)
                    seq.token_times.append(now)
                    seq.finish_reason = stop_reason(seq.output_ids, seq.request.max_new_tokens, self.eos_ids,
                                                    seq.request.ignore_eos)
                    if seq.finish_reason:  # a stop inside accepted guesses: the guesses after it are dropped
                        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                        break
            # Only now are the accepted guesses among the sequence's tokens: the prefix cache hashes
            # a block's tokens, so it must see them (and a finished sequence's last blocks too).
            self.kv.on_computed(seq)
            if seq.finish_reason:
                seq.status = RequestStatus.FINISHED
                self.running.remove(seq)
                self.kv.free(seq)
                finished.append(seq)
        return finished

    def abort(self, seq: Sequence) -> None:
        """Take ``seq`` out wherever it is, and free its KV blocks (or its swapped-out copy) at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.swapper.discard(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = RequestStatus.ABORTED
        seq.slot = None

    # -- internals ---------------------------------------------------------------------------
    def _schedule(self, seq: Sequence, n: int, out: SchedulerOutput) -> int:
        if self.kv.allocate_slots(seq, n) is None:
            raise RuntimeError(f"KV manager refused {n} tokens it reported room for ({seq!r})")
        out.add(seq, n)
        return n

    def _start(self, seq: Sequence) -> None:
        seq.status = RequestStatus.RUNNING
        seq.slot = self._free_slot()
        self.running.append(seq)

    def _preempt_for(self, seq: Sequence, needed: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Preempt running requests the policy lets ``seq`` displace (priority: less urgent ones) until it fits.
        Returns (whether it fits now, tokens given back by victims already scheduled this step)."""
        refund = 0
        lower = [r for r in self.running if self.waiting.may_preempt(seq, r)]
        if not lower:
            return False, refund
        # Only blocks no one else holds come free (prefix caching shares blocks): if preempting all of
        # them would still not make room, preempt nobody -- victims would lose their work for nothing.
        if self.kv.num_admittable_tokens(seq) + self.kv.num_freeable_tokens(lower) < needed:
            return False, refund
        while self.kv.num_admittable_tokens(seq) < needed:
            lower = [r for r in self.running if self.waiting.may_preempt(seq, r)]
            if not lower:  # cannot happen while the count above is exact; fail safe rather than loop
                return False, refund
            refund += self._preempt(self.waiting.pick_victim(lower), out)
        return True, refund

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Preempt ``seq``; returns the tokens it had been scheduled for this step (now given back)."""
        refund = out.remove(seq)
        self.running.remove(seq)
        seq.slot = None
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.preemption == "swap" and self.swapper is not None and seq.num_computed_tokens > 0:
            self.swapper.swap_out(seq)  # copies its blocks to host memory, then frees them
            seq.status = RequestStatus.SWAPPED
            self.swapped.append(seq)
            return refund
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        self.waiting.readd_preempted(seq)
        return refund

    def _free_slot(self) -> int:
        used = {s.slot for s in self.running}
        return next(i for i in range(self.max_batch_size) if i not in used)
