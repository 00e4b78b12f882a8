"""Run All in the student copy is honest: no claim line is computed from a stub.

In the student copy (``python -m cbteach student``) every exercise is undone: a solution cell is a stub,
and notebook 12 reads the learner's own notebooks. A claim that rests on the learner's code must then
print no verdict of its own -- not "DID NOT HOLD on this machine", which blames the machine for a piece not
written yet (issue 55 found notebook 12 doing it). Such a claim sits either in the body of ``if check_x(...):``
(the check prints "not done yet" and names what to write) or beside :func:`cbteach.perf.claims.not_checked`,
which prints ``claim: ... -- not checked: <what to write> first``.

Executing every student notebook takes minutes, so the first test reads the code: every ``claim(...)`` whose
arguments come from a solution's names or from the learner's notebooks is guarded so. The second runs notebook
12's tournament cell -- the one issue 55 caught -- with the learner's scheduler disqualified and with it passing.
"""
import ast
import contextlib
import io
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from cbteach.perf.claims import CLAIM_LINE, FAILED, NOT_CHECKED, claim, failed_claims, not_checked
from cbteach.student import reads_learners_work, strip_solutions
from test_notebooks import CHECK_NAME, code_tree, is_solution, solution_only_names, source

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def _loads(node) -> set:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _into(node) -> set:
    """The names a statement that binds nothing may have changed: what it reads, less the functions it calls
    by name (``claim(...)``, ``print(...)`` change no name of theirs); a bare self-check call changes none."""
    value = node.value if isinstance(node, ast.Expr) else None
    if isinstance(value, ast.Call) and CHECK_NAME.search(ast.unparse(value.func)):
        return set()  # a self-check reads what it is given (the learner's function, the model) and changes none of it
    called = {n.func.id for n in ast.walk(node) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return _loads(node) - called


def _binds(node) -> set:
    names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    return names | {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}


def learners_names(cells: list) -> list[set]:
    """For each cell, the names that hold the learner's work once it has run: what a solution cell alone binds
    (a stub in the student copy), what a cell reading the learner's notebooks binds, and whatever a later
    statement computes from those (or, binding nothing, may have put them into: ``(room / "x.py").write_text``)."""
    tainted, learners, out = set(solution_only_names(cells)), reads_learners_work(cells), []
    for i, cell in enumerate(cells):
        if cell["cell_type"] == "code" and not is_solution(cell):
            for stmt in code_tree(source(cell)).body:
                if _loads(stmt) & tainted or i in learners:
                    tainted |= _binds(stmt) or _into(stmt)
        out.append(set(tainted))
    return out


def _calls(node, name: str) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == name for n in ast.walk(node))


def guarded(call, parents: dict) -> bool:
    """Whether a ``claim(...)`` call runs only after a check passed, or has a ``not_checked`` line beside it
    for when the learner's code is not there yet: an enclosing ``if check_x(...):`` (the call in its body), or
    an enclosing ``if`` whose other branch calls ``not_checked``."""
    node = call
    while id(node) in parents:
        parent = parents[id(node)]
        if isinstance(parent, ast.If):
            in_body = any(node is s for s in parent.body)
            if in_body and isinstance(parent.test, ast.Call) and CHECK_NAME.search(ast.unparse(parent.test.func)):
                return True
            other = parent.orelse if in_body else parent.body
            if any(_calls(s, "not_checked") for s in other):
                return True
        node = parent
    return False


def unguarded_claims(cells: list) -> list[tuple[int, str, list]]:
    """(cell index, the claim's first argument, the learner's names it reads) for every claim that would be
    computed from the learner's code with nothing to say "not checked" instead."""
    found = []
    for i, (cell, tainted) in enumerate(zip(cells, learners_names(cells))):
        if cell["cell_type"] != "code" or is_solution(cell):
            continue
        tree = code_tree(source(cell))
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and ast.unparse(call.func) == "claim":
                reads = sorted(_loads(call) & tainted)
                if reads and not guarded(call, parents):
                    found.append((i, ast.unparse(call.args[0])[:80] if call.args else "", reads))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_claim_in_the_student_copy_is_computed_from_a_stub(path):
    student, _ = strip_solutions(json.loads(path.read_text()))
    found = unguarded_claims(student["cells"])
    assert not found, ("claims computed from the learner's code with no check before them and no `not_checked` "
                       f"beside them -- in the student copy they would judge a stub (cell, claim, names): {found}")


