"""Notebook 13's self-check: the KV heads a rank holds and the bytes a step all-reduces, against a real
two-process run. The solution passes; each typical mistake fails with the hint for its idea, never
with the right value."""
import re

import pytest
from conftest import tiny_model

from cbteach import Engine
from cbteach.core.request import Request
from cbteach.exercises import ex13


@pytest.fixture(scope="module")
def run():
    model = tiny_model("llama")
    eng = Engine(model, None, max_batch_size=3, kv="paged", block_size=4, tensor_parallel_size=2)
    try:
        eng.run([Request([1, 2, 3, 4, 5], 4, request_id=0), Request([7, 8], 6, request_id=1),
                 Request([9] * 11, 3, request_id=2)])
        log = list(eng.executor.comm_log)
    finally:
        eng.close()
    return {"comm_log": log, "num_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size}


def kv_right(rank, world_size, num_heads, num_kv_heads):
    per_rank = max(1, num_kv_heads // world_size)
    replicas = max(1, world_size // num_kv_heads)
    first = rank // replicas * per_rank
    return list(range(first, first + per_rank))


def bytes_right(num_layers, num_tokens, hidden_size, dtype_bytes, world_size):
    tensor = num_tokens * hidden_size * dtype_bytes  # one all-reduced tensor
    return 2 * num_layers * 2 * (world_size - 1) * tensor // world_size  # two per layer; the ring's share


def check(run, capsys, kv=kv_right, nbytes=bytes_right):
    ok = ex13.check_tp(kv, nbytes, **run)
    return ok, capsys.readouterr().out


def test_solution_passes(run, capsys):
    ok, out = check(run, capsys)
    assert ok, out
    assert out.count("✓") == 2


@pytest.mark.parametrize("wrong, idea", [
    (lambda r, w, h, k: list(range(r * k // w, (r + 1) * k // w)), "cannot be split"),  # split like query heads
    (lambda r, w, h, k: list(range(k)), "only the KV heads its own query heads read"),  # every KV head everywhere
    (lambda r, w, h, k: [r % k] if k < w else kv_right(r, w, h, k), "consecutive ranks"),  # round robin copies
    (lambda r, w, h, k: list(range(r * h // w, (r + 1) * h // w)), "those are the query heads"),  # num_heads for kv
    (lambda r, w, h, k: list(range(r // max(1, w // k), r // max(1, w // k) + max(1, k // w))),
     "KV heads overlap"),  # the first head not times the heads per rank
    (lambda r, w, k, h: kv_right(r, w, h, k), "yours takes the head counts the other way round"),  # (a layout hint)
    (lambda r, w, h, k: list(range(r // (w // k) * max(1, k // w), r // (w // k) * max(1, k // w) + max(1, k // w))),
     "a count made with // is 0 for this shape"),  # replicas without max(1, ...) (was "the check stopped with")
    (lambda r, w, h, k: [r * k // w], "a rank holds 2 of them"),  # one head each, wherever a rank holds several
])
def test_kv_mistakes(run, capsys, wrong, idea):
    ok, out = check(run, capsys, kv=wrong)
    assert not ok and idea in out


def ring(N):
    return 2 * (N - 1) / N


@pytest.mark.parametrize("wrong, idea", [
    (lambda L, T, h, b, N: 2 * L * T * h * b, "the size of the all-reduced tensors, not what one rank sends"),
    (lambda L, T, h, b, N: 2 * bytes_right(L, T, h, b, N), "not what it sends and receives"),  # send + receive
    (lambda L, T, h, b, N: 2 * L * 2 * (N - 1) * T * h * b, "not 2 (N - 1) whole tensors"),  # no / N
    (lambda L, T, h, b, N: L * ring(N) * T * h * b, "two row-parallel products"),  # one all-reduce per layer
    (lambda L, T, h, b, N: 2 * L * (N - 1) / N * T * h * b, "reduce-scatter *and* an all-gather"),  # half the ring
    (lambda L, T, h, b, N: 3 * L * ring(N) * T * h * b, "twice, not three times"),
    (lambda L, T, h, b, N: 2 * ring(N) * T * h * b, "multiply by the number of layers"),  # forgets the layers
    (lambda L, T, h, b, N: 2 * L * ring(N) * T * h, "bytes, not elements"),
    (lambda L, T, h, b, N: 2 * L * ring(N) * T * (h / N) * b, "already full width"),  # a rank's slice
    (lambda L, T, h, b, N: 2 * L * ring(N) * h * b, "one row per token"),  # forgets the tokens
    (lambda L, T, h, b, N: 2 * L * (2 * (N - 1) // N) * T * h * b, "rounded down by integer division"),
    (lambda L, T, h, b, N: 2 * L * 2 * T * h * b, "N - 1 chunks, not N"),  # 2 N / N
    (lambda L, T, h, b, N: 2 * L * 2 * (N - 1) / (N + 1) * T * h * b, "not 1/(N + 1)"),
    (lambda L, T, h, b, N: 2 * L * 2 * N / (N - 1) * T * h * b, "factor is upside down"),  # N / (N - 1) for (N - 1) / N
    (lambda L, T, h, b, N: bytes_right(L, T, h, N, b), "swapped"),
    (lambda L, T, h, b, N: 8 * bytes_right(L, T, h, b, N), "bytes, not bits"),
    # Mistakes the check does not know: the hint says what the wrong answers have in common, never the formula.
    (lambda L, T, h, b, N: bytes_right(L, T, h, b, 2), "as if there were always 2 ranks"),
    (lambda L, T, h, b, N: bytes_right(L, T, h, b, 4), "right at world_size 4, wrong at 2, 8"),
    (lambda L, T, h, b, N: 0.75 * bytes_right(L, T, h, b, N), "every answer is 0.75 times"),
    (lambda L, T, h, b, N: bytes_right(L, T + 1, h, b, N), "work one case out by hand"),
])
def test_bytes_mistakes(run, capsys, wrong, idea):
    ok, out = check(run, capsys, nbytes=wrong)
    assert not ok and idea in out
    case = re.search(r"num_layers=(\d+), num_tokens=(\d+), hidden_size=(\d+), dtype_bytes=(\d+), world_size=(\d+)", out)
    assert f"{bytes_right(*map(int, case.groups())):g}" not in out  # the hint never gives the right value
    assert "2 (world_size - 1)" not in out and "twice in every layer" not in out  # ... nor the formula


def test_distinct_mistakes_give_distinct_hints(run, capsys):
    """bierce-like shapes at 2 ranks make several mistakes coincide (4 layers, 4-byte floats, N = 2): the
    check's second shape and 4 and 8 ranks tell them apart."""
    hints = set()
    for wrong in (lambda L, T, h, b, N: 2 * ring(N) * T * h * b,  # forgets layers
                  lambda L, T, h, b, N: 2 * L * ring(N) * T * h,  # elements
                  lambda L, T, h, b, N: 2 * bytes_right(L, T, h, b, N),  # send + receive
                  lambda L, T, h, b, N: 3 * L * ring(N) * T * h * b):  # three all-reduces per layer
        ok, out = check(run, capsys, nbytes=wrong)
        assert not ok
        hints.add(out.split(": ")[-1])
    assert len(hints) == 4


def test_the_check_and_the_simulator_agree(run):
    """The exercise's truth is the simulator's formula: a CostModel step's wire bytes at N ranks."""
    from cbteach.sim import CostModel

    for n in (2, 4, 8):
        step = CostModel("llama-3-8b", "h100", n).step([0] * 3, [5] * 3)
        assert step.comm_bytes == pytest.approx(bytes_right(32, 15, 4096, 2, n))


def test_one_head_as_a_numpy_integer_or_heads_as_a_tensor_pass(run, capsys):
    import numpy as np
    import torch

    def numpy_scalar(rank, world_size, num_heads, num_kv_heads):
        heads = np.array(kv_right(rank, world_size, num_heads, num_kv_heads))
        return heads[0] if len(heads) == 1 else heads  # one head: a NumPy integer (was: "not iterable" from the check)

    for kv in (numpy_scalar, lambda *a: torch.tensor(kv_right(*a))):
        ok, out = check(run, capsys, kv=kv)
        assert ok, out


def test_a_right_formula_with_an_extra_argument_that_has_a_default_passes(run, capsys):
    """The check called it with five arguments but refused any signature of another length (a sixth with a
    default, or a keyword-only one, was "takes 6 arguments")."""
    def sixth(num_layers, num_tokens, hidden_size, dtype_bytes, world_size, per_layer=2):
        return per_layer / 2 * bytes_right(num_layers, num_tokens, hidden_size, dtype_bytes, world_size)

    def keyword_only(num_layers, num_tokens, hidden_size, dtype_bytes, world_size, *, verbose=False):
        return bytes_right(num_layers, num_tokens, hidden_size, dtype_bytes, world_size)

    for fn in (sixth, keyword_only):
        ok, out = check(run, capsys, nbytes=fn)
        assert ok, out


def test_bad_input_is_a_hint_not_a_traceback(run, capsys):
    assert not ex13.check_tp(None, bytes_right, **run)
    assert "pass your two functions" in capsys.readouterr().out
    assert not ex13.check_tp(kv_right, lambda *a: 1 / 0, **run)
    assert "the check stopped with ZeroDivisionError" in capsys.readouterr().out
    assert not ex13.check_tp(kv_right, bytes_right, [], num_layers=2, hidden_size=64)
    capsys.readouterr()
    assert not ex13.check_tp(lambda *a: None, lambda *a: None, **run)  # returning None
    assert "return the list of KV head indices" in capsys.readouterr().out

    def kv_heads_of_rank(rank, world_size, num_heads, num_kv_heads):
        ...  # the student copy's stub

    assert not ex13.check_tp(kv_heads_of_rank, bytes_right, **run)
    assert "not done yet: kv_heads_of_rank is still the stub" in capsys.readouterr().out
    assert not ex13.check_tp(kv_right, lambda *a: "many", **run)
    assert "return a number of bytes" in capsys.readouterr().out
    assert not ex13.check_tp(kv_right, lambda L, T, h, b: 2 * L * T * h * b, **run)  # the old four-argument form
    assert "needs five" in capsys.readouterr().out
