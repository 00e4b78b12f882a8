"""No route around a check: a piece that is, copies or calls the engine's or the course's own answer is refused.

The checks of notebooks 05, 05b, 06, 12 and 13 compare a learner's piece with the engine's own (and
with the course's references, :mod:`cbteach.exercises.ex05_mistakes`). A piece that hands its work to
either would pass without one line of its own, so every check asks, of each piece:

1. **is it theirs?** -- the function itself (``my_attention = default_attention``), or a class whose
   method is theirs by inheritance (``class MyKVManager(KVCacheManager): pass``) (:func:`is_own`);
2. **is it a copy, or does it keep one?** -- code with the *shape* of theirs (:mod:`.shapes`: the same
   instructions whatever the names, comments and layout): ``exec(inspect.getsource(...))``, a code
   object in a new function, a solution cell read from disk -- as the piece, or reachable from it
   through its globals, closure, defaults or a dict of them;
3. **does it call theirs while it runs?** -- :class:`Watch` is a window around the learner's code.
   While it is open the own implementations of its pieces refuse to run on *every* thread, whatever
   hooks the learner's code switched off (:mod:`.tripwires`); copies made while it runs are refused
   as they are made; and a profile hook on the learner's thread names a copy made earlier when it is
   called -- and notices when the learner's code switches it off.

Each answer names the function and whose it is. The learner may call everything else of the
engine's -- ``meta.pool.write``, ``self.kv_manager.allocate_slots`` from a scheduler, ``self.admit``.
The course's *solution cells* are the honest answer the notebooks run through their own checks: a
piece may be one (notebook 12 says so, :mod:`.where`), but may not call one.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types

from . import own, tripwires
from .own import _escaped, _shape_of, copy_of, own_codes, refusal, registry
from .tripwires import Delegated

__all__ = ["Delegated", "Watch", "is_own", "learner_codes", "own_codes", "refusal", "refusing", "watched"]

# piece -> the methods of a class piece that must be the learner's own (a scheduler from notebook 06's
# stage 4 may keep the engine's update; notebook 12 asks for both: is_own(..., methods=...))
METHODS = {"kv_manager": ("allocate_slots", "free"), "scheduler": ("schedule",)}
_CBTEACH = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ESCAPES = {sys.setprofile, sys.settrace}  # the C functions that switch a watch off; threading's are below
_ESCAPE_CODES = {getattr(threading, n).__code__: n for n in ("setprofile", "settrace", "setprofile_all_threads",
                                                             "settrace_all_threads") if hasattr(threading, n)}


def _function(obj):
    """The plain function behind ``obj`` (a function, a bound method, a ``functools.partial``, a Triton
    kernel), or None."""
    try:
        for _ in range(8):
            if isinstance(obj, functools.partial):
                obj = obj.func
            elif isinstance(obj, (types.MethodType, staticmethod, classmethod)):
                obj = obj.__func__
            elif isinstance(getattr(obj, "fn", None), types.FunctionType):
                obj = obj.fn
            else:
                break
        return obj if isinstance(getattr(obj, "__code__", None), types.CodeType) else None
    except Exception:  # an object of the learner's whose attributes raise: not a function
        return None


def _library(f) -> bool:
    """Code of cbteach's or of the Python installation: a copy exec'd from their source is the learner's."""
    path = os.path.abspath(f.__code__.co_filename)
    return path.startswith(_CBTEACH) or path.startswith(tuple(os.path.abspath(p) + os.sep for p in
                                                              {sys.prefix, sys.base_prefix, sys.exec_prefix}))


def _reachable(obj, limit: int = 600):
    """``(function, where)`` of every function ``obj`` can reach: through the globals its code names, its
    closure, its defaults, a class's attributes, the dicts, lists and run-time modules among them."""
    seen, todo = set(), [(obj, "")]
    while todo and len(seen) < limit:
        o, where = todo.pop()
        if id(o) in seen or isinstance(o, (str, bytes, int, float, type(None))):
            continue
        seen.add(id(o))
        f = _function(o)
        if f is not None:
            yield f, where
            if _library(f):
                continue
            g = f.__globals__
            todo += [(g[n], f"under the name {n}") for c in _nested(f.__code__) for n in c.co_names if n in g]
            todo += [(c.cell_contents, "in its closure") for c in f.__closure__ or () if _filled(c)]
            todo += [(d, "as a default argument") for d in (*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values())]
            if isinstance(o, functools.partial):
                todo += [(a, "in a partial") for a in (*o.args, *o.keywords.values())]
        elif isinstance(o, type):
            if o is not object and not o.__module__.startswith("cbteach."):
                todo += [(v, where or f"in {o.__name__}") for v in vars(o).values()]
        elif isinstance(o, dict):
            todo += [(v, where) for v in list(o.values())[:200]]
        elif isinstance(o, (list, tuple, set, frozenset)):
            todo += [(v, where) for v in list(o)[:200]]
        elif isinstance(o, types.ModuleType) and getattr(o, "__file__", None) is None:  # made at run time
            todo += [(v, where) for v in list(vars(o).values())[:200]]


