"""Notebook 12, your engine: the learner's pieces -- read from notebooks 05, 06 and 06b as the notebook reads
them -- plugged into one engine equal the engine's own pieces token for token and step for step on
the course workload (and per-prompt ``generate``); the check names a missing or broken piece; the
student copy's stubs say "not done yet"; ``serve`` refuses a piece that fails its check before it
starts, and serves OpenAI clients exactly with the solution pieces."""
import asyncio
import contextlib
import io
import json
import linecache
import os
import sys
from pathlib import Path

import pytest

from cbteach import Engine
from cbteach.exercises import capstone, ex12, tournament
from cbteach.student import write_course
from conftest import tiny_model

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"


def solution_source() -> str:
    """The pieces module the course copy gives: every solution cell of notebooks 05, 06 and 06b."""
    source, _ = capstone.pieces_source(NOTEBOOKS)
    return source


def pieces_of(source: str) -> capstone.Pieces:
    namespace, filename = {"__name__": "my_engine"}, f"<my_engine {len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # as a notebook keeps a cell
    exec(compile(source, filename, "exec"), namespace)
    objects = {p: namespace.get(names[0]) for p, (_, names, _, _) in capstone.PIECES.items()}
    objects["scheduler"] = namespace[capstone.ENGINE_CLASS]
    return capstone.Pieces(objects, source)


SOLUTION = solution_source()


def my_engine_of(pieces, drop=None):
    def my_engine(model, tok, **options):
        kwargs = {k: v for k, v in pieces.engine_kwargs().items() if k != drop}
        return Engine(model, tok, kv="paged", **kwargs, **options)
    return my_engine


def check(my_engine, pieces, model, tok=None):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = ex12.check_my_engine(my_engine, pieces, model, tok)
    return ok, out.getvalue()


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


@pytest.mark.parametrize("which", ["bierce", "llama", "qwen2"])
def test_the_solution_pieces_equal_the_engines_own_token_for_token_and_step_for_step(which, bierce):
    model, tok = bierce if which == "bierce" else (tiny_model(which), None)
    pieces = pieces_of(SOLUTION)
    got = ex12.compare(my_engine_of(pieces), pieces, model, tok)
    assert got["plugged"] is None and "error" not in got, got
    assert got["diverges_at"] is None and got["tokens"] and got["generate"] and got["blocks"], got
    assert got["preemptions"] > 0 and got["chunks"] > 0, got  # the workload exercises every piece


def test_the_check_passes_the_assembled_solution(bierce):
    pieces = pieces_of(SOLUTION)
    ok, out = check(my_engine_of(pieces), pieces, *bierce)
    assert ok and out.startswith("✓") and "step for step" in out, out


BROKEN = {  # a piece broken the way learners break it -> the words that must name it
    "kv_manager": ("        self.free_blocks.extend(seq.block_table)\n", "", "kv manager (notebook 05)"),
    "scheduler": ("n = min(seq.num_tokens - num_cached_tokens, budget)", "n = seq.num_tokens - num_cached_tokens",
                  "scheduler (notebook 06)"),
    "update": ("                self.kv_manager.free(seq)\n                finished.append(seq)",
               "                finished.append(seq)", "scheduler (notebook 06)"),
    "update_batch": ("    batch.condense()\n", "", "update batch (notebook 06b) fails its own check: on the workload"),
    # wrong only where the course workload never goes (no late arrival): served exactly, and passed once
    "scheduler_early": ("for seq in [s for s in self.waiting if s.arrival_time <= now]:", "for seq in list(self.waiting):",
                        "served the course workload exactly, but your scheduler (notebook 06) fails its own check"),
}


@pytest.mark.parametrize("piece", sorted(BROKEN))
def test_a_broken_piece_is_named_by_its_own_check(piece, llama):
    old, new, words = BROKEN[piece]
    assert old in SOLUTION, old
    broken = pieces_of(SOLUTION.replace(old, new, 1))
    ok, out = check(my_engine_of(broken), broken, llama)
    assert not ok and out.startswith("✗") and words in out, out


