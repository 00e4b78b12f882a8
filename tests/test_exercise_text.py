"""The text a learner follows names real code: every exercise's markdown, its stub (in the course and
in the student copy ``python -m cbteach student`` writes) and its check's hints are read as code
(:mod:`exercise_text`), and each name they tell the learner to use must exist, with the signature
it is written with, in what the learner's class inherits or imports.

The objects the text calls by name are real: ``self``, ``seq``, ``plan``, ``output``... are taken from
a running engine at the moment a learner's code would see them.
"""
import ast
import json
import sys
from pathlib import Path

import pytest

import cbteach
from cbteach.student import strip_solutions
from exercise_text import Scope, code_spans, hint_fragments, learner_defs, problems
from test_notebooks import code_tree, imports_before, is_solution, source, top_level_names

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def exercises(nb: dict) -> list[tuple[list[int], str]]:
    """Each exercise: its solution cells' indices and its text -- the markdown of the section they sit
    in, from the heading before the first to the next heading (a cell is cut at a heading)."""
    cells, out = nb["cells"], []
    text = [source(c) if c["cell_type"] == "markdown" else "" for c in cells]
    heading = [any(line.startswith("## ") for line in t.splitlines()) for t in text]
    for i, c in enumerate(cells):
        if not is_solution(c) or (out and i in out[-1][0]):
            continue
        start = max([j for j in range(i) if heading[j]], default=0)
        end = min([j for j in range(i + 1, len(cells)) if heading[j]], default=len(cells))
        lines = text[start].splitlines()
        first = "\n".join(lines[max(k for k, line in enumerate(lines) if line.startswith("## ")):]) if heading[start] \
            else text[start]
        out.append(([j for j in range(start, end) if is_solution(cells[j])],
                    "\n".join([first, *text[start + 1:end]])))
    return out


# ---- the objects an exercise's text calls by name, from a running engine -------------------------------------

@pytest.fixture(scope="module")
def captured(bierce):  # bierce: (model, tokenizer)
    """What a learner's scheduler sees in a real run: itself, a request, its plan and message, the
    runner's output; what a plugged attention function sees (``meta``); what a plugged update_batch
    sees (the runner, a message, a new request's data and its state); and 12's pieces."""
    from cbteach import Engine, Request
    from cbteach.attention.paged import default_attention
    from cbteach.engine.scheduler import Scheduler
    from cbteach.worker import model_runner

    seen = {}

    class Capture(Scheduler):
        def make_output(self, plan):
            seen.setdefault("plan", plan)
            return super().make_output(plan)

        def update_from_output(self, scheduler_output, output, now):
            seen.setdefault("scheduler_output", scheduler_output)
            seen.setdefault("runner_output", output)
            seen.setdefault("self", self)
            seen.setdefault("seq", next(iter(self.requests.values())))
            return super().update_from_output(scheduler_output, output, now)

    def attention(query, key, value, meta, layer, scaling):
        seen.setdefault("meta", meta)
        return default_attention(query, key, value, meta, layer, scaling)

    def update_batch(runner, scheduler_output):  # what notebook 06b's worker exercise sees
        model_runner.update_batch(runner, scheduler_output)
        seen.setdefault("runner", runner)
        if scheduler_output.scheduled_new_reqs:
            seen.setdefault("new", scheduler_output.scheduled_new_reqs[0])
            seen.setdefault("state", runner.requests[scheduler_output.scheduled_new_reqs[0].req_id])
        if scheduler_output.scheduled_cached_reqs.req_ids:
            seen.setdefault("batch_message", scheduler_output)

    eng = Engine(bierce[0], None, max_batch_size=2, kv="paged", block_size=4, token_budget=8, prefix_caching=True,
                 scheduler_cls=Capture, attention=attention, update_batch=update_batch)
    eng.run([Request(list(range(3, 14)), 4, request_id="a"), Request(list(range(3, 9)), 3, request_id="b")])
    seen["model"], seen["tok"] = bierce
    return seen


def glossary(c) -> list:
    """What a lone field name in the prose may belong to: the course's live objects."""
    modules = [m for name, m in sorted(sys.modules.items()) if name.split(".")[0] == "cbteach" and m is not None]
    return [c["seq"], c["seq"].request, c["seq"].request.sampling_params, c["plan"], c["scheduler_output"],
            c["runner_output"], c["meta"], c["self"], c["model"].config, *modules]


