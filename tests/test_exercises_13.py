"""Notebook 13's self-check: the KV heads a rank holds and the bytes a step all-reduces, against a real
two-process run. The solution passes; each typical mistake fails with the hint for its idea, never
with the right value."""
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
        log = list(eng.runner.comm_log)
    finally:
        eng.close()
    return {"comm_log": log, "num_layers": model.config.num_hidden_layers, "hidden_size": model.config.hidden_size}


def kv_right(rank, world_size, num_heads, num_kv_heads):
    per_rank = max(1, num_kv_heads // world_size)
    replicas = max(1, world_size // num_kv_heads)
    first = rank // replicas * per_rank
    return list(range(first, first + per_rank))


def bytes_right(num_layers, num_tokens, hidden_size, dtype_bytes):
    return 2 * num_layers * num_tokens * hidden_size * dtype_bytes


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
])
def test_kv_mistakes(run, capsys, wrong, idea):
    ok, out = check(run, capsys, kv=wrong)
    assert not ok and idea in out


@pytest.mark.parametrize("wrong, idea", [
    (lambda L, T, h, b: L * T * h * b, "two row-parallel products"),  # one all-reduce per layer
    (lambda L, T, h, b: 2 * L * T * h, "bytes, not elements"),
    (lambda L, T, h, b: 2 * 2 * L * T * h * b, "one rank sends in"),  # times the world size
    (lambda L, T, h, b: 2 * L * T * (h // 2) * b, "already full width"),  # a rank's slice
    (lambda L, T, h, b: 2 * L * h * b, "one row per token"),  # forgets the tokens
])
def test_bytes_mistakes(run, capsys, wrong, idea):
    ok, out = check(run, capsys, nbytes=wrong)
    assert not ok and idea in out
    assert str(bytes_right(run["num_layers"], run["comm_log"][0]["num_tokens"], run["hidden_size"], 4)) not in out


def test_bad_input_is_a_hint_not_a_traceback(run, capsys):
    assert not ex13.check_tp(None, bytes_right, **run)
    assert "pass your two functions" in capsys.readouterr().out
    assert not ex13.check_tp(kv_right, lambda *a: 1 / 0, **run)
    assert "the check stopped with ZeroDivisionError" in capsys.readouterr().out
    assert not ex13.check_tp(kv_right, bytes_right, [], num_layers=2, hidden_size=64)
    capsys.readouterr()
    assert not ex13.check_tp(lambda *a: None, lambda *a: None, **run)  # the student copy's stubs
    assert "return the list of KV head indices" in capsys.readouterr().out
    assert not ex13.check_tp(kv_right, lambda *a: 3.5, **run)
    assert "a whole number of bytes" in capsys.readouterr().out