def _nested(code):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _nested(c)


def _filled(cell) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def is_own(piece: str, obj, methods=None) -> str | None:
    """The refusal if ``obj`` is, copies or keeps a copy of the engine's or the course's own ``piece``
    (else None); ``methods``: those of a class that must be the learner's (default :data:`METHODS`)."""
    if isinstance(obj, type):
        wanted = methods if methods is not None else METHODS.get(piece, ())
        targets = [(getattr(obj, m, None), f"{obj.__name__}.{m}") for m in wanted]
    else:
        targets = [(obj, "")]
    codes, originals = own_codes(), {id(_function(o)) for es in registry().values() for _, _, o in es}
    mine = learner_codes(piece, obj)
    for target, label in targets:
        f = _function(target)
        if f is None:
            continue
        hit = next((r for r in codes.get(f.__code__, ()) if r[0] == piece), None)
        how = f"is, in {label}," if label else "is"
        if hit is None:
            hit = copy_of(f.__code__, {piece}, solutions=False)
            how = f"is, in {label}, a copy of" if label else "is a copy of"
        if hit is not None:
            return refusal(*hit, how)
    callable_object = not isinstance(obj, type) and _function(obj) is None and callable(obj)
    for g, where in _reachable(type(obj) if callable_object else obj):  # a copy kept where the piece reaches it
        if g.__code__ in mine or id(g) in originals:
            continue
        hit = next((r for r in codes.get(g.__code__, ()) if r[0] == piece), None) or copy_of(g.__code__, {piece})
        if hit is not None:
            return refusal(*hit, "keeps a copy of", where)
    return None


def learner_codes(piece: str, obj) -> set:
    """The code objects of a learner's piece: a function's (with the functions nested in it), or every
    method of a class that is not cbteach's own (of the class of a callable object)."""
    if not isinstance(obj, type) and _function(obj) is None and callable(obj):
        obj = type(obj)
    if isinstance(obj, type):  # (a class exec'd without a __name__ in its globals says it is from builtins)
        functions = [f for cls in obj.__mro__ if cls is not object and not cls.__module__.startswith("cbteach.")
                     for f in vars(cls).values()]
    else:
        functions = [obj]
    return {c for f in functions if _function(f) is not None for c in _nested(_function(f).__code__)}


