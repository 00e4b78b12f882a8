"""The self-check of notebook 01 accepts a right static-batching simulator and rejects typical wrong
ones with a hint that names the mistake -- never the engine's numbers."""

import re

import pytest

from cbteach.exercises import ex01
from conftest import tiny_model

# The notebook's run stands in as a small static run: ragged prompts (padding), skewed forced
# output lengths (idling), and a last wave of 2 requests in 3 slots (empty slots).
PROMPTS = [3, 1, 4, 1, 5, 9, 2]
OUTPUTS = [6, 2, 8, 3, 1, 4, 4]
B = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def static_run(model):
    return ex01.run_static(model, PROMPTS, OUTPUTS, B)


def schedule(prompt_lens, output_lens, batch_size):
    """The reference answer (as in the notebook's solution cell)."""
    waves = []
    for first in range(0, len(prompt_lens), batch_size):
        prompts, outputs = prompt_lens[first:first + batch_size], output_lens[first:first + batch_size]
        steps = max(outputs)
        waves.append((max(prompts), steps, sum(steps - n for n in outputs)))
    return waves


def test_engine_waves_are_read_from_the_records(static_run):
    assert ex01.engine_waves(static_run) == [(4, 8, 2 + 6 + 0), (9, 4, 1 + 3 + 0), (2, 4, 0)]
    assert sum(w[1] for w in ex01.engine_waves(static_run)) == len(static_run.steps)


def test_accepts_the_right_schedule(model, static_run, capsys):
    assert ex01.check_static_schedule(schedule, model, static_run)
    out = capsys.readouterr().out
    assert out.startswith("✓") and f"all {len(ex01.CASES) + 1} workloads" in out
    assert ex01.check_static_schedule(lambda p, o, b: [list(w) for w in schedule(p, o, b)], model)  # lists do


def _sorted(p, o, b):
    order = sorted(range(len(p)), key=lambda i: o[i])
    return schedule([p[i] for i in order], [o[i] for i in order], b)


def _round_robin(p, o, b):
    k = -(-len(p) // b)
    waves = [list(range(w, len(p), k)) for w in range(k)]
    return [(max(p[i] for i in g), max(o[i] for i in g), sum(max(o[i] for i in g) - o[i] for i in g)) for g in waves]


def _each(f):
    """Apply ``f(wave_index, (width, steps, idle), prompts, outputs, b)`` to every wave of the right answer."""
    def wrong(p, o, b):
        return [f(k, w, p[k * b:(k + 1) * b], o[k * b:(k + 1) * b], b) for k, w in enumerate(schedule(p, o, b))]
    return wrong


WRONG = [
    (_each(lambda k, w, p, o, b: (w[0], w[1] - 1, w[2])), "only the decode steps"),
    (_each(lambda k, w, p, o, b: (w[0], w[1] + 1, w[2])), "one step too many"),
    (_each(lambda k, w, p, o, b: (w[0], sum(o), w[2])), "side by side"),
    (_each(lambda k, w, p, o, b: (w[0], min(o), w[2])), "batch barrier"),
    (_each(lambda k, w, p, o, b: (sum(p), w[1], w[2])), "sum of the wave's prompt lengths"),
    (_each(lambda k, w, p, o, b: (min(p), w[1], w[2])), "never cut"),
    (lambda p, o, b: [(max(p), s, i) for _, s, i in schedule(p, o, b)], "whole workload"),
    (_each(lambda k, w, p, o, b: (w[0], w[1], w[2] + (b - len(o)) * w[1])), "empty slots too"),
    (_each(lambda k, w, p, o, b: (w[0], w[1], w[2] + len(o))), "off by one"),
    (_each(lambda k, w, p, o, b: (w[0], w[1], sum(o))), "useful"),
    (_each(lambda k, w, p, o, b: (w[0], w[1], w[2] + 1)), "after its last token"),
    (_sorted, "sorted"),
    (_round_robin, "round-robin"),
    (lambda p, o, b: schedule(p, o, b)[:-1], "partly full"),
    (lambda p, o, b: schedule(p, o, b) + [(1, 1, 0)], "partly full"),
    (lambda p, o, b: [(w, s, float(i)) for w, s, i in schedule(p, o, b)], "whole numbers"),
    (lambda p, o, b: len(p), "one tuple"),
    (lambda p, o, b: [(True, 1, 0)], "whole numbers"),
    (lambda p, o, b: 1 / 0, "ZeroDivisionError"),
]


@pytest.mark.parametrize("wrong, words", WRONG, ids=[w for _, w in WRONG])
def test_rejects_wrong_schedules_with_a_hint(model, static_run, capsys, wrong, words):
    assert not ex01.check_static_schedule(wrong, model, static_run)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out


@pytest.mark.parametrize("wrong, words", WRONG, ids=[w for _, w in WRONG])
def test_a_wrong_answer_is_never_told_the_engine_numbers(model, static_run, capsys, wrong, words):
    ex01.check_static_schedule(wrong, model, static_run)
    out = capsys.readouterr().out
    m = re.search(r"wave (\d+) has (\w+) = (-?\d+), but that is not what the engine did (.*)", out)
    if m:
        right = ex01.engine_waves(static_run)[int(m.group(1))][ex01.FIELDS.index(m.group(2))]
        assert right != int(m.group(3)) and not re.search(rf"(?<![\w.]){right}(?![\w.])", m.group(4))


def test_the_small_cases_catch_mistakes_the_notebook_run_might_not(model, capsys):
    # No empty slot in this run: a schedule that counts empty slots as idle passes it, and is caught later.
    full = ex01.run_static(model, [2, 2, 3, 3], [2, 5, 1, 4], 2)
    counts_empty = _each(lambda k, w, p, o, b: (w[0], w[1], w[2] + (b - len(o)) * w[1]))
    assert not ex01.check_static_schedule(counts_empty, model, full)
    out = capsys.readouterr().out
    assert out.startswith("✗ static_schedule([") and "empty slots too" in out


def test_not_a_function_and_bad_result(model, capsys):
    assert not ex01.check_static_schedule(schedule([1], [1], 1), model)
    assert "pass your function itself" in capsys.readouterr().out
    assert not ex01.check_static_schedule(schedule, model, [])  # the notebook's result argument, wrong
    assert "stopped with ValueError: expected the StaticResult" in capsys.readouterr().out