def contexts(captured, stem: str, solution: str) -> dict:
    """The text's names for real objects, per exercise (``output`` is the message while a step is
    planned, the runner's output in the update); ``model`` and ``tok`` everywhere (cell 2 loads them)."""
    c = captured
    return {"model": c["model"], "tok": c["tok"], **_contexts(c, stem, solution)}


def _contexts(c, stem: str, solution: str) -> dict:
    if stem.startswith("09_"):  # handover(prompt_len, config, ...): a model's config
        return {"config": c["model"].config}
    if stem.startswith("05_"):
        return {"seq": c["seq"], "meta": c["meta"]}
    if stem.startswith("06b_") and "def update_batch" in solution:  # the worker's side of the message (06b)
        msg = c["batch_message"]
        return {"runner": c["runner"], "scheduler_output": msg, "batch": c["runner"].input_batch,
                "cached": msg.scheduled_cached_reqs, "new": c["new"], "state": c["state"]}
    if stem.startswith("06_") and "def update_from_output" not in solution:  # the scheduling step
        return {"self": c["self"], "seq": c["seq"], "plan": c["plan"], "output": c["scheduler_output"]}
    if stem.startswith("06_"):  # update_from_output
        return {"self": c["self"], "seq": c["seq"], "scheduler_output": c["scheduler_output"],
                "output": c["runner_output"], "plan": c["plan"]}
    if stem.startswith("12_"):
        from cbteach.exercises import capstone

        return {"pieces": capstone.pieces_from_notebooks(ROOT / "notebooks", say=lambda *_: None)}
    return {}


def bound_before(cells, index) -> set:
    """Names the code cells before ``index`` bind (``server``, ``long_prompt``): the learner's namespace."""
    return set().union(*(top_level_names(code_tree(source(c))) for c in cells[:index]
                         if c["cell_type"] == "code" and not is_solution(c)))


def course_defs() -> set:
    """Every function a solution of the course defines (a text may point at another notebook's)."""
    names = set()
    for path in NOTEBOOKS:
        for c in json.loads(path.read_text())["cells"]:
            if is_solution(c):
                names |= set(learner_defs(source(c))[0])
    return names


def scope_for(nb: dict, stem: str, indices: list, learner_source: str, captured, namespace=None) -> Scope:
    """What the learner's code reaches at the exercise's last solution cell; ``learner_source``: the
    stub (student copy) or the solution (course), whose functions the text's signatures must match."""
    cells, last = nb["cells"], indices[-1]
    namespace = imports_before(cells, last) if namespace is None else namespace
    defs, written = learner_defs(learner_source)
    solutions = "\n".join(source(cells[i]) for i in indices)
    overrides = {}
    for node in ast.walk(ast.parse(solutions)):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                cls = namespace.get(ast.unparse(base)) if isinstance(base, ast.Name) else None
                for item in node.body if isinstance(cls, type) else ():
                    if isinstance(item, ast.FunctionDef) and callable(getattr(cls, item.name, None)):
                        overrides[item.name] = getattr(cls, item.name)
    written |= learner_defs(solutions)[1] | bound_before(cells, last) | course_defs()
    return Scope(namespace, contexts(captured, stem, solutions), defs, overrides, written,
                 glossary=glossary(captured), course=cbteach)


def text_problems(nb: dict, stem: str, captured) -> list[str]:
    student, _ = strip_solutions(nb)
    found = []
    for indices, text in exercises(nb):
        for copy, cells in (("course", nb["cells"]), ("student copy", student["cells"])):
            scope = scope_for(nb, stem, indices, "\n".join(source(cells[i]) for i in indices), captured)
            for span in code_spans(text):
                found += [f"{stem} cells {indices} ({copy}): {p}" for p in problems(span, scope)]
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_name_an_exercise_tells_the_learner_to_use_exists_as_written(path, captured):
    nb = json.loads(path.read_text())
    found = text_problems(nb, path.stem, captured)
    assert not found, "the exercise text names code that does not exist as written:\n" + "\n".join(found)


