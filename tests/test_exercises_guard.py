"""No route around a check runs the course's code: notebooks 05, 05b, 06, 12 and 13 refuse every way a piece
can hand its work to the engine's or the course's own, each way written as a learner would write it.

The routes: a helper thread; tracing and profiling switched off first; frames walked up to the check's
own globals; ``importlib`` inside the piece; a closure; a copied code object; ``exec`` of the course's
source; a notebook's solution cell read from disk; a reformatted, renamed copy of a course solution;
the course's Triton kernel as "your attention"; torch's SDPA where attention is the exercise. Each
refusal says whose code it is. And the honest answers still pass, the check leaves nothing armed,
and the check's own calls of the engine (from threads with no learner code) are not refused.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cbteach.attention import paged
from cbteach.engine import scheduler as scheduler_module
from cbteach.engine.scheduler import Scheduler
from cbteach.exercises import capstone, delegation, ex05, ex05_attention, ex05_mistakes, ex06, ex13, tripwires, where
from cbteach.kv.manager import KVCacheManager
from cbteach.sim import cost
from conftest import tiny_model

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
# a refused call on a helper thread ends that thread with the refusal: what the check reports is what counts
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def solution(number: str, defines: str) -> str:
    """The course's solution cell of notebook ``number`` that defines ``defines``."""
    path = next(NOTEBOOKS.glob(f"{number}_*.ipynb"))
    return next("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                if "solution" in c["metadata"].get("tags", []) and f" {defines}(" in "".join(c["source"]))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.fixture(autouse=True)
def nothing_left_armed():
    """Every check closes what it opened: no window, the engine's code its own, no profile hook left."""
    own = paged.reference_attention.__code__
    yield
    assert not tripwires._windows and not tripwires._armed and tripwires._sdpa["windows"] == 0
    assert paged.reference_attention.__code__ is own and sys.getprofile() is None and threading.getprofile() is None


def slot_mapping(block_tables, num_computed_tokens, num_scheduled_tokens, block_size):
    out = []
    for table, c, n in zip(block_tables, num_computed_tokens, num_scheduled_tokens):
        out += [table[p // block_size] * block_size + p % block_size for p in range(c, c + n)]
    return out


def refused(check, *args, words: str, capsys) -> str:
    assert check(*args) is False
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out and "yourself" in out, out
    return out


# == notebook 05: the attention, the slot mapping, the KV manager ==============================================

def _write(q, k, v, meta, layer):
    meta.pool.write(layer, meta.slot_mapping, k[0].transpose(0, 1), v[0].transpose(0, 1))


def from_a_thread(q, k, v, meta, layer, scaling):
    _write(q, k, v, meta, layer)
    out = []
    helper = threading.Thread(target=lambda: out.append(paged.reference_attention(q, layer, meta, scaling)))
    helper.start()
    helper.join()
    return out[0] if out else torch.zeros_like(q)


def tracing_off(q, k, v, meta, layer, scaling):
    sys.settrace(None)
    sys.setprofile(None)
    return paged.default_attention(q, k, v, meta, layer, scaling)


def through_frames(q, k, v, meta, layer, scaling):
    frame = sys._getframe()
    while frame is not None and "attend" not in frame.f_globals:  # up to the check's own module
        frame = frame.f_back
    return frame.f_globals["attend"](q, k, v, meta, layer, scaling)


def through_importlib(q, k, v, meta, layer, scaling):
    return importlib.import_module("cbteach.attention.paged").default_attention(q, k, v, meta, layer, scaling)


def _closure(inner):
    def my_attention(q, k, v, meta, layer, scaling):
        _write(q, k, v, meta, layer)
        return inner(q, layer, meta, scaling)
    return my_attention


def _exec_copy(function, renames=()):
    """``function``'s source, its names changed and a comment added, executed: a copy under the learner's name."""
    source = "# my own\n" + textwrap.dedent(inspect.getsource(function))
    for old, new in renames:
        source = source.replace(old, new)
    namespace = dict(vars(sys.modules[function.__module__]))
    exec(source, namespace)  # noqa: S102
    return namespace[function.__name__]


STOLEN_CODE = types.FunctionType(paged.reference_attention.__code__, vars(paged), "mine")


def keeps_a_copied_code_object(q, k, v, meta, layer, scaling):
    _write(q, k, v, meta, layer)
    return STOLEN_CODE(q, layer, meta, scaling)


def copies_a_code_object_inside(q, k, v, meta, layer, scaling):
    _write(q, k, v, meta, layer)
    return types.FunctionType(paged.reference_attention.__code__, vars(paged))(q, layer, meta, scaling)


def execs_the_courses_source(q, k, v, meta, layer, scaling):
    namespace = {}
    exec(inspect.getsource(ex05_mistakes), namespace)  # noqa: S102
    return namespace["attend"](q, k, v, meta, layer, scaling)


def reads_the_solution_cell(q, k, v, meta, layer, scaling):
    path = next((Path(capstone.__file__).parents[2] / "notebooks").glob("05_*.ipynb"))
    cell = next("".join(c["source"]) for c in json.loads(path.read_text())["cells"]
                if "def my_attention" in "".join(c["source"]))
    namespace = {"torch": torch, "F": F}
    exec(cell, namespace)  # noqa: S102
    return namespace["my_attention"](q, k, v, meta, layer, scaling)


def _renamed_solution():
    namespace = {"torch": torch, "F": F}
    cell = solution("05", "my_attention").replace("my_attention", "helper").replace("group", "g").replace(
        "# ", "# (mine) ")
    exec("# a reformatted copy\n" + cell.replace(", dim=0)", ",\n            dim=0)"), namespace)  # noqa: S102
    return namespace["helper"]


RENAMED_SOLUTION = _renamed_solution()


def calls_a_renamed_solution(q, k, v, meta, layer, scaling):
    return RENAMED_SOLUTION(q, k, v, meta, layer, scaling)


ATTENTION_ROUTES = [
    ("a helper thread", from_a_thread, "called the engine's reference_attention"),
    ("tracing and profiling off", tracing_off, "called the engine's default_attention"),
    ("frames walked up to the check's globals", through_frames, "called the course's own answer attend"),
    ("importlib inside the piece", through_importlib, "called the engine's default_attention"),
    ("a closure over the engine's", _closure(paged.vectorised_attention), "called the engine's vectorised_attention"),
    ("a closure over a copy", _closure(_exec_copy(paged.reference_attention, [("slots", "where")])),
     "keeps a copy of the engine's reference_attention (in its closure)"),
    ("a copied code object kept", keeps_a_copied_code_object, "keeps a copy of the engine's reference_attention"),
    ("a code object copied inside", copies_a_code_object_inside, "made a copy of the engine's reference_attention"),
    ("exec of the course's source", execs_the_courses_source, "made a copy of the course's own answer attend"),
    ("the solution cell read from disk", reads_the_solution_cell,
     "made a copy of the course's solution my_attention (notebook 05's solution cell)"),
    ("a reformatted, renamed copy of the solution", calls_a_renamed_solution,
     "keeps a copy of the course's solution my_attention (notebook 05's solution cell)"),
]


@pytest.mark.parametrize("route", ATTENTION_ROUTES, ids=[r[0] for r in ATTENTION_ROUTES])
def test_05_attention_refuses_every_route_to_the_courses_code(model, capsys, route):
    _, cheat, words = route
    refused(ex05_attention.check_paged_attention, cheat, model, None, None, slot_mapping, words=words, capsys=capsys)


def test_05_the_courses_triton_kernel_is_not_your_attention(model, capsys):
    triton_unified = pytest.importorskip("cbteach.attention.triton_unified")
    refused(ex05_attention.check_paged_attention, triton_unified.kernel_attention(), model, None, None, slot_mapping,
            words="is the engine's kernel_attention (the Triton kernel)", capsys=capsys)

    def launches_the_kernel(q, k, v, meta, layer, scaling):
        _write(q, k, v, meta, layer)
        return triton_unified.unified_attention(q, meta.pool.k[layer], meta.pool.v[layer], meta, scaling)
    refused(ex05_attention.check_paged_attention, launches_the_kernel, model, None, None, slot_mapping,
            words="called the engine's unified_attention", capsys=capsys)


def test_05_the_solution_and_an_own_attention_still_pass(model, capsys):
    namespace = {"torch": torch, "F": F}
    exec(solution("05", "my_attention"), namespace)  # noqa: S102
    assert ex05_attention.check_paged_attention(namespace["my_attention"], model, slot_mapping=slot_mapping)
    assert capsys.readouterr().out.startswith("✓")


def test_05_slot_mapping_from_a_thread_or_with_tracing_off_is_refused(model, capsys):
    def threaded(*args):
        out = []
        helper = threading.Thread(target=lambda: out.append(ex05_mistakes.slots(*args)))
        helper.start()
        helper.join()
        return out[0] if out else []

    def untraced(*args):
        sys.setprofile(None)
        return ex05_mistakes.slots(*args)
    for cheat in (threaded, untraced):
        refused(ex05_attention.check_slot_mapping, cheat, model, words="called the course's own answer slots",
                capsys=capsys)


class ThreadedManager:
    """A KV manager with a free list to show, whose allocate_slots runs the engine's manager on a helper thread."""

    def __init__(self, num_blocks, block_size):
        self.inner = KVCacheManager(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))

    def allocate_slots(self, seq, n):
        out = []
        helper = threading.Thread(target=lambda: out.append(self.inner.allocate_slots(seq, n)))
        helper.start()
        helper.join()
        return out[0] if out else None

    def free(self, seq):
        seq.block_table = []


def test_05_kv_manager_delegating_from_a_thread_is_refused(model, capsys):
    refused(ex05.check_kv_manager, ThreadedManager, model, words="called the engine's KVCacheManager.allocate_slots",
            capsys=capsys)


# == notebook 05b: the kernel loop ==============================================================================

CHEATING_LOOPS = {  # what the loop's helper does, in plain Python the interpreter runs; the words of the refusal
    "frames": ("    frame = sys._getframe()\n"
               "    while 'reference_attention' not in frame.f_globals or 'meta' not in frame.f_locals:\n"
               "        frame = frame.f_back\n"
               "    got = frame.f_globals['reference_attention'](frame.f_locals['query'], 0, frame.f_locals['meta'])\n",
               "called the engine's reference_attention"),
    "thread": ("    frame = sys._getframe()\n"
               "    while 'meta' not in frame.f_locals:\n"
               "        frame = frame.f_back\n"
               "    helper = threading.Thread(target=paged.reference_attention, args=(frame.f_locals['query'], 0,\n"
               "                                                                       frame.f_locals['meta']))\n"
               "    helper.start()\n"
               "    helper.join()\n", "called the engine's reference_attention"),
    "importlib": ("    sys.settrace(None)\n"
                  "    importlib.import_module('cbteach.attention.paged').vectorised_attention(None, 0, None)\n",
                  "called the engine's vectorised_attention"),
    "sdpa": ("    x = torch.ones(1, 1, 2, 4)\n"
             "    torch.nn.functional.scaled_dot_product_attention(x, x, x)\n",
             "called torch's scaled_dot_product_attention"),
    "solution cell": ("    path = next((pathlib.Path(cbteach.__file__).parents[1] / 'notebooks').glob('05b_*.ipynb'))\n"
                      "    cell = next(''.join(c['source']) for c in json.loads(path.read_text())['cells']\n"
                      "                if 'def my_attend_blocks' in ''.join(c['source']))\n"
                      "    exec(cell.replace('@triton.jit', ''), {'tl': tl, 'triton': triton})\n",
                      "made a copy of the course's solution my_attend_blocks (notebook 05b's solution cell)"),
    "course source": ("    exec(inspect.getsource(importlib.import_module('cbteach.attention.triton_unified')), {})\n",
                      "made a copy of the engine's attend_blocks"),
    "code object": ("    from cbteach.attention import triton_unified\n"
                    "    types.FunctionType(triton_unified.attend_blocks.fn.__code__, {})\n",
                    "made a copy of the engine's attend_blocks"),
}


def cheating_loop(tmp_path, name: str, helper: str):
    """A module whose @triton.jit loop first runs ``helper`` (plain Python: the interpreter runs it)."""
    path = tmp_path / f"cheat_{name.replace(' ', '_')}.py"
    path.write_text(
        "import importlib, inspect, json, pathlib, sys, threading, types\nimport torch\nimport triton\n"
        "import triton.language as tl\nimport cbteach\nfrom cbteach.attention import paged\n\n\n"
        f"def helper():\n{helper}\n\n"
        "@triton.jit\n"
        "def attend_blocks(q, q_pos, head, table_ptr, num_keys, seq_len, k_pool_ptr, v_pool_ptr, stride_block,\n"
        "                  stride_slot, stride_head, scale, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,\n"
        "                  TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):\n"
        "    helper()\n"
        "    return tl.zeros(q.shape, tl.float32), tl.full([q.shape[0]], 1.0, tl.float32)\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module.attend_blocks


@pytest.mark.parametrize("name", sorted(CHEATING_LOOPS))
def test_05b_a_loop_that_reaches_for_the_courses_code_is_refused(tmp_path, capsys, name):
    pytest.importorskip("cbteach.attention.triton_unified")
    from cbteach.exercises import ex05b

    helper, words = CHEATING_LOOPS[name]
    refused(ex05b.check_attend_blocks, cheating_loop(tmp_path, name, helper), words=words, capsys=capsys)
    x = torch.ones(1, 1, 2, 4)
    assert torch.equal(F.scaled_dot_product_attention(x, x, x), x)  # torch's own kernel is back


# == notebook 06: the scheduler =================================================================================

class FromAThread(Scheduler):
    def schedule(self, now):
        out = []
        helper = threading.Thread(target=lambda: out.append(Scheduler.schedule(self, now)))
        helper.start()
        helper.join()
        return out[0]


class TracingOff(Scheduler):
    def schedule(self, now):
        sys.settrace(None)
        sys.setprofile(None)
        return super().schedule(now)


def _copied_scheduler():
    namespace = dict(vars(scheduler_module))
    exec("# my scheduler\n" + inspect.getsource(Scheduler), namespace)  # noqa: S102
    return type("MyScheduler", (Scheduler,), {"schedule": namespace["Scheduler"].schedule})


@pytest.mark.parametrize("cheat, words", [
    (FromAThread, "engine's own scheduling (super().schedule)"),
    (TracingOff, "engine's own scheduling (super().schedule)"),
    (_copied_scheduler(), "is, in MyScheduler.schedule, a copy of the engine's Scheduler.schedule"),
], ids=["a helper thread", "tracing and profiling off", "an exec'd copy of the engine's Scheduler"])
def test_06_a_scheduler_that_runs_the_engines_is_refused(model, capsys, cheat, words):
    assert ex06.check_stage(1, cheat, model) is False
    out = capsys.readouterr().out
    assert out.startswith("✗") and words in out, out


# == notebook 12: the assembled engine, and whose cells the pieces are ==========================================

def test_12_a_reformatted_renamed_solution_cell_is_called_the_courses(tmp_path):
    nb = json.loads(next(NOTEBOOKS.glob("05_*.ipynb")).read_text())
    for cell in nb["cells"]:
        if "solution" in cell["metadata"].get("tags", []):
            text = "".join(cell["source"])
            if "def my_attention" in text:  # names changed, a comment, a line broken differently
                text = "# written by me\n" + text.replace("group", "heads_per_kv").replace(
                    "dim=0)", "\n            dim=0)")
            cell["source"] = text
    (tmp_path / "05_paged_kv_cache.ipynb").write_text(json.dumps(nb))
    (tmp_path / "06_scheduling_and_latency.ipynb").write_text(next(NOTEBOOKS.glob("06_*.ipynb")).read_text())
    pieces = capstone.pieces_from_notebooks(tmp_path, say=None)
    assert "attention" in pieces.course and "scheduler" in pieces.course, pieces.course
    mine = solution("05", "my_attention").replace("    out = torch.empty_like(query)\n",
                                                  "    out = torch.empty_like(query)\n    checked = True\n")
    assert where.is_course_cell("# renamed\n" + solution("05", "my_attention").replace("group", "g"), "05")
    assert not where.is_course_cell(mine, "05")  # one statement of its own: the learner's


def test_12_an_assembled_engine_whose_attention_calls_the_engines_from_a_thread_is_refused():
    from test_exercises_12 import SOLUTION, check, my_engine_of, pieces_of

    start = SOLUTION.index("def my_attention")
    end = SOLUTION.find("\n# -- from", start)
    cheat = ("import threading\nfrom cbteach.attention.paged import default_attention\n\n\n"
             "def my_attention(*args):\n    out = []\n"
             "    helper = threading.Thread(target=lambda: out.append(default_attention(*args)))\n"
             "    helper.start()\n    helper.join()\n    return out[0]\n")
    pieces = pieces_of(SOLUTION[:start] + cheat + SOLUTION[end:])
    ok, out = check(my_engine_of(pieces), pieces, tiny_model("llama"))
    assert not ok and "called the engine's default_attention" in out, out


# == notebook 13: the layout and the bytes ======================================================================

LOG = [{"all_reduce_bytes": 2 * 2 * 5 * 64 * 4, "num_tokens": 5}]


def kv_right(rank, world_size, num_heads, num_kv_heads):
    per_rank, copies = max(1, num_kv_heads // world_size), max(1, world_size // num_kv_heads)
    return list(range(rank // copies * per_rank, rank // copies * per_rank + per_rank))


def bytes_right(num_layers, num_tokens, hidden_size, dtype_bytes, world_size):
    return 2 * num_layers * 2 * (world_size - 1) * num_tokens * hidden_size * dtype_bytes / world_size


def kv_from_the_layout(rank, world_size, num_heads, num_kv_heads):
    from cbteach.parallel.shard import Layout

    return list(Layout("llama", world_size, num_heads, num_kv_heads, 8, 8 * num_heads, 16 * world_size, 1).kv_heads(rank))


def bytes_from_a_thread(num_layers, num_tokens, hidden_size, dtype_bytes, world_size):
    sys.setprofile(None)
    out = []
    payload = 2 * num_layers * num_tokens * hidden_size * dtype_bytes
    helper = threading.Thread(target=lambda: out.append(cost.ring_all_reduce_bytes(payload, world_size)))
    helper.start()
    helper.join()
    return out[0] if out else 0


def bytes_from_an_exec_copy(num_layers, num_tokens, hidden_size, dtype_bytes, world_size):
    namespace = {}
    exec(inspect.getsource(cost.ring_all_reduce_bytes), namespace)  # noqa: S102
    return namespace["ring_all_reduce_bytes"](2 * num_layers * num_tokens * hidden_size * dtype_bytes, world_size)


@pytest.mark.parametrize("kv, nbytes, words", [
    (kv_from_the_layout, bytes_right, "called the engine's Layout.kv_heads"),
    (kv_right, bytes_from_a_thread, "called the simulator's ring_all_reduce_bytes"),
    (kv_right, bytes_from_an_exec_copy, "made a copy of the simulator's ring_all_reduce_bytes"),
    (kv_right, cost.ring_all_reduce_bytes, "is the simulator's ring_all_reduce_bytes"),
], ids=["the layout's kv_heads", "the formula from a thread, profiling off", "an exec'd copy of the formula",
        "the formula itself"])
def test_13_the_layout_and_the_simulators_formula_are_refused(capsys, kv, nbytes, words):
    assert ex13.check_tp(kv, nbytes, LOG, num_layers=2, hidden_size=64) is False
    out = capsys.readouterr().out
    assert "✗" in out and words in out, out
    assert ex13.check_tp(kv_right, bytes_right, LOG, num_layers=2, hidden_size=64) is True


# == the window itself ==========================================================================================

def test_the_checks_own_calls_run_in_a_window_that_knows_the_learners_code():
    """With the learner's code known (notebook 12's window), the engine's own call from a frame with no
    learner code -- on this thread or another -- runs, and gives the engine's answer."""
    def learners(*args):
        return paged.reference_attention(*args)
    got = []
    with delegation.Watch(["attention"], {learners.__code__: "attention"}) as seen:
        helper = threading.Thread(target=lambda: got.append(paged.reference_attention.__code__ is not None))
        helper.start()
        helper.join()
        code_inside = paged.reference_attention.__code__
    assert seen.found is None and got == [True]
    assert code_inside is not paged.reference_attention.__code__  # it was tripped, and is itself again
    with delegation.Watch(["attention"], {learners.__code__: "attention"}) as seen:
        with pytest.raises(delegation.Delegated, match="called the engine's reference_attention"):
            learners(None, 0, None)
    assert "reference_attention" in seen.found
