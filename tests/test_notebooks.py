"""The course's own rules for every notebook (nbval runs them; this checks their shape)."""
import json
import re
from pathlib import Path

import pytest

import cbteach
from cbteach.student import PLACEHOLDER, strip_solutions

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def cells(path):
    return json.loads(path.read_text())["cells"]


def source(cell):
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def test_course_has_its_notebooks():
    names = [p.stem[:2] for p in NOTEBOOKS]
    assert names[:1] == ["00"] and names == sorted(names)


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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_copy_empties_solutions_but_keeps_checks(path):
    nb = json.loads(path.read_text())
    student, n = strip_solutions(nb)
    assert n >= 1
    for orig, new in zip(nb["cells"], student["cells"]):
        if "solution" in orig.get("metadata", {}).get("tags", []):
            assert new["source"] == PLACEHOLDER and new["outputs"] == []
        else:
            assert new == orig
