"""``python -m cbteach student SRC DST`` (``make student``): the notebooks as handed to a class.

Exercise solutions live in code cells tagged ``solution``. The student copy keeps every other cell
-- explanations, the exercise's starting code, and the self-check cell -- and replaces each
solution cell's source with a placeholder, with its outputs cleared. Instructors hand out the copy
and keep the originals.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

SOLUTION_TAG = "solution"
PLACEHOLDER = "# Your solution here: write it, then run the self-check cell below.\n"


def strip_solutions(nb: dict) -> tuple[dict, int]:
    """Return a copy of a notebook (as JSON) with solution cells emptied, and how many there were."""
    out = json.loads(json.dumps(nb))
    n = 0
    for cell in out.get("cells", []):
        if SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            cell["source"] = PLACEHOLDER
            if cell.get("cell_type") == "code":
                cell["outputs"] = []
                cell["execution_count"] = None
            n += 1
    return out, n


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbteach student", description=__doc__)
    p.add_argument("src", type=Path, nargs="?", default=Path("notebooks"))
    p.add_argument("dst", type=Path, nargs="?", default=Path("student"))
    a = p.parse_args(argv)
    notebooks = sorted(a.src.glob("*.ipynb"))
    if not notebooks:
        p.error(f"no notebooks found in {a.src}")
    a.dst.mkdir(parents=True, exist_ok=True)
    for path in notebooks:
        nb, n = strip_solutions(json.loads(path.read_text()))
        (a.dst / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"{path.name}: {n} solution cell(s) emptied")
    for extra in ("sanitize.cfg",):
        if (a.src / extra).exists():
            (a.dst / extra).write_text((a.src / extra).read_text())
    return 0
