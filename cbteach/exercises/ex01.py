"""Notebook 01: simulate static batching wave by wave -- the padded prefill, the barrier, the idling.

The learner writes ``static_schedule(prompt_lens, output_lens, batch_size)`` returning, for each
wave in order, ``(prefill_width, num_steps, idle_slot_steps)``. The check reads the same three
numbers from the step records of :func:`cbteach.static_batching` -- first of the notebook's own run,
then of small workloads it runs live with forced output lengths (``ignore_eos=True``,
``max_new_tokens`` = the length), chosen to catch the usual mistakes -- and compares wave by wave.
"""
from __future__ import annotations

from numbers import Integral

from ..core.request import Request
from ..core.static import static_batching
from . import report, self_check

# (prompt lengths, output lengths, batch_size): one request; one ragged wave; a partial last wave
# (empty slots are not idle); a long request late in the queue (waves go in queue order, unsorted);
# equal lengths (nothing idles, nothing is padded).
CASES = [([3], [4], 1), ([2, 5, 3], [4, 1, 6], 3), ([4, 1, 2, 6, 2], [3, 7, 2, 2, 5], 2),
         ([6, 2, 2, 2, 2, 6], [1, 9, 2, 2, 9, 1], 4), ([3, 3, 3, 3], [5, 5, 5, 5], 2)]
FIELDS = ("prefill_width", "num_steps", "idle_slot_steps")


def engine_waves(result) -> list[tuple[int, int, int]]:
    """Per wave of a :class:`~cbteach.StaticResult`: ``(prefill_width, num_steps, idle_slot_steps)``,
    read from its step records (the width is a prefill row's tokens plus its padding)."""
    if not (hasattr(result, "steps") and hasattr(result, "batch_size")):
        raise ValueError(f"expected the StaticResult of cbteach.static_batching, got {type(result).__name__}")
    waves: dict = {}
    for st in result.steps:
        w = waves.setdefault(st.wave, [0, 0, 0])
        if st.kind == "prefill":
            w[0] = max(s.num_tokens + s.num_pad for s in st.slots if s.state == "prefill")
        w[1] += 1
        w[2] += sum(s.state == "idle" for s in st.slots)
    return [tuple(waves[k]) for k in sorted(waves)]


def run_static(model, prompt_lens, output_lens, batch_size: int):
    """The real static batcher on prompts of ``prompt_lens`` tokens forced to ``output_lens`` new tokens."""
    reqs = [Request([1 + i % 5] * int(p), int(n), request_id=f"r{i}", ignore_eos=True)
            for i, (p, n) in enumerate(zip(prompt_lens, output_lens))]
    return static_batching(model, None, reqs, batch_size)


def _waves(n, b):
    return [list(range(i, min(i + b, n))) for i in range(0, n, b)]


def _simulate(prompts, outputs, groups):
    """A schedule for a given grouping of requests into waves (used only to recognise mistakes)."""
    out = []
    for g in groups:
        steps = max(outputs[i] for i in g)
        out.append((max(prompts[i] for i in g), steps, sum(steps - outputs[i] for i in g)))
    return out


