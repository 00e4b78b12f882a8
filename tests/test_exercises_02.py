"""The self-checks of notebook 02 accept the right answer and reject typical wrong ones helpfully."""
import heapq
import math

import pytest

from cbteach.exercises import ex02
from conftest import tiny_model

# A small workload of forced output lengths, and its batch size.
LENGTHS = [4, 10, 2, 5, 3]
B = 3


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


# -- ex02: FCFS slot-refill simulator ------------------------------------------------------------------

def fcfs(lengths, b):
    free = [0] * b
    end = 0
    for n in lengths:
        start = heapq.heappop(free)
        end = max(end, start + n)
        heapq.heappush(free, start + n)
    return end


def static_steps(lengths, b):
    return sum(max(lengths[i:i + b]) for i in range(0, len(lengths), b))


def lower_bound(lengths, b):
    return max(math.ceil(sum(lengths) / b), max(lengths))


def with_gap(lengths, b):
    free = [0] * b
    end = 0
    for n in lengths:
        start = heapq.heappop(free)
        end = max(end, start + n)
        heapq.heappush(free, start + n + 1)
    return end


def round_robin(lengths, b):
    return max(sum(lengths[s::b]) for s in range(b))


def one_admission_a_step(lengths, b):
    """Admits at most one waiting request per step."""
    queue, running, t = list(lengths), [], 0
    while queue or running:
        if queue and len(running) < b:
            running.append(queue.pop(0))
        t += 1
        running = [r - 1 for r in running if r - 1 > 0]
    return t


def _slots(lengths, b):
    """(starts, ends) of each request, FCFS, each taking the slot that frees first."""
    free, starts, ends = [0] * b, [], []
    for n in lengths:
        k = free.index(min(free))
        starts.append(free[k])
        free[k] += n
        ends.append(free[k])
    return starts, ends


def test_engine_steps_match_the_reference_simulator(model):
    for lengths, b in ex02.CASES + [(LENGTHS, B)]:
        assert ex02.engine_steps(model, lengths, b) == fcfs(lengths, b), (lengths, b)


def test_ex02_accepts_a_right_simulator(model, capsys):
    assert ex02.check_fcfs_simulator(fcfs, model, LENGTHS, B)
    assert capsys.readouterr().out.startswith("✓")


@pytest.mark.parametrize("wrong, words", [
    (static_steps, "static batching"),
    (lower_bound, "lower bound"),
    (lambda lengths, b: fcfs(lengths, b) + 1, "off by one"),
    (lambda lengths, b: fcfs(lengths, b) - 1, "off by one"),
    (with_gap, "empty for one step"),
    (lambda lengths, b: fcfs([n - 1 for n in lengths], b), "decode steps only (L - 1)"),  # (was the generic hint)
    (round_robin, "slot i % slots"),
    (lambda lengths, b: fcfs(sorted(lengths), b), "shortest requests first"),  # (was told "off by one")
    (lambda lengths, b: max(lengths), "a slot of its own"),  # max_batch_size ignored
    (lambda lengths, b: _slots(lengths, b)[1][-1], "last request admitted finishes"),  # not the last to finish
    (lambda lengths, b: max(_slots(lengths, b)[0]), "last request starts"),  # a start, not an end
    (lambda lengths, b: fcfs(lengths[::-1], b), "last in, first out"),
    (one_admission_a_step, "you admitted one request a step"),  # (was told "off by one")
    (lambda lengths, b: float(fcfs(lengths, b)), "an int"),
    (lambda lengths, b: lengths[99], "IndexError"),
    (lambda lengths, b: None, "not done yet"),
])
def test_ex02_rejects_wrong_simulators_with_a_hint(model, capsys, wrong, words):
    assert not ex02.check_fcfs_simulator(wrong, model, LENGTHS, B)
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out


def test_ex02_not_callable(model, capsys):
    assert not ex02.check_fcfs_simulator(fcfs(LENGTHS, B), model)
    assert "pass your function itself" in capsys.readouterr().out


def test_ex02_simulator_cannot_change_the_notebook_workload(model):
    lengths = list(LENGTHS)

    def greedy_mutator(ls, b):
        r = fcfs(ls, b)
        ls.clear()
        return r

    assert ex02.check_fcfs_simulator(greedy_mutator, model, lengths, B)
    assert lengths == LENGTHS


def test_ex02_wrong_answer_does_not_show_the_engines_count(model, capsys):
    assert not ex02.check_fcfs_simulator(lambda lengths, b: 0, model)
    out = capsys.readouterr().out
    assert "took more steps" in out and not any(f"took {n} steps" in out for n in range(1000))


def test_a_numpy_integer_is_a_whole_number_too(model, capsys):
    import numpy as np

    assert ex02.check_fcfs_simulator(lambda lengths, b: np.int64(fcfs(lengths, b)), model)
    assert capsys.readouterr().out.startswith("✓")