class Watch:
    """``with Watch(pieces, mine) as w:`` -- a window around the learner's code; ``w.found``: the refusal
    for its first hand-over to an own implementation of one of ``pieces`` (or a copy of one).

    ``mine``: ``{code object: piece}`` of the learner's code; a call counts when the nearest learner frame
    below it belongs to the same piece (a learner's scheduler may call the engine's KV manager; a learner's
    KV manager may not) -- on its own thread, or, from a thread with no learner frame, on a thread the
    learner's code started or one where such a frame waits. ``mine=None``: every such call counts, on any
    thread (the window is open only around one call of the learner's). ``exempt``: code objects of the
    learner's whose shape is never taken for a copy (the piece itself may be a course solution)."""

    def __init__(self, pieces, mine: dict | None = None, exempt=()):
        self.pieces, self.mine, self.found, self.escaped = set(pieces), mine, None, False
        self.found_code = None  # the own code the refusal names, where it names one
        self.entries = [(obj, (piece, who, name)) for piece in self.pieces for who, name, obj in registry().get(piece, ())]
        self.codes = {c: [r for r in rs if r[0] in self.pieces] for c, rs in own_codes().items()}
        self.codes = {c: rs for c, rs in self.codes.items() if rs}
        self.exempt = {_shape_of(c) for c in (*(mine or {}), *exempt)}
        own.prepare()  # every table made now: the hooks below must not import or read files
        self.spawned: dict = {}
        self.saved = self.saved_threads = None
        self.open = False

    # -- whose call is it ----------------------------------------------------------------------------
    def _nearest(self, frame):
        while frame is not None:
            piece = self.mine.get(frame.f_code)
            if piece is not None:
                return piece
            frame = frame.f_back
        return None

    def _delegating(self, piece: str, frame) -> bool:
        if self.mine is None:
            return True
        nearest = self._nearest(frame)
        if nearest is not None:
            return nearest == piece
        if self.spawned.get(threading.current_thread()) == piece:
            return True
        me = threading.get_ident()
        return any(self._nearest(top) == piece for ident, top in sys._current_frames().items() if ident != me)

    def _piece_at(self, frame) -> str:
        """The piece whose code runs at ``frame`` (for a message): the nearest learner frame's, or the first."""
        return (self._nearest(frame) if self.mine else None) or sorted(self.pieces)[0]

    def _refuse(self, said: str, code=None) -> str:
        if self.found is None or self.escaped:  # naming the course's code says more than "switched off"
            self.found, self.found_code, self.escaped = said, code, False
        return said

    def claim(self, records, frame, code=None) -> str | None:
        """(A tripwire asks.) The refusal if this call of an own implementation is the learner's hand-over."""
        hit = next((r for r in records if r[0] in self.pieces), None)
        if hit is None or not self._delegating(hit[0], frame):
            return None
        return self._refuse(refusal(*hit), code)

    def made(self, code, frame) -> str | None:
        """(The audit hook asks.) The refusal if ``code``, being executed or made a function, copies one."""
        hit = next((r for r in tripwires.tripped(code) if r[0] in self.pieces), None)
        if hit is not None and self._delegating(hit[0], frame):  # the code of a function now refusing
            return self._refuse(refusal(*hit, "made a copy of"))
        for c in _nested(code):
            hit = None if (self.mine and c in self.mine) else copy_of(c, self.pieces)
            if hit is not None and _shape_of(c) not in self.exempt and self._delegating(hit[0], frame):
                return self._refuse(refusal(*hit, "made a copy of"))
        return None

    def spawning(self, target, frame) -> None:
        """(The audit hook says a thread starts.) A thread the learner's code starts works for its piece."""
        thread = getattr(target, "__self__", None)
        piece = self._nearest(frame) if self.mine is not None else None
        if piece is not None and isinstance(thread, threading.Thread):
            self.spawned[thread] = piece

    # -- the profile hook on the learner's thread ----------------------------------------------------
    def _escape(self, frame, name: str) -> None:
        if self.found is None:
            self.found, self.escaped = _escaped(self._piece_at(frame), name), True

    def __call__(self, frame, event, arg):
        if not self.open:  # a thread started in the window outlived it: it is watched no longer
            sys.setprofile(None)
            return
        if self.found is not None and not self.escaped:
            return
        if event == "c_call" and arg in _ESCAPES and not frame.f_code.co_filename.startswith(_CBTEACH):
            self._escape(frame, f"sys.{arg.__name__}")
        elif event == "call":
            code = frame.f_code
            if code in _ESCAPE_CODES and not frame.f_back.f_code.co_filename.startswith(_CBTEACH):
                self._escape(frame.f_back, f"threading.{_ESCAPE_CODES[code]}")
                return
            records, how = self.codes.get(code), "called"
            if records is None:
                if (self.mine and code in self.mine) or code.co_filename.startswith(_CBTEACH):
                    return
                hit = copy_of(code, self.pieces)
                if hit is None or _shape_of(code) in self.exempt:
                    return
                records, how = [hit], "called a copy of"
            if self._delegating(records[0][0], frame.f_back):
                self._refuse(refusal(*records[0], how), code if how == "called" else None)

    def __enter__(self):
        self.open = True
        tripwires.arm(self, self.entries)
        self.saved, self.saved_threads = sys.getprofile(), threading.getprofile()
        sys.setprofile(self)
        if self.saved_threads is None:
            threading.setprofile(self)  # threads the learner's code starts are watched too
        return self

    def __exit__(self, *exc):
        replaced = sys.getprofile() is not self
        self.open = False
        sys.setprofile(self.saved)
        if threading.getprofile() is self:
            threading.setprofile(self.saved_threads)
        tripwires.disarm(self, self.entries)
        if replaced and self.found is None:
            self.found, self.escaped = _escaped(sorted(self.pieces)[0], "sys.setprofile"), True


@contextlib.contextmanager
def refusing(piece: str, learner, on: bool = True, error=Delegated, names=None, text: str = "{}"):
    """``with refusing(piece, learner):`` -- the learner's code inside runs in a :class:`Watch` of ``piece``;
    a refusal is raised as ``error`` when the block ends (whatever the learner's code raised or caught
    meanwhile). ``names``: ``{own code: label}`` -- a refusal of one of them says ``text.format(label)``
    instead (notebook 06's hints name the engine's scheduling that ran). ``on=False``: no window."""
    if not on:
        yield None
        return
    seen = Watch([piece], exempt=learner_codes(piece, learner))
    try:
        with seen:
            yield seen
    except Exception:  # the learner's code: a refusal, if there was one, is what to say
        if seen.found is None:
            raise
    if seen.found:
        label = (names or {}).get(seen.found_code)
        raise error(text.format(label) if label is not None else seen.found) from None


def watched(piece: str, fn):
    """``fn`` that raises :class:`Delegated` when a call of it hands its work to an own implementation."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with Watch([piece], exempt=learner_codes(piece, fn)) as w:
            try:
                out = fn(*args, **kwargs)
            except Delegated as err:
                raise Delegated(w.found or str(err)) from None
        if w.found:
            raise Delegated(w.found)
        return out
    return wrapper
