"""Notebook 07's self-check: a right speed-up prediction passes, wrong ones get a hint and never the answer."""
import heapq
import math
import re

import pytest

from cbteach.exercises import ex07
from conftest import tiny_model

LENGTHS = [5, 1, 9, 2, 2, 7, 3, 1, 4, 8]
B = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def static_steps(lengths, b):
    return sum(max(lengths[i:i + b]) for i in range(0, len(lengths), b))


def fcfs_steps(lengths, b):
    free_at, last = [0] * b, 0
    for n in lengths:
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + n)
        last = max(last, start + n)
    return last


def right(lengths, b):
    return static_steps(lengths, b) / fcfs_steps(lengths, b)


def bound(lengths, b):
    return static_steps(lengths, b) / max(math.ceil(sum(lengths) / b), max(lengths))


def test_engines_take_the_steps_slot_arithmetic_predicts(model):
    for lengths, b in [(LENGTHS, B)] + ex07.CASES:
        assert ex07.measured_steps(model, lengths, b) == (static_steps(lengths, b), fcfs_steps(lengths, b))
    # the cases include one where the lower bound is not reached (so the bound alone is not enough)
    assert any(not ex07._close(bound(l, b), right(l, b)) for l, b in ex07.CASES)


def test_accepts_a_right_prediction(model, capsys):
    assert ex07.check_speedup_prediction(right, model, LENGTHS, B)
    out = capsys.readouterr().out
    assert out.startswith("✓") and f"all {len(ex07.CASES) + 1} workloads" in out


def test_accepts_a_prediction_within_the_tolerance(model, capsys):
    assert ex07.check_speedup_prediction(lambda l, b: 1.02 * right(l, b), model, LENGTHS, B)
    assert not ex07.check_speedup_prediction(lambda l, b: 1.2 * right(l, b), model, LENGTHS, B)
    assert "too high" in capsys.readouterr().out


WRONG = {
    "upside down": lambda l, b: 1 / right(l, b),
    "same number of steps": lambda l, b: 1.0,
    "lower bound": bound,
    "its own longest": lambda l, b: math.ceil(len(l) / b) * max(l) / fcfs_steps(l, b),
    "not its average": lambda l, b: sum(sum(l[i:i + b]) / len(l[i:i + b]) for i in range(0, len(l), b))
    / fcfs_steps(l, b),
    "not the sum": lambda l, b: sum(l) / fcfs_steps(l, b),
}


@pytest.mark.parametrize("hint", list(WRONG))
def test_wrong_predictions_get_their_hint_and_never_the_answer(model, capsys, hint):
    assert not ex07.check_speedup_prediction(WRONG[hint], model, LENGTHS, B)
    out = capsys.readouterr().out
    assert out.startswith("✗") and hint in out, out
    out = re.sub(r"\) = \d+\.\d+ is", ") = (their answer) is", out)  # the learner's own value is echoed
    for lengths, b in [(LENGTHS, B)] + ex07.CASES:  # no measured speed-up or step count is printed
        truth = right(lengths, b)
        assert f"{truth:.3f}" not in out and f"{truth:.2f}x" not in out
        assert f" {fcfs_steps(lengths, b)} steps" not in out and f" {static_steps(lengths, b)} steps" not in out


def test_bad_answers_are_explained(model, capsys):
    assert not ex07.check_speedup_prediction(right(LENGTHS, B), model, LENGTHS, B)
    assert "function itself" in capsys.readouterr().out
    assert not ex07.check_speedup_prediction(lambda l, b: None, model, LENGTHS, B)
    assert "positive number" in capsys.readouterr().out
    assert not ex07.check_speedup_prediction(lambda l, b: 1 / 0, model, LENGTHS, B)
    assert "ZeroDivisionError" in capsys.readouterr().out
