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
   room that is free; only a sequence that cannot get even one token forces a **preemption**: the
   waiting queue picks a victim (FCFS: the most recently admitted sequence), whose blocks are
   freed and which is queued again to be recomputed later from its prompt plus what it generated
   (vLLM's recompute preemption). Nothing it produced is lost.
3. **Then admissions**, in the waiting queue's order, while there is a free slot
   (``max_batch_size``), token budget left and KV room for the *whole* prompt (plus any output a
   preempted request must recompute), even when the budget feeds it in chunks -- but **never in a
   step that had to preempt** (vLLM V1's rule): the room is clearly short, and a request admitted
   now would only be preempted again.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .request import RequestStatus, Sequence, check_positive_int
from .sampling import stop_reason


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
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(int(n))
        self.num_computed_tokens.append(seq.num_computed_tokens)


class FCFSQueue:
    """Waiting requests in arrival order; preempted ones go back to the front. Also picks victims."""

    def __init__(self):
        self._q: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        """Queue by arrival time (stable: equal times keep the order they were added in)."""
        i = len(self._q)
        # Preempted sequences were pushed to the front on purpose: never queue ahead of them.
        while i > 0 and self._q[i - 1].arrival_time > seq.arrival_time and self._q[i - 1].status is RequestStatus.WAITING:
            i -= 1
        self._q.insert(i, seq)

    def push_front(self, seq: Sequence) -> None:
        self._q.appendleft(seq)

    def peek(self) -> Sequence:
        return self._q[0]

    def pop(self) -> Sequence:
        return self._q.popleft()

    def pick_victim(self, running: list[Sequence]) -> Sequence:
        """FCFS preempts the most recently admitted running sequence."""
        return running[-1]

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self):
        return iter(self._q)


class Scheduler:
    """An iteration-level scheduler with an optional per-step token budget."""

    def __init__(self, max_batch_size: int, kv_manager, token_budget: int | None = None, eos_ids=frozenset()):
        check_batch_size(max_batch_size)
        check_token_budget(token_budget)
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.kv = kv_manager
        self.eos_ids = eos_ids
        self.waiting = FCFSQueue()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = RequestStatus.WAITING
        self.waiting.add(seq)

    def has_unfinished(self) -> bool:
        return bool(len(self.waiting) or self.running)

    def next_arrival(self) -> float | None:
        """Earliest arrival time among waiting requests (None if nobody waits)."""
        return min((s.arrival_time for s in self.waiting), default=None)

    def schedule(self, now: float) -> SchedulerOutput:
        """Plan one step at engine time ``now``."""
        budget = self.token_budget if self.token_budget is not None else math.inf
        out = SchedulerOutput()

        # 1. Running sequences, oldest first.
        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not RequestStatus.RUNNING:  # preempted a moment ago to make room
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            # 2. Shrink a prefill chunk to the free room; preempt only when not one token fits.
            while (room := self.kv.num_allocatable_tokens(seq)) < 1:
                victim = self.waiting.pick_victim(self.running)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not RequestStatus.RUNNING:
                continue
            n = min(n, room)
            if self.kv.allocate_slots(seq, n) is None:
                raise RuntimeError(f"KV manager refused {n} tokens it reported room for ({seq!r})")
            out.add(seq, n)
            budget -= n

        # 3. Admissions, in queue order, into free slots -- not in a step that had to preempt.
        while (not out.preempted and len(self.waiting) and len(self.running) < self.max_batch_size
               and budget > 0):
            seq = self.waiting.peek()
            if seq.arrival_time > now:
                break
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget)
            # Admit only when the whole prompt (plus any output to recompute) fits in the free room,
            # even if the budget feeds it in chunks: a request let in on a sliver of room would fill
            # it and be preempted again before its prefill ends.
            if self.kv.num_allocatable_tokens(seq) < remaining or self.kv.allocate_slots(seq, n) is None:
                break  # not enough KV room: keep it queued (nobody overtakes it)
            self.waiting.pop()
            seq.status = RequestStatus.RUNNING
            seq.slot = self._free_slot()
            self.running.append(seq)
            out.admitted.append(seq)
            out.add(seq, n)
            budget -= n
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: list[int | None], now: float) -> list[Sequence]:
        """Advance every scheduled sequence by what the step computed; append sampled tokens, stop the
        finished ones and free their KV. Returns the sequences that finished on this step."""
        finished = []
        for seq, n, token in zip(out.seqs, out.num_scheduled_tokens, sampled):
            seq.num_computed_tokens += n
            if token is None:  # a prefill chunk that did not reach the end of the known tokens
                continue
            seq.output_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_times.append(now)
            seq.finish_reason = stop_reason(seq.output_ids, seq.request.max_new_tokens, self.eos_ids,
                                            seq.request.ignore_eos)
            if seq.finish_reason:
                seq.status = RequestStatus.FINISHED
                self.running.remove(seq)
                self.kv.free(seq)
                finished.append(seq)
        return finished

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.slot = None
        seq.num_preemptions += 1
        seq.status = RequestStatus.PREEMPTED
        self.waiting.push_front(seq)

    def _free_slot(self) -> int:
        used = {s.slot for s in self.running}
        return next(i for i in range(self.max_batch_size) if i not in used)
