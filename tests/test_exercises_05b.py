"""Notebook 05b's exercise: the Triton inner loop's check names each typical mistake, accepts a right loop
(and the engine runs on it), and refuses a stub and a loop that is or calls the course's own.

The loops here are written as a learner writes them from the notebook's prose -- not the course's own
loop with a mistake written in: :data:`LEARNERS_LOOP` is one learner's right answer, and each wrong loop
is that learner's answer with one typical mistake. Each is saved as a module of its own (Triton reads a
kernel's source), so the loops the check meets are real ``@triton.jit`` functions, run by the
interpreter (TRITON_INTERPRET=1) on the CPU."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from conftest import tiny_model

triton_unified = pytest.importorskip("cbteach.attention.triton_unified",
                                     reason='Triton is not installed (pip install "cbteach[kernels]")')
from cbteach.exercises import ex05b, ex05b_mistakes  # noqa: E402

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "05b_paged_attention_kernel.ipynb"

LEARNERS_LOOP = '''\
def attend_blocks(q, q_pos, head, table_ptr, num_keys, seq_len, k_pool_ptr, v_pool_ptr, stride_block,
                  stride_slot, stride_head, scale, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    keys = tl.arange(0, TILE_N)
    g = head // GROUP
    run_max = tl.zeros([q.shape[0]], dtype=tl.float32) - float("inf")
    run_sum = tl.zeros([q.shape[0]], dtype=tl.float32)
    out = tl.zeros(q.shape, dtype=tl.float32)
    for t in range(0, num_keys, TILE_N):
        p_k = t + keys
        in_seq = p_k < seq_len
        logical = p_k // BLOCK_SIZE
        physical = tl.load(table_ptr + logical, mask=in_seq, other=0)
        offset = p_k % BLOCK_SIZE
        base = physical * stride_block + offset * stride_slot + g * stride_head
        both = in_seq[:, None] & (cols < HEAD_DIM)[None, :]
        kt = tl.load(k_pool_ptr + base[:, None] + cols[None, :], mask=both, other=0.0)
        vt = tl.load(v_pool_ptr + base[:, None] + cols[None, :], mask=both, other=0.0)
        scores = tl.dot(q, tl.trans(kt), input_precision="ieee") * scale
        visible = in_seq[None, :] & (p_k[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(scores, axis=1))
        shrink = tl.exp(run_max - new_max)
        w = tl.exp(scores - new_max[:, None])
        run_sum = run_sum * shrink + tl.sum(w, axis=1)
        out = out * shrink[:, None] + tl.dot(w, vt, input_precision="ieee")
        run_max = new_max
    return out, run_sum
'''
MASKED = "scores = tl.where(visible, scores, float(\"-inf\"))"
NEW_MAX = "new_max = tl.maximum(run_max, tl.max(scores, axis=1))"

# (mistake, [(text in the learner's loop, what the mistaken loop has instead)], words its hint must have)
MISTAKES = [
    ("block and slot swapped", [("table_ptr + logical,", "table_ptr + p_k % BLOCK_SIZE,"),
                                ("offset = p_k % BLOCK_SIZE", "offset = p_k // BLOCK_SIZE")], "block and slot are swapped"),
    ("block index one too far", [("logical = p_k // BLOCK_SIZE", "logical = p_k // BLOCK_SIZE + 1")], "one too far"),
    ("slot not times its stride", [("offset * stride_slot", "offset")], "stride_slot elements further"),
    ("block not times its stride", [("physical * stride_block", "physical")], "stride_block elements further"),
    ("KV head not times its stride", [("g * stride_head", "g")], "stride_head elements further"),
    ("logical block used as physical", [("physical = tl.load(table_ptr + logical, mask=in_seq, other=0)",
                                         "physical = logical")], "block table says"),
    ("one block per tile", [("physical = tl.load(table_ptr + logical, mask=in_seq, other=0)",
                             "physical = tl.load(table_ptr + t // BLOCK_SIZE)"), ("offset = p_k % BLOCK_SIZE",
                                                                                  "offset = keys")],
     "spans several blocks"),
    ("no scale", [(") * scale", ")")], "not multiplied by scale"),
    ("scale applied twice", [("tl.dot(q, tl.trans(kt)", "tl.dot(q * scale, tl.trans(kt)")], "multiplied by scale twice"),
    ("loads not masked", [("table_ptr + logical, mask=in_seq, other=0)", "table_ptr + logical)"), ("both = in_seq[:, None] &", "both = (p_k >= 0)[:, None] &")],
     "mask the loads"),
    ("masked with 0 instead of -inf", [(MASKED, "scores = tl.where(visible, scores, 0.0)")], "set to 0, not -inf"),
    ("no causal mask", [("visible = in_seq[None, :] & (p_k[None, :] <= q_pos[:, None])", "visible = in_seq[None, :]")],
     "prefill chunk"),
    ("strict causal mask", [("p_k[None, :] <= q_pos", "p_k[None, :] < q_pos")], "itself included"),
    ("max before masking", [(MASKED, "MASKED"), (NEW_MAX, MASKED), ("MASKED", NEW_MAX)], "max must be"),
    ("query head used as KV head", [("g = head // GROUP", "g = head")], "wrong KV head"),
    ("KV head by modulo", [("g = head // GROUP", "g = head % GROUP")], "wrong KV head"),
    ("rescale inverted", [("shrink = tl.exp(run_max - new_max)", "shrink = tl.exp(new_max - run_max)")],
     "your rescale factor grows"),
    ("p against the old max", [("w = tl.exp(scores - new_max[:, None])", "w = tl.exp(scores - run_max[:, None])")],
     "p subtracts the old max"),
    ("running max never stored", [("        run_max = new_max\n", "")], "never updated"),
    ("slot from the place in the tile", [("offset = p_k % BLOCK_SIZE", "offset = keys % BLOCK_SIZE")],
     "its place in the tile"),
    ("acc rescaled without [:, None]", [("out = out * shrink[:, None] +", "out = out * shrink +")], "x[:, None]"),
    ("sum not rescaled", [("run_sum = run_sum * shrink +", "run_sum = run_sum +")], "the running sum kept"),
    ("output not rescaled", [("out = out * shrink[:, None] +", "out = out +")], "the output so far kept"),
    ("softmax without the running max", [("w = tl.exp(scores - new_max[:, None])", "w = tl.exp(scores)"),
                                         ("run_sum = run_sum * shrink +", "run_sum = run_sum +"),
                                         ("out = out * shrink[:, None] +", "out = out +")], "overflows float32"),
    ("running max starting at 0", [('run_max = tl.zeros([q.shape[0]], dtype=tl.float32) - float("inf")',
                                   "run_max = tl.zeros([q.shape[0]], dtype=tl.float32)")], "running max starts at 0"),
    ("divided in the loop", [("return out, run_sum", "return out / run_sum[:, None], run_sum")],
     "divided by the sum itself"),
    ("float16 products", [("tl.dot(w, vt, input_precision=\"ieee\")", "tl.dot(w.to(tl.float16), vt.to(tl.float16))")],
     "not within float32's rounding"),
    ("float16 accumulator", [("out = out * shrink[:, None] + tl.dot(w, vt, input_precision=\"ieee\")",
                              "out = (out * shrink[:, None] + tl.dot(w, vt, input_precision=\"ieee\")).to(tl.float16)")],
     "not within float32's rounding"),
    ("scale divided instead of multiplied", [(") * scale", ") / scale")], "divided by scale"),
    ("KV head times the group", [("g = head // GROUP", "g = head * GROUP")], "reads KV head h // GROUP"),
    ("one key past the length", [("in_seq = p_k < seq_len", "in_seq = p_k <= seq_len")], "seq_len itself is past"),
    ("head's columns not masked", [("both = in_seq[:, None] & (cols < HEAD_DIM)[None, :]", "both = in_seq[:, None]")],
     "mask the columns past HEAD_DIM"),
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
    source = LEARNERS_LOOP
    for old, new in edits:
        assert old in source, f"the learner's loop no longer has {old!r}: update this test"
        source = source.replace(old, new)
    return loop_from_source(tmp_path, f"wrong_loop_{i}", source)


@pytest.mark.parametrize("i", range(len(MISTAKES)), ids=[m[0] for m in MISTAKES])
def test_each_typical_mistake_gets_a_hint_that_names_it(tmp_path, capsys, i):
    _, edits, words = MISTAKES[i]
    assert ex05b.check_attend_blocks(mistaken(tmp_path, i, edits)) is False
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out


@pytest.mark.parametrize("edit,words", [
    (("return out, run_sum", "return run_sum, out"), "the two swapped"),
    (("tl.sum(w, axis=1)", "tl.sum(w, axis=0)"), "wrong axis"),
    (("tl.dot(q, tl.trans(kt)", "tl.dot(q, (kt)"), "the keys transposed"),
], ids=["returns swapped", "sum over the wrong axis", "keys not transposed"])
def test_a_loop_the_interpreter_stops_gets_a_hint_that_names_the_mistake(tmp_path, capsys, edit, words):
    assert ex05b.check_attend_blocks(mistaken(tmp_path, 300 + len(words), [edit])) is False
    out = capsys.readouterr().out
    assert "your loop stopped with" in out and words in out, out


def test_every_simulated_mistake_has_a_wrong_loop_here():
    """Each mistake the check can name is met by one of the loops above (and says which idea it missed)."""
    named = {hint for hint in ex05b_mistakes.MISTAKES.values()}
    met = {hint for _, _, words in MISTAKES for hint in named if words in hint}
    assert met == named, sorted(named - met)


def test_the_learners_loop_and_the_notebooks_solution_pass_and_the_engine_runs_on_them(tmp_path, capsys):
    mine = loop_from_source(tmp_path, "right_loop", LEARNERS_LOOP)
    assert not ex05b.delegates(mine)
    assert ex05b.check_attend_blocks(mine, tiny_model("llama")) is True
    out = capsys.readouterr().out
    assert "the real engine ran on it" in out and "equal to generate's" in out
    cell = next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                if "solution" in c["metadata"].get("tags", []))
    solution = loop_from_source(tmp_path, "solution_loop", cell.split("@triton.jit\n", 1)[1].replace(
        "def my_attend_blocks", "def attend_blocks"))
    assert ex05b.check_attend_blocks(solution) is True, capsys.readouterr().out


def test_the_student_stub_is_decorated_and_called_not_done(tmp_path, capsys):
    from cbteach.student import stub

    cell = next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                if "solution" in c["metadata"].get("tags", []))
    source = stub(cell)
    assert "@triton.jit\ndef my_attend_blocks(" in source, source
    path = tmp_path / "student_stub.py"
    path.write_text("from cbteach.attention.triton_mode import tl, triton\n" + source)
    spec = importlib.util.spec_from_file_location("student_stub", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert ex05b.check_attend_blocks(module.my_attend_blocks) is False
    assert "still the stub" in capsys.readouterr().out


def test_the_stub_a_delegating_loop_and_a_wrong_argument_are_refused(tmp_path, capsys):
    def my_attend_blocks(q, q_pos, head, table_ptr, num_keys, seq_len, k_pool_ptr, v_pool_ptr, stride_block,
                         stride_slot, stride_head, scale, GROUP, BLOCK_SIZE, TILE_N, HEAD_DIM, BLOCK_D):
        ...  # your code

    assert ex05b.check_attend_blocks(my_attend_blocks) is False
    out = capsys.readouterr().out  # the stub is already @triton.jit: the hint asks for its loop, not a decorator
    assert "still the stub" in out and "write its loop" in out and "decorate" not in out, out
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


@pytest.mark.parametrize("i", [0, 1, 2, 7, 9, 10, 12, 16, 19, 29, 30, 31], ids=[MISTAKES[i][0] for i in [0, 1, 2, 7, 9, 10, 12, 16, 19, 29, 30, 31]])
def test_the_steps_made_four_times_larger_for_a_gpu_still_name_each_mistake(tmp_path, i):
    """Compiled for a GPU, tl.dot wants tiles of 16 or more, so there the steps are four times larger
    (ex05b.scaled); here, in the interpreter, the larger steps must catch and name the same mistakes."""
    _, edits, words = MISTAKES[i]
    with pytest.raises(ex05b.Fail, match=words):
        ex05b.run_steps(mistaken(tmp_path, 100 + i, edits), scale=4)
    if i == 0:
        assert ex05b.run_steps(loop_from_source(tmp_path, "right_loop_x4", LEARNERS_LOOP), scale=4) == len(ex05b.STEPS)


def test_a_softmax_without_the_max_passes_every_step_but_the_one_that_overflows(tmp_path):
    """Without the running max the sums are right as long as exp does not overflow (or underflow): one step's
    scores are extreme enough that it does, and that step is the one that fails -- as it is for a running max that
    starts at 0, which only a query whose scores all lie far below zero tells from a right loop."""
    name, edits, _ = next(m for m in MISTAKES if m[0] == "softmax without the running max")
    with pytest.raises(ex05b.Fail, match=r"step \d+ of \d+ \(two decodes over three blocks, one scoring in the hundreds"):
        ex05b.run_steps(mistaken(tmp_path, 200, edits))
    name, edits, _ = next(m for m in MISTAKES if m[0] == "running max starting at 0")
    with pytest.raises(ex05b.Fail, match=r"step \d+ of \d+ \(two decodes over three blocks, one scoring in the hundreds"):
        ex05b.run_steps(mistaken(tmp_path, 201, edits))
