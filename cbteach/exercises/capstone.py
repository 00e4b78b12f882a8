"""Your engine: the pieces you wrote in notebooks 05 and 06, assembled into one engine (notebook 12).

Four plug points of :class:`~cbteach.Engine` take a learner's pieces (:mod:`cbteach.engine.plug`):

==================  ==========================  ===========  ================================
piece               ``Engine(...)`` keyword      notebook     ``serve`` option
==================  ==========================  ===========  ================================
``MyKVManager``     ``kv_manager=``              05           ``--kv-manager MODULE:CLASS``
``my_slot_mapping`` ``slot_mapping=``            05           ``--slot-mapping MODULE:FUNCTION``
``my_attention``    ``attention=``               05           ``--attention MODULE:FUNCTION``
``MyScheduler`` +   ``scheduler_cls=``           06           ``--scheduler MODULE:CLASS``
``MyUpdate``
==================  ==========================  ===========  ================================

:func:`pieces_from_notebooks` reads them from the notebooks themselves -- the cells tagged
``solution``, where the learner typed them (in the course copy they hold the solutions), after the
imports of the cells before them -- and :func:`write_module` writes them into one ``.py`` file that
``python -m cbteach serve`` can import. :func:`refuse_broken_pieces` is what ``serve`` calls first
when piece options are given: each piece runs its own notebook's check, and one that fails stops
the server before it starts, with the check's hint (a piece that breaks a rule later, mid-run, stops
its engine with :class:`~cbteach.errors.EngineRuleError`).
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.scheduler import Scheduler

# piece -> (notebook number, the names it is made of, serve's option, Engine's keyword)
PIECES = {
    "kv_manager": ("05", ("MyKVManager",), "--kv-manager", "kv_manager"),
    "slot_mapping": ("05", ("my_slot_mapping",), "--slot-mapping", "slot_mapping"),
    "attention": ("05", ("my_attention",), "--attention", "attention"),
    "scheduler": ("06", ("MyScheduler", "MyUpdate"), "--scheduler", "scheduler_cls"),
}
ENGINE_CLASS = "MyEngineScheduler"  # MyScheduler's schedule with MyUpdate's update_from_output


@dataclass
class Pieces:
    """The learner's pieces as objects (``None``: not written yet), and the source they came from."""

    objects: dict = field(default_factory=dict)  # piece -> object (the scheduler: the combined class)
    source: str = ""  # a module defining every piece (write_module writes it)
    where: dict = field(default_factory=dict)  # notebook number -> the notebook's path

    def engine_kwargs(self) -> dict:
        """The pieces as ``Engine(...)`` keywords (those written so far)."""
        return {PIECES[k][3]: v for k, v in self.objects.items() if v is not None}


def _notebook(folder: Path, number: str) -> Path | None:
    found = sorted(folder.glob(f"{number}_*.ipynb"))
    return found[0] if found else None


