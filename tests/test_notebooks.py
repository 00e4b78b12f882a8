"""The course's own rules for every notebook (nbval runs them; this checks their shape)."""
import ast
import json
import re
from pathlib import Path

import pytest

import cbteach
from cbteach.student import PLACEHOLDER, is_check, reads_learners_work, strip_solutions

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def cells(path):
    return json.loads(path.read_text())["cells"]


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_course_has_its_notebooks():
    names = [p.stem[:2] for p in NOTEBOOKS]
    assert names[:1] == ["00"] and names == sorted(names)


def test_instructor_kit_covers_every_notebook():
    kit = (Path(__file__).parent.parent / "notebooks" / "INSTRUCTOR.md").read_text()
    for path in NOTEBOOKS:
        assert f"| `{path.stem}` |" in kit, f"notebooks/INSTRUCTOR.md has no timing row for {path.stem}"
        assert f"### {path.stem[:2]} · " in kit, f"notebooks/INSTRUCTOR.md has no section for {path.stem}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_shape(path):
    nb = json.loads(path.read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    cs = nb["cells"]
    first = source(cs[0])
    assert "colab-badge.svg" in first and "Expected time" in first and "learn" in first.lower()
    install = source(cs[1])
    assert "google.colab" in install and f"git+{cbteach.REPO_URL}" in install and "-e " not in install
    assert source(cs[2]).startswith("# NBVAL_IGNORE_OUTPUT")
    code = [c for c in cs if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code), "run the notebook so outputs are stored"
    assert any("image/png" in o.get("data", {}) for c in code for o in c.get("outputs", [])), "no figure"
    sols = [c for c in code if "solution" in c.get("metadata", {}).get("tags", [])]
    assert sols, "no exercise solution cell"
    after = source(code[code.index(sols[-1]) + 1]) if code.index(sols[-1]) + 1 < len(code) else ""
    assert "check" in after, "the solution should be followed by a self-check cell"
    for c in code:
        assert len(source(c).splitlines()) <= 30, f"a {len(source(c).splitlines())}-line cell"
        for o in c.get("outputs", []):
            assert o.get("output_type") != "error"
            text = "".join(o.get("text", []))
            assert not re.search(r"/(root|home|tmp|work)/", text), "an output shows a machine path"


def imports_before(nb_cells, index) -> dict:
    """The namespace the imports of the code cells before ``index`` make (where a stub runs in the notebook)."""
    namespace: dict = {}
    for c in nb_cells[:index]:
        if c["cell_type"] == "code" and not is_solution(c):
            for node in code_tree(source(c)).body:
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    exec(compile(ast.Module([node], []), "imports", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_copy_empties_solutions_but_keeps_checks(path):
    nb = json.loads(path.read_text())
    student, n = strip_solutions(nb)
    assert n >= 1
    for i, (orig, new) in enumerate(zip(nb["cells"], student["cells"])):
        if "solution" in orig.get("metadata", {}).get("tags", []):
            assert new["source"].startswith(PLACEHOLDER) and new["outputs"] == []
            assert not new["metadata"].get("jupyter", {}).get("source_hidden")  # visible: the learner types here
            exec(compile(new["source"], "stub", "exec"), imports_before(nb["cells"], i))  # the stub runs there
            solution = "".join(orig["source"])
            assert solution.strip() not in new["source"]
            for node in ast.walk(ast.parse(new["source"])):  # it keeps given data, never a computed answer
                if isinstance(node, ast.Assign):
                    ast.literal_eval(node.value)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    assert all(isinstance(n, (ast.Expr, ast.Assign, ast.FunctionDef)) for n in node.body)
        elif is_check(orig) or i in reads_learners_work(nb["cells"]):  # would show the answer, or the course's as yours
            assert new["source"] == orig["source"] and new["outputs"] == []
        else:
            assert new == orig
    assert any(is_check(c) for c in nb["cells"]), "every notebook has a self-check cell"
    cleared, _ = strip_solutions(nb, clear_outputs=True)
    assert all(not c.get("outputs") for c in cleared["cells"])


# Names the engine no longer has (renamed in the vLLM-style split): a notebook using one would fail to run.
OLD_API = re.compile(r"\bnum_cached\b|\bnum_new\b|\.clock\(\)|\bkv\.k\[|\b_current\b|paged_attention_forward"
                     r"|device available")
# Calls that make tensors; in a notebook they must say where (the model's device), so the course runs
# unchanged on CPU, CUDA and MPS.
MAKES_TENSORS = re.compile(r"\b(?:torch\.(?:tensor|full|zeros|ones|arange|randn|rand|empty)|pack"
                           r"|block_diagonal_causal_mask|per_sequence_causal_mask)\(")


def call_arguments(src, open_paren_end):
    """The text of a call's arguments, from just after its "(" to the matching ")"."""
    depth = 1
    for i in range(open_paren_end, len(src)):
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        if depth == 0:
            return src[open_paren_end:i]
    return src[open_paren_end:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_uses_the_current_api_and_the_models_device(path):
    cs = cells(path)
    setup = source(cs[2])
    assert "model.device" in setup or "pick_device()" in setup, "the setup cell should say where the model runs"
    for c in cs:
        if c["cell_type"] != "code":
            continue
        src = source(c)
        assert not OLD_API.search(src), f"old API in:\n{src}"
        for m in MAKES_TENSORS.finditer(src):
            assert "device=" in call_arguments(src, m.end()), f"{m.group(0)} without device= in:\n{src}"
        for line in src.splitlines():
            if 'return_tensors="pt"' in line:
                assert ".to(" in line, f"tokenizer tensors not moved to the model's device: {line}"


# ---- The student copy: what a learner sees and runs with every exercise left undone ----------------------------

def code_tree(src):
    """A code cell's syntax tree, IPython magics (``%pip``) turned into plain Python first."""
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        return ast.parse(TransformerManager().transform_cell(src))
    except SyntaxError:
        return ast.parse("")


def is_solution(cell):
    return cell["cell_type"] == "code" and "solution" in cell.get("metadata", {}).get("tags", [])


def top_level_names(tree):
    """The names a cell binds in the notebook's namespace: assignments, loops, imports, defs and classes
    at the top level (also inside top-level if/for/with/try blocks), not names local to a function."""
    names = set()
    for stmt in tree.body:
        for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.For, ast.With, ast.Try)) else [stmt]:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def locally_bound(tree):
    """Every name a cell binds anywhere (stores, parameters, comprehension targets): a use of such a
    name in that cell reads the cell's own value, not a solution's."""
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    names |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in n.posonlyargs + n.args + n.kwonlyargs + [x for x in (n.vararg, n.kwarg) if x]}
    return names | top_level_names(tree)


def solution_only_names(nb_cells):
    """Names only a solution cell binds: in the student copy they are stubs (``...`` or a function
    returning None) until the learner writes them."""
    solution, other = set(), set()
    for c in nb_cells:
        if c["cell_type"] == "code":
            (solution if is_solution(c) else other).update(top_level_names(code_tree(source(c))))
    return solution - other


def uses(cell, names):
    tree = code_tree(source(cell))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} \
        & (names - locally_bound(tree))


