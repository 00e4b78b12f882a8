"""Your engine: the pieces you wrote in notebooks 05, 06 and 06b, read from those notebooks and assembled
(notebook 12).

:data:`PIECES` names each piece, its notebook, ``serve``'s option and ``Engine``'s keyword.
:func:`pieces_from_notebooks` reads the solution cells (where the learner typed them), a piece not written
yet -- or, with :func:`stand_in`, one that fails its check -- replaced by the course's and marked so;
:func:`write_module` writes them into a ``.py`` file ``serve`` imports, and :func:`refuse_broken_pieces`
stops ``serve`` before it starts when a piece fails its notebook's check.
"""
from __future__ import annotations

import ast
import contextlib
import io
import linecache
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..engine.scheduler import Scheduler
from . import guard, is_stub, where


class Piece(NamedTuple):
    notebook: str  # the notebook's number
    names: tuple  # the names the piece is made of
    option: str  # serve's option
    engine_kwarg: str  # Engine's keyword


PIECES = {
    "kv_manager": Piece(notebook="05", names=("MyKVManager",), option="--kv-manager", engine_kwarg="kv_manager"),
    "slot_mapping": Piece(notebook="05", names=("my_slot_mapping",), option="--slot-mapping",
                          engine_kwarg="slot_mapping"),
    "attention": Piece(notebook="05", names=("my_attention",), option="--attention", engine_kwarg="attention"),
    "scheduler": Piece(notebook="06", names=("MyScheduler", "MyUpdate"), option="--scheduler",
                       engine_kwarg="scheduler_cls"),
    "update_batch": Piece(notebook="06b", names=("update_batch",), option="--update-batch",  # the worker's side
                          engine_kwarg="update_batch"),
}
ENGINE_CLASS = "MyEngineScheduler"  # MyScheduler's schedule with MyUpdate's update_from_output


@dataclass
class Pieces:
    """The learner's pieces as objects (``None``: not written yet), their module's source, where each
    notebook was found (``None``: nowhere), and which pieces are the course's own."""

    objects: dict = field(default_factory=dict)  # piece -> object (the scheduler: the combined class)
    source: str = ""  # a module defining every piece (write_module writes it)
    where: dict = field(default_factory=dict)  # notebook number -> the notebook's path, or None
    course: set = field(default_factory=set)  # pieces that are the course's solutions, not the learner's
    searched: list = field(default_factory=list)  # the folders looked in
    filled: dict = field(default_factory=dict)  # piece not written yet -> the cell to write it in (the course's runs)
    read_with: dict = field(default_factory=dict, repr=False)  # how they were read (stand_in reads them again)

    @property
    def yours(self) -> list:
        """The pieces that are the learner's own."""
        return [p for p in PIECES if self.objects.get(p) is not None and p not in self.course]

    def engine_kwargs(self) -> dict:
        """The pieces as ``Engine(...)`` keywords (those written so far)."""
        return {PIECES[k].engine_kwarg: v for k, v in self.objects.items() if v is not None}

    def report(self) -> str:
        """Every piece: its name, and the folder and file it came from -- and, in lines that cannot be
        missed, which notebooks were not found and which pieces are the course's own solutions."""
        lines = []
        for piece, (number, names, _, _) in PIECES.items():
            path = self.where.get(number)
            what = "not written yet" if self.objects.get(piece) is None else " + ".join(names)
            origin = f"{path.name}  in {where.shown(path.parent)}" if path is not None else f"no notebook {number} found"
            mark = "   <-- THE COURSE'S SOLUTION" if piece in self.course else ""
            if piece in self.filled:
                mark = f"   <-- THE COURSE'S ({self.filled[piece]})"
            lines.append(f"{piece:13s} {what:22s} from {origin}{mark}")
        missing = [n for n, p in self.where.items() if p is None]
        if missing:
            lines.append(where.not_found_text(missing, self.searched))
        if self.filled:
            lines.append(where.course_text(list(self.filled), "not written yet, failing its check, or asked for: "
                                                              "the course's solution stands in, so the engine runs"))
        if self.course - set(self.filled):
            folders = {p.parent for p in self.where.values() if p is not None}
            why = ("read from the course's own notebooks, the folder cbteach's course is shipped in"
                   if len(folders) == 1 and where.is_course_folder(next(iter(folders)))
                   else "their cells are the course's solution cells, whatever their comments, layout or names")
            lines.append(where.course_text([p for p in PIECES if p in self.course and p not in self.filled], why))
        return "\n".join(lines)


