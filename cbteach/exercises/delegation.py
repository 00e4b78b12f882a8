"""No route around a check: a piece that is, copies or calls the engine's or the course's own answer is refused.

The checks of notebooks 05 and 12 compare a learner's piece with the engine's own (and with the
course's reference, :mod:`cbteach.exercises.ex05_mistakes`). A piece that hands its work to either
would pass without one line of its own, so every check asks three questions first, of each piece:

1. **is it theirs?** -- the function itself (``my_attention = default_attention``), or a class whose
   method is theirs by inheritance (``class MyKVManager(KVCacheManager): pass``);
2. **is it a copy?** -- the same compiled code under another name (``exec(inspect.getsource(...))``);
3. **does it call theirs while it runs?** -- a wrapper, ``super().schedule(now)``, an instance of the
   engine's manager kept inside: :class:`Watch` puts a profile hook (``sys.setprofile``) around the
   learner's code and notes the first call into one of them.

Each answer names the function and says why it is refused. The learner may call everything else of
the engine's -- ``meta.pool.write``, ``self.kv_manager.allocate_slots`` from a scheduler, ``self.admit``.
"""
from __future__ import annotations

import functools
import sys
import types

# piece -> the methods of a class piece that must be the learner's own (a scheduler from notebook 06's
# stage 4 may keep the engine's update; notebook 12 asks for both: is_own(..., methods=...))
METHODS = {"kv_manager": ("allocate_slots", "free"), "scheduler": ("schedule",)}
WHAT = {"slot_mapping": "slot mapping", "attention": "attention", "kv_manager": "KV manager", "scheduler": "scheduler"}


class Delegated(Exception):
    """A piece handed its work to the engine's or the course's own implementation (the message says whose)."""


@functools.lru_cache(maxsize=None)
def own_codes() -> dict:
    """Every implementation a piece may not hand its work to: ``{code object: (piece, who, name)}``."""
    from ..attention import metadata, paged
    from ..engine.scheduler import Scheduler
    from ..kv.fork import ForkingKVCacheManager
    from ..kv.manager import BlockAllocator, KVCacheManager
    from ..kv.paged import PagedKVCache
    from . import ex05_mistakes

    engine = {"slot_mapping": [metadata.build, PagedKVCache.slots],
              "attention": [paged.default_attention, paged.vectorised_attention, paged.reference_attention,
                            paged.paged_attention_forward],
              "kv_manager": [KVCacheManager.allocate_slots, ForkingKVCacheManager.allocate_slots, KVCacheManager.free,
                             BlockAllocator.allocate, BlockAllocator.release],
              "scheduler": [Scheduler.schedule, Scheduler.update_from_output]}
    course = {"slot_mapping": [ex05_mistakes.slots], "attention": [ex05_mistakes.attend]}
    out = {}
    for who, table in (("engine", engine), ("course", course)):
        for piece, functions in table.items():
            for f in functions:
                out[f.__code__] = (piece, who, f.__qualname__ if "." in f.__qualname__ else f.__name__)
    return out


def refusal(piece: str, who: str, name: str, how: str = "called") -> str:
    """The hint: whose implementation it was, and why that cannot pass."""
    if who == "course":
        whose = f"the course's own answer {name} (cbteach.exercises.ex05_mistakes), the very one the check compares with"
    else:
        whose = f"the engine's {name}"
    return (f"write the {WHAT[piece]} yourself: your {WHAT[piece]} {how} {whose} -- a check that compared the "
            "engine (or the course) with itself would prove nothing about your code")


def _shape(code) -> tuple:
    """What a copy of ``code`` shares with it whatever compiled it: the names it uses, its local variables
    and its constants, nested functions alike (the bytecode itself differs between compilations)."""
    consts = tuple(_shape(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.co_names, code.co_varnames, code.co_argcount, consts


@functools.lru_cache(maxsize=None)
def _own_shapes() -> dict:
    return {_shape(code): who for code, who in own_codes().items()}


def _function(obj):
    """The plain function behind ``obj`` (a function, a bound method, a ``functools.partial``), or None."""
    for _ in range(8):
        if isinstance(obj, functools.partial):
            obj = obj.func
        elif isinstance(obj, types.MethodType):
            obj = obj.__func__
        else:
            break
    return obj if isinstance(getattr(obj, "__code__", None), types.CodeType) else None


def is_own(piece: str, obj, methods=None) -> str | None:
    """The refusal if ``obj`` is, or copies, the engine's or the course's own ``piece`` (else None);
    ``methods``: those of a class that must be the learner's (default :data:`METHODS`)."""
    if isinstance(obj, type):
        wanted = methods if methods is not None else METHODS.get(piece, ())
        targets = [(getattr(obj, m, None), f"{obj.__name__}.{m}") for m in wanted]
    else:
        targets = [(obj, "")]
    for target, label in targets:
        f = _function(target)
        if f is None:
            continue
        hit = own_codes().get(f.__code__)
        how = f"is, in {label}," if label else "is"
        if hit is None:
            hit = _own_shapes().get(_shape(f.__code__))
            how = f"is, in {label}, a copy of" if label else "is a copy of"
        if hit is not None:
            return refusal(hit[0], hit[1], hit[2], how)
    return None


def learner_codes(piece: str, obj) -> set:
    """The code objects of a learner's piece: a function's (with the functions nested in it), or every
    method of a class that is not cbteach's own."""
    if isinstance(obj, type):
        functions = [f for cls in obj.__mro__ if not cls.__module__.startswith(("cbteach.", "builtins"))
                     for f in vars(cls).values()]
    else:
        functions = [obj]
    codes, todo = set(), [c for c in (getattr(_function(f), "__code__", None) for f in functions) if c is not None]
    while todo:
        code = todo.pop()
        codes.add(code)
        todo += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return codes


class Watch:
    """``with Watch(pieces, mine) as w:`` -- ``w.found``: the refusal for the first call into an own
    implementation of one of ``pieces`` made by that piece's learner code.

    ``mine``: ``{code object: piece}`` of the learner's code; a call counts when the nearest learner frame
    below it belongs to the same piece (a learner's scheduler may call the engine's KV manager; a learner's
    KV manager may not). ``mine=None``: every such call counts (the watch is on only around one call of
    the learner's)."""

    def __init__(self, pieces, mine: dict | None = None):
        self.codes = {c: w for c, w in own_codes().items() if w[0] in set(pieces)}
        self.mine, self.found, self.saved = mine, None, None

    def __call__(self, frame, event, arg):
        if event != "call" or self.found is not None:
            return
        hit = self.codes.get(frame.f_code)
        if hit is None:
            return
        if self.mine is not None:
            caller = frame.f_back
            while caller is not None and caller.f_code not in self.mine:
                caller = caller.f_back
            if caller is None or self.mine[caller.f_code] != hit[0]:
                return
        self.found = refusal(*hit)

    def __enter__(self):
        self.saved = sys.getprofile()
        sys.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(self.saved)


def watched(piece: str, fn):
    """``fn`` that raises :class:`Delegated` when a call of it hands its work to an own implementation."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with Watch([piece]) as w:
            out = fn(*args, **kwargs)
        if w.found:
            raise Delegated(w.found)
        return out
    return wrapper
