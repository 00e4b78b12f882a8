"""Notebook 10's self-check: predictions about a small run, checked against the real engines.

It accepts the answers the course's rules give, rejects typical wrong ones with the hint for the
rule that was missed, and never prints the engine's value for a wrong answer.
"""
import math
import re

import pytest

from cbteach.exercises import ex10
from conftest import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(scope="module")
def truth(model):
    return ex10.measure(model)


def by_the_rules() -> dict:
    """The six answers from the rules the notebooks teach, without running anything."""
    L, P, B, bs = ex10.OUTPUT_LENS, ex10.PROMPT_LENS, ex10.BATCH_SIZE, ex10.BLOCK_SIZE
    static = sum(max(L[i:i + B]) for i in range(0, len(L), B))
    free_at, start = [0] * B, {}
    for rid, n in zip(ex10.IDS, L):  # FCFS: the next request takes the slot that frees first
        s = min(free_at)
        free_at[free_at.index(s)] = s + n
        start[rid] = s
    k = ex10.STEP
    running = {rid: "prefill" if start[rid] == k else "decode"
               for rid, n in zip(ex10.IDS, L) if start[rid] <= k < start[rid] + n}
    computed = P[ex10.IDS.index(ex10.FOCUS)] + k - start[ex10.FOCUS] - 1
    return {"static_steps": static, "continuous_steps": max(free_at), "running": running,
            "num_computed_tokens": computed, "num_blocks": math.ceil((computed + 1) / bs),
            "prefill_steps": math.ceil(ex10.LONG_PROMPT / (ex10.TOKEN_BUDGET - 1))}


def answers(truth, **changes):
    out = {name: truth[name] for name in ex10.FIELDS}
    out.update(changes)
    return out


def run(model, capsys, **kw):
    ok = ex10.check_schedule(model, **kw)
    return ok, capsys.readouterr().out


def line_for(out, name):
    return next(line for line in out.splitlines() if re.match(rf"[✓✗] {name}\b", line))


def test_the_engines_follow_the_rules_the_notebooks_teach(truth):
    assert {name: truth[name] for name in ex10.FIELDS} == by_the_rules()


def test_the_workload_asks_something_worth_asking(truth):
    assert set(truth["running"].values()) == {"prefill", "decode"}  # the step asked about is a fused step
    assert truth["num_blocks"] > math.ceil(truth["num_computed_tokens"] / ex10.BLOCK_SIZE)  # a block was just added
    assert truth["continuous_steps"] < truth["static_steps"]
    assert truth["continuous_steps"] > max(math.ceil(sum(ex10.OUTPUT_LENS) / ex10.BATCH_SIZE), max(ex10.OUTPUT_LENS))
    assert truth["_finished"][ex10.FOCUS] > ex10.STEP  # its block table is still there after the step


def test_answers_do_not_depend_on_the_model(truth, bierce):
    model, _ = bierce
    assert {n: ex10.measure(model)[n] for n in ex10.FIELDS} == {n: truth[n] for n in ex10.FIELDS}


def test_right_answers_pass(model, truth, capsys):
    ok, out = run(model, capsys, **answers(truth))
    assert ok
    assert out.count("✓") == len(ex10.FIELDS) and "✗" not in out