def test_the_student_copy_written_by_the_command_has_the_same_exercises(tmp_path):
    """What ``python -m cbteach student`` writes is what the test above reads (its stubs included)."""
    from cbteach.__main__ import main

    assert main(["student", str(ROOT / "notebooks"), str(tmp_path / "student")]) == 0
    for path in NOTEBOOKS:
        written = json.loads((tmp_path / "student" / path.name).read_text())
        stripped, _ = strip_solutions(json.loads(path.read_text()))
        assert [source(c) for c in written["cells"]] == [source(c) for c in stripped["cells"]]


# ---- the checks' hints name real code too -----------------------------------------------------------------------

def hint_texts(module) -> list[str]:
    """Every string a check's module says to the learner: its literals and f-strings' literal parts,
    less docstrings (they speak to whoever reads the code)."""
    tree = ast.parse(Path(module.__file__).read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs]


@pytest.mark.parametrize("name", ["06_scheduling_and_latency", "06b_the_worker"])
def test_notebook_06s_hints_name_its_interface(name, captured):
    """The hints of 06's checks (``rules``, ``update_rules``, ``ex06``) and of 06b's (``batch_rules``,
    ``ex06_batch``) name the calls and signatures the exercise text does -- ``self.make_output(plan)``,
    ``update_from_output(self, scheduler_output, output, now)``, ``batch.remove_request(req_id)``."""
    from cbteach.exercises import batch_rules, ex06, ex06_batch, rules, update_rules

    path = ROOT / "notebooks" / f"{name}.ipynb"
    nb = json.loads(path.read_text())
    student, _ = strip_solutions(nb)
    if name.startswith("06_"):  # two exercises: the scheduling step, its update
        (schedule_at, _), (update_at, _) = exercises(nb)
        checks = ((rules, schedule_at), (update_rules, update_at), (ex06, schedule_at), (ex06, update_at))
        at = schedule_at + update_at
    else:  # one: the worker's update_batch
        ((at, _),) = exercises(nb)
        checks = ((batch_rules, at), (ex06_batch, at))
    everything = imports_before(nb["cells"], len(nb["cells"]))  # a hint may name a check imported later
    stubs = "\n".join(source(student["cells"][i]) for i in at)
    found = []
    for module, indices in checks:
        scope = scope_for(nb, path.stem, indices, stubs, captured, namespace=everything)
        for text in hint_texts(module):
            for fragment in hint_fragments(text):
                found += [f"{module.__name__}: {p}" for p in problems(fragment, scope)]
    assert not found, "a hint names code that does not exist as written:\n" + "\n".join(sorted(set(found)))


# ---- the reader itself: it can fail ------------------------------------------------------------------------------

def test_the_reader_catches_what_issue_43_found(captured):
    """Today's mistakes, as the old 06 text wrote them, are caught; the current interface passes."""
    from cbteach.core.scheduler_output import StepPlan
    from cbteach.engine.scheduler import Scheduler

    def scope():
        return Scope({"Scheduler": Scheduler, "StepPlan": StepPlan},
                     {"self": captured["self"], "seq": captured["seq"], "plan": captured["plan"]},
                     defs={"update_from_output": ["self", "scheduler_output", "output", "now"],
                           "schedule": ["self", "now"]},
                     overrides={"update_from_output": Scheduler.update_from_output, "schedule": Scheduler.schedule})

    s = scope()
    assert problems("out = SchedulerOutput()", s)  # not importable where the learner writes
    assert problems("out.add(seq, n)", s)  # so `out` is nothing
    assert problems("update_from_output(self, plan, output, now)", s)  # not the stub's parameters
    assert problems("self.preempt(seq)", s)  # a missing argument
    assert problems("seq.num_computed", s) and problems("plan.append(seq, n)", s)
    assert problems("schedule(self)", s)
    assert problems("self.update_after_schedule(plan)", s)  # a plan is not the message
    s = scope()
    for fine in ("plan = StepPlan()", "plan.add(seq, n)", "output = self.make_output(plan)",
                 "self.update_after_schedule(output)", "return output", "self.preempt(seq, plan)",
                 "update_from_output(self, scheduler_output, output, now)", "schedule(self, now)",
                 "allocate_slots(seq, n, new_computed_blocks=cached)", "num_computed_tokens", "c .. c + n - 1"):
        assert not problems(fine, s), (fine, problems(fine, s))
