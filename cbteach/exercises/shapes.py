"""The shape of a piece of code: what a copy keeps of the original whatever its text (:mod:`.delegation`).

A copy of the course's answer can be made many ways -- ``exec(inspect.getsource(...))``, a code
object put in a new function, a notebook's solution cell read from disk and executed, the same cell
pasted with comments added, the lines reflowed, the variables renamed. None of them changes what the
compiler makes of it: the same instructions in the same order. :func:`fingerprint` is that sequence,
read from the compiled code (``dis``), so comments, blank lines, line breaks and docstrings never
count; nested functions, lambdas and comprehensions are part of it.

How much is abstracted depends on how much code there is. A function of :data:`DISTINCTIVE`
instructions or more is compared with every name -- variables, globals, attributes -- replaced by its
order of first use, and every constant by its type: no one writes sixty instructions in the course's
order by chance, so a renamed copy is still a copy. A shorter one keeps its names and constants: four
lines computing a slot are what every learner writes, and only a copy keeps the course's very names.
:func:`solutions` holds the fingerprints of the course's solution cells (notebooks 05, 05b, 06, 13);
:func:`same_cell` tells notebook 12 whether a learner's cell is one of them.
"""
from __future__ import annotations

import dis
import functools
import json
import types

DISTINCTIVE = 60  # instructions, nested code included: from here on names and constants are abstracted
_SKIP = frozenset({"NOP", "RESUME", "CACHE", "EXTENDED_ARG", "PRECALL", "PUSH_NULL", "COPY_FREE_VARS", "MAKE_CELL"})
# Python 3.11 loads ``module.f`` for a call with LOAD_ATTR when ``module`` was imported in the same
# source, with LOAD_METHOD when not (a function exec'd alone): one instruction to the shape.
_SAME = {"LOAD_METHOD": "LOAD_ATTR"}
_NAMES = frozenset(dis.haslocal) | frozenset(dis.hasname) | frozenset(dis.hasfree)
_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)
_CONSTS = frozenset(dis.hasconst)

# The solution cells' functions, by notebook and name -> the piece they are (None: any piece).
NOTEBOOKS = ("05", "05b", "06", "13")
PIECE_OF = {"my_attention": "attention", "my_slot_mapping": "slot_mapping", "MyKVManager": "kv_manager",
            "my_attend_blocks": "loop", "MyScheduler": "scheduler", "MyUpdate": "scheduler",
            "kv_heads_of_rank": "tp", "all_reduce_bytes": "tp", "update_batch": "update_batch"}


def _instructions(code):
    return [i for i in dis.get_instructions(code) if i.opname not in _SKIP]


def size(code) -> int:
    """Instructions in ``code`` and the code nested in it (what :data:`DISTINCTIVE` counts)."""
    return len(_instructions(code)) + sum(size(c) for c in code.co_consts if isinstance(c, types.CodeType))


def fingerprint(code, abstract: bool | None = None) -> tuple:
    """The shape of ``code``: its instructions, with names and constants abstracted when it is
    distinctive (``abstract=None``: decided by :func:`size`), nested code alike."""
    if abstract is None:
        abstract = size(code) >= DISTINCTIVE
    order: dict = {}
    out = [code.co_argcount, code.co_kwonlyargcount, code.co_flags & 0x0C]  # *args / **kwargs
    for ins in _instructions(code):
        arg = ins.argval
        if ins.opcode in _JUMPS:
            arg = None  # where a jump lands moves with the instructions; the jumps themselves stay
        elif ins.opcode in _NAMES:
            if abstract:
                arg = tuple(order.setdefault(a, len(order)) for a in (arg if isinstance(arg, tuple) else (arg,)))
        elif ins.opcode in _CONSTS:
            if isinstance(arg, types.CodeType):
                arg = fingerprint(arg, abstract)
            elif abstract:
                arg = type(arg).__name__
        elif not isinstance(arg, (int, str, type(None))):
            arg = ins.arg
        out.append((_SAME.get(ins.opname, ins.opname), arg))
    return tuple(out)


def functions(code, prefix: str = ""):
    """``(qualified name, code)`` of every function and method defined in a module's or a class's code."""
    for c in code.co_consts:
        if not isinstance(c, types.CodeType):
            continue
        if c.co_flags & 0x02:  # CO_NEWLOCALS: a function (a class body has none)
            if not c.co_name.startswith("<"):
                yield prefix + c.co_name, c
        else:  # a class body: its methods
            yield from functions(c, prefix + c.co_name + ".")


def cell_code(source: str):
    """A notebook cell compiled (its ``%magic`` and ``!shell`` lines left out); None if it does not compile."""
    text = "\n".join(line for line in source.splitlines() if not line.lstrip().startswith(("%", "!")))
    try:
        return compile(text, "<cell>", "exec", dont_inherit=True)
    except SyntaxError:
        return None


def _solution_cells(number: str) -> list[str]:
    from ..student import SOLUTION_TAG, course_dir

    try:
        path = next(iter(sorted(course_dir().glob(f"{number}_*.ipynb"))), None)
    except FileNotFoundError:
        return []
    if path is None:
        return []
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    return ["".join(c["source"]) if isinstance(c["source"], list) else c["source"] for c in cells
            if c.get("cell_type") == "code" and SOLUTION_TAG in c.get("metadata", {}).get("tags", [])]


@functools.lru_cache(maxsize=None)
def solutions() -> dict:
    """``{fingerprint: (piece or None, notebook, name, distinctive)}`` of every function in the course's
    solution cells (empty where the course's notebooks cannot be found)."""
    out = {}
    for number in NOTEBOOKS:
        for source in _solution_cells(number):
            code = cell_code(source)
            for name, c in functions(code) if code is not None else ():
                out.setdefault(fingerprint(c), (PIECE_OF.get(name.split(".")[0]), number, name, size(c) >= DISTINCTIVE))
    return out


def same_cell(source: str, number: str) -> bool:
    """Whether ``source`` is one of notebook ``number``'s solution cells up to comments, formatting and
    -- where the code is distinctive -- names: every function it defines has the shape of the one of
    the same place in a solution cell."""
    mine = cell_code(source)
    if mine is None:
        return False
    shape = [fingerprint(c) for _, c in functions(mine)]
    if not shape:
        return False
    for theirs in _solution_cells(number):
        code = cell_code(theirs)
        if code is not None and [fingerprint(c) for _, c in functions(code)] == shape:
            return True
    return False
