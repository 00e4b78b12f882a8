"""Notebook 06 in two teachable parts (issue 55): 06 the scheduler's side, 06b the worker's side. Each states
its goals and its time, holds its own exercises, reads in cells of one idea each, and between them there is one
"Which V1" box."""
import ast
import json
import re
from pathlib import Path

import pytest

from test_notebooks import code_tree, is_solution, source, stated_minutes

NOTEBOOKS = Path(__file__).parent.parent / "notebooks"
PARTS = {"06_scheduling_and_latency": {"MyScheduler", "MyUpdate"}, "06b_the_worker": {"update_batch"}}


def cells(stem):
    return json.loads((NOTEBOOKS / f"{stem}.ipynb").read_text())["cells"]


@pytest.mark.parametrize("stem", PARTS)
def test_each_part_holds_its_own_exercise_and_ends_with_its_check_and_a_summary(stem):
    cs = cells(stem)
    written = set()
    for c in cs:
        if is_solution(c):
            written |= set(re.findall(r"^(?:class|def) (\w+)", source(c), re.M))
    assert written == PARTS[stem]
    last_solution = max(i for i, c in enumerate(cs) if is_solution(c))
    assert any(re.search(r"\bcheck_\w+\(", source(c)) for c in cs[last_solution + 1:] if c["cell_type"] == "code")
    assert source(cs[-1]).startswith("## Summary")


def test_the_two_parts_fill_the_old_slot_and_06b_says_it_follows_06():
    assert stated_minutes(NOTEBOOKS / "06_scheduling_and_latency.ipynb") + \
        stated_minutes(NOTEBOOKS / "06b_the_worker.ipynb") == 90
    assert "06b_the_worker" in source(cells("06_scheduling_and_latency")[0])
    assert "notebook 06" in source(cells("06b_the_worker")[0])


def test_06b_runs_without_anything_written_in_06():
    """06b's code uses no name that only 06 binds: a learner can open it in the slot after 06, done or not."""
    only06 = {"MyScheduler", "MyUpdate", "check_stage", "run", "v1", "v0", "w", "ex06"}
    for c in cells("06b_the_worker"):
        if c["cell_type"] == "code":
            used = {n.id for n in ast.walk(code_tree(source(c))) if isinstance(n, ast.Name)}
            assert not used & only06, (used & only06, source(c)[:200])


def test_one_which_v1_box_and_no_wall_of_text():
    boxes = [(stem, c["id"]) for stem in PARTS for c in cells(stem)
             if c["cell_type"] == "markdown" and source(c).lstrip().startswith("> **Which V1.**")]
    assert len(boxes) == 1, boxes
    walls = [(stem, c["id"], len(source(c).split())) for stem in PARTS for c in cells(stem)
             if c["cell_type"] == "markdown" and len(source(c).split()) > 350]
    assert not walls, f"markdown cells of more than 350 words (issue 55 found one of 959): {walls}"