@pytest.mark.parametrize("drop, words", [("attention", "your attention"), ("slot_mapping", "your slot mapping"),
                                         ("kv_manager", "your KV manager"), ("scheduler_cls", "your scheduler"),
                                         ("update_batch", "your update_batch")])
def test_a_piece_left_out_of_the_engine_is_named(drop, words, llama):
    pieces = pieces_of(SOLUTION)
    ok, out = check(my_engine_of(pieces, drop=drop), pieces, llama)
    assert not ok and words in out, out


def test_assembly_slips_get_a_hint_that_names_the_slip(llama):
    """Two slips learners make putting the engine together: an instance of the KV manager where the class
    goes (built for another pool), and options not passed on to Engine."""
    pieces = pieces_of(SOLUTION)
    kw = pieces.engine_kwargs()

    def instance(model, tok, **options):
        return Engine(model, tok, kv="paged", **{**kw, "kv_manager": kw["kv_manager"](64, 4)}, **options)

    def no_options(model, tok, **options):
        return Engine(model, tok, kv="paged", **kw)

    ok, out = check(instance, pieces, llama)
    assert not ok and "pass the class itself" in out and "64 free blocks" in out, out
    ok, out = check(no_options, pieces, llama)
    assert not ok and "pass them on" in out and "**options" in out, out

    def twice(model, tok, **options):  # an option written in, and passed on in options too
        return Engine(model, tok, kv="paged", **kw, max_batch_size=4, **options)

    def scheduler_instance(model, tok, **options):
        return Engine(model, tok, kv="paged", **{**kw, "scheduler_cls": kw["scheduler_cls"]()}, **options)

    def swapped(model, tok, **options):
        return Engine(model, tok, kv="paged", **{**kw, "attention": kw["slot_mapping"], "slot_mapping": kw["attention"]},
                      **options)

    def options_written_in(model, tok, **options):  # the check's numbers, but not its clock
        return Engine(model, tok, kv="paged", **kw, **{k: v for k, v in options.items() if k != "clock"})

    def wrapped(model, tok, **options):  # the learner's attention, wrapped: it did pass attention=
        import functools
        return Engine(model, tok, kv="paged", **{**kw, "attention": functools.partial(kw["attention"])}, **options)

    for slip, words in ((twice, "leave it to the options"), (scheduler_instance, "takes the class itself"),
                        (swapped, "are swapped"), (options_written_in, "did not take the options"),
                        (wrapped, "attention= got another function than the piece capstone gives you")):
        ok, out = check(slip, pieces, llama)
        assert not ok and words in out, (slip.__name__, out)


def test_what_my_engine_prints_is_shown_as_printed_before_the_verdict(llama):
    """The check took the first two characters of whatever was printed for the verdict's mark: a learner's own
    print lost them and got a ✓ in front."""
    pieces = pieces_of(SOLUTION)
    engine = my_engine_of(pieces)

    def chatty(model, tok, **options):
        print("building my engine with", sorted(options))
        return engine(model, tok, **options)

    ok, out = check(chatty, pieces, llama)
    assert ok and out.startswith("building my engine with ['block_size'"), out
    assert out.count("✓") == 1 and out.splitlines()[-1].startswith("✓ ") and len(out.splitlines()) == 2, out


def test_an_engine_built_without_the_tokenizer_is_named(bierce):
    """Tokens alone cannot tell: an engine given ``None`` for the tokenizer generates the same ids."""
    model, tok = bierce
    pieces = pieces_of(SOLUTION)

    def no_tokenizer(model, tok, **options):
        return Engine(model, None, kv="paged", **pieces.engine_kwargs(), **options)

    ok, out = check(no_tokenizer, pieces, model, tok)
    assert not ok and "without the tokenizer" in out and "Engine(model, tok" in out, out


@pytest.mark.parametrize("answer, words", [(None, "not done yet"), (..., "not done yet"), (lambda m, t, **o: 3, "Engine"),
                                           (lambda m, t, **o: 1 / 0, "ZeroDivisionError")])
def test_anything_a_learner_passes_gets_a_hint(answer, words, llama):
    ok, out = check(answer, pieces_of(SOLUTION), llama)
    assert not ok and out.startswith("✗") and words in out, out


