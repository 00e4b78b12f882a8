"""Iteration-level scheduling: decide, before *every* forward step, who runs and with how many tokens.

This is Orca's idea (Yu et al., OSDI'22): a static batcher decides once per batch; an iteration-level
scheduler decides once per step, so a sequence that finished on step ``t`` leaves and a queued
request takes its slot on step ``t + 1``. The step is split the way vLLM V1 splits it:
:meth:`Scheduler.schedule` plans it and returns a :class:`SchedulerOutput` (``num_scheduled_tokens``
per sequence); a model runner executes the plan; :meth:`Scheduler.update_from_output` is the *one*
place where ``num_computed_tokens``, outputs and statuses change, and finished requests leave.

There is no "prefill phase" and "decode phase" (vLLM V1's design note): every sequence has
``num_computed_tokens`` catching up with its ``num_tokens``. Planning follows V1's ``schedule()``:

1. **Running sequences first**, in the running list's order. Each asks for what it lacks -- one
   token for a decode (plus any speculative guesses), the rest of its prompt for a prefill -- cut to
   the **token budget** left: a long prompt is prefilled in chunks (Sarathi-Serve).
2. **Ask the KV manager for room** for exactly that chunk (``allocate_slots``). When it refuses,
   **preempt** the policy's victim (:mod:`cbteach.engine.policies`) and ask again, until the sequence
   gets its room or is itself the victim (then the running loop stops, as V1's does). A victim is
   recomputed later from its prompt plus what it generated (``preemption="recompute"``), or its
   blocks are copied to host memory and back (``"swap"``, vLLM V0 only; the vLLM paper, 4.5).
3. **Never admit in a step that preempted** (V1): room is clearly short. Swapped-out sequences
   come back first (V0's swap mode).
4. **Admissions**, in the waiting queue's order, while a slot (``max_batch_size``) and budget are
   left: a request is let in when ``allocate_slots`` gives room for the chunk it feeds now (V1); the
   first refusal ends admissions (nobody overtakes it). ``admission="whole_prompt"`` is V0's rule:
   room for the whole remaining prompt, watermark kept. Under ``policy="priority"`` an urgent
   request that does not fit may preempt less urgent running ones (V0's priority scheduling; V1
   preempts only for running requests); then nobody else is admitted that step, and nobody admitted
   or swapped in this step is sent away in it.

Writing a scheduler is overriding :meth:`Scheduler.schedule` with the public pieces below
(``allocate_or_preempt``, ``preempt``, ``admit``, :meth:`SchedulerOutput.add`); notebook 06 does.
"""
from __future__ import annotations

import math

from ..core.config import SchedulerConfig
from .policies import make_queue
from ..core.request import RequestStatus, Sequence
from ..core.sampling import stop_reason
from ..core.scheduler_output import SchedulerOutput

__all__ = ["Scheduler", "SchedulerOutput"]


