"""Notebook 02: predict continuous batching's step count with a tiny FCFS slot-refill simulator; the check
compares it with the real engine's on forced output lengths, and on cases chosen to catch the usual mistakes.
"""
from __future__ import annotations

import math
from typing import NamedTuple

from ..engine.engine import Engine
from ..core.request import Request
from . import fail, is_int, need_function, passed, raised, self_check


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


def _static_steps(lengths, b):
    return sum(max(lengths[i:i + b]) for i in range(0, len(lengths), b))


def _hint(model, lengths, b, got, expected) -> str:
    n = len(lengths)
    if got == _static_steps(lengths, b) and b < n:
        return "that is static batching's count; here a slot is refilled as soon as its request finishes"
    if got == max(math.ceil(sum(lengths) / b), max(lengths)):
        return "that is the lower bound, a perfect packing; FCFS cannot start early a long request that comes late"
    if got == math.ceil(sum(lengths) / b):
        return "that is sum / slots, which ignores that one request alone can take longer than that"
    if got in (expected + 1, expected - 1):
        return "off by one: the prefill step already makes the first token, so L new tokens hold a slot L steps"
    if b < n and got == engine_steps(model, [x + 1 for x in lengths], b) - 1:
        return ("you left a slot empty for one step after each finish; the next request prefills in it on the very "
                "next step")
    if b < n and got == max(sum(lengths[s::b]) for s in range(b)):
        return "you gave request i to slot i % slots; the next request in the queue takes whichever slot frees first"
    if got == sum(lengths):
        return "that is the total number of new tokens: with one slot it is right, with more they run side by side"
    return "follow the slots step by step: who is admitted when, and when does each finish?"


@self_check
def check_fcfs_simulator(simulate, model, lengths=None, batch_size=None) -> bool:
    """``simulate(lengths, batch_size)`` -> the engine's step count (on ``model``: the count does not depend on
    it, the lengths are forced); the notebook's workload first."""
    need_function(simulate, "simulate")
    cases = ([Case(lengths=list(lengths), max_batch_size=batch_size)] if lengths is not None else []) + CASES
    for case_lengths, b in cases:
        expected = engine_steps(model, case_lengths, b)
        try:
            got = simulate(list(case_lengths), b)
        except Exception as err:  # the learner's code: say what failed, and on which input
            return fail(f"simulate({case_lengths}, {b}) raised {raised(err)}")
        if got is None:
            return fail("not done yet: your simulator returned None -- write it in the cell above")
        if not is_int(got):
            return fail(f"simulate({case_lengths}, {b}) returned {got!r}; it should return a whole "
                        "number of steps (an int)")
        if got != expected:
            shown = case_lengths if len(case_lengths) <= 12 else f"{case_lengths[:12]}... ({len(case_lengths)} requests)"
            return fail(f"simulate({shown}, {b}) = {got}, but the engine took {'more' if expected > got else 'fewer'} steps "
                        f"({_hint(model, case_lengths, b, got, expected)})")
    return passed(f"your simulator matches the engine's step count on all {len(cases)} workloads")