def test_pieces_are_read_from_the_notebooks_and_the_student_copys_stubs_are_not_done(tmp_path, llama):
    course = capstone.pieces_from_notebooks(NOTEBOOKS)
    assert course.objects["kv_manager"].__name__ == "MyKVManager" and course.objects["scheduler"] is not None
    assert set(course.where) == {"05", "06", "06b"}
    write_course(NOTEBOOKS, tmp_path, student=True, say=lambda _m: None)
    student = capstone.pieces_from_notebooks(tmp_path)  # every cell a stub: every piece the course's, marked so
    assert student.course == set(student.filled) == set(capstone.PIECES) and not student.yours, student.filled
    ok, out = check(my_engine_of(student), student, llama)
    assert ok and "yours: none; NOT YOURS: the course's own solution for kv_manager" in out, out
    ok, out = check(lambda model, tok, **options: None, student, llama)  # the student copy's my_engine
    assert not ok and "not done yet" in out and "2. Exercise: assemble your engine" in out, out
    with pytest.raises(ValueError, match="is not a folder"):
        capstone.pieces_from_notebooks(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no notebook 05"):
        capstone.pieces_from_notebooks(tmp_path / "empty")


def test_the_pieces_module_is_what_serve_imports(tmp_path, monkeypatch):
    path = capstone.write_module(tmp_path / "my_engine_mod.py", NOTEBOOKS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module("my_engine_mod")
    assert issubclass(getattr(module, capstone.ENGINE_CLASS), module.MyScheduler)
    options = capstone.serve_options("my_engine_mod")
    assert options[options.index("--scheduler") + 1] == f"my_engine_mod:{capstone.ENGINE_CLASS}"
    assert path.read_text().startswith('"""')


@pytest.fixture()
def pieces_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "good_pieces.py").write_text(SOLUTION)
    (tmp_path / "bad_pieces.py").write_text(SOLUTION.replace(*BROKEN["scheduler"][:2], 1))
    return tmp_path


def test_serve_refuses_a_piece_that_fails_its_check_before_it_starts(pieces_dir):
    from cbteach.__main__ import main

    with pytest.raises(ValueError, match=r"--scheduler bad_pieces:MyEngineScheduler failed its check.*token budget"):
        capstone.refuse_broken_pieces(["--scheduler", f"bad_pieces:{capstone.ENGINE_CLASS}"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["serve", "--port", "0", f"--scheduler=bad_pieces:{capstone.ENGINE_CLASS}"]) == 2
    assert "failed its check" in err.getvalue() and "does not start" in err.getvalue()
    with pytest.raises(ValueError, match="cannot import"):
        capstone.refuse_broken_pieces(["--attention", "no_such_module:fn"])
    # The learner's module itself broken: a traceback and exit 1 before (only ImportError was caught).
    (pieces_dir / "typo_pieces.py").write_text("def f(:\n    pass\n")
    (pieces_dir / "exits_pieces.py").write_text("raise SystemExit(0)\n")
    for module, words in (("typo_pieces", "raised SyntaxError, line 1"), ("exits_pieces", "raised SystemExit")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert main(["serve", "--port", "0", f"--scheduler={module}:MyScheduler"]) == 2
        assert words in err.getvalue() and "Traceback" not in err.getvalue(), err.getvalue()
    with pytest.raises(ValueError, match="takes a value"):
        capstone.refuse_broken_pieces(["--kv-manager"])


def test_serve_refuses_the_engines_own_pieces_under_a_learners_option(pieces_dir):
    with pytest.raises(ValueError, match="--kv-manager cbteach.kv.manager:KVCacheManager failed its check.*the engine's"):
        capstone.refuse_broken_pieces(["--kv-manager", "cbteach.kv.manager:KVCacheManager"])
    with pytest.raises(ValueError, match="--attention cbteach.exercises.ex05_mistakes:attend failed.*course's own"):
        capstone.refuse_broken_pieces(["--attention", "cbteach.exercises.ex05_mistakes:attend"])


def test_serve_lets_a_scheduler_keep_the_engines_update(pieces_dir):
    """A stage-4 scheduler of notebook 06 writes schedule only: serve and the tournament take it."""
    source = SOLUTION[:SOLUTION.index("class MyUpdate")] + "\n\nclass MyUpdate(Scheduler):\n    pass\n" + \
        SOLUTION[SOLUTION.index(f"\n\nclass {capstone.ENGINE_CLASS}"):]
    (pieces_dir / "stage4.py").write_text(source)
    assert set(capstone.refuse_broken_pieces(["--scheduler", f"stage4:{capstone.ENGINE_CLASS}"])) == {"scheduler_cls"}


def test_serve_lets_pieces_that_pass_their_checks_start(pieces_dir):
    pieces = capstone.refuse_broken_pieces(capstone.serve_options("good_pieces"))
    assert set(pieces) == {"scheduler_cls", "kv_manager", "attention", "slot_mapping", "update_batch"}
    assert capstone.refuse_broken_pieces(["--max-batch-size", "4"]) == {}


@pytest.mark.timeout(600)
def test_serve_with_the_learners_pieces_answers_openai_clients_exactly(tmp_path, monkeypatch, bierce):
    openai = pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from serverkit import make_ref

    from cbteach.bierce.corpus import headword_prompts
    from cbteach.serving.server import ServerThread

    (tmp_path / "room_engine.py").write_text(SOLUTION)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    ref = make_ref(*bierce)
    prompts, lengths = headword_prompts(8), [5 + 7 * (i % 3) for i in range(8)]
    server = ServerThread(["--port", "0", "--max-batch-size", "3", "--block-size", "4", "--token-budget", "8",
                           *capstone.serve_options("room_engine")]).start()
    try:
        async def one(client, prompt, n):
            r = await client.completions.create(model="bierce", prompt=prompt, max_tokens=n, temperature=0,
                                                extra_body={"return_token_ids": True})
            return r.choices[0]

        async def go():
            client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

        answers = asyncio.run(go())
    finally:
        server.stop()
    for prompt, n, choice in zip(prompts, lengths, answers):
        want = ref(prompt, n)
        assert choice.token_ids == want and choice.text == ref.text(want), prompt
        assert choice.finish_reason == ("stop" if len(want) < n else "length")


def test_the_course_notebooks_hold_every_piece():
    pieces = pieces_of(SOLUTION)
    assert all(v is not None for v in pieces.objects.values()), pieces.objects
    assert "def my_slot_mapping" in SOLUTION and "def my_attention" in SOLUTION and "class MyUpdate" in SOLUTION
    assert "def update_batch" in SOLUTION


def test_the_notebook_reads_the_pieces_it_assembles():
    nb = json.loads((NOTEBOOKS / "12_your_engine.ipynb").read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "pieces_from_notebooks" in code and "check_my_engine" in code and "serve_options" in code
    assert sys.gettrace() is None


def test_a_scheduler_without_prefix_caching_serves_an_engine_without_it(pieces_dir):
    """A V1 scheduler that never asks for cached blocks is right for an engine that caches none: serve
    checks it on prefix caching only when --prefix-caching is on."""
    source = SOLUTION.replace("cached, num_cached_tokens = self.kv_manager.get_computed_blocks(seq)",
                              "cached, num_cached_tokens = [], 0")
    assert source != SOLUTION
    (pieces_dir / "no_cache.py").write_text(source)
    option = ["--scheduler", f"no_cache:{capstone.ENGINE_CLASS}"]
    assert set(capstone.refuse_broken_pieces(option)) == {"scheduler_cls"}
    with pytest.raises(ValueError, match="past the blocks"):
        capstone.refuse_broken_pieces(option + ["--prefix-caching"])


# -- where notebook 12 looks for the learner's 05 and 06, and what it says when it runs the course's -------------

@pytest.fixture()
def colab(tmp_path, monkeypatch):
    """A Colab-like machine: the kernel starts in /content (no 05/06 there), Drive mounted or not."""
    from cbteach.exercises import where

    content = tmp_path / "content"
    content.mkdir()
    monkeypatch.chdir(content)
    monkeypatch.setattr(where, "COLAB_UPLOADS", content)
    monkeypatch.setattr(where, "COLAB_DRIVE", content / "drive" / "MyDrive")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return content


def read(**kwargs):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pieces = capstone.pieces_from_notebooks(**kwargs)
    return pieces, out.getvalue()


def test_from_an_empty_folder_nothing_is_taken_from_the_course_without_saying_so(colab, llama):
    pieces, said = read()
    assert all(v is None for v in pieces.objects.values()) and not pieces.course, pieces.objects
    assert "NOT FOUND: notebook 05, 06 and 06b" in said and str(colab.resolve()) in said and "drive.mount" in said, said
    ok, out = check(my_engine_of(pieces), pieces, llama)
    assert not ok and "was not found" in out, out
    course, said = read(use_course_solutions=True)  # the instructor's way: it runs, and says whose it is
    assert all(v is not None for v in course.objects.values()) and course.course == set(capstone.PIECES)
    assert "NOT YOUR CODE" in said and "COURSE'S OWN SOLUTIONS" in said, said
    ok, out = check(my_engine_of(course), course, llama)
    assert ok and "NOT YOURS" in out, out


def test_from_an_empty_folder_on_a_laptop_it_says_where_it_looked(tmp_path, monkeypatch):
    from cbteach.exercises import where

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(where, "COLAB_UPLOADS", tmp_path / "no-content")
    monkeypatch.setattr(where, "COLAB_DRIVE", tmp_path / "no-drive")
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    pieces, said = read()
    assert all(v is None for v in pieces.objects.values()) and pieces.where == {"05": None, "06": None, "06b": None}
    assert "NOT FOUND" in said and "!!   the current folder\n" in said and str(tmp_path) not in said, said


def _learners_copy(path: Path, number: str, undone: tuple = ()) -> None:
    """The course's notebook with every solution cell rewritten, as a learner's own would differ: one more
    statement in every function; a cell that defines one of ``undone`` left as the student copy's stub."""
    import ast

    from cbteach.exercises import where
    from cbteach.student import stub

    nb = json.loads(next(NOTEBOOKS.glob(f"{number}_*.ipynb")).read_text())
    for cell in nb["cells"]:
        if "solution" in cell["metadata"].get("tags", []) and where.defined("".join(cell["source"])) & set(undone):
            cell["source"] = stub("".join(cell["source"]))
        elif "solution" in cell["metadata"].get("tags", []):
            tree = ast.parse("".join(cell["source"]))
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef):
                    node.body.insert(0, ast.parse("checked = True").body[0])
            cell["source"] = "# mine\n" + ast.unparse(tree)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb))


def test_on_colab_the_learners_notebooks_are_found_on_drive_and_named(colab, llama):
    drive = colab / "drive" / "MyDrive"
    _learners_copy(drive / "Colab Notebooks" / "Copy of 05_paged_kv_cache.ipynb", "05")
    _learners_copy(drive / "cbteach" / "06_scheduling_and_latency.ipynb", "06")
    _learners_copy(drive / "cbteach" / "06b_the_worker.ipynb", "06b")
    pieces, said = read()
    assert pieces.where["05"].name == "Copy of 05_paged_kv_cache.ipynb"
    assert pieces.where["06"].parent.name == pieces.where["06b"].parent.name == "cbteach" and not pieces.course, \
        pieces.course
    assert str((drive / "Colab Notebooks").resolve()) in said and str((drive / "cbteach").resolve()) in said, said
    assert "NOT" not in said, said
    ok, out = check(my_engine_of(pieces), pieces, llama)
    assert ok and out.startswith("✓ your engine"), out


def test_an_upload_beside_the_notebook_wins_and_a_pasted_solution_is_called_the_courses(colab):
    _learners_copy(colab / "05_paged_kv_cache.ipynb", "05")
    for name in ("06_scheduling_and_latency.ipynb", "06b_the_worker.ipynb"):
        (colab / name).write_text((NOTEBOOKS / name).read_text())
    _learners_copy(colab / "drive" / "MyDrive" / "05_paged_kv_cache.ipynb", "05")
    pieces, said = read()
    assert pieces.where["05"].parent == colab and pieces.course == {"scheduler", "update_batch"}, (pieces.where,
                                                                                                  pieces.course)
    assert "NOT YOUR CODE: scheduler, update_batch are the COURSE'S OWN SOLUTIONS" in said, said


def test_in_the_course_copy_every_piece_is_called_the_courses(monkeypatch):
    monkeypatch.chdir(NOTEBOOKS)
    pieces, said = read()
    assert pieces.course == set(capstone.PIECES) and "NOT YOUR CODE" in said, said


# -- catch-up: a piece not written yet is the course's, marked so everywhere, and the rest still runs ------------

@pytest.mark.parametrize("undone", list(capstone.PIECES))
def test_a_piece_left_undone_is_the_courses_marked_so_and_the_engine_assembles_and_ranks(undone, tmp_path, llama):
    number, names = capstone.PIECES[undone][:2]
    _learners_copy(tmp_path / "05_paged_kv_cache.ipynb", "05", names)
    _learners_copy(tmp_path / "06_scheduling_and_latency.ipynb", "06", names)
    _learners_copy(tmp_path / "06b_the_worker.ipynb", "06b", names)
    pieces, said = read(folder=tmp_path)
    assert all(o is not None for o in pieces.objects.values()), pieces.objects
    assert pieces.course == set(pieces.filled) == {undone} and undone not in pieces.yours, (pieces.course, pieces.yours)
    assert f"THE COURSE'S (yours is not written yet: notebook {number}, the cell under '" in said, said
    ok, out = check(my_engine_of(pieces), pieces, llama)
    assert ok and f"yours: {', '.join(p for p in capstone.PIECES if p != undone)}; NOT YOURS" in out, out
    assert out.rstrip().split("NOT YOURS: the course's own solution for ")[1].startswith(undone), out
    (tmp_path / "room").mkdir()
    module = capstone.write_module(tmp_path / "room" / "yours.py", pieces)
    entries = tournament.run_tournament({"yours": tournament.load_scheduler(module)}, llama,
                                        tournament.Trace(num_requests=4), baseline=False)
    table = tournament.table(entries, tournament.Trace(num_requests=4))
    assert entries[0].disqualified is None and ("yours (the course's)" in table) == (undone == "scheduler"), table


def test_a_written_piece_that_fails_its_check_is_replaced_by_the_courses_marked_so_and_the_check_says_why(tmp_path,
                                                                                                          llama):
    _learners_copy(tmp_path / "05_paged_kv_cache.ipynb", "05")
    _learners_copy(tmp_path / "06_scheduling_and_latency.ipynb", "06")
    _learners_copy(tmp_path / "06b_the_worker.ipynb", "06b")
    path = tmp_path / "05_paged_kv_cache.ipynb"
    leak = "self.free_blocks.extend(seq.block_table)\\n        "  # as the notebook's JSON holds the line
    assert path.read_text().count(leak) == 1  # the learner's free() forgets to give the blocks back
    path.write_text(path.read_text().replace(leak, ""))
    pieces, said = read(folder=tmp_path)
    assert not pieces.course and "kv_manager" in pieces.yours, said  # written: it is the learner's until checked
    ok, out = check(my_engine_of(pieces), pieces, llama)
    assert ok and "NOT YOURS: the course's own solution for kv_manager" in out, out
    assert "the course's kv_manager stood in for yours, which fails its own check (" in out, out
    assert "are not back in the free list" in out, out  # the check's own hint says why
    assert pieces.course == set(pieces.filled) == {"kv_manager"}, (pieces.course, pieces.filled)
    assert "yours fails its own check" in pieces.filled["kv_manager"] and "THE COURSE'S (yours fails" in pieces.report()
    assert "def free(self, seq):\n        self.free_blocks.extend" in pieces.source  # serve and the tournament get it


def test_a_helper_the_learner_wrote_in_a_cell_of_its_own_comes_with_the_piece(tmp_path, llama):
    """Notebook 12 read only the exercise's cell (and the imports before it): a helper written in a cell of its own,
    which the piece passed its check with in notebook 06b, was lost -- a NameError, and the course's piece stood in.
    The functions of the learner's own that a piece calls (and those they call) now come with it."""
    _learners_copy(tmp_path / "05_paged_kv_cache.ipynb", "05")
    _learners_copy(tmp_path / "06_scheduling_and_latency.ipynb", "06")
    _learners_copy(tmp_path / "06b_the_worker.ipynb", "06b")
    path = tmp_path / "06b_the_worker.ipynb"
    nb = json.loads(path.read_text())
    at = next(i for i, c in enumerate(nb["cells"]) if "solution" in c["metadata"].get("tags", [])
              and "def update_batch(" in "".join(c["source"]))
    body = "".join(nb["cells"][at]["source"]).replace("def update_batch(", "def my_update_impl(")
    helper = body + "\n\ndef my_update_entry(runner, scheduler_output):\n    return my_update_impl(runner, scheduler_output)\n"
    nb["cells"][at]["source"] = "def update_batch(runner, scheduler_output):\n    return my_update_entry(runner, scheduler_output)\n"
    nb["cells"].insert(at, {"cell_type": "code", "metadata": {}, "source": helper, "outputs": [], "execution_count": None})
    path.write_text(json.dumps(nb))
    pieces, said = read(folder=tmp_path)
    assert not pieces.course and "update_batch" in pieces.yours, said
    assert "a cell of your own" in pieces.source and "def my_update_impl(" in pieces.source
    ok, out = check(my_engine_of(pieces), pieces, llama)
    assert ok and out.startswith("✓ your engine"), out


def test_a_piece_that_does_not_pass_yet_can_be_the_courses_on_request_marked_so(tmp_path, llama):
    _learners_copy(tmp_path / "05_paged_kv_cache.ipynb", "05")
    _learners_copy(tmp_path / "06_scheduling_and_latency.ipynb", "06")
    _learners_copy(tmp_path / "06b_the_worker.ipynb", "06b")
    pieces, said = read(folder=tmp_path, use_course_for=["attention"])
    assert pieces.course == set(pieces.filled) == {"attention"} and "you asked for the course's" in said, said
    ok, out = check(my_engine_of(pieces), pieces, llama)
    assert ok and "NOT YOURS: the course's own solution for attention" in out, out
    for bad in ("attention", ["the attention"]):
        with pytest.raises(ValueError, match="use_course_for takes a list of pieces"):
            capstone.pieces_from_notebooks(tmp_path, use_course_for=bad, say=None)


# -- no route around the check: a piece that is, or hands its work to, the engine's or the course's own -----------

CHEATS = {  # piece -> (the learner's cell, the words that must name it)
    "attention": ("from cbteach.exercises.ex05_mistakes import attend as my_attention",
                  "is the course's own answer attend"),
    "attention_wrapper": ("from cbteach.attention.paged import default_attention\n\n\n"
                          "def my_attention(*args):\n    return default_attention(*args)",
                          "calls the engine's default_attention"),
    "slot_mapping": ("from cbteach.exercises.ex05_mistakes import slots as my_slot_mapping",
                     "is the course's own answer slots"),
    "kv_manager": ("from cbteach.kv.manager import KVCacheManager\n\n\nclass MyKVManager(KVCacheManager):\n"
                   "    def __init__(self, num_blocks, block_size):\n        super().__init__(num_blocks, block_size)\n"
                   "        self.free_blocks = list(range(num_blocks))",
                   "MyKVManager.allocate_slots is still the engine's KVCacheManager.allocate_slots"),
    "scheduler": ("class MyScheduler(Scheduler):\n    def schedule(self, now):\n        return super().schedule(now)",
                  "calls the engine's Scheduler.schedule (through super().schedule)"),
    "update": ("class MyUpdate(Scheduler):\n    def update_from_output(self, plan, output, now):\n"
               "        return super().update_from_output(plan, output, now)",
               "calls the engine's Scheduler.update_from_output (through super().update_from_output)"),
    "update_missing": ("class MyUpdate(Scheduler):\n    pass", "MyEngineScheduler.update_from_output is still the engine's"),
    "update_batch": ("from cbteach.worker.model_runner import update_batch", "is the worker's own update_batch"),
    "update_batch_wrapper": ("from cbteach.worker import model_runner\n\n\ndef update_batch(runner, scheduler_output):\n"
                             "    model_runner.update_batch(runner, scheduler_output)", "calls the worker's own update_batch"),
}


@pytest.mark.parametrize("cheat", sorted(CHEATS))
def test_a_piece_that_is_or_calls_the_engines_or_the_courses_own_is_refused(cheat, llama):
    cell, words = CHEATS[cheat]
    name = {"attention_wrapper": "attention", "update": "scheduler", "update_missing": "scheduler",
            "update_batch_wrapper": "update_batch"}.get(cheat, cheat)
    defines = {"update": "class MyUpdate", "update_missing": "class MyUpdate"}.get(cheat, {"attention": "def my_attention", "slot_mapping":
                                                        "def my_slot_mapping", "kv_manager": "class MyKVManager",
                                                        "scheduler": "class MyScheduler",
                                                        "update_batch": "def update_batch"}[name])
    start = SOLUTION.index(defines)
    end = SOLUTION.find("\n# -- from", start)
    source = SOLUTION[:start] + cell + "\n" + (SOLUTION[end:] if end != -1 else "")
    if end == -1:  # the last cell: keep the combined class after it
        source += SOLUTION[SOLUTION.index(f"\n\nclass {capstone.ENGINE_CLASS}"):]
    pieces = pieces_of(source)
    ok, out = check(my_engine_of(pieces), pieces, llama)
    assert not ok and out.startswith("✗") and words in out and "yourself" in out, out


def test_the_benchmark_interleaves_rounds_and_reports_medians_with_their_range(llama):
    pieces = pieces_of(SOLUTION)
    got = ex12.benchmark(my_engine_of(pieces), llama, None, rounds=2)
    assert list(got) == ["your engine", "the engine's own pieces"]
    for s in got.values():
        assert len(s["runs"]) == 2
        for key in ex12.METRICS:
            assert s[key]["min"] <= s[key]["median"] <= s[key]["max"], (key, s[key])
    with pytest.raises(ValueError, match="rounds"):
        ex12.benchmark(my_engine_of(pieces), llama, None, rounds=0)


def test_serve_refuses_a_learners_update_batch_with_tensor_parallelism(pieces_dir, capsys):
    """The plugged update runs in the engine core's process; tensor-parallel ranks run the worker's own."""
    from cbteach.__main__ import main

    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--port", "0", "--tensor-parallel-size", "2", "--update-batch", "good_pieces:update_batch"])
    assert stopped.value.code == 2 and "--update-batch runs in the engine core's own process" in capsys.readouterr().err


def test_run_all_in_the_student_copy_claims_nothing_it_computed_from_a_stub(tmp_path):
    """Notebook 12's student copy, every exercise undone, Run All: each piece is the course's and says so, the
    cells that need my_engine say "not done yet", the tournament's table marks the course's scheduler, and no
    claim reports that it did not hold (a claim computed from a stub would)."""
    import nbformat
    from nbclient import NotebookClient

    from cbteach.perf.claims import FAILED

    write_course(NOTEBOOKS, tmp_path, student=True, say=lambda _m: None)
    path = tmp_path / "12_your_engine.ipynb"
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, resources={"metadata": {"path": str(tmp_path)}}).execute()
    printed = ["".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")) for c in nb.cells
               if c.cell_type == "code" for o in c.get("outputs", [])]
    text = "\n".join(printed)
    assert FAILED not in text and "Traceback" not in text, text
    for piece, (number, _, _, _) in capstone.PIECES.items():
        assert f"{piece}" in text and f"yours is not written yet: notebook {number}, the cell under '" in text, piece
    assert "not done yet: my_engine returned None" in text and "yours (the course's)" in text, text
    assert "claim: yours (the course's) scores what the engine's own does" in text, text
