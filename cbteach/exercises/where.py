"""Where notebook 12 finds the learner's notebooks 05, 06 and 06b, and how it reads the pieces out of them.

It looks in the current folder, the running notebook's folder, then (Colab) Google Drive's ``MyDrive/Colab
Notebooks``, ``MyDrive`` and the folders under it, taking the ``05_*.ipynb`` / ``Copy of 05_*.ipynb`` saved last.
The course's own notebooks hold the solutions and are never searched.
"""
from __future__ import annotations

import ast
import contextlib
import json
import os
import re
from pathlib import Path

COLAB_DRIVE = Path("/content/drive/MyDrive")
COLAB_UPLOADS = Path("/content")


def _front_end_notebook() -> Path | None:
    """The running notebook's path, if the front end tells the kernel (JupyterLab >= 4 / Notebook 7:
    ``JPY_SESSION_NAME``; VS Code: ``__vsc_ipynb_file__`` in the user's namespace)."""
    name = os.environ.get("JPY_SESSION_NAME", "")
    if name.endswith(".ipynb"):
        return Path(name)
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    shell = get_ipython()
    path = shell.user_ns.get("__vsc_ipynb_file__") if shell is not None else None
    return Path(path) if isinstance(path, str) and path.endswith(".ipynb") else None


def search_folders() -> list[Path]:
    """The folders :func:`find_notebook` looks in, in order (see the module): those that exist, each once."""
    drive, notebook = Path(COLAB_DRIVE), _front_end_notebook()
    folders = [Path.cwd(), *([Path.cwd() / notebook.parent] if notebook is not None else []), Path(COLAB_UPLOADS)]
    if drive.is_dir():
        folders += [drive / "Colab Notebooks", drive]
        with contextlib.suppress(OSError):  # Drive can refuse a listing; the folders above are still searched
            folders += sorted(p for p in drive.iterdir() if p.is_dir() and p.name != "Colab Notebooks")
    out: dict = {}
    for folder in folders:
        with contextlib.suppress(OSError):
            if folder.is_dir():
                out.setdefault(folder.resolve(), folder)
    return list(out.values())


def shown(folder: Path) -> str:
    """A folder as the learner reads it: ``the current folder``, or its full path."""
    try:
        here, there = Path.cwd().resolve(), Path(folder).resolve()
    except OSError:
        return str(folder)
    return "the current folder" if there == here and there != Path(COLAB_UPLOADS) else str(there)


def find_notebook(folder: Path, number: str) -> Path | None:
    """Notebook ``number`` (``"05"``) in ``folder``: the ``05_*.ipynb`` or ``Copy of 05_*.ipynb`` saved last."""
    pattern = re.compile(rf"^(Copy of )?{number}_.*\.ipynb$")
    try:
        found = [p for p in Path(folder).iterdir() if pattern.match(p.name) and p.is_file()]
    except OSError:
        return None
    return max(found, key=lambda p: (p.stat().st_mtime, p.name)) if found else None


def is_course_folder(folder: Path) -> bool:
    """Whether ``folder`` is the course's own notebooks (which hold the solutions)."""
    from ..student import course_dir

    try:
        return Path(folder).resolve() == course_dir().resolve()
    except (FileNotFoundError, OSError):
        return False


def normal(source) -> str:
    """A cell's source, compared without trailing spaces and blank lines at either end."""
    text = "".join(source) if isinstance(source, list) else source
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def not_found_text(missing: list[str], searched: list[Path]) -> str:
    """The loud lines printed when notebooks 05/06/06b were found nowhere."""
    bar = "!" * 100
    where = "\n".join(f"!!   {shown(f)}" for f in searched) or "!!   (no folder)"
    names = " and ".join(filter(None, [", ".join(missing[:-1]), missing[-1]]))  # 05, 06 and 06b
    return (f"{bar}\n!! NOT FOUND: notebook {names} -- the pieces written there count as NOT WRITTEN YET.\n"
            f"!! Looked in:\n{where}\n"
            "!! Keep this notebook beside your 05, 06 and 06b and save them. On Colab: upload your saved 05, 06 "
            "and 06b (Files pane, Upload: they land\n!! in /content), or mount Google Drive (from google.colab import "
            "drive; drive.mount('/content/drive')) if you saved\n!! them there (File > Save a copy in Drive puts "
            "them in MyDrive/Colab Notebooks), then run this cell again. Or name the\n!! folder: "
            "capstone.pieces_from_notebooks('path/to/folder'). (Instructors: use_course_solutions=True runs the "
            f"course's own.)\n{bar}")


def course_text(pieces: list[str], why: str) -> str:
    """The loud lines printed when pieces are the course's own solutions."""
    bar = "!" * 100
    return (f"{bar}\n!! NOT YOUR CODE: {', '.join(pieces)} {'is' if len(pieces) == 1 else 'are'} the COURSE'S OWN "
            f"SOLUTION{'' if len(pieces) == 1 else 'S'} ({why}).\n!! Every check, the server and the tournament below "
            f"run the course's answers for them, not yours.\n{bar}")


# -- reading the pieces out of a notebook ---------------------------------------------------------------

def defined(src: str) -> set:
    """The top-level names a cell defines (functions, classes, assignments)."""
    try:
        body = ast.parse(src).body
    except SyntaxError:
        return set()
    return ({n.name for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
            | {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)})


def cells(path: Path, stubbed: bool = False) -> tuple[list[str], list[str], list[str]]:
    """(the import statements of the code cells that are not solutions, the solution cells' sources, the
    heading each solution cell sits under); ``stubbed``: the solution cells as the student copy hands them out."""
    from ..student import SOLUTION_TAG, stub

    imports, solutions, headings, heading = [], [], [], ""
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell.get("cell_type") == "markdown":
            heading = next((line.lstrip("#").strip() for line in src.splitlines() if line.startswith("#")), heading)
        if cell.get("cell_type") != "code":
            continue
        if SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            solutions.append(stub(src) if stubbed else src)
            headings.append(heading)
            continue
        imports += [ast.unparse(n) for n in _top_level(src) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return imports, solutions, headings


def helpers(path: Path) -> dict:
    """``{name: source}`` of the functions and classes defined at the top of the code cells that are not
    solutions (a helper a learner wrote in a cell of its own, beside the course's demos)."""
    from ..student import SOLUTION_TAG

    out = {}
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if cell.get("cell_type") != "code" or SOLUTION_TAG in cell.get("metadata", {}).get("tags", []):
            continue
        out.update({n.name: ast.unparse(n) for n in _top_level(src)
                    if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))})
    return out


def _top_level(src: str) -> list:
    """A code cell's top-level statements, its ``%`` and ``!`` lines left out ([] if it does not parse)."""
    try:
        return ast.parse("\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))).body
    except SyntaxError:
        return []


def binds(statement: str) -> set:
    """The names an import statement binds."""
    node = ast.parse(statement).body[0]
    return {(a.asname or a.name).split(".")[0] for a in node.names}
