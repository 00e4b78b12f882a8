"""Notebook 02: predict continuous batching's step count with a tiny FCFS slot-refill simulator; the check
compares it with the real engine's on forced output lengths, and on cases chosen to catch the usual mistakes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..engine.engine import Engine
from ..core.request import Request
from . import ask, fail, is_int, need_function, passed, self_check


class Case(NamedTuple):
    lengths: list  # new tokens of each request, in arrival order
    max_batch_size: int


# One wave, one slot, more slots than requests, a long request first (short ones refill around it), a long
# request last (FCFS cannot pull it forward), a mix.
CASES = [Case(lengths=[5], max_batch_size=1), Case(lengths=[7, 3, 5], max_batch_size=1),
         Case(lengths=[2, 2, 2], max_batch_size=8), Case(lengths=[10, 1, 1, 1, 1, 1, 1], max_batch_size=2),
         Case(lengths=[1, 1, 1, 1, 1, 9], max_batch_size=2), Case(lengths=[4, 8, 2, 6, 3, 7, 1, 5], max_batch_size=3)]


def engine_steps(model, lengths, batch_size: int) -> int:
    """Steps the real engine takes to produce exactly ``lengths[i]`` new tokens for request ``i``."""
    reqs = [Request([1 + i % 5] * (1 + i % 4), int(n), request_id=f"r{i}", ignore_eos=True)
            for i, n in enumerate(lengths)]
    engine = Engine(model, None, max_batch_size=batch_size)
    engine.run(reqs)
    return len(engine.records)


def _fcfs(lengths, slots: int, order=None) -> tuple[list, list]:
    """Each request's first and one-past-last step when it takes the slot that frees first (``order``: the
    queue, default arrival order): the rule the engine follows, in a few lines, for the mistakes below."""
    free, starts, ends = [0] * slots, [], []
    for n in (lengths if order is None else order):
        k = free.index(min(free))
        starts.append(free[k])
        free[k] += n
        ends.append(free[k])
    return starts, ends


def _one_admission_a_step(lengths, slots: int) -> int:
    """The steps when at most one waiting request is admitted per step (a mistake below)."""
    queue, running, steps = list(lengths), [], 0
    while queue or running:
        if queue and len(running) < slots:
            running.append(queue.pop(0))
        steps += 1
        running = [n - 1 for n in running if n > 1]
    return steps


# Typical mistakes: (the counts each gives, from the lengths ls, the slots b, the engine's count e and the model m;
# the hint). A mistake that only shows with fewer slots than requests gives nothing otherwise.
MISTAKES = [
    (lambda ls, b, e, m: [sum(max(ls[i:i + b]) for i in range(0, len(ls), b))] if b < len(ls) else [],
     "that is static batching's count; here a slot is refilled as soon as its request finishes"),
    (lambda ls, b, e, m: [max(math.ceil(sum(ls) / b), max(ls))],
     "that is the lower bound, a perfect packing; FCFS cannot start early a long request that comes late"),
    (lambda ls, b, e, m: [math.ceil(sum(ls) / b)], "that is sum / slots: one request alone can take longer"),
    (lambda ls, b, e, m: [max(sum(ls[s::b]) for s in range(b))] if b < len(ls) else [],
     "you gave request i to slot i % slots; the next request in the queue takes whichever slot frees first"),
    (lambda ls, b, e, m: [engine_steps(m, sorted(ls), b)] if b < len(ls) and sorted(ls) != ls else [],
     "you served the shortest requests first; FCFS admits them in arrival order, whatever their length"),
    (lambda ls, b, e, m: [max(_fcfs([x - 1 for x in ls], b)[1])] if len(ls) > 1 else [],
     "you counted each request's decode steps only (L - 1): its prefill step, which makes the first token, holds "
     "the slot too"),
    (lambda ls, b, e, m: [_one_admission_a_step(ls, b)] if b > 1 and len(ls) > 1 else [],
     "you admitted one request a step; every slot free at a step is filled on that step, from the queue in order"),
    (lambda ls, b, e, m: [e + 1, e - 1],
     "off by one: the prefill step already makes the first token, so L new tokens hold a slot L steps"),
    (lambda ls, b, e, m: [engine_steps(m, [x + 1 for x in ls], b) - 1] if b < len(ls) else [],
     "you left a slot empty for one step after each finish; the next request prefills in it on the very next step"),
    (lambda ls, b, e, m: [sum(ls)],
     "that is the total number of new tokens: with one slot it is right, with more they run side by side"),
    (lambda ls, b, e, m: [max(ls)] if b < len(ls) else [],
     "every request got a slot of its own: at most max_batch_size requests run at once"),
    (lambda ls, b, e, m: [_fcfs(ls, b)[1][-1]] if b < len(ls) else [],
     "that is when the last request admitted finishes; one admitted before it may finish later"),
    (lambda ls, b, e, m: [max(_fcfs(ls, b)[0])] if b < len(ls) else [],
     "that is when the last request starts, not when the last one finishes"),
    (lambda ls, b, e, m: [max(_fcfs(ls, b, ls[::-1])[1])] if b < len(ls) else [],
     "you served the requests last in, first out; FCFS admits them in arrival order"),
]
GENERIC = "follow the slots step by step: who is admitted when, and when does each finish?"


@self_check
def check_fcfs_simulator(simulate, model, lengths=None, batch_size=None) -> bool:
    """``simulate(lengths, batch_size)`` -> the engine's step count (on ``model``: the count does not depend on
    it, the lengths are forced); the notebook's workload first."""
    need_function(simulate, "simulate")
    cases = ([Case(lengths=list(lengths), max_batch_size=batch_size)] if lengths is not None else []) + CASES
    for ls, b in cases:
        expected = engine_steps(model, ls, b)
        shown = ls if len(ls) <= 12 else f"{ls[:12]}... ({len(ls)} requests)"
        got = ask(simulate, list(ls), b, shown=f"simulate({shown}, {b})")
        if not is_int(got):
            return fail(f"simulate({shown}, {b}) returned {got!r}; it should return a whole number of steps (an int)")
        if got != expected:
            hints = [h for mistake, h in MISTAKES if got in mistake(ls, b, expected, model)]
            hint = " -- or ".join(hints[:2]) if hints else None  # (two mistakes can give the same count: both named)
            more = "more" if expected > got else "fewer"
            return fail(f"simulate({shown}, {b}) = {got}, but the engine took {more} steps ({hint or GENERIC})")
    return passed(f"your simulator matches the engine's step count on all {len(cases)} workloads")
