"""The watchers notebook 06's harness wraps around a learner's scheduler (:mod:`cbteach.exercises.scheduler_check`).

Each stands in for one thing the scheduler touches and behaves exactly like it, but notices one
mistake the moment it happens, while the evidence is still there:

* :class:`Tracer` -- ``sys.settrace`` around one ``schedule`` call: did it run the engine's own
  scheduling code, and does it ever return (:data:`MAX_EVENTS`)?
* :class:`QueueWatch` -- the waiting queue: was it changed while a loop walked it?
* :class:`RunningWatch` -- the running list: did removing a request make a loop skip the next one?
* :class:`KVWatch` -- the KV manager: what room was granted or refused this step, and what each
  ``free`` saw (read by :mod:`cbteach.exercises.update_rules`).
"""
from __future__ import annotations

import sys

from .rules import SchedulerMistake, hint

MAX_EVENTS = 200_000  # traced calls and lines in one schedule() call: far beyond any honest step


class Tracer:
    """``sys.settrace`` for one call: which engine code it ran, and a bound on events."""

    def __init__(self, watch: dict):
        self.watch, self.called, self.events, self.saved = watch, None, 0, None

    def __call__(self, frame, event, arg):
        self.events += 1
        if self.events > MAX_EVENTS:
            raise SchedulerMistake("schedule() did not return: a loop that never ends? (a retry loop must change "
                                   "something each time round -- preempt someone -- or stop)")
        if event == "call" and frame.f_code in self.watch and self.called is None:
            self.called = self.watch[frame.f_code]
        return self

    def __enter__(self):
        self.saved = sys.gettrace()
        sys.settrace(self)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.saved)


class QueueWatch:
    """The policy's waiting queue, unchanged, but it knows when it is changed while being walked."""

    def __init__(self, queue):
        self.queue, self.version = queue, 0

    def __getattr__(self, name):
        return getattr(self.queue, name)

    def __len__(self):
        return len(self.queue)

    def __contains__(self, seq):
        return seq in self.queue

    def __iter__(self):
        version = self.version
        for seq in list(self.queue):
            if self.version != version:  # a plain list iterator would now skip a request
                raise SchedulerMistake(hint("walked_waiting", None))
            yield seq

    def _changed(self, method, seq):
        self.version += 1
        return method(seq)

    def add(self, seq):
        return self._changed(self.queue.add, seq)

    def remove(self, seq):
        return self._changed(self.queue.remove, seq)

    def readd_preempted(self, seq):
        return self._changed(self.queue.readd_preempted, seq)


class RunningWatch(list):
    """The running list, unchanged, but it knows when a loop over it skips a request: removing one at or
    before the loop's position shifts the rest left, and a plain list iterator steps over the next."""

    def __init__(self, items=()):
        super().__init__(items)
        self.cursors: list = []  # [position, skipped] of each live loop

    def __iter__(self):
        cursor = [0, False]
        self.cursors.append(cursor)
        try:
            while True:
                if cursor[1]:
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