def test_the_reader_finds_a_claim_on_a_stub_and_accepts_the_two_guards():
    """The static reader can fail: a claim on a solution's name, or on what notebook 12 read from the learner's
    notebooks, is caught bare and passes under ``if check_x(...)`` or beside ``not_checked``."""
    def nb(*cells):
        return [{"cell_type": "code", "source": s, "metadata": {"tags": ["solution"]} if i == 0 else {}}
                for i, s in enumerate(cells)]

    bare = nb("def answer():\n    return 3", "x = answer()\nclaim('it is three', x == 3)")
    assert [(i, names) for i, _, names in unguarded_claims(bare)] == [(1, ["x"])]
    checked = nb("def answer():\n    return 3", "if check_answer(answer):\n    claim('it is three', answer() == 3)")
    assert unguarded_claims(checked) == []
    said = nb("def answer():\n    return 3", "if answer() is not None:\n    claim('three', answer() == 3)\n"
              "else:\n    not_checked('three', 'write it')")
    assert unguarded_claims(said) == []
    read = nb("N = 1", "pieces = capstone.pieces_from_notebooks()", "by = {p: 1 for p in pieces.objects}",
              "claim('all in', len(by) == 5)")
    assert [i for i, _, _ in unguarded_claims(read)] == [3]


def test_a_claim_not_checked_says_what_to_write_first_and_is_no_verdict():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        not_checked("your scheduler scores what the engine's own does", "write MyScheduler in notebook 06")
        claim("a count holds", True)
    lines = out.getvalue().splitlines()
    assert lines[0] == ("claim: your scheduler scores what the engine's own does -- "
                        f"{NOT_CHECKED}: write MyScheduler in notebook 06 first")
    assert not CLAIM_LINE.match(lines[0]) and failed_claims(out.getvalue()) == []  # neither holds nor failed
    with pytest.raises(ValueError):
        not_checked("two\nlines", "write it")


# -- notebook 12's tournament cell, run: a disqualified scheduler of the learner's leaves its claims unchecked ----

def tournament_cell() -> str:
    cells = json.loads((Path(__file__).parent.parent / "notebooks" / "12_your_engine.ipynb").read_text())["cells"]
    (cell,) = [source(c) for c in cells if c["cell_type"] == "code" and "plot_tournament(entries" in source(c)]
    return cell


def run_tournament_cell(yours_disqualified: str | None) -> str:
    """The cell's own code on a made-up table: yours disqualified (or not), yours_plus_one disqualified for
    yours' reason when yours is (it is yours and one token more), else by the rule for room."""
    from cbteach.exercises import tournament
    from cbteach.exercises.rules import hint

    room = hint("no_room", None)
    entries = [SimpleNamespace(name=tournament.BASELINE, label="the engine's own", goodput=6.0, disqualified=None),
               SimpleNamespace(name="yours", label="yours", goodput=6.0, disqualified=yours_disqualified),
               SimpleNamespace(name="yours_plus_one", label="yours_plus_one", goodput=0.0,
                               disqualified=yours_disqualified or f"disqualified: {room}")]
    namespace = {"entries": entries, "trace": SimpleNamespace(ttft_slo=0.5, tpot_slo=0.03),
                 "plot_tournament": lambda *a, **k: None, "plt": SimpleNamespace(show=lambda: None),
                 "claim": claim, "not_checked": not_checked, "hint": hint, "tournament": tournament}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(tournament_cell(), "<notebook 12, the tournament's figure>", "exec"), namespace)
    return out.getvalue()


def test_notebook_12s_tournament_claims_say_not_checked_when_the_learners_scheduler_is_disqualified():
    said = run_tournament_cell("disqualified: a running request was skipped while budget was left")
    assert FAILED not in said and "holds" not in said, said
    assert len(re.findall(rf"^claim: .+ -- {NOT_CHECKED}: make MyScheduler in notebook 06 pass its stages first$",
                          said, re.M)) == 2, said
    said = run_tournament_cell(None)  # a scheduler that passes: both claims computed, both hold
    assert said.count("-- holds") == 2 and NOT_CHECKED not in said, said
