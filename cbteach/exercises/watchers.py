"""The watchers :func:`.scheduler_check.watched` wraps around a learner's scheduler: the waiting queue
(changed while walked?), the running list (a request skipped after a removal?) and the KV manager (this step's
grants, refusals and frees). Each counts one ``schedule``'s calls: past :data:`MAX_CALLS` it never ends.
"""
from __future__ import annotations

from .rules import SchedulerMistake, hint

MAX_CALLS = 100_000  # calls on the queue, the running list and the KV manager in one step: far beyond any honest step
_calls = [None]  # calls so far in the schedule() running now (None: none is running)


def counting(on: bool) -> None:
    """Start (or stop) counting the calls of one ``schedule``."""
    _calls[0] = 0 if on else None


def tick() -> None:
    """One more call on a watched object in this ``schedule``; past :data:`MAX_CALLS`, it never ends."""
    if _calls[0] is None:
        return
    _calls[0] += 1
    if _calls[0] > MAX_CALLS:
        raise SchedulerMistake("schedule() did not return: a loop that never ends? (a retry loop must change "
                               "something each time round -- preempt someone -- or stop)")


class QueueWatch:
    """The policy's waiting queue, unchanged, but it knows when it is changed while being walked."""

    def __init__(self, queue, strict: bool = True):
        self.queue, self.version, self.strict = queue, 0, strict  # strict: the exercise's rule, not only safety

    def __getattr__(self, name):
        if name in ("add", "remove", "readd_preempted"):  # the queue is about to change
            self.version += 1
        return getattr(self.queue, name)

    def __len__(self):
        tick()
        return len(self.queue)

    def __contains__(self, seq):
        tick()
        return seq in self.queue

    def __iter__(self):
        version = self.version
        for seq in list(self.queue):
            if self.strict and self.version != version:  # a plain list iterator would now skip a request
                raise SchedulerMistake(hint("walked_waiting", None))
            yield seq


class RunningWatch(list):
    """The running list, unchanged, but it knows when a loop over it skips a request: removing one at or
    before the loop's position shifts the rest left, and a plain list iterator steps over the next."""

    def __init__(self, items=(), strict: bool = True):
        super().__init__(items)
        self.cursors: list = []  # [position, skipped] of each live loop
        self.strict = strict  # the exercise's rule (no request skipped), not only the count

    def __len__(self):
        tick()
        return super().__len__()

    def __contains__(self, seq):
        tick()
        return super().__contains__(seq)

    def __iter__(self):
        cursor = [0, False]
        self.cursors.append(cursor)
        try:
            while True:
                if cursor[1] and self.strict:
                    raise SchedulerMistake(hint("walked_running", None))
                if cursor[0] >= len(self):
                    return
                cursor[0] += 1
                yield self[cursor[0] - 1]
        finally:
            self.cursors.remove(cursor)

    def remove(self, seq):
        i = next(j for j in range(len(self)) if self[j] is seq)
        super().pop(i)
        for cursor in self.cursors:  # the request that moved into a visited position is never visited
            cursor[1] = cursor[1] or (i < cursor[0] and cursor[0] - 1 < len(self))


class KVWatch:
    """The KV manager, unchanged, but it remembers this step's grants and what each free saw."""

    def __init__(self, manager):
        self.manager = manager
        self.begin_step()

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def begin_step(self):
        self.granted, self.refused, self.frees = {}, set(), {}

    def allocate_slots(self, seq, num_new_tokens, *args, **kwargs):
        tick()
        cached = kwargs.get("new_computed_blocks", args[0] if args else ())
        start = seq.num_computed_tokens + len(cached) * self.manager.block_size  # an admission's cached prefix
        got = self.manager.allocate_slots(seq, num_new_tokens, *args, **kwargs)
        if got is None:
            self.refused.add(id(seq))
        else:
            self.granted[id(seq)] = (start, num_new_tokens)
        return got

    def free(self, seq):
        self.frees[id(seq)] = (len(seq.output_ids), seq.finish_reason)
        return self.manager.free(seq)
