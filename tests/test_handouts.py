"""tools/handouts.py: one Markdown handout per exercise, from the notebooks' solution cells, whose stub
is exactly what the student copy shows and whose solution is the notebook's cell, verbatim."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from cbteach.student import SOLUTION_TAG, strip_solutions

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import handouts  # noqa: E402


def test_one_handout_per_exercise_with_the_student_stub_and_the_solution(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "handouts.py"), "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    files = sorted(p for p in tmp_path.glob("*.md") if p.name != "index.md")
    solution_cells, headings = 0, set()
    for book in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = json.loads(book.read_text(encoding="utf-8"))
        student, _ = strip_solutions(nb)
        for i, cell in enumerate(nb["cells"]):
            if SOLUTION_TAG not in cell.get("metadata", {}).get("tags", []):
                continue
            solution_cells += 1
            (ex,) = [e for e in handouts.exercises(book) if i in [j for j, _ in e.solutions]]
            headings.add((book.name, ex.heading_cell))
            text = (tmp_path / ex.filename).read_text(encoding="utf-8")
            assert ex.heading in text.splitlines()[0]
            assert "".join(cell["source"]).rstrip() in text  # the course's solution, verbatim
            assert "".join(student["cells"][i]["source"]).rstrip() in text  # what the student copy shows
    assert solution_cells >= 15 and len(files) == len(headings)  # cells under one heading share a handout
    index = (tmp_path / "index.md").read_text(encoding="utf-8")
    assert all(f"]({p.name})" in index for p in files)
    assert out.stdout.strip() == f"wrote {len(files)} handouts and index.md to {tmp_path}"


def test_bad_folders_say_what_was_wrong(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert handouts.main(["--notebooks", str(empty), "--out", str(tmp_path / "o")]) == 2
    assert "holds no .ipynb file" in capsys.readouterr().err
    (tmp_path / "f").write_text("x")
    assert handouts.main(["--out", str(tmp_path / "f")]) == 2
    assert "is a file: give a folder" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is the notebooks folder"):
        handouts.write_handouts(ROOT / "notebooks", ROOT / "notebooks")
