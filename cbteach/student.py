"""``python -m cbteach student SRC DST`` (``make student``): the notebooks as handed to a class;
``python -m cbteach notebooks DIR [--student]``: the course, written out from the installed package.

Exercise solutions live in code cells tagged ``solution``. The student copy keeps every other cell
-- explanations, the exercise's starting code, and the self-check cell -- and replaces each
solution cell's source with a *stub* that names what to write (the functions it defines, with
their signatures, and the names it assigns), visible and runnable, with its outputs cleared. The
self-check cells keep their code but lose their stored output, which would otherwise show the
answer; so do the cells that read the learner's own work (notebook 12's ``pieces_from_notebooks``)
and those that use what such a cell made (:func:`reads_learners_work`): stored in the course copy,
their output shows the course's solutions as "yours". ``--clear-outputs`` clears every cell's
output, for workshops that want learners to predict before they run. Instructors hand out the copy
and keep the originals.

Where the course comes from: in a checkout, ``notebooks/``; in an installed wheel, the copy that
``setup.py`` put into the package as ``cbteach/course/`` (:func:`course_dir`). Neither command
overwrites a notebook that is already there unless given ``--force``: a learner's work is not lost.
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
LEARNERS_WORK = re.compile(r"\bpieces_from_notebooks\(")  # reads the learner's notebooks (12)


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
    """The ``def`` or ``class`` line, after its decorators (``@triton.jit`` is part of what to write)."""
    lines = source.splitlines()
    indent = lines[node.lineno - 1][:len(lines[node.lineno - 1]) - len(lines[node.lineno - 1].lstrip())]
    decorators = [indent + "@" + ast.get_source_segment(source, d) for d in node.decorator_list]
    return "\n".join(decorators + [lines[node.lineno - 1].rstrip()])


def _clear(cell: dict) -> None:
    if cell.get("cell_type") == "code":
        cell["outputs"] = []
        cell["execution_count"] = None


def is_check(cell: dict) -> bool:
    """A self-check cell: code that calls one of :mod:`cbteach.exercises`' checks."""
    src = "".join(cell.get("source", ""))
    return cell.get("cell_type") == "code" and bool(CHECK_CALL.search(src))


def reads_learners_work(cells: list) -> set[int]:
    """The indices of the code cells whose output comes from the learner's own work: a cell that reads
    the learner's notebooks, and every later one with a statement that uses what such a statement
    bound -- or, binding nothing (``(room / "yours.py").write_text(yours)``), may have put it into the
    names it uses. A cell that is not Python (an IPython magic) is skipped."""
    tainted, found = set(), set()
    for i, cell in enumerate(cells):
        if cell.get("cell_type") != "code":
            continue
        src = "".join(cell.get("source", ""))
        try:
            tree = ast.parse(src)
        except SyntaxError:
            continue
        for stmt in tree.body:
            used = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
            bound = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            bound |= {n.name for n in ast.walk(stmt) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            if used & tainted or LEARNERS_WORK.search(ast.get_source_segment(src, stmt) or ""):
                tainted |= bound or used
                found.add(i)
    return found


def strip_solutions(nb: dict, clear_outputs: bool = False) -> tuple[dict, int]:
    """Return a copy of a notebook (as JSON) with solution cells replaced by stubs and the outputs of
    self-checks and of cells that read the learner's work cleared (every output with
    ``clear_outputs``), and how many solution cells there were."""
    out = json.loads(json.dumps(nb))
    learners = reads_learners_work(out.get("cells", []))
    n = 0
    for i, cell in enumerate(out.get("cells", [])):
        if SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            cell["source"] = stub("".join(cell.get("source", "")))
            cell.get("metadata", {}).pop("jupyter", None)  # not collapsed: the learner writes here
            _clear(cell)
            n += 1
        elif clear_outputs or is_check(cell) or i in learners:
            _clear(cell)
    return out, n


COURSE_EXTRAS = ("sanitize.cfg",)          # copied with the notebooks (nbval needs it to check them)
INSTRUCTOR_FILES = ("INSTRUCTOR.md", "WORKSHOP_KIT.md")  # with the full course only, not the student copy


def course_dir() -> Path:
    """Where the course notebooks are: ``notebooks/`` beside the package in a checkout or an editable
    install, else the copy shipped inside the installed package (``cbteach/course/``)."""
    package = Path(__file__).resolve().parent
    for candidate in (package.parent / "notebooks", package / "course"):
        if any(candidate.glob("*.ipynb")):
            return candidate
    raise FileNotFoundError(f"no course notebooks in {package.parent / 'notebooks'} or {package / 'course'}; "
                            "reinstall cbteach from a wheel or a checkout")


def write_course(src: Path, dst: Path, student: bool, force: bool = False, clear_outputs: bool = False,
                 say=print) -> list[Path]:
    """Write ``src``'s notebooks into ``dst`` (with stubs for solutions when ``student``); returns the
    notebooks written. Refuses (FileExistsError) to replace any notebook already in ``dst`` unless ``force``."""
    notebooks = sorted(src.glob("*.ipynb"))
    if not notebooks:
        raise FileNotFoundError(f"no notebooks found in {src}")
    if dst.exists() and not dst.is_dir():
        raise NotADirectoryError(f"{dst} is a file, not a folder")
    if dst.exists() and dst.resolve() == src.resolve():
        raise ValueError(f"{dst} is the folder the notebooks come from: writing there would replace them "
                         "(the solutions with stubs); choose another folder")
    extras = COURSE_EXTRAS + (() if student else INSTRUCTOR_FILES)
    there = [dst / name for name in [p.name for p in notebooks] + [e for e in extras if (src / e).exists()]
             if (dst / name).exists()]
    if there and not force:
        raise FileExistsError(f"{dst} already holds {len(there)} of the course's files ({there[0].name}, ...); "
                              "your work there is kept: choose another folder, or add --force to overwrite")
    books = {path: _read_notebook(path) for path in notebooks}  # all of them first: a bad one stops before DST is made
    dst.mkdir(parents=True, exist_ok=True)
    for path, nb in books.items():
        if student:
            nb, n = strip_solutions(nb, clear_outputs=clear_outputs)
            say(f"{path.name}: {n} solution cell(s) emptied")
        (dst / path.name).write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    for extra in extras:
        if (src / extra).exists():
            (dst / extra).write_text((src / extra).read_text(encoding="utf-8"), encoding="utf-8")
    for name in INSTRUCTOR_FILES if student else ():  # a full copy written there before: the student copy has none
        left, ours = dst / name, src / name
        if left.exists() and ours.exists() and left.read_bytes() == ours.read_bytes():
            left.unlink()
            say(f"{name}: removed (the course's instructor notes have no place in the student copy)")
        elif left.exists():
            say(f"!! {name} is still in {dst}: it is not the course's copy (your own notes?), so it was kept -- "
                "remove it before handing the folder out")
    return [dst / p.name for p in notebooks]


def _read_notebook(path: Path) -> dict:
    """The notebook at ``path`` as JSON, or ``ValueError`` naming the file."""
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:  # (json's errors are ValueErrors)
        raise ValueError(f"{path} is not a notebook: {err}") from None
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list) or \
            not all(isinstance(c, dict) and isinstance(c.get("source", ""), (str, list)) for c in nb["cells"]):
        raise ValueError(f"{path} is not a notebook: it has no list of cells")
    return nb


