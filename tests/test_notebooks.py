"""The course's own rules for every notebook (nbval runs them; this checks their shape)."""
import ast
import json
import re
from pathlib import Path

import pytest

import cbteach
from cbteach.student import PLACEHOLDER, is_check, strip_solutions

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


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_student_copy_empties_solutions_but_keeps_checks(path):
    nb = json.loads(path.read_text())
    student, n = strip_solutions(nb)
    assert n >= 1
    for orig, new in zip(nb["cells"], student["cells"]):
        if "solution" in orig.get("metadata", {}).get("tags", []):
            assert new["source"].startswith(PLACEHOLDER) and new["outputs"] == []
            assert not new["metadata"].get("jupyter", {}).get("source_hidden")  # visible: the learner types here
            exec(compile(new["source"], "stub", "exec"), {})  # the stub runs
            solution = "".join(orig["source"])
            assert solution.strip() not in new["source"]
            for node in ast.walk(ast.parse(new["source"])):  # it keeps given data, never a computed answer
                if isinstance(node, ast.Assign):
                    ast.literal_eval(node.value)
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                    assert all(isinstance(n, (ast.Expr, ast.Assign, ast.FunctionDef)) for n in node.body)
        elif is_check(orig):  # a check's stored output would show the answer
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