def _cells(path: Path) -> tuple[list[str], list[str]]:
    """(the import statements of the code cells that are not solutions, the solution cells' sources)."""
    imports, solutions = [], []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell.get("cell_type") != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        if "solution" in cell.get("metadata", {}).get("tags", []):
            solutions.append(src)
            continue
        try:
            tree = ast.parse("\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!"))))
        except SyntaxError:
            continue
        imports += [ast.unparse(n) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    return imports, solutions


def pieces_source(folder=None) -> tuple[str, dict]:
    """A module's text with every piece from notebooks 05 and 06 in ``folder`` (default: the current
    folder if it holds them, else the course's own notebooks), and where each notebook was found."""
    from ..student import course_dir

    folder = Path(folder) if folder is not None else Path.cwd()
    if folder.is_dir() and _notebook(folder, "05") is None and _notebook(folder, "06") is None:
        try:
            folder = course_dir()
        except FileNotFoundError:
            pass
    where, imports, bodies = {}, ["import math"], []  # math: notebook 06 imports it before its exercise
    for number in ("05", "06"):
        path = _notebook(folder, number)
        if path is None:
            raise ValueError(f"no notebook {number}_*.ipynb in {folder}: your pieces are read from notebooks 05 and "
                             "06 -- keep notebook 12 in the same folder, and save those notebooks")
        where[number] = path
        more, solutions = _cells(path)
        imports += [i for i in more if i not in imports]
        bodies += [f"# -- from {path.name} --\n{s.strip()}\n" for s in solutions]
    used = {n.id for b in bodies for n in ast.walk(ast.parse(b)) if isinstance(n, ast.Name)}
    imports = [i for i in imports if _binds(i) & used]  # only what the pieces use
    combined = (f"\n\nclass {ENGINE_CLASS}(MyScheduler, MyUpdate):\n    \"\"\"Your schedule (notebook 06, stages 1-4) "
                "and your update (stage 5): one scheduler.\"\"\"\n")
    header = '"""Your engine\'s pieces, written from notebooks 05 and 06 (cbteach.exercises.capstone)."""\n'
    return header + "\n".join(imports) + "\n\n\n" + "\n\n".join(bodies) + combined, where


def _binds(statement: str) -> set:
    """The names an import statement binds."""
    node = ast.parse(statement).body[0]
    return {(a.asname or a.name).split(".")[0] for a in node.names}


def pieces_from_notebooks(folder=None) -> Pieces:
    """The learner's pieces, read from notebooks 05 and 06 (see :func:`pieces_source`) and run."""
    source, where = pieces_source(folder)
    namespace: dict = {"__name__": "my_engine"}
    exec(compile(source, "my_engine.py", "exec"), namespace)  # noqa: S102 -- the learner's own code
    objects = {}
    for piece, (_, names, _, _) in PIECES.items():
        found = [namespace.get(n) for n in names]
        objects[piece] = None if any(_is_stub(o) for o in found) else found[0]
    if objects["scheduler"] is not None:
        objects["scheduler"] = namespace[ENGINE_CLASS]
    return Pieces(objects, source, where)


def _stub():
    ...  # what the student copy's stub of a function compiles to


def _is_stub(obj) -> bool:
    """Not written yet: missing, ``...``, or the student copy's stub (functions whose body is ``...``)."""
    if obj is None or obj is Ellipsis:
        return True
    if isinstance(obj, type):
        own = [f for f in vars(obj).values() if callable(f) and hasattr(f, "__code__")]
        return bool(own) and all(_is_stub(f) for f in own)
    code = getattr(obj, "__code__", None)
    return code is not None and code.co_code == _stub.__code__.co_code and code.co_consts == _stub.__code__.co_consts


def write_module(path, folder=None) -> Path:
    """Write the pieces of notebooks 05 and 06 into ``path`` (a ``.py`` file ``serve`` imports)."""
    path = Path(path)
    path.write_text(pieces_source(folder)[0], encoding="utf-8")
    return path


def serve_options(module: str) -> list[str]:
    """``serve``'s options that plug every piece of ``module`` (a module name, e.g. ``"my_engine"``)."""
    return ["--scheduler", f"{module}:{ENGINE_CLASS}", "--kv-manager", f"{module}:MyKVManager",
            "--attention", f"{module}:my_attention", "--slot-mapping", f"{module}:my_slot_mapping"]


# -- a piece's own check ----------------------------------------------------------------------------------

def check_piece(piece: str, obj, model, tok=None, slot_mapping=None, prefix_caching: bool = True) -> tuple[bool, str]:
    """Run ``piece``'s own notebook check on ``obj``: (passed, what the check said -- its failure if any).
    ``prefix_caching=False``: the scheduler is not checked on workloads with prefix caching on."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = _run_check(piece, obj, model, tok, slot_mapping, prefix_caching)
    lines = [line[2:] if line[:2] in ("✓ ", "✗ ") else line for line in out.getvalue().strip().splitlines()]
    failed = [line for line in out.getvalue().splitlines() if line.startswith("✗ ")]
    return bool(ok), (failed[0][2:] if failed else (lines[-1] if lines else ""))


def _token_prompts(model) -> list:
    """Prompts as token ids, for a model without a tokenizer (clear of its special ids 0-2)."""
    span = max(1, min(model.config.vocab_size, 97) - 3)
    return [[3 + (13 * i + 5 * j) % span for j in range(5 + 4 * i)] for i in range(5)]


def _run_check(piece, obj, model, tok, slot_mapping, prefix_caching=True) -> bool:
    prompts = None if tok is not None else _token_prompts(model)
    if piece == "kv_manager":
        from .ex05 import check_kv_manager

        return check_kv_manager(obj, model)
    if piece == "slot_mapping":
        from .ex05_attention import check_slot_mapping

        return check_slot_mapping(obj, model, tok, prompts)
    if piece == "attention":
        from .ex05_attention import check_paged_attention

        return check_paged_attention(obj, model, tok, prompts, slot_mapping=slot_mapping)
    from .ex06 import check_stage

    if not (isinstance(obj, type) and issubclass(obj, Scheduler)):
        return check_stage(1, obj, model)  # its answer says what a scheduler must be
    stages = ([1, 2, 3, 4] if obj.schedule is not Scheduler.schedule else []) + \
        ([5] if obj.update_from_output is not Scheduler.update_from_output else [])
    if not stages:
        return check_stage(1, obj, model)  # "not done yet"
    return all(check_stage(s, obj, model, prefix_caching=prefix_caching) for s in stages)  # stops at a failure


def _options(argv: list[str]) -> dict:
    """serve's ``--OPTION VALUE`` / ``--OPTION=VALUE`` pairs for the pieces and the model."""
    wanted = {spec[2]: piece for piece, spec in PIECES.items()} | {"--model": "model"}
    found, i = {}, 0
    while i < len(argv):
        name, eq, value = argv[i].partition("=")
        if name in wanted:
            if not eq:
                if i + 1 >= len(argv):
                    raise ValueError(f"{name} takes a value (MODULE:NAME)")
                value, i = argv[i + 1], i + 1
            found[wanted[name]] = value
        i += 1
    return found


def refuse_broken_pieces(argv) -> dict:
    """``serve`` with piece options: import each ``MODULE:NAME`` (the current folder on the path) and
    run its notebook's check on serve's ``--model``; a piece that fails raises ``ValueError`` with the
    check's hint, before the server starts. (A scheduler meets prefix caching in its check only if serve
    turns it on.) Returns the pieces, by Engine keyword."""
    from ..models import load_model
    from ..serving.engine_core import load_piece

    argv = list(argv)
    options = _options(argv)
    specs = {k: v for k, v in options.items() if k != "model"}
    if not specs:
        return {}
    if "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))  # python -m puts it there; a direct call may not
    loaded = {piece: load_piece(spec, piece) for piece, spec in specs.items()}
    print(f"checking {len(loaded)} piece(s) with their notebooks' checks before the server starts (seconds on "
          "bierce)...", file=sys.stderr)
    model, tok = load_model(options.get("model", "bierce"), device="cpu")
    for piece in ("kv_manager", "slot_mapping", "attention", "scheduler"):
        if piece not in loaded:
            continue
        ok, said = check_piece(piece, loaded[piece], model, tok, slot_mapping=loaded.get("slot_mapping"),
                               prefix_caching="--prefix-caching" in argv)
        if not ok:
            raise ValueError(f"{PIECES[piece][2]} {specs[piece]} failed its check (notebook {PIECES[piece][0]}), so "
                             f"the server does not start: {said}")
        print(f"{PIECES[piece][2]} {specs[piece]}: passed its check (notebook {PIECES[piece][0]})", file=sys.stderr)
    return {PIECES[p][3]: obj for p, obj in loaded.items()}