def cli(argv=None) -> int:
    """``python -m cbteach student [SRC] [DST]``."""
    p = argparse.ArgumentParser(prog="python -m cbteach student", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", nargs="?", default=None,
                   help="folder of notebooks (default: ./notebooks, else the course shipped with cbteach)")
    p.add_argument("dst", nargs="?", default="student", help="where to write (default: student)")
    p.add_argument("--clear-outputs", action="store_true", help="clear every cell's output, not only the checks'")
    p.add_argument("--force", action="store_true", help="overwrite notebooks already in DST")
    a = p.parse_args(argv)
    for name, value in (("SRC", a.src), ("DST", a.dst)):
        if value is not None and not value.strip():  # (Path("") would be the current folder)
            p.error(f"{name} is empty: give a folder, e.g. `python -m cbteach student notebooks student`")
    a.src, a.dst = (Path(a.src) if a.src is not None else None), Path(a.dst)
    src = a.src if a.src is not None else Path("notebooks") if any(Path("notebooks").glob("*.ipynb")) else course_dir()
    if not any(src.glob("*.ipynb")):
        p.error(f"no notebooks found in {src}")
    write_course(src, a.dst, student=True, force=a.force, clear_outputs=a.clear_outputs)
    return 0


def notebooks_cli(argv=None) -> int:
    """``python -m cbteach notebooks DIR [--student] [--force]``: the course from the installed package."""
    p = argparse.ArgumentParser(
        prog="python -m cbteach notebooks",
        description="Write the course's notebooks (with their stored outputs) into DIR, then open them: "
                    "`jupyter lab DIR`. With --student, each exercise's solution is replaced by a stub.")
    p.add_argument("dir", help="folder to write the notebooks into (made if missing)")
    p.add_argument("--student", action="store_true", help="the student copy: solutions replaced by stubs")
    p.add_argument("--force", action="store_true", help="overwrite notebooks already in DIR")
    a = p.parse_args(argv)
    if not a.dir.strip():  # (Path("") would be the current folder)
        p.error("give the folder to write the notebooks into, e.g. `python -m cbteach notebooks course`")
    a.dir = Path(a.dir)
    written = write_course(course_dir(), a.dir, student=a.student, force=a.force, say=lambda _msg: None)
    kind = "notebooks of the student copy (solutions replaced by stubs)" if a.student else "notebooks"
    print(f"wrote {len(written)} {kind} to {a.dir}; open them with: jupyter lab {a.dir}")
    return 0
