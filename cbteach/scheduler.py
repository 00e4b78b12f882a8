"""Iteration-level scheduling: decide, before *every* forward step, who runs and with how many tokens.

This is Orca's idea (Yu et al., OSDI'22). A static batcher decides once per batch; an
iteration-level scheduler decides once per step, so a sequence that finished on step ``t`` leaves
and a queued request takes its slot on step ``t + 1`` -- nobody waits for the longest member of a
batch.

Each step the scheduler builds a list of ``(sequence, num_new_tokens)``:

1. **Running sequences first**, oldest first. A decoding sequence needs one token (the one it
   sampled last step). A sequence whose prompt was cut short by the token budget continues its
   prefill with as much as the budget allows -- chunked prefill, as in Sarathi-Serve.
2. **Then admissions**, first come first served, while there is a free slot
   (``max_batch_size``), token budget left, and KV-cache room for the prompt.

If the KV cache cannot grow a running sequence (only possible with the bounded paged pool), the
most recently admitted sequence is **preempted**: its blocks are freed and it goes back to the
front of the queue with ``num_computed_tokens = 0``, to be recomputed later from its prompt plus
the tokens it has already generated (vLLM's recompute preemption). Nothing it produced is lost.
"""
from __future__ import annotations

from collections import deque

from .request import Sequence, check_positive_int


def check_batch_size(max_batch_size) -> None:
    check_positive_int("max_batch_size", max_batch_size)


def check_token_budget(token_budget) -> None:
    if token_budget is not None:
        check_positive_int("token_budget (or None)", token_budget)


class Scheduler:
    """First-come-first-served iteration-level scheduler with an optional per-step token budget."""

    def __init__(self, max_batch_size: int, kv, token_budget: int | None = None):
        check_batch_size(max_batch_size)
        check_token_budget(token_budget)
        self.max_batch_size = max_batch_size
        self.token_budget = token_budget
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        """Queue in arrival order (stable: equal arrival times keep the order they were added in)."""
        t = seq.request.arrival_time
        i = len(self.waiting)
        # Preempted sequences were pushed back to the front on purpose: never queue ahead of them.
        while i > 0 and self.waiting[i - 1].request.arrival_time > t and self.waiting[i - 1].num_preemptions == 0:
            i -= 1
        self.waiting.insert(i, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def next_arrival(self) -> float | None:
        """Earliest arrival time among waiting requests (None if nobody waits)."""
        return min((s.request.arrival_time for s in self.waiting), default=None)

    def schedule(self, now: float) -> tuple[list[tuple[Sequence, int]], list[Sequence], list[Sequence]]:
        """Plan one step. Returns ``(scheduled, admitted, preempted)``."""
        budget = self.token_budget if self.token_budget is not None else float("inf")
        scheduled: list[tuple[Sequence, int]] = []
        preempted: list[Sequence] = []

        # 1. Running sequences, oldest first.
        for seq in list(self.running):
            if seq not in self.running:  # preempted a moment ago to make room for an older one
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n <= 0:
                break
            while not self.kv.can_allocate(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq not in self.running:
                continue
            self.kv.allocate(seq, n)
            scheduled.append((seq, int(n)))
            budget -= n

        # 2. Admissions, first come first served, into free slots.
        admitted: list[Sequence] = []
        while self.waiting and len(self.running) < self.max_batch_size and budget > 0:
            seq = self.waiting[0]
            if seq.request.arrival_time > now:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.kv.can_allocate(seq, n):
                break  # not enough KV room: keep it queued (FCFS: nobody overtakes it)
            self.waiting.popleft()
            self.kv.allocate(seq, n)
            seq.slot = self._free_slot()
            self.running.append(seq)
            admitted.append(seq)
            scheduled.append((seq, int(n)))
            budget -= n
        return scheduled, admitted, preempted

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.slot = None
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _free_slot(self) -> int:
        used = {s.slot for s in self.running}
        return next(i for i in range(self.max_batch_size) if i not in used)