def _grouping_hint(got, prompts, outputs, b):
    n = len(prompts)
    by_length = sorted(range(n), key=lambda i: outputs[i])
    if got == _simulate(prompts, outputs, [by_length[i:i + b] for i in range(0, n, b)]):
        return (f"you sorted the requests by length first; static batching takes them in queue order, {b} at a "
                "time -- it cannot know the lengths in advance")
    k = -(-n // b)
    if got == _simulate(prompts, outputs, [list(range(w, n, k)) for w in range(k)]):
        return f"you dealt the requests round-robin; a wave holds the next {b} requests of the queue, in order"
    return None


def _field_hint(field, got, expected, wave, prompts, outputs, b):
    """What a wrong ``got`` for ``field`` of one wave suggests; ``expected`` is the engine's wave tuple."""
    ps, ls = [prompts[i] for i in wave], [outputs[i] for i in wave]
    if field == "prefill_width":
        if got == sum(ps):
            return "that is the sum of the wave's prompt lengths; the rows sit side by side, each padded to one width"
        if got == max(prompts) and len(wave) < len(prompts):
            return "you padded to the longest prompt of the whole workload; a wave is padded only to its own rows"
        if got == min(ps):
            return "short rows are padded up to the width of the widest row, never cut"
        return "every row of a wave is left-padded to the same width: which prompt decides it?"
    if field == "num_steps":
        if got == expected[1] - 1:
            return ("you counted only the decode steps; the prefill step counts too -- it already produces each "
                    "request's first token")
        if got == expected[1] + 1:
            return "one step too many: the prefill step already produces the first token, so L new tokens take L steps"
        if got == sum(ls):
            return "the requests of a wave run side by side, not one after another"
        return "a wave ends only when every one of its requests is done: the batch barrier"
    empty = (b - len(wave)) * expected[1]
    idle = expected[2]
    if empty and got == idle + empty:
        return ("you counted the empty slots too: this wave has fewer requests than slots, and a slot that no "
                "request holds is empty, not idle")
    if got in (idle + len(wave), idle - len(wave)):
        return "off by one step per request: a request with L new tokens is busy for exactly L steps of its wave"
    if got == sum(ls):
        return "that is the useful (busy) slot-steps; idle ones are the steps a finished request waits"
    return "a request idles from the step after its last token until its wave ends"


def _shown(prompts, outputs, b, notebook):
    if notebook:
        return f"static_schedule on the notebook's run ({len(prompts)} requests, batch_size {b})"
    return f"static_schedule({prompts}, {outputs}, {b})"


@self_check
def check_static_schedule(static_schedule, model, result=None) -> bool:
    """``static_schedule(prompt_lens, output_lens, batch_size)`` should return, per wave in order,
    ``(prefill_width, num_steps, idle_slot_steps)`` exactly as the static batcher recorded them.

    ``model``: any causal LM (the notebook's bierce) for the live runs -- the numbers do not depend
    on it, because the lengths are forced. ``result``: the notebook's :class:`~cbteach.StaticResult`,
    checked first, on its own prompt and answer lengths.
    """
    if not callable(static_schedule):
        return report(False, "", "pass your function itself (static_schedule, not static_schedule(...)); got "
                                 f"{type(static_schedule).__name__}")
    cases = []
    if result is not None:
        waves = engine_waves(result)  # validates it first
        cases.append(([len(c.prompt_ids) for c in result], [len(c.output_ids) for c in result], result.batch_size,
                      waves, True))
    cases += [(p, o, b, None, False) for p, o, b in CASES]
    for prompts, outputs, b, expected, notebook in cases:
        if expected is None:
            expected = engine_waves(run_static(model, prompts, outputs, b))
        where = _shown(prompts, outputs, b, notebook)
        try:
            got = static_schedule(list(prompts), list(outputs), b)
        except Exception as err:  # the learner's code: say what failed, and on which input
            return report(False, "", f"{where} raised {type(err).__name__}: {err}")
        ok_shape = isinstance(got, (list, tuple)) and all(
            isinstance(w, (list, tuple)) and len(w) == 3
            and all(isinstance(v, Integral) and not isinstance(v, bool) for v in w) for w in got)
        if not ok_shape:
            return report(False, "", f"{where} returned {got!r}; it should return a list with one tuple "
                                     "(prefill_width, num_steps, idle_slot_steps) of whole numbers per wave")
        got = [tuple(int(v) for v in w) for w in got]
        if len(got) != len(expected):
            return report(False, "", f"{where} returned {len(got)} waves for {len(prompts)} requests and "
                                     f"{b} slots; the engine takes the queue {b} at a time, and the last wave may "
                                     "be only partly full")
        if got != expected:
            hint = _grouping_hint(got, prompts, outputs, b)
            k = next(i for i, (g, e) in enumerate(zip(got, expected)) if g != e)
            field = next(f for f, g, e in zip(FIELDS, got[k], expected[k]) if g != e)
            value = got[k][FIELDS.index(field)]
            if hint is None:
                hint = _field_hint(field, value, expected[k], _waves(len(prompts), b)[k], prompts, outputs, b)
            return report(False, "", f"{where}: wave {k} has {field} = {value}, but that is not what the engine "
                                     f"did ({hint})")
    return report(True, f"your schedule matches the static batcher's waves on all {len(cases)} workloads: "
                        "prefill widths, steps and idle slot-steps", "")