class Scheduler:
    """A waiting queue (the policy's), the running batch, and swapped-out requests; see the module."""

    def __init__(self, config: SchedulerConfig, kv_manager, eos_ids=frozenset(), swapper=None):
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"Scheduler takes a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.max_batch_size = config.max_batch_size
        self.token_budget = config.token_budget
        self.kv_manager = kv_manager  # what it calls: cbteach.kv.interface.KVManager
        self.eos_ids = eos_ids
        self.waiting = make_queue(config.policy)
        self.swapper = swapper  # the paged cache: copies a sequence's blocks to host memory and back
        self.running: list[Sequence] = []  # in admission order
        self.swapped: list[Sequence] = []  # swapped out (or handed over), waiting for room to come back

    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.add(seq)

    def add_swapped(self, seq: Sequence) -> None:
        """Queue a sequence whose K/V wait in host memory (swapped out, or handed over by another
        engine); it comes back when its ``ready_time`` has passed and its blocks fit."""
        seq.status = RequestStatus.SWAPPED
        self.swapped.append(seq)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running or self.swapped)

    def num_slots_taken(self) -> int:
        """Batch slots in use: one per running sequence, plus one per sample waiting to fork from it."""
        return sum(s.num_slots for s in self.running)

    def next_event_time(self, now: float) -> float | None:
        """The earliest time after ``now`` when a step could do something it cannot do now: a
        waiting request arrives, or a swapped-out (handed-over) one's K/V become ready. ``None`` if
        nothing is due later -- then idle work means the scheduler is stuck."""
        times = [s.arrival_time for s in self.waiting] + [s.ready_time for s in self.swapped]
        return min((t for t in times if t > now), default=None)

    # -- planning a step -----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """Plan one step at engine time ``now``: running sequences, then (if nobody was preempted)
        swapped-out ones, then admissions."""
        out = SchedulerOutput()
        budget = self.token_budget if self.token_budget is not None else math.inf
        budget = self.schedule_running(out, budget)
        if not out.preempted:
            budget = self.schedule_swapped(out, budget, now)
            self.schedule_waiting(out, budget, now)
        return out

    def schedule_running(self, out: SchedulerOutput, budget: float) -> float:
        """Give every running sequence what it lacks, cut to the budget; preempt when room is refused."""
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not RequestStatus.RUNNING:  # preempted a moment ago to make room
                continue
            n = min(seq.num_tokens + len(seq.draft_ids) - seq.num_computed_tokens, budget)  # + speculative guesses
            ok, refund = self.allocate_or_preempt(seq, n, out)
            budget += refund
            if not ok:  # it was the victim itself: the running loop ends here (vLLM V1)
                break
            out.add(seq, n)
            budget -= n
        return budget

    def schedule_swapped(self, out: SchedulerOutput, budget: float, now: float) -> float:
        """Bring swapped-out sequences back, in policy order, when their blocks fit again (V0's swap)."""
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
            self.swapper.swap_in(seq)
            out.swapped_in.append(seq)
            self._start(seq)
            if self.kv_manager.allocate_slots(seq, n) is None:
                raise RuntimeError(f"the KV manager refused {n} tokens of {seq!r} after reporting room for them")
            out.add(seq, n)
            budget -= n
        return budget

    def schedule_waiting(self, out: SchedulerOutput, budget: float, now: float) -> None:
        """Admit arrived requests in policy order while a slot, budget and KV room are left."""
        while not self.swapped and self.num_slots_taken() < self.max_batch_size and budget > 0:
            seq = next((s for s in self.waiting if s.arrival_time <= now), None)
            if seq is None or seq in out.preempted:  # never re-admitted in the step that preempted it
                break
            if self.num_slots_taken() + seq.num_slots > self.max_batch_size:  # n > 1: room for every sample
                break
            self.kv_manager.take_cached_prefix(seq)  # prefix caching: start past the blocks already computed
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            need = remaining if self.config.admission == "whole_prompt" else n
            preempted = False
            if self.kv_manager.num_admittable_tokens(seq) < need:
                fits, refund = self._preempt_for(seq, need, out)
                budget += refund
                preempted = fits
            if (self.config.admission == "whole_prompt" and self.kv_manager.num_admittable_tokens(seq) < need) \
                    or self.kv_manager.allocate_slots(seq, n) is None:
                self.kv_manager.free(seq)  # give back any cached-prefix blocks it took
                seq.num_computed_tokens = 0
                break  # nobody overtakes it
            self.admit(seq, out)
            out.add(seq, n)
            budget -= n
            if preempted:  # it preempted to get in: nobody else is admitted in this step
                break

    # -- the pieces a scheduler is built from ------------------------------------------------------
    def allocate_or_preempt(self, seq: Sequence, n: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Ask the KV manager for room for ``n`` more tokens of ``seq``; while it refuses, preempt
        the policy's victim among the running sequences and ask again. Returns (whether ``seq`` got
        its room, tokens given back by victims that were already scheduled this step)."""
        refund = 0
        while self.kv_manager.allocate_slots(seq, n) is None:
            victim = self.waiting.pick_victim(self.running)
            refund += self.preempt(victim, out)
            if victim is seq:
                return False, refund
        return True, refund

    def admit(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Move ``seq`` from the waiting queue into the running batch (it has its KV room)."""
        self.waiting.remove(seq)
        self._start(seq)
        self.kv_manager.on_admitted(seq)
        out.admitted.append(seq)

    def preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Take ``seq`` out of the batch and free its KV blocks: it is queued again (``recompute``) or
        its K/V copied to host memory first (``swap``). Returns the tokens it had been scheduled for
        this step (now given back to the budget)."""
        refund = out.remove(seq)
        self.running.remove(seq)
        seq.slot = None
        seq.num_preemptions += 1
        out.preempted.append(seq)
        if self.config.preemption == "swap" and self.swapper is not None and seq.num_computed_tokens > 0:
            self.swapper.swap_out(seq)  # copies its blocks to host memory, then frees them
            self.add_swapped(seq)
            return refund
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        self.waiting.readd_preempted(seq)
        return refund

    # -- after the step --------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: list, now: float,
                           fork_tokens: list | None = None) -> list[Sequence]:
        """Advance every scheduled sequence by what the step computed; append its sampled tokens
        (``sampled[i]``: a list, several after speculative decoding, or None), stop the finished ones
        and free their KV. ``fork_tokens[i]``: the first tokens of the samples waiting to fork from
        sequence ``i`` (parallel sampling), which start now on its blocks. Returns the sequences that
        finished on this step."""
        finished = []
        for i, (seq, c, n, drafts, tokens) in enumerate(zip(out.seqs, out.num_computed_tokens,
                                                            out.num_scheduled_tokens, out.num_draft_tokens, sampled)):
            # K/V stay valid for the known tokens and the accepted guesses; rejected ones are forgotten.
            seq.num_computed_tokens = c + n - drafts + (len(tokens) - 1 if drafts else 0)
            seq.draft_ids = []
            if drafts:
                self.kv_manager.trim(seq)  # blocks that held only rejected guesses go back to the pool
            for token in tokens or ():  # None: a prefill chunk that did not reach the end of the known tokens
                if self._append(seq, token, now):  # a stop inside accepted guesses drops the guesses after it
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                    break
            # Only now are the accepted guesses among the sequence's tokens: the prefix cache hashes
            # a block's tokens, so it must see them (and a finished sequence's last blocks too).
            self.kv_manager.on_computed(seq)
            if fork_tokens is not None and fork_tokens[i]:
                for sample, token in zip(seq.forks, fork_tokens[i]):  # before seq may free its blocks
                    self._fork(seq, sample, token, now, finished)
                seq.forks = []
            if seq.finish_reason:
                self._finish(seq, finished)
        return finished

    def _fork(self, parent: Sequence, sample: Sequence, token: int, now: float, finished: list) -> None:
        """Start ``sample`` on ``parent``'s blocks (just computed: its prompt) with its own first token."""
        self.kv_manager.fork(parent, sample)
        sample.num_computed_tokens = parent.num_computed_tokens
        self._start(sample)
        if self._append(sample, token, now):
            self._finish(sample, finished)

    def _append(self, seq: Sequence, token: int, now: float) -> bool:
        """Append a sampled token to ``seq``'s output; True when it stops the sequence."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids.append(token)
        seq.token_times.append(now)
        seq.finish_reason = stop_reason(seq.output_ids, seq.request.max_new_tokens, self.eos_ids,
                                        seq.request.ignore_eos)
        return seq.finish_reason is not None

    def _finish(self, seq: Sequence, finished: list) -> None:
        seq.status = RequestStatus.FINISHED
        self.running.remove(seq)
        self.kv_manager.free(seq)
        finished.append(seq)

    def abort(self, seq: Sequence) -> None:
        """Take ``seq`` out wherever it is, and free its KV blocks (or its swapped-out copy) at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv_manager.free(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            if self.swapper is not None:
                self.swapper.discard(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            self.kv_manager.free(seq)  # nothing, unless a cached prefix was taken
        seq.status = RequestStatus.ABORTED
        seq.slot = None
        seq.forks = []  # the engine aborts them too

    # -- internals ---------------------------------------------------------------------------
    def _start(self, seq: Sequence) -> None:
        seq.status = RequestStatus.RUNNING
        seq.slot = self._free_slot()
        self.running.append(seq)

    def _preempt_for(self, seq: Sequence, needed: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Preempt running requests the policy lets ``seq`` displace (priority: less urgent ones) until
        it has room for ``needed`` tokens. Nobody admitted or swapped in during this step is sent away
        in it. Returns (whether it fits now, tokens given back by victims already scheduled)."""
        def displaceable():
            return [r for r in self.running if self.waiting.may_preempt(seq, r)
                    and r not in out.admitted and r not in out.swapped_in]

        refund, lower = 0, displaceable()
        # Only blocks no one else holds come free (prefix caching shares blocks): if preempting all of
        # them would still not make room, preempt nobody -- victims would lose their work for nothing.
        if not lower or self.kv_manager.num_admittable_tokens(seq) + self.kv_manager.num_freeable_tokens(lower) < needed:
            return False, refund
        while self.kv_manager.num_admittable_tokens(seq) < needed and lower:
            refund += self.preempt(self.waiting.pick_victim(lower), out)
            lower = displaceable()
        return self.kv_manager.num_admittable_tokens(seq) >= needed, refund

    def _free_slot(self) -> int:
        used = {s.slot for s in self.running}
        return next(i for i in range(self.max_batch_size) if i not in used)
