"""The scheduler: before each step, who runs and with how many tokens; after it, what the output changes.

Iteration-level scheduling (Orca, OSDI'22): the batch is decided again on every step, so a finished
sequence's slot goes to a waiting request on the next one. The step is split as vLLM V1 splits it
(``vllm/v1/core/sched/scheduler.py``): :meth:`Scheduler.schedule` plans it as a message for the model
runner (a ``SchedulerOutput``), and :meth:`Scheduler.update_from_output` turns the runner's output
into request state.

There is no prefill phase and no decode phase: each sequence's ``num_computed_tokens`` catches up with
its ``num_tokens``. A step gives a running sequence what it lacks (one token to decode, the rest of its
prompt to prefill) cut to the token budget, so a long prompt is prefilled in chunks (Sarathi-Serve).
Before planning a chunk the scheduler asks the KV manager for room for exactly it; on refusal it
preempts the policy's victim (:mod:`cbteach.engine.policies`: freed, recomputed later) and asks again,
unless the victim was the asker (that ends the running loop). A step that preempted admits nobody;
otherwise waiting requests are admitted in the policy's order until the first that does not fit.
Notebook 06 writes :meth:`Scheduler.schedule` from the public pieces below.
"""
from __future__ import annotations

import math

from ..core.config import SchedulerConfig
from ..core.request import RequestStatus, Sequence
from ..core.sampling import stop_reason
from ..core.scheduler_output import RunnerOutput, SchedulerOutput, StepPlan, make_scheduler_output
from .policies import make_queue

__all__ = ["Scheduler", "SchedulerOutput", "StepPlan"]


