"""Notebook 07: predict a workload's speed-up from its output lengths, before running anything.

The learner writes ``predict_speedup(lengths, batch_size)``: how many times fewer forward steps
continuous batching needs than static batching, for requests that generate exactly ``lengths[i]``
tokens (EOS ignored) with ``batch_size`` slots. The check runs the real engines --
:func:`~cbteach.static_batching` and the paged :class:`~cbteach.Engine` -- on the notebook's workload
and on a few small cases chosen to catch the usual mistakes, and compares the prediction with the
measured ratio of steps (static / continuous) within ``TOLERANCE``. On a wrong answer it says on which
workload, in which direction, and gives a hint; it never prints the measured value.
"""
from __future__ import annotations

import math
import numbers

from ..core.engine import Engine
from ..core.request import Request
from ..core.static import static_batching
from . import report, self_check

TOLERANCE = 0.05  # relative
# (answer lengths, batch size): equal lengths (nothing to gain), one long request first (short ones
# refill beside it), a long request last (FCFS cannot start it early: the lower bound is not reached),
# a mix over three slots, and a longer mix.
CASES = [([6, 6, 6, 6], 2), ([10, 1, 1, 1, 1, 1, 1], 2), ([1, 1, 1, 1, 1, 9], 2), ([4, 8, 2, 6, 3, 7, 1, 5], 3),
         ([3, 12, 2, 2, 9, 1, 4, 4, 8, 2, 6, 1], 4)]


def measured_steps(model, lengths, batch_size: int) -> tuple[int, int]:
    """``(static steps, continuous steps)`` of the real engines for outputs of exactly ``lengths`` tokens."""
    def reqs():
        return [Request([1 + i % 5] * (1 + i % 4), int(n), request_id=f"r{i}", ignore_eos=True)
                for i, n in enumerate(lengths)]
    static = len(static_batching(model, None, reqs(), batch_size).steps)
    engine = Engine(model, None, max_batch_size=batch_size, kv="paged", keep_records=False)
    engine.run(reqs())
    return static, engine.num_steps


def _close(a, b) -> bool:
    return b > 0 and abs(a - b) <= TOLERANCE * b


def _hint(lengths, b, got, static, continuous) -> str:
    n = len(lengths)
    waves = [lengths[i:i + b] for i in range(0, n, b)]
    wave_max = sum(max(w) for w in waves)
    bound = max(math.ceil(sum(lengths) / b), max(lengths))
    truth = static / continuous
    if not _close(truth, 1.0) and _close(got, 1 / truth):
        return ("it looks upside down: the speed-up is static steps / continuous steps, above 1 when continuous "
                "batching needs fewer steps")
    if not _close(truth, 1.0) and _close(got, 1.0):
        return ("both strategies produce the same tokens, but not in the same number of steps: count the steps "
                "each one needs")
    if continuous != bound and _close(got, wave_max / bound):
        return ("your continuous count looks like the lower bound max(ceil(sum / B), longest). The engine admits "
                "requests first come, first served, so a long request late in the queue starts late, and at the "
                "end slots drain: follow the slots step by step (notebook 02's exercise)")
    if _close(got, wave_max / math.ceil(sum(lengths) / b)):
        return "sum / B alone ignores that the longest request needs that many steps by itself"
    if len(waves) > 1 and _close(got, len(waves) * max(lengths) / continuous):
        return "each static wave waits for its own longest request, not for the longest of the whole workload"
    if _close(got, sum(sum(w) / len(w) for w in waves) / continuous):
        return "a static wave lasts as long as its longest request, not its average one"
    if _close(got, sum(lengths) / continuous):
        return "static batching runs a wave's requests side by side: a wave costs its longest request, not the sum"
    return ("count both: static = sum over waves of B requests of the longest output; continuous = the step "
            "at which the last request finishes when every freed slot takes the next request at once")


@self_check
def check_speedup_prediction(predict, model, lengths=None, batch_size=None) -> bool:
    """``predict(lengths, batch_size)`` should return static steps / continuous steps for any workload.

    ``model``: any causal LM the engines run (the step counts do not depend on it: the lengths are
    forced). ``lengths`` / ``batch_size``: the notebook's workload, checked first.
    """
    if not callable(predict):
        return report(False, "", f"pass your function itself (predict_speedup, not predict_speedup(...)); got "
                                 f"{type(predict).__name__}")
    cases = ([(list(lengths), batch_size)] if lengths is not None else []) + CASES
    for case_lengths, b in cases:
        shown = case_lengths if len(case_lengths) <= 12 else f"{case_lengths[:12]}... ({len(case_lengths)} requests)"
        try:
            got = predict(list(case_lengths), b)
        except Exception as err:  # the learner's code: say what failed, and on which input
            return report(False, "", f"predict_speedup({shown}, {b}) raised {type(err).__name__}: {err}")
        if isinstance(got, bool) or not isinstance(got, numbers.Real) or not math.isfinite(got) or got <= 0:
            return report(False, "", f"predict_speedup({shown}, {b}) returned {got!r}; it should return a positive "
                                     "number (static steps / continuous steps)")
        static, continuous = measured_steps(model, case_lengths, b)
        truth = static / continuous
        if not _close(float(got), truth):
            way = "too high" if got > truth else "too low"
            return report(False, "", f"predict_speedup({shown}, {b}) = {float(got):.3f} is {way}: the engines' "
                                     f"measured speed-up in steps differs by more than {TOLERANCE:.0%}. Hint: "
                                     f"{_hint(case_lengths, b, float(got), static, continuous)}")
    return report(True, f"your predictions match the engines' measured speed-ups (in steps) on all {len(cases)} "
                        f"workloads, within {TOLERANCE:.0%}", "")
