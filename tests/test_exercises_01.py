"""The self-checks of notebook 01 accept the right answer and reject typical wrong ones helpfully."""

import pytest

from cbteach import Request, static_batching
from cbteach.exercises import ex01
from conftest import tiny_model

# Forced output lengths (ignore_eos), prompts of different lengths so the prefill is padded.
LENGTHS = [4, 10, 2, 5, 3]
B = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def static_run(model):
    reqs = [Request([1 + i] * (1 + 2 * i), n, request_id=f"r{i}", ignore_eos=True) for i, n in enumerate(LENGTHS)]
    return static_batching(model, None, reqs, batch_size=B)


def idle(lengths):
    return sum(max(lengths) - n for n in lengths)


# -- ex01: idle slot-steps of a wave -----------------------------------------------------------------

def test_ex01_accepts_right_answer(static_run, capsys):
    assert ex01.check_idle_slot_steps(static_run, 0, idle(LENGTHS[:3]))
    assert ex01.check_idle_slot_steps(static_run, 1, idle(LENGTHS[3:]))
    assert capsys.readouterr().out.startswith("✓")


def test_ex01_expected_value_comes_from_the_run(static_run):
    counted = sum(s.state == "idle" for st in static_run.steps if st.wave == 0 for s in st.slots)
    assert counted == idle(LENGTHS[:3]) == 14


@pytest.mark.parametrize("wave, wrong, words", [
    (1, idle(LENGTHS[3:]) + 5, "empty"),  # wave 1: two requests, three slots, five steps
    (0, idle(LENGTHS[:3]) + 3, "off by one"),
    (0, idle(LENGTHS[:3]) - 3, "off by one"),
    (0, 10 - 2, "shortest"),
    (0, sum(LENGTHS[:3]), "useful"),
    (0, 10, "number of steps"),
    (0, "14", "whole number"),
    (0, 13, "max(lengths) minus its own"),
])
def test_ex01_rejects_wrong_answers_with_a_hint(static_run, capsys, wave, wrong, words):
    assert not ex01.check_idle_slot_steps(static_run, wave, wrong)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out


def test_ex01_padding_hint(static_run, capsys):
    pad = sum(s.num_pad for st in static_run.steps if st.wave == 0 for s in st.slots if s.state == "prefill")
    assert pad > 0
    assert not ex01.check_idle_slot_steps(static_run, 0, idle(LENGTHS[:3]) + pad)
    assert "padding" in capsys.readouterr().out


def test_ex01_bad_arguments(static_run):
    with pytest.raises(ValueError, match="no wave 7"):
        ex01.check_idle_slot_steps(static_run, 7, 0)
    with pytest.raises(ValueError, match="StaticResult"):
        ex01.check_idle_slot_steps([], 0, 0)