def _read(folder=None, use_course_solutions: bool = False, use_course_for=(), failed=None) -> tuple:
    """(the pieces module's text, where each notebook was found, the pieces that are the course's
    solutions, the folders searched, the pieces not written yet -> where to write them). A notebook found
    nowhere gives the student copy's stubs; a piece whose cell is still the stub gets the course's cell."""
    from ..student import course_dir, stub

    if use_course_solutions:
        folders = [course_dir()]
    elif folder is not None:
        folders = [Path(folder)]
        if not folders[0].is_dir():
            raise ValueError(f"{folder} is not a folder: name the folder that holds your notebooks 05, 06 and 06b")
    else:
        folders = where.search_folders()
    found = {n: next((p for p in (where.find_notebook(f, n) for f in folders) if p is not None), None)
             for n in dict.fromkeys(number for number, *_ in PIECES.values())}  # 05, 06, 06b
    if folder is not None and not use_course_solutions and not any(found.values()):
        raise ValueError(f"no notebook 05_*.ipynb, 06_*.ipynb or 06b_*.ipynb in {folder}: your pieces are read from "
                         "notebooks 05, 06 and 06b -- name the folder you saved them in")
    imports, bodies, course_names, filled = ["import math"], [], set(), {}  # math: notebook 06 imports it
    for number, path in found.items():
        try:
            course_path = where.find_notebook(course_dir(), number)
        except FileNotFoundError:  # no course notebooks: no course cells to stand in
            course_path = None
        source_path = path if path is not None else course_path
        if source_path is None:  # no cell at all: empty classes and functions
            bodies += [f"class {name}:\n    pass\n" if name.startswith("My") else f"def {name}(*args):\n    ...\n"
                       for n, names, _, _ in PIECES.values() if n == number for name in names]
            continue
        more, solutions, _ = where.cells(source_path, stubbed=path is None)
        imports += [i for i in more if i not in imports]
        theirs = dict(zip(*where.cells(course_path)[1:])) if path is not None and course_path is not None else {}
        for i, s in enumerate(solutions):
            twin = next((c for c in theirs if where.defined(c) == where.defined(s)), None)
            asked = where.defined(s) & {n for p in use_course_for for n in PIECES[p].names}  # yours does not pass yet
            failing = next((p for p in failed or {} if where.defined(s) & set(PIECES[p].names)), None)
            if twin is not None and (asked or failing or where.normal(s) == where.normal(stub(twin))):  # the course's
                solutions[i] = twin
                why = (f"yours fails its own check: {failed[failing]}" if failing else
                       "you asked for the course's" if asked else "yours is not written yet")
                filled.update({n: f"{why}: notebook {number}, the cell under '{theirs[twin]}'" for n in where.defined(s)})
            elif where.normal(s) in {where.normal(c) for c in theirs}:  # a solution cell pasted in, or the course's
                course_names |= where.defined(s)
        label = path.name if path is not None else f"{number} (not found: the student copy's stubs)"
        bodies += [f"# -- from {label} --\n{s.strip()}\n" for s in solutions]
    used = {n.id for b in bodies for n in ast.walk(ast.parse(b)) if isinstance(n, ast.Name)}
    imports = [i for i in imports if where.binds(i) & used]  # only what the pieces use
    combined = (f"\n\nclass {ENGINE_CLASS}(MyScheduler, MyUpdate):\n    \"\"\"Your schedule (notebook 06, stages 1-4) "
                "and your update (stage 5): one scheduler.\"\"\"\n")
    header = '"""Your engine\'s pieces, written from notebooks 05 and 06 (cbteach.exercises.capstone)."""\n'
    source = header + "\n".join(imports) + "\n\n\n" + "\n\n".join(bodies) + combined
    course = {p for p, (_, names, _, _) in PIECES.items() if course_names & set(names)}
    filled = {p: next(filled[n] for n in names if n in filled) for p, (_, names, _, _) in PIECES.items()
              if filled.keys() & set(names)}
    if "scheduler" in course | set(filled):  # the tournament's table marks it (tournament_core.run_entry)
        source += f"\n\n{PIECES['scheduler'].names[0]}.course_solution = True  # the course's, not yours\n"
    return source, found, course, folders, filled


def pieces_source(folder=None, use_course_solutions: bool = False) -> tuple[str, dict]:
    """A module's text with every piece from notebooks 05 and 06 -- in ``folder``, or where the learner
    works (:mod:`cbteach.exercises.where`) -- and where each notebook was found (``None``: nowhere)."""
    source, found, _, _, _ = _read(folder, use_course_solutions)
    return source, found


def pieces_from_notebooks(folder=None, *, use_course_solutions: bool = False, use_course_for=(), say=print) -> Pieces:
    """The learner's pieces, read from notebooks 05 and 06 in ``folder`` (default: where the learner works,
    :func:`where.search_folders`) and run; ``say`` gets :meth:`Pieces.report`. A piece not written yet, or named in
    ``use_course_for``, is the course's, marked so everywhere; ``use_course_solutions=True`` (instructors): all."""
    unknown = set(use_course_for) - set(PIECES)
    if isinstance(use_course_for, str) or unknown:
        raise ValueError(f"use_course_for takes a list of pieces, each one of {list(PIECES)}; got {use_course_for!r}")
    pieces = _assemble(dict(folder=folder, use_course_solutions=use_course_solutions,
                            use_course_for=list(use_course_for)))
    if say is not None:
        say(pieces.report())
    return pieces


def stand_in(pieces: Pieces, failed: dict) -> bool:
    """Catch-up: read ``pieces`` again with the course's piece, marked as the course's, in place of each piece
    of ``failed`` (piece -> what its check said). False if they were not read from notebooks (nothing to read)."""
    if not pieces.read_with:
        return False
    vars(pieces).update(vars(_assemble(pieces.read_with, {**pieces.read_with.get("failed", {}), **failed})))
    return True