class Scheduler:
    """A waiting queue (the policy's) and the running batch."""

    def __init__(self, config: SchedulerConfig, kv_manager, eos_ids=frozenset()):
        if not isinstance(config, SchedulerConfig):
            raise ValueError(f"Scheduler takes a SchedulerConfig, got {type(config).__name__}")
        self.config = config
        self.max_batch_size = config.max_batch_size
        self.token_budget = config.token_budget
        self.kv_manager = kv_manager  # what it calls: cbteach.kv.interface.KVManager
        self.eos_ids = eos_ids
        self.waiting = make_queue(config.policy)
        self.running: list[Sequence] = []  # in admission order
        self.requests: dict[object, Sequence] = {}  # every unfinished request, by id (V1's ``requests``)
        self.finished_req_ids: set = set()  # finished or aborted since the last message: the runner forgets them
        self.sent_block_ids: dict[object, list[int] | None] = {}  # the table the worker holds (None: preempted)
        self.prev_scheduled: frozenset = frozenset()  # the requests of the last message (V1: prev_step_scheduled_req_ids)

    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        self.requests[seq.request_id] = seq
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running)

    def has_finished_requests(self) -> bool:
        """Finished or aborted requests the worker has not been told of yet (V1's name)."""
        return bool(self.finished_req_ids)

    def num_slots_taken(self) -> int:
        return len(self.running)

    def next_event_time(self, now: float) -> float | None:
        """The next arrival after ``now`` (``None``: nothing is due later)."""
        return min((s.arrival_time for s in self.waiting if s.arrival_time > now), default=None)

    # -- planning a step -----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        """Plan one step at engine time ``now``: running sequences, then (if nobody was preempted)
        admissions; then the message, and the plan counts as computed."""
        plan = StepPlan()
        budget = self.token_budget if self.token_budget is not None else math.inf
        budget = self.schedule_running(plan, budget)
        if not plan.preempted:  # never admit in a step that preempted (V1)
            self.schedule_waiting(plan, budget, now)
        output = self.make_output(plan)
        self.update_after_schedule(output)
        return output

    def make_output(self, plan: StepPlan) -> SchedulerOutput:
        """The message: a request the runner has not seen goes in whole, one it holds as a diff, with the
        requests finished since the last message. Its ``num_computed_tokens`` are where each request starts."""
        finished, self.finished_req_ids = frozenset(self.finished_req_ids), set()
        output = make_scheduler_output(plan, self.sent_block_ids, finished, self.prev_scheduled,
                                       **self.extra_output_fields(plan))
        self.prev_scheduled = frozenset(output.num_scheduled_tokens)
        return output

    def extra_output_fields(self, plan: StepPlan) -> dict:
        """Fields a subclass adds to the message (and the message class that holds them)."""
        return {}

    def update_after_schedule(self, output: SchedulerOutput) -> None:
        """The planned tokens count as computed as soon as they are planned (V1's ``_update_after_schedule``),
        so the next step can be planned while this one runs."""
        for rid, n in output.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n

    def schedule_running(self, out: StepPlan, budget: float) -> float:
        """Give every running sequence what it lacks, cut to the budget; preempt when room is refused."""
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not RequestStatus.RUNNING:  # preempted a moment ago to make room
                continue
            if seq.num_generated >= seq.request.max_new_tokens:
                continue  # the step in flight gives it its last token (V1 skips it too)
            # What it lacks: the rest of its prompt, or one token -- plus V1's spec tokens, if any.
            n = min(seq.num_tokens_with_placeholders + len(seq.draft_ids) - seq.num_computed_tokens, budget)
            if n <= 0:  # nothing to feed now (V1's running loop skips such a request)
                continue
            ok, refund = self.allocate_or_preempt(seq, n, out)
            budget += refund
            if not ok:  # it was the victim itself: the running loop ends here (vLLM V1)
                break
            out.add(seq, n)
            budget -= n
        return budget

    def schedule_waiting(self, out: StepPlan, budget: float, now: float) -> None:
        """Admit arrived requests in policy order while a slot, budget and KV room are left; the first
        that does not fit ends admissions (nobody overtakes it)."""
        while self.num_slots_taken() < self.max_batch_size and budget > 0:
            seq = next((s for s in self.waiting if s.arrival_time <= now), None)
            if seq is None:
                break
            cached, num_cached = self.kv_manager.get_computed_blocks(seq)  # prefix caching; changes nothing
            n = min(seq.num_tokens - num_cached, budget)
            if self.allocate_admission(seq, n, cached) is None:
                break  # nothing was taken: the prefix cache's LRU order is untouched
            seq.num_computed_tokens = num_cached
            self.admit(seq, out)
            out.add(seq, n)
            budget -= n

    def allocate_admission(self, seq: Sequence, n: int, cached: list, lookahead: int = 0):
        """``allocate_slots`` for an admission, its prefix-cache hits ``cached`` included."""
        return self.kv_manager.allocate_slots(seq, n, new_computed_blocks=cached, num_lookahead_tokens=lookahead)

    # -- after the forward pass: the output becomes request state ---------------------------------
    def update_from_output(self, scheduler_output: SchedulerOutput, output: RunnerOutput, now: float) -> list[Sequence]:
        """Append each request's sampled tokens, check its stop rules, and free the blocks of those that
        finished, after their last token is recorded (a free missed here leaks the blocks). ``output``'s
        lists are in the worker's order: each request is found by its id, as in V1's
        ``update_from_output``. Returns the sequences that finished on this step."""
        finished = []
        start = scheduler_output.num_computed_tokens_of()
        index = output.req_id_to_index
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            seq = self.requests.get(rid)
            if seq is None or seq.status.is_finished:  # stopped or aborted while this step was in flight: dropped (V1)
                continue
            i = index[rid]
            tokens = output.sampled[i]
            if output.error(i) is not None:
                self._fail(seq, output.error(i), finished, computed_before=start[rid])
                continue
            drafts = scheduler_output.num_draft_tokens(rid)
            if drafts:  # V1's spec tokens: the rejected guesses are no longer computed
                seq.num_computed_tokens -= drafts - (len(tokens) - 1)
                self.kv_manager.trim(seq)  # ours: blocks that held only them go back (V1 keeps them)
            seq.draft_ids = []
            for token in tokens or ():  # None: a prefill chunk that did not reach the end of the known tokens
                if self._append(seq, token, now):  # a stop: tokens fed after it do not count as computed
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
                    break
            self.kv_manager.on_computed(seq)  # the tokens are appended: their full blocks become findable
            if seq.finish_reason:
                self._finish(seq, finished)
        return finished

    def _append(self, seq: Sequence, token: int, now: float) -> bool:
        """Append a sampled token to ``seq``'s output; True when it stops the sequence."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.output_ids.append(token)
        seq.token_times.append(now)
        params = seq.request.sampling_params
        seq.finish_reason = stop_reason(seq.output_ids, seq.request.max_new_tokens, self.eos_ids,
                                        seq.request.ignore_eos, params.stop_token_ids)
        return seq.finish_reason is not None

    def _finish(self, seq: Sequence, finished: list) -> None:
        """``seq`` stopped: it leaves the batch (or the queue, if preempted in flight) and its blocks go back."""
        seq.status = RequestStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_manager.free(seq)
        self.forget(seq)
        finished.append(seq)

    def _fail(self, seq: Sequence, message: str, finished: list, computed_before: int) -> None:
        """The step failed for ``seq`` alone: it ends with ``finish_reason="error"``. Its computed count goes
        back to what it found in the prefix cache, so ``free`` drops from the cache every block it filled:
        this step's (K/V perhaps never written) and earlier chunks' (a NaN spoils the positions before it
        too, through attention's 0 * NaN, and a chunk that samples nothing is never checked)."""
        seq.num_computed_tokens = min(seq.num_computed_tokens, computed_before, seq.num_cached_prompt_tokens)
        seq.finish_reason, seq.error = "error", message
        self._finish(seq, finished)

    # -- the pieces a scheduler is built from ------------------------------------------------------
    def allocate_or_preempt(self, seq: Sequence, n: int, out: StepPlan) -> tuple[bool, int]:
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

    def admit(self, seq: Sequence, out: StepPlan) -> None:
        """Move ``seq`` from the waiting queue into the running batch; :meth:`StepPlan.add` plans its tokens."""
        self.waiting.remove(seq)
        self._start(seq)
        self.kv_manager.on_admitted(seq)
        out.admitted.append(seq)

    def preempt(self, seq: Sequence, out: StepPlan) -> int:
        """Take ``seq`` out of the batch and this step's plan, free its blocks and queue it again, to be
        recomputed (V1's only kind of preemption). Returns the tokens it had been planned this step."""
        refund = self.take_out(seq, out)
        self.kv_manager.free(seq)
        self.taken_back(seq)
        seq.num_computed_tokens = 0
        seq.status = RequestStatus.PREEMPTED
        self.waiting.readd_preempted(seq)
        return refund

    def take_out(self, seq: Sequence, out: StepPlan) -> int:
        """A preemption's first half: ``seq`` leaves the batch and this step's plan (its tokens returned)."""
        refund = out.remove(seq)
        self.running.remove(seq)
        seq.slot = None
        seq.num_preemptions += 1
        out.preempted.append(seq)
        return refund

    def taken_back(self, seq: Sequence) -> None:
        """``seq`` lost its blocks: if the worker holds it, its next message resumes it."""
        if seq.request_id in self.sent_block_ids:
            self.sent_block_ids[seq.request_id] = None

    def abort(self, seq: Sequence) -> None:
        """Take ``seq`` out wherever it is, and free its KV blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
            self.kv_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = RequestStatus.ABORTED
        seq.slot = None
        self.forget(seq)

    def forget(self, seq: Sequence) -> None:
        """``seq`` finished or was aborted: out of :attr:`requests`; the next message tells the runner."""
        self.requests.pop(seq.request_id, None)
        self.sent_block_ids.pop(seq.request_id, None)
        self.finished_req_ids.add(seq.request_id)

    # -- internals ---------------------------------------------------------------------------
    def _start(self, seq: Sequence) -> None:
        seq.status = RequestStatus.RUNNING
        self.requests[seq.request_id] = seq
        seq.slot = self._free_slot()
        self.running.append(seq)

    def _free_slot(self) -> int:
        used = {s.slot for s in self.running}
        return next(i for i in range(self.max_batch_size) if i not in used)
