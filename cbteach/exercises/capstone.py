"""Your engine (notebook 12): the pieces you wrote in notebooks 05, 06 and 06b, read from those notebooks.

:func:`pieces_from_notebooks` reads the solution cells; the course's piece, marked as the course's, stands in for
one not written yet, asked for, or (:func:`stand_in`) failing its check. :func:`write_module` writes them into the
``.py`` file ``serve`` imports; :func:`refuse_broken_pieces` stops ``serve`` when a piece fails its check.
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
    """The learner's pieces (``None``: not written yet), their module's source, and whose each is."""

    objects: dict = field(default_factory=dict)  # piece -> object (the scheduler: the combined class)
    source: str = ""  # a module defining every piece (write_module writes it)
    where: dict = field(default_factory=dict)  # notebook number -> the notebook's path, or None
    course: set = field(default_factory=set)  # pieces that are the course's solutions, not the learner's
    searched: list = field(default_factory=list)  # the folders looked in
    filled: dict = field(default_factory=dict)  # piece the course's stands in for -> why, and its cell
    read_with: dict = field(default_factory=dict, repr=False)  # how they were read (stand_in reads them again)

    @property
    def yours(self) -> list:
        """The pieces that are the learner's own."""
        return [p for p in PIECES if self.objects.get(p) is not None and p not in self.course]

    def engine_kwargs(self) -> dict:
        """The pieces as ``Engine(...)`` keywords (those written so far)."""
        return {PIECES[k].engine_kwarg: v for k, v in self.objects.items() if v is not None}

    def report(self) -> str:
        """Every piece and the file it came from; in lines that cannot be missed, the notebooks not found and
        the pieces that are the course's own."""
        lines = []
        for piece, (number, names, _, _) in PIECES.items():
            path = self.where.get(number)
            what = "not written yet" if self.objects.get(piece) is None else " + ".join(names)
            origin = (f"{path.name}  in {where.shown(path.parent)}" if path is not None
                      else f"no notebook {number} found")
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


def _read(folder=None, use_course_solutions: bool = False, use_course_for=(), failed=None) -> Pieces:
    """The pieces' module text (no objects yet), read from notebooks 05, 06 and 06b; a notebook found nowhere gives
    the student copy's stubs. The course's cell stands in for a piece whose cell is the stub, asked for
    (``use_course_for``) or ``failed`` (piece -> its check's hint); a cell equal to the course's is marked so."""
    from ..student import course_dir, stub

    if folder is not None and not use_course_solutions and not Path(folder).is_dir():
        raise ValueError(f"{folder} is not a folder: name the folder that holds your notebooks 05, 06 and 06b")
    folders = ([course_dir()] if use_course_solutions else where.search_folders() if folder is None
               else [Path(folder)])
    found = {n: next(filter(None, (where.find_notebook(f, n) for f in folders)), None)
             for n in dict.fromkeys(spec.notebook for spec in PIECES.values())}  # 05, 06, 06b
    if folder is not None and not use_course_solutions and not any(found.values()):
        raise ValueError(f"no notebook 05_*.ipynb, 06_*.ipynb or 06b_*.ipynb in {folder}: your pieces are read from "
                         "notebooks 05, 06 and 06b -- name the folder you saved them in")
    piece_of = {name: piece for piece, spec in PIECES.items() for name in spec.names}
    imports, bodies, course, filled = ["import math"], [], set(), {}  # math: notebook 06 imports it
    helpers = {}  # a function or class of the learner's own, in another cell of theirs: name -> (notebook, source)
    for number, path in found.items():
        try:
            course_path = where.find_notebook(course_dir(), number)
        except FileNotFoundError:  # no course notebooks: no course cells to stand in
            course_path = None
        if path is None and course_path is None:  # no cell at all: empty classes and functions
            bodies += [f"class {name}:\n    pass\n" if name.startswith("My") else f"def {name}(*args):\n    ...\n"
                       for spec in PIECES.values() if spec.notebook == number for name in spec.names]
            continue
        more, solutions, _ = where.cells(path or course_path, stubbed=path is None)
        imports += [i for i in more if i not in imports]
        if path is not None:  # (the course's own demos are not the learner's helpers)
            demos = set(where.helpers(course_path)) if course_path is not None else set()
            helpers.update({n: (path.name, s) for n, s in where.helpers(path).items()
                            if n not in demos and n not in piece_of})
        theirs = dict(zip(*where.cells(course_path)[1:])) if path is not None and course_path is not None else {}
        for i, s in enumerate(solutions):
            pieces = {piece_of[n] for n in where.defined(s) if n in piece_of}
            twin = next((c for c in theirs if where.defined(c) == where.defined(s)), None)
            failing = next((p for p in pieces if p in (failed or {})), None)
            asked = pieces & set(use_course_for)
            if twin is not None and (asked or failing or where.normal(s) == where.normal(stub(twin))):
                solutions[i] = twin
                why = (f"yours fails its own check: {failed[failing]}" if failing else
                       "you asked for the course's" if asked else "yours is not written yet")
                for p in pieces:
                    filled.setdefault(p, f"{why}: notebook {number}, the cell under '{theirs[twin]}'")
            elif where.normal(s) in {where.normal(c) for c in theirs}:  # a solution cell pasted in, or the course's
                course |= pieces
        label = path.name if path is not None else f"{number} (not found: the student copy's stubs)"
        bodies += [f"# -- from {label} --\n{s.strip()}\n" for s in solutions]
    used, taken = _names(bodies), []
    while True:  # the helpers the pieces call, and those they call in turn
        more = [n for n in helpers if n in used and n not in taken]
        if not more:
            break
        taken += more
        used |= _names([helpers[n][1] for n in more])
    bodies[:0] = [f"# -- from {helpers[n][0]}, a cell of your own --\n{helpers[n][1]}\n" for n in taken]
    imports = [i for i in imports if where.binds(i) & used]  # only what the pieces use
    source = ('"""Your engine\'s pieces, written from notebooks 05 and 06 (cbteach.exercises.capstone)."""\n' +
              "\n".join(imports) + "\n\n\n" + "\n\n".join(bodies) +
              f"\n\nclass {ENGINE_CLASS}(MyScheduler, MyUpdate):\n    \"\"\"Your schedule (notebook 06, stages 1-4) "
              "and your update (stage 5): one scheduler.\"\"\"\n")
    if "scheduler" in course | set(filled):  # the tournament's table marks it (tournament_core.run_entry)
        source += f"\n\n{PIECES['scheduler'].names[0]}.course_solution = True  # the course's, not yours\n"
    return Pieces({}, source, found, course | set(filled), folders, filled)


