"""Notebook 05b's exercise: the Triton inner loop's check names each typical mistake, accepts a right loop
(and the engine runs on it), and refuses a stub and a loop that calls the course's own.

Each wrong loop is the course's own source with one mistake written in, saved as a module of its own
(Triton reads a kernel's source), so the loops the check meets are real ``@triton.jit`` functions."""
from __future__ import annotations

import importlib.util
import inspect
import sys
import textwrap

import pytest

from conftest import tiny_model

triton_unified = pytest.importorskip("cbteach.attention.triton_unified",
                                     reason='Triton is not installed (pip install "cbteach[kernels]")')
from cbteach.exercises import ex05b  # noqa: E402

SOURCE = textwrap.dedent(inspect.getsource(triton_unified.attend_blocks.fn)).replace("@triton.jit\n", "", 1)
LOAD_BLOCK = "block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=present, other=0)"
SCORE_MASK = "s = tl.where(present[None, :] & (pos[None, :] <= q_pos[:, None]), s, float(\"-inf\"))"
MAX = "m_new = tl.maximum(m, tl.max(s, axis=1))"

# (mistake, [(text in the course's loop, what the mistaken loop has instead)], the hint's words)
MISTAKES = [
    ("no scale", [(") * scale  #", ")  #")], "simplest step"),
    ("sum not rescaled", [("total = total * alpha +", "total = total +")], "rescaled"),
    ("output not rescaled", [("acc = acc * alpha[:, None] +", "acc = acc +")], "rescaled"),
    ("logical block used as physical", [(LOAD_BLOCK, "block = pos // BLOCK_SIZE")], "block table says"),
    ("loads not masked to the length", [(LOAD_BLOCK, "block = tl.load(table_ptr + pos // BLOCK_SIZE)"),
                                        ("kv_mask = present[:, None] &", "kv_mask = (pos >= 0)[:, None] &")],
     "partly filled"),
    ("one block per tile", [(LOAD_BLOCK, "block = tl.load(table_ptr + start // BLOCK_SIZE)"),
                            ("(pos % BLOCK_SIZE) * stride_slot", "offs_n * stride_slot")], "spans several blocks"),
    ("no causal mask", [("(pos[None, :] <= q_pos[:, None])", "(pos[None, :] >= 0)")], "prefill chunk"),
    ("max before masking", [(SCORE_MASK, "SCORE_MASK"), (MAX, SCORE_MASK), ("SCORE_MASK", MAX)], "max must be"),
    ("query head used as KV head", [("kv_head = head // GROUP", "kv_head = head")], "wrong KV head"),
    ("KV head by modulo", [("kv_head = head // GROUP", "kv_head = head % GROUP")], "wrong KV head"),
]


def loop_from_source(tmp_path, name, source):
    """``source`` (a loop named attend_blocks) as the @triton.jit function of a module of its own."""
    path = tmp_path / f"{name}.py"
    path.write_text("import triton\nimport triton.language as tl\n\n\n@triton.jit\n" + source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.attend_blocks


def mistaken(tmp_path, i, edits):
    source = SOURCE
    for old, new in edits:
        assert old in source, f"the course's loop no longer has {old!r}: update this test"
        source = source.replace(old, new)
    return loop_from_source(tmp_path, f"wrong_loop_{i}", source)


@pytest.mark.parametrize("i", range(len(MISTAKES)), ids=[m[0] for m in MISTAKES])
def test_each_typical_mistake_gets_a_hint_that_names_it(tmp_path, capsys, i):
    _, edits, words = MISTAKES[i]
    assert ex05b.check_attend_blocks(mistaken(tmp_path, i, edits)) is False
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out


def test_a_right_loop_passes_and_the_engine_runs_on_it(tmp_path, capsys):
    mine = loop_from_source(tmp_path, "right_loop", SOURCE)
    assert not ex05b.delegates(mine)
    assert ex05b.check_attend_blocks(mine, tiny_model("llama")) is True
    out = capsys.readouterr().out
    assert "the real engine ran on it" in out and "equal to generate's" in out


def test_the_stub_a_delegating_loop_and_a_wrong_argument_are_refused(tmp_path, capsys):
    def my_attend_blocks(q, q_pos, head, table_ptr, num_keys, seq_len, k_pool_ptr, v_pool_ptr, stride_block,
                         stride_slot, stride_head, scale, GROUP, BLOCK_SIZE, TILE_N, HEAD_DIM, BLOCK_D):
        ...  # your code

    assert ex05b.check_attend_blocks(my_attend_blocks) is False
    assert "still the stub" in capsys.readouterr().out
    for delegating in (triton_unified.attend_blocks, loop_from_source(tmp_path, "delegating", (
            "def attend_blocks(q, q_pos, head, table_ptr, num_keys, seq_len, k_pool_ptr, v_pool_ptr, stride_block,\n"
            "                  stride_slot, stride_head, scale, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,\n"
            "                  TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):\n"
            "    return triton_unified.attend_blocks(q, q_pos, head, table_ptr, num_keys, seq_len, k_pool_ptr,\n"
            "        v_pool_ptr, stride_block, stride_slot, stride_head, scale, GROUP, BLOCK_SIZE, TILE_N, HEAD_DIM,\n"
            "        BLOCK_D)\n"))):
        if getattr(delegating, "fn", None) is not None and delegating is not triton_unified.attend_blocks:
            delegating.fn.__globals__["triton_unified"] = triton_unified
        assert ex05b.check_attend_blocks(delegating) is False
        assert "calls the course's own" in capsys.readouterr().out
    assert ex05b.check_attend_blocks(my_attend_blocks(*[None] * 17)) is False
    assert "pass your function itself" in capsys.readouterr().out


def test_without_triton_the_check_says_how_to_install_it(monkeypatch, capsys):
    import cbteach.attention

    monkeypatch.setitem(sys.modules, "cbteach.attention.triton_unified", None)
    monkeypatch.delattr(cbteach.attention, "triton_unified")
    assert ex05b.check_attend_blocks(lambda: None) is False
    assert 'pip install "cbteach[kernels]"' in capsys.readouterr().out


@pytest.mark.parametrize("i", range(len(MISTAKES)), ids=[m[0] for m in MISTAKES])
def test_the_steps_made_four_times_larger_for_a_gpu_still_name_each_mistake(tmp_path, i):
    """Compiled for a GPU, tl.dot wants tiles of 16 or more, so there the steps are four times larger
    (ex05b.scaled); here, in the interpreter, the larger steps must catch the same mistakes."""
    _, edits, words = MISTAKES[i]
    with pytest.raises(ex05b.Fail, match=words):
        ex05b.run_steps(mistaken(tmp_path, 100 + i, edits), scale=4)
    if i == 0:
        assert ex05b.run_steps(loop_from_source(tmp_path, "right_loop_x4", SOURCE), scale=4) == len(ex05b.STEPS)