def unguarded_uses(cell, names):
    """Uses of ``names`` anywhere but as a plain argument of a self-check (``check_x(f, answer=a)``) or in
    the body of ``if check_x(...):``: a check is wrapped in ``self_check`` and answers a stub with a hint and
    False, so its body runs only for a solution that passed; any other use of a stub can raise."""
    tree = code_tree(source(cell))
    guarded = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and CHECK_NAME.search(ast.unparse(node.func)):
            guarded |= {id(a) for a in node.args + [k.value for k in node.keywords] if isinstance(a, ast.Name)}
        if isinstance(node, ast.If) and isinstance(node.test, ast.Call) and CHECK_NAME.search(ast.unparse(node.test.func)):
            guarded |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    local = locally_bound(tree)
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                   and n.id in names and n.id not in local and id(n) not in guarded})


CHECK_NAME = re.compile(r"(^|\.)check_\w*$")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_copy_shows_no_output_computed_by_a_solution(path):
    """A stored output of a cell that reads a solution's name shows the solution's result (09's "126 MiB",
    07's "predicted 1.52x"): the student copy must not keep it."""
    nb = json.loads(path.read_text())
    only = solution_only_names(nb["cells"])
    student, _ = strip_solutions(nb)
    leaks = [(i, sorted(uses(c, only))) for i, c in enumerate(student["cells"])
             if c["cell_type"] == "code" and not is_solution(c) and c.get("outputs") and uses(c, only)]
    assert not leaks, f"student copy keeps outputs of cells (index, solution names) {leaks}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_stubs_name_only_what_the_check_needs(path):
    """A stub names what to write -- the names the self-check reads -- and nothing that gives the way away:
    no helper a later cell never reads (10's ``admission_steps``), no import only the solution needs
    (``import heapq``)."""
    nb = json.loads(path.read_text())
    cs = nb["cells"]
    only = solution_only_names(cs)
    student, _ = strip_solutions(nb)
    for i, (orig, new) in enumerate(zip(cs, student["cells"])):
        if not is_solution(orig):
            continue
        later = set().union(*(uses(c, only) for c in cs[i + 1:] if c["cell_type"] == "code" and not is_solution(c)))
        stub = code_tree(new["source"])
        itself = {n.id for n in ast.walk(stub) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}  # a base class
        extra = sorted((top_level_names(stub) & only) - later - itself)
        assert not extra, f"cell {i}'s stub names {extra}, which no later cell reads: they hint at the solution"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_copy_runs_with_every_exercise_undone(path):
    """Run All in the student copy, exercises undone, must reach the end. Executing all twelve notebooks
    takes minutes, so this checks statically what would raise: after a solution is stubbed, a name only
    it binds is ``...`` or a function returning None, and a later cell may pass it to a self-check (which
    answers any value with a hint, never a traceback) but not compute with it."""
    cs = cells(path)
    only = solution_only_names(cs)
    bad = [(i, unguarded_uses(c, only)) for i, c in enumerate(cs)
           if c["cell_type"] == "code" and not is_solution(c) and unguarded_uses(c, only)]
    assert not bad, f"cells (index, names) that compute with a stubbed solution's names and would raise: {bad}"