def _names(sources) -> set:
    """Every name the sources read."""
    return {n.id for s in sources for n in ast.walk(ast.parse(s)) if isinstance(n, ast.Name)}


def pieces_source(folder=None, use_course_solutions: bool = False) -> tuple[str, dict]:
    """A module's text with every piece from notebooks 05, 06 and 06b in ``folder`` (default: where the learner
    works, :mod:`.where`), and where each notebook was found (``None``: nowhere)."""
    pieces = _read(folder, use_course_solutions)
    return pieces.source, pieces.where


def pieces_from_notebooks(folder=None, *, use_course_solutions: bool = False, use_course_for=(), say=print) -> Pieces:
    """The learner's pieces, read from notebooks 05, 06 and 06b in ``folder`` (default: where the learner works)
    and run; ``say`` gets :meth:`Pieces.report`. ``use_course_solutions=True`` (instructors): all the course's."""
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
    failed = {**pieces.read_with.get("failed", {}), **failed}
    vars(pieces).update(vars(_assemble({**pieces.read_with, "failed": failed})))
    return True


def _assemble(read_with: dict) -> Pieces:
    """The pieces read as ``read_with`` (:func:`_read`'s arguments) says, run: their objects."""
    pieces = _read(**read_with)
    pieces.read_with = read_with
    namespace: dict = {"__name__": "my_engine"}
    filename = f"<my_engine {len(linecache.cache)}>"  # kept as a notebook keeps a cell: the guard reads the source
    linecache.cache[filename] = (len(pieces.source), None, pieces.source.splitlines(True), filename)
    exec(compile(pieces.source, filename, "exec"), namespace)  # noqa: S102 -- the learner's own code
    for piece, spec in PIECES.items():
        got = [namespace.get(n) for n in spec.names]
        written = pieces.where[spec.notebook] is not None and not any(is_stub(o) for o in got)
        pieces.objects[piece] = None if not written else namespace[ENGINE_CLASS] if piece == "scheduler" else got[0]
    pieces.course = {p for p in pieces.course if pieces.objects[p] is not None}
    pieces.filled = {p: why for p, why in pieces.filled.items() if p in pieces.course}
    return pieces


def write_module(path, pieces=None) -> Path:
    """Write ``pieces`` (:func:`pieces_from_notebooks`'s, or a folder to read them from; default: where the learner
    works) into ``path``, a ``.py`` file ``serve`` imports."""
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
    """``piece``'s own notebook check on ``obj``: (passed, what it said -- its failure if any). A piece that is or
    calls the course's own is refused first (:mod:`.guard`); ``prefix_caching=False``: no such scheduler workloads."""
    refused = guard.refusal(piece, obj)
    if refused:
        return False, refused
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = _run_check(piece, obj, model, tok, slot_mapping, prefix_caching)
    lines = out.getvalue().strip().splitlines() or [""]
    said = next((line for line in lines if line.startswith("✗ ")), lines[-1])
    return bool(ok), said[2:] if said[:2] in ("✓ ", "✗ ") else said


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
    stages = [1]  # its answer says what a scheduler must be, or "not done yet"
    if isinstance(obj, type) and issubclass(obj, Scheduler):
        stages = ([1, 2, 3, 4] if obj.schedule is not Scheduler.schedule else []) + \
            ([5] if obj.update_from_output is not Scheduler.update_from_output else []) or [1]
    return all(ex06.check_stage(s, obj, model, prefix_caching=prefix_caching) for s in stages)  # stops at a failure


def _options(argv: list[str]) -> dict:
    """serve's ``--OPTION VALUE`` / ``--OPTION=VALUE`` pairs for the pieces and the model."""
    wanted = {spec.option: piece for piece, spec in PIECES.items()} | {"--model": "model"}
    found, args = {}, iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in wanted:
            found[wanted[name]] = value if eq else next(args, None)
            if found[wanted[name]] is None:
                raise ValueError(f"{name} takes a value (MODULE:NAME)")
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