WRONG = [  # (field, a wrong answer derived from the truth, what the hint must say)
    ("static_steps", lambda t: sum(ex10.OUTPUT_LENS), "side by side"),
    ("static_steps", lambda t: 3 * max(ex10.OUTPUT_LENS), "its own longest"),
    ("static_steps", lambda t: t["continuous_steps"], "cannot refill a slot mid-wave"),
    ("continuous_steps", lambda t: t["static_steps"], "no waiting for a wave"),
    ("static_steps", lambda t: ex10.FULL_WAVES, "leftover request is a wave of its own"),  # the last wave forgotten
    ("continuous_steps", lambda t: ex10._refilled_late(), "no step in between"),  # a freed slot refilled a step late
    ("prefill_steps", lambda t: ex10.LONG_PROMPT // (ex10.TOKEN_BUDGET - 1), "last, shorter chunk"),  # chunks floored
    ("continuous_steps", lambda t: max(math.ceil(sum(ex10.OUTPUT_LENS) / ex10.BATCH_SIZE), max(ex10.OUTPUT_LENS)),
     "lower bound"),
    ("continuous_steps", lambda t: t["continuous_steps"] + 1, "off by one"),
    ("continuous_steps", lambda t: ex10._refilled_late(0, sorted(ex10.OUTPUT_LENS)), "shortest requests first"),
    ("num_computed_tokens", lambda t: t["num_computed_tokens"] + 1, "before* the step"),
    ("num_computed_tokens", lambda t: t["num_computed_tokens"] - ex10.PROMPT_LENS[ex10.IDS.index(ex10.FOCUS)],
     "prompt's tokens too"),
    ("num_computed_tokens", lambda t: t["num_computed_tokens"] - 1, "too low by one"),
    ("num_blocks", lambda t: math.ceil(t["num_computed_tokens"] / ex10.BLOCK_SIZE), "makes room"),
    ("num_blocks", lambda t: t["num_computed_tokens"], "not tokens"),
    ("prefill_steps", lambda t: math.ceil(ex10.LONG_PROMPT / ex10.TOKEN_BUDGET), "decodes are scheduled first"),
    ("prefill_steps", lambda t: 1, "in chunks"),
    ("prefill_steps", lambda t: t["prefill_steps"] + 1, "off by one"),
]


@pytest.mark.parametrize("name,wrong,hint", WRONG, ids=[f"{w[0]}-{w[2][:12]}" for w in WRONG])
def test_wrong_numbers_get_a_hint_and_never_the_answer(model, truth, capsys, name, wrong, hint):
    value = wrong(truth)
    assert value != truth[name]
    ok, out = run(model, capsys, **answers(truth, **{name: value}))
    assert not ok
    line = line_for(out, name)
    assert line.startswith("✗") and hint in line, line
    assert not re.search(rf"(?<![\d.]){truth[name]}(?![\d.])", line), f"the answer leaked: {line}"
    assert out.count("✓") == len(ex10.FIELDS) - 1  # the other five still pass
    assert "All six" not in out


def test_running_hints_name_the_rule_not_the_answer(model, truth, capsys):
    rid = next(iter(truth["running"]))  # one request that does run on the step
    gone = next(r for r in ex10.IDS if truth["_finished"][r] < ex10.STEP)
    later = next(r for r in ex10.IDS if truth["_admitted"][r] > ex10.STEP)
    cases = [
        ({**truth["running"], gone: "decode"}, "already finished"),
        ({**truth["running"], later: "prefill"}, "not been admitted yet"),
        ({rid: truth["running"][rid]}, "missing"),
        ({r: "decode" for r in truth["running"]}, "not every kind is"),
        ({**truth["running"], "Z": "decode"}, "not a request of the workload"),
        (truth["_near"][-1], "the steps are counted from 0"),  # (was told a request had finished)
    ]
    for guess, hint in cases:
        ok, out = run(model, capsys, **answers(truth, running=guess))
        line = line_for(out, "running")
        assert not ok and line.startswith("✗") and hint in line, line
        for missing in set(truth["running"]) - set(guess):  # a missing request is never named
            assert f"'{missing}'" not in line
        assert repr(truth["running"]) not in line


@pytest.mark.parametrize("name,value,hint", [
    ("static_steps", ..., "not done yet"),
    ("continuous_steps", True, "whole number"),
    ("num_blocks", "2", "whole number"),
    ("running", ["C", "D"], "should be a dict"),
    ("running", {"C": "decoding"}, "should be a dict"),
])
def test_malformed_answers_say_what_shape_is_expected(model, truth, capsys, name, value, hint):
    ok, out = run(model, capsys, **answers(truth, **{name: value}))
    assert not ok and hint in line_for(out, name)


def test_every_field_is_asked_once_and_the_notebook_names_match():
    import inspect

    params = list(inspect.signature(ex10.check_schedule).parameters)
    assert params == ["model", *ex10.FIELDS]
    assert set(ex10.HINTS) == set(ex10.GOOD) == set(ex10.FIELDS)