def _assemble(read_with: dict, failed=None) -> Pieces:
    """The pieces read as ``read_with`` says (:func:`pieces_from_notebooks`'s arguments), run."""
    read_with = {**read_with, **({"failed": failed} if failed else {})}
    source, found, course, searched, filled = _read(**read_with)
    namespace: dict = {"__name__": "my_engine"}
    filename = f"<my_engine {len(linecache.cache)}>"  # kept as a notebook keeps a cell: the guard reads the source
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # noqa: S102 -- the learner's own code
    objects = {}
    for piece, (_, names, _, _) in PIECES.items():
        got = [namespace.get(n) for n in names]
        missing = found[PIECES[piece].notebook] is None  # its notebook was found nowhere: not written
        objects[piece] = None if missing or any(is_stub(o) for o in got) else got[0]
    if objects["scheduler"] is not None:
        objects["scheduler"] = namespace[ENGINE_CLASS]
    course = {p for p in course | set(filled) if objects[p] is not None}
    return Pieces(objects, source, found, course, searched, {p: w for p, w in filled.items() if p in course}, read_with)


def write_module(path, pieces=None) -> Path:
    """Write the pieces into ``path`` (a ``.py`` file ``serve`` imports): ``pieces`` is what
    :func:`pieces_from_notebooks` returned, or a folder to read notebooks 05 and 06 from (default: where
    the learner works, as :func:`pieces_from_notebooks` looks)."""
    path = Path(path)
    path.write_text(pieces.source if isinstance(pieces, Pieces) else pieces_source(pieces)[0], encoding="utf-8")
    return path


def serve_options(module: str) -> list[str]:
    """``serve``'s options that plug every piece of ``module`` (a module name, e.g. ``"my_engine"``)."""
    return ["--scheduler", f"{module}:{ENGINE_CLASS}", "--kv-manager", f"{module}:MyKVManager",
            "--attention", f"{module}:my_attention", "--slot-mapping", f"{module}:my_slot_mapping",
            "--update-batch", f"{module}:update_batch"]


# -- a piece's own check ----------------------------------------------------------------------------------

def check_piece(piece: str, obj, model, tok=None, slot_mapping=None, prefix_caching: bool = True) -> tuple[bool, str]:
    """Run ``piece``'s own notebook check on ``obj``: (passed, what the check said -- its failure if any).
    ``prefix_caching=False``: the scheduler is not checked on workloads with prefix caching on. A piece
    that is, or calls, the engine's or the course's own is refused first (:mod:`.guard`)."""
    refused = guard.refusal(piece, obj)
    if refused:
        return False, refused
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
    from . import ex05, ex05_attention, ex06, ex06_batch  # the notebooks' checks, imported when one runs

    prompts = None if tok is not None else _token_prompts(model)
    if piece == "kv_manager":
        return ex05.check_kv_manager(obj, model)
    if piece == "slot_mapping":
        return ex05_attention.check_slot_mapping(obj, model, tok, prompts)
    if piece == "attention":
        return ex05_attention.check_paged_attention(obj, model, tok, prompts, slot_mapping=slot_mapping)
    if piece == "update_batch":
        return ex06_batch.check_update_batch(obj, model)
    check_stage = ex06.check_stage
    if not (isinstance(obj, type) and issubclass(obj, Scheduler)):
        return check_stage(1, obj, model)  # its answer says what a scheduler must be
    stages = ([1, 2, 3, 4] if obj.schedule is not Scheduler.schedule else []) + \
        ([5] if obj.update_from_output is not Scheduler.update_from_output else [])
    if not stages:
        return check_stage(1, obj, model)  # "not done yet"
    return all(check_stage(s, obj, model, prefix_caching=prefix_caching) for s in stages)  # stops at a failure


def _options(argv: list[str]) -> dict:
    """serve's ``--OPTION VALUE`` / ``--OPTION=VALUE`` pairs for the pieces and the model."""
    wanted = {spec.option: piece for piece, spec in PIECES.items()} | {"--model": "model"}
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
    """``serve`` with piece options: each ``MODULE:NAME`` imported and run through its notebook's check on serve's
    ``--model``; a failing piece raises ``ValueError`` with the hint before the server starts. Returns them."""
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
    for piece in (p for p in PIECES if p in loaded):  # in the notebooks' order
        ok, said = check_piece(piece, loaded[piece], model, tok, slot_mapping=loaded.get("slot_mapping"),
                               prefix_caching="--prefix-caching" in argv)
        if not ok:
            raise ValueError(f"{PIECES[piece].option} {specs[piece]} failed its check (notebook "
                             f"{PIECES[piece].notebook}), so the server does not start: {said}")
        print(f"{PIECES[piece].option} {specs[piece]}: passed its check (notebook {PIECES[piece].notebook})",
              file=sys.stderr)
    return {PIECES[p].engine_kwarg: obj for p, obj in loaded.items()}