# ---- Stored outputs back the prose ----------------------------------------------------------------------------

def stored_text(cell):
    """Everything a code cell printed, as stored: streams and plain-text results."""
    out = []
    for o in cell.get("outputs", []):
        text = o.get("text") or o.get("data", {}).get("text/plain", "")
        out.append("".join(text) if isinstance(text, list) else text)
    return "".join(out)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_claim_reports_that_it_did_not_hold(path):
    """A cell that backs the prose prints ``claim: <text> -- holds`` (:func:`cbteach.perf.claims.claim`);
    outputs stored where a claim did not hold contradict the text beside them: re-run on a quiet machine
    (``tools/store_outputs.py``) or fix the claim."""
    from cbteach.perf.claims import FAILED, failed_claims, stored_failed_claims

    assert failed_claims(f"claim: a sample -- {FAILED}") == ["a sample"]  # the reader still knows the format
    failed = stored_failed_claims(path)
    assert not failed, f"stored outputs report claims that did not hold (cell, claim): {failed}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_copy_prints_no_solution_source(path):
    """No stored output of the student copy shows a solution: not a line of a solution cell, and no printed
    source of a function the exercise asks for (06's printout of the engine's ``schedule`` only appears once
    stage 4 passes, in a check cell, whose output the student copy drops)."""
    nb = json.loads(path.read_text())
    solutions = [source(c) for c in nb["cells"] if is_solution(c)]
    lines = {line.strip() for s in solutions for line in s.splitlines() if len(line.strip()) >= 30}
    asked = {node.name for s in solutions for node in ast.walk(code_tree(s))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    student, _ = strip_solutions(nb)
    for i, c in enumerate(student["cells"]):
        if c["cell_type"] != "code" or is_solution(c):
            continue
        text = stored_text(c)
        shown = [line for line in lines if line in text] + [f"def {n}(" for n in asked if f"def {n}(" in text]
        assert not shown, f"cell {i} of the student copy shows solution source: {shown[:3]}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_copy_ships_no_output_that_calls_the_courses_solutions_yours_or_not(path):
    """The course copy's notebook 12 reads the course's own notebooks, so its stored outputs say "NOT YOUR
    CODE" and show the course's solutions running as "yours": a learner's copy must show neither."""
    student, _ = strip_solutions(json.loads(path.read_text()))
    for i, c in enumerate(student["cells"]):
        text = stored_text(c) if c["cell_type"] == "code" else ""
        assert not re.search(r"NOT YOUR|COURSE'S (OWN )?SOLUTION|the course's own solution", text, re.I), \
            f"cell {i} of the student copy ships the course copy's verdict on the course's solutions"


# A line where a rule caught something names the rule, never a Python error the rule did not mean.
RULE_LINE = re.compile(r"disqualified|refused|claim:|fails? (its|the) check", re.I)
PYTHON_ERROR = re.compile(r"\b(?!Value)[A-Z]\w*(Error|Exception)\b")  # ValueError is the course's word for bad input


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_stored_output_shows_a_python_error_where_the_prose_claims_a_rule(path):
    for i, c in enumerate(cells(path)):
        for line in stored_text(c).splitlines() if c["cell_type"] == "code" else []:
            assert not (RULE_LINE.search(line) and PYTHON_ERROR.search(line)), \
                f"cell {i} shows a Python error where a rule should speak: {line[:200]}"


def claims_in(src: str):
    """``claim(text, condition)`` calls of a code cell: (text, condition) pairs."""
    for node in ast.walk(code_tree(src)):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "claim" and len(node.args) == 2 \
                and isinstance(node.args[0], ast.Constant):
            yield node.args[0].value, node.args[1]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_disqualification_claim_checks_the_reason_not_only_the_verdict(path):
    """"The wrong entrant is disqualified" holds for any crash; the claim must test *why* (the rule's
    words in ``.disqualified``), or a TypeError would prove it."""
    for c in cells(path):
        for text, condition in claims_in(source(c)) if c["cell_type"] == "code" else ():
            if "disqualified" in text:
                reasons = [n for n in ast.walk(condition) if isinstance(n, ast.Compare)
                           and any(isinstance(op, ast.In) for op in n.ops) and ".disqualified" in ast.unparse(n)]
                assert reasons, f"the claim {text!r} checks only that an entrant was disqualified, not for what"


# ---- The instructor's kit: its totals are its tables' ---------------------------------------------------------

KIT = Path(__file__).parent.parent / "notebooks" / "INSTRUCTOR.md"


def stated_minutes(path) -> int:
    """A notebook's own "Expected time" (its first cell), in minutes: a learner's pace."""
    return int(re.search(r"Expected time:\*\* about (\d+) minutes", source(cells(path)[0])).group(1))


def test_the_kits_run_time_total_is_its_tables_sum():
    kit = KIT.read_text()
    rows = dict(re.findall(r"^\| `([^`]+)` \| [^|]* \| (\d+) s\b[^|]*\| [^|]*\|$", kit, re.M))
    assert set(rows) == {p.stem for p in NOTEBOOKS}, "the timing table has one run time per notebook"
    minutes, seconds, count = re.search(r"add up to ([\d.]+) minutes \((\d+) s\) for the (\d+) notebooks", kit).groups()
    total = sum(map(int, rows.values()))
    assert (int(seconds), float(minutes), int(count)) == (total, round(total / 60, 2), len(NOTEBOOKS))


DAY = ("00", "01", "02", "03", "05", "06", "06b", "12")  # the capstone path: every piece notebook 12 assembles


def estimated_minutes(kit: str) -> dict:
    """The timing table's "reading + exercise time" column: (low, high) minutes per notebook, an estimate."""
    rows = re.findall(r"^\| `([^`]+)` \| [^|]* \| [^|]* \| (\d+)(?:-(\d+))? min \|$", kit, re.M)
    return {name: (int(low), int(high or low)) for name, low, high in rows}


def when_time_is_short(kit: str, number: str) -> str:
    """The "When time is short" paragraph of notebook ``number``'s section of the kit."""
    head = re.search(rf"^### {number} · .*$", kit, re.M)
    section = kit[head.end():head.end() + re.search(r"\n##", kit[head.end():]).start()]
    return section[section.index("When time is short:"):]


def test_the_one_day_workshop_gives_each_notebook_its_estimate_fits_a_day_and_has_checkpoints_and_homework():
    kit = KIT.read_text()
    day = kit[kit.index("## A one-day workshop"):]
    estimate = estimated_minutes(kit)
    assert set(estimate) == {p.stem for p in NOTEBOOKS}, "the timing table has one reading + exercise estimate per notebook"
    assert "No learner was timed" in day and "measured" not in day, "the day's minutes are estimates and say so"

    # the day: slots back to back, each notebook's at least the low end of its estimate, which its row quotes
    rows = re.findall(r"^\| (\d\d):(\d\d)-(\d\d):(\d\d) \| (\d+) \| ([^|]*) \|", day, re.M)
    clock, room, kinds, pauses, slots = None, {}, {"notebooks": 0, "breaks": 0, "lunch": 0, "other": 0}, [], []
    for h0, m0, h1, m1, minutes, what in rows:
        start, end = int(h0) * 60 + int(m0), int(h1) * 60 + int(m1)
        assert clock in (None, start) and end - start == int(minutes), f"the slot {h0}:{m0}-{h1}:{m1} does not add up"
        clock = end
        names = [n for n in re.findall(r"`([^`]+)`", what) if n in estimate]
        assert len(names) <= 1, f"one notebook a slot: {what}"
        if names:
            room[names[0]] = room.get(names[0], 0) + int(minutes)
            quoted = re.search(r"\(estimate (\d+)(?:-(\d+))?\)", what)
            assert quoted and (int(quoted[1]), int(quoted[2] or quoted[1])) == estimate[names[0]], f"{names[0]}: its row quotes its estimate"
            slots.append((start, names[0]))
        kind = "notebooks" if names else "lunch" if "lunch" in what else "breaks" if "break" in what else "other"
        kinds[kind] += int(minutes)
        if kind in ("lunch", "breaks"):
            pauses.append(start)
    assert list(room) == [p.stem for p in NOTEBOOKS if p.stem.split("_")[0] in DAY], "the capstone path, in order"
    for name, minutes in room.items():
        assert minutes >= estimate[name][0], f"{name}: {minutes} minutes, below the low end of its estimate {estimate[name]}"
    assert len(pauses) == 3, "lunch and two breaks"
    said = re.search(r"The day is (\d\d:\d\d)-(\d\d:\d\d): (\d+) minutes of notebooks, (\d+) of breaks and (\d+) of "
                     r"opening and close -- ([\d.]+) hours in\s+the room -- and (\d+) of lunch", day)
    assert said[1] == f"{rows[0][0]}:{rows[0][1]}" and said[2] == f"{rows[-1][2]}:{rows[-1][3]}"
    assert [int(x) for x in said.groups()[2:5]] + [int(said[7])] == [kinds[k] for k in ("notebooks", "breaks", "other", "lunch")]
    in_room = kinds["notebooks"] + kinds["breaks"] + kinds["other"]
    assert float(said[6]) == in_room / 60 and 6 * 60 <= in_room <= 7 * 60, "a day in a room: 6-7 hours with breaks, lunch aside"
    high = re.search(r"At the high end\s+the same notebooks need (\d+) minutes, (\d+) more than their slots", day)
    top = sum(estimate[n][1] for n in room)
    assert (int(high[1]), int(high[2])) == (top, top - kinds["notebooks"])

    # a checkpoint before each break, lunch and notebook 12; each names its block's notebooks, and a learner
    # who fell behind moves on, takes home sections its notebook's "When time is short" skips, and takes
    # the course's piece (marked) for a piece of notebook 12 written in that block
    table = day[day.index("**Checkpoints**"):day.index("At home")]
    checks = re.findall(r"^\| (\d\d):(\d\d), before [^|]* \| ([^|]*) \| ([^|]*) \|$", table, re.M)
    twelve = next(start for start, name in slots if name.startswith("12_"))
    assert [int(h) * 60 + int(m) for h, m, *_ in checks] == sorted(pauses + [twelve])
    previous = 0
    for h, m, have, behind in checks:
        at = int(h) * 60 + int(m)
        block = [name.split("_")[0] for start, name in slots if previous <= start < at]
        previous = at
        assert block and all(re.search(rf"\b{n}\b", have + behind) for n in block), f"{h}:{m}: names {block}"
        assert behind.startswith("moves on") and "homework:" in behind
        if {"05", "06", "06b"} & set(block):
            assert "as the course's" in behind and "marked" in behind, f"{h}:{m}: the unwritten piece runs as the course's"
        taken = re.findall(r"(\d\db?)'s sections? (\b\d+\b(?!'s)(?:(?:, | and )\b\d+\b(?!'s))*)", behind)
        assert {n for n, _ in taken} == set(block), f"{h}:{m}: homework from each notebook of the block"
        for number, sections in taken:
            short = when_time_is_short(kit, number)
            for s in re.findall(r"\d+", sections):
                assert re.search(rf"\b{s}\b", short), f"{number}'s section {s} is not in its When time is short"

    # the homework: every other notebook, once, in order, each at its estimate, with the total
    home = day[day.index("At home"):]
    listed = re.findall(r"`([^`]+)` \((\d+)(?:-(\d+))?[;)]", home)
    assert sorted([n for n, *_ in listed] + list(room)) == sorted(estimate), "every notebook is in the room or at home, once"
    for name, low, high in listed:
        assert (int(low), int(high or low)) == estimate[name], f"{name}: the homework quotes its estimate"
    total = re.search(r"-- (\d+)-(\d+) minutes, before", home)
    assert (int(total[1]), int(total[2])) == tuple(sum(estimate[n][k] for n, *_ in listed) for k in (0, 1))


def test_the_readmes_hours_are_the_kits_sums_and_its_day():
    """README's hours: the stated times' sum, the estimates' sum (called estimates), and INSTRUCTOR's day."""
    readme = " ".join((Path(__file__).parent.parent / "README.md").read_text().split())
    kit = KIT.read_text()
    estimate, stated = estimated_minutes(kit), sum(stated_minutes(p) for p in NOTEBOOKS)
    words = {8: "eight", 9: "nine", 10: "ten", 11: "eleven", 12: "twelve"}
    low, high = (sum(e[k] for e in estimate.values()) for k in (0, 1))
    assert f"state about {words[round(stated / 60)]} hours of reading and exercises in all ({stated} minutes" in readme
    assert f"plan on {words[round(low / 60)]} to {words[round(high / 60)]} ({low}-{high} minutes" in readme
    assert "estimates -- estimates, not yet learners' measured times" in readme
    day = " ".join(kit[kit.index("## A one-day workshop"):].split())
    span, notebooks, hours = re.search(r"The day is (\S+): (\d+) minutes of notebooks, .*? -- ([\d.]+) hours in the room", day).groups()
    home = re.search(r"-- (\d+-\d+) minutes, before", day)[1]
    assert (f"one-day workshop, {span}: the eight notebooks of the capstone path at the low end of those estimates "
            f"({notebooks} minutes, {hours} hours in the room with breaks, lunch aside), the other eight as homework "
            f"({home} minutes, estimated)") in readme
    assert len(DAY) == 8 == len(NOTEBOOKS) - 8


def test_notebook_07s_table_names_every_engine_it_benchmarks():
    from cbteach.bench import ALL_ENGINES

    nb07 = "".join(source(c) for c in cells(next(p for p in NOTEBOOKS if p.stem.startswith("07_"))))
    assert all(f"`{name}`" in nb07 for name in ALL_ENGINES), "07's engine table misses an engine it runs"
