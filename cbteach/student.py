"""``python -m cbteach student SRC DST`` (``make student``): the notebooks as handed to a class.

Exercise solutions live in code cells tagged ``solution``. The student copy keeps every other cell
-- explanations, the exercise's starting code, and the self-check cell -- and replaces each
solution cell's source with a *stub* that names what to write (the functions it defines, with
their signatures, and the names it assigns), visible and runnable, with its outputs cleared. The
self-check cells keep their code but lose their stored output, which would otherwise show the
answer. ``--clear-outputs`` clears every cell's output, for workshops that want learners to
predict before they run. Instructors hand out the copy and keep the originals.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
from pathlib import Path

SOLUTION_TAG = "solution"
PLACEHOLDER = "# Your solution here: write it, then run the self-check cell below.\n"


CHECK_CALL = re.compile(r"cbteach\.exercises|\bcheck_\w*\(")


def stub(source: str) -> str:
    """What a learner should write, without the answer: the solution's imports and given data
    (assignments of plain literals) as they are, the signatures of the functions and classes it
    defines, and the other names it assigns -- each left as ``...`` so the stub runs."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return PLACEHOLDER
    lines = []
    for node in tree.body:
        text = ast.get_source_segment(source, node) or ""
        if isinstance(node, (ast.Import, ast.ImportFrom)) or (isinstance(node, ast.Assign) and _literal(node.value)):
            lines.append(text)
        elif isinstance(node, ast.FunctionDef):
            lines += [_head(source, node), "    ...  # your code", ""]
        elif isinstance(node, ast.ClassDef):
            lines.append(_head(source, node))
            for item in node.body:
                if isinstance(item, ast.Assign) and _literal(item.value):
                    lines.append("    " + (ast.get_source_segment(source, item) or ""))
                elif isinstance(item, ast.FunctionDef):
                    lines += ["", "    " + _head(source, item).strip(), "        ...  # your code"]
            lines.append("")
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            lines.append(" = ".join(ast.unparse(t) for t in targets) + " = ...  # your answer")
    return PLACEHOLDER + ("\n".join(lines).rstrip() + "\n" if lines else "")


def _literal(value) -> bool:
    try:
        ast.literal_eval(value)
        return True
    except ValueError:
        return False


def _head(source: str, node) -> str:
    return source.splitlines()[node.lineno - 1].rstrip()


def _clear(cell: dict) -> None:
    if cell.get("cell_type") == "code":
        cell["outputs"] = []
        cell["execution_count"] = None


def is_check(cell: dict) -> bool:
    """A self-check cell: code that calls one of :mod:`cbteach.exercises`' checks."""
    src = "".join(cell.get("source", ""))
    return cell.get("cell_type") == "code" and bool(CHECK_CALL.search(src))


def strip_solutions(nb: dict, clear_outputs: bool = False) -> tuple[dict, int]:
    """Return a copy of a notebook (as JSON) with solution cells replaced by stubs and self-check
    outputs cleared (every output with ``clear_outputs``), and how many solution cells there were."""
    out = json.loads(json.dumps(nb))
    n = 0
    for cell in out.get("cells", []):
        if SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            cell["source"] = stub("".join(cell.get("source", "")))
            cell.get("metadata", {}).pop("jupyter", None)  # not collapsed: the learner writes here
            _clear(cell)
            n += 1
        elif clear_outputs or is_check(cell):
            _clear(cell)
    return out, n


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbteach student", description=__doc__)
    p.add_argument("src", type=Path, nargs="?", default=Path("notebooks"))
    p.add_argument("dst", type=Path, nargs="?", default=Path("student"))
    p.add_argument("--clear-outputs", action="store_true", help="clear every cell's output, not only the checks'")
    a = p.parse_args(argv)
    notebooks = sorted(a.src.glob("*.ipynb"))
    if not notebooks:
        p.error(f"no notebooks found in {a.src}")
    a.dst.mkdir(parents=True, exist_ok=True)
    for path in notebooks:
        nb, n = strip_solutions(json.loads(path.read_text()), clear_outputs=a.clear_outputs)
        (a.dst / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        print(f"{path.name}: {n} solution cell(s) emptied")
    for extra in ("sanitize.cfg",):
        if (a.src / extra).exists():
            (a.dst / extra).write_text((a.src / extra).read_text())
    return 0
