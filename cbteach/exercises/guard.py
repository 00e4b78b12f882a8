"""Is a learner's piece the course's own? The accidental routes a check would otherwise compare the engine with itself on.

A piece that *is* the engine's (``my_attention = default_attention``, a ``functools.wraps`` wrapper or a
``partial`` of it, a class that inherits the method instead of writing it), a method whose body calls
``super().<the same method>``, or a function whose body calls the engine's function for that piece by
name (``return paged.default_attention(...)``), gets a refusal naming the course's piece. It is read from
the function's source (and its names), nothing is hooked. Deliberate copying -- pasting the course's
code, reaching it through a helper -- is not policed: the solution is one click away in every notebook.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap

WHAT = {"slot_mapping": "slot mapping", "attention": "attention", "kv_manager": "KV manager", "scheduler": "scheduler",
        "tp": "answer", "update_batch": "batch update"}
METHODS = {"kv_manager": ("allocate_slots", "free"), "scheduler": ("schedule",)}  # a class piece's own methods


@functools.lru_cache(maxsize=None)
def registry() -> dict:
    """piece -> ``{function: whose name}``: the engine's and the course's implementations of it."""
    from ..attention import metadata, paged
    from ..engine.scheduler import Scheduler as S
    from ..kv.manager import KVCacheManager as K
    from ..kv.paged import PagedKVCache
    from ..parallel.shard import Layout
    from ..sim.cost import ring_all_reduce_bytes
    from ..worker import states
    from . import ex05_mistakes as course

    def engine(*fs):
        return {f: f"the engine's {f.__qualname__}" for f in fs}

    theirs = "the course's own answer {} (cbteach.exercises.ex05_mistakes), the very one the check compares with"
    return {"slot_mapping": {**engine(metadata.build, PagedKVCache.slots), course.slots: theirs.format("slots")},
            "attention": {**engine(paged.default_attention, paged.vectorised_attention, paged.reference_attention,
                                   paged.paged_attention_forward), course.attend: theirs.format("attend")},
            "kv_manager": engine(K.allocate_slots, K.free),
            "scheduler": {f: f"the engine's Scheduler.{f.__name__}" for f in (
                S.schedule, S.schedule_running, S.schedule_waiting, S.allocate_or_preempt, S.update_from_output)},
            "tp": {**engine(Layout.kv_heads, Layout.q_heads),
                   ring_all_reduce_bytes: "the simulator's ring_all_reduce_bytes (cbteach.sim.cost)"},
            "update_batch": {states.update_batch: "the worker's own update_batch (cbteach.worker.states)"}}


def _unwrap(obj) -> list:
    """``obj`` and what it wraps: a bound method's function, a partial's, a ``functools.wraps`` wrapper's, a kernel's."""
    seen = [obj]
    for attr in ("__func__", "func", "__wrapped__", "fn") * 3:
        inner = getattr(seen[-1], attr, None)
        seen += [inner] if callable(inner) else []
    return seen


def _owner(obj, own: dict) -> str | None:
    return next((w for o in _unwrap(obj) for f, w in own.items() if o is f), None)


def _calls(fn, own: dict, cls=None) -> str | None:
    """Whose function of ``own`` the source of ``fn`` calls by name (or builds, for a class), or via ``super()``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        names = inspect.getclosurevars(fn)
    except (OSError, TypeError, SyntaxError):  # no source (a lambda inside an expression, exec'd code): its names
        names = inspect.getclosurevars(fn)
        return next(filter(None, (_owner(v, own) for v in {**names.globals, **names.nonlocals}.values())), None)
    scope = {**names.builtins, **names.globals, **names.nonlocals, "self": cls}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("cbteach"):  # a local import
            module = importlib.import_module(node.module)
            scope.update({a.asname or a.name: getattr(module, a.name, None) for a in node.names})
    for node in ast.walk(tree):
        f = node.func if isinstance(node, ast.Call) else None
        chain = []
        while isinstance(f, ast.Attribute):
            chain, f = [f.attr, *chain], f.value
        if isinstance(f, ast.Call) and getattr(f.func, "id", "") == "super" and chain == [fn.__name__] and cls:
            later = [c for c in cls.__mro__ if fn.__name__ in vars(c) and vars(c)[fn.__name__] is not fn]
            said = _owner(vars(later[0])[fn.__name__], own) if later else None
            if said:
                return f"{said} (through super().{fn.__name__})"
        obj = scope.get(f.id) if isinstance(f, ast.Name) else None
        for attr in chain:
            obj = getattr(obj, attr, None)
        said = _owner(obj, own) or (isinstance(obj, type) and any(getattr(obj, o.__name__, None) is o for o in own)
                                    and f"the engine's {obj.__name__}")
        if said:
            return said
    return None


def refusal(piece: str, obj, methods=None) -> str | None:
    """The refusal if ``obj`` is, inherits or calls the engine's or the course's own ``piece`` (else None)."""
    own, what = registry()[piece], WHAT[piece]
    if isinstance(obj, type):
        wanted = methods if methods is not None else METHODS.get(piece, ())
        for m in wanted:
            said = _owner(inspect.getattr_static(obj, m, None), own)
            if said:
                return f"not done yet: {obj.__name__}.{m} is still {said} (inherited): write the {what} yourself"
        mine = [(n, f) for c in obj.__mro__ if not c.__module__.startswith("cbteach.") and c is not object
                for n, f in vars(c).items() if inspect.isfunction(f) and (n in wanted or n not in
                                                                         {o.__name__ for o in own})]
        said = next((f"{n} calls {s}" for n, f in mine for s in [_calls(f, own, obj)] if s), None)
        return f"write the {what} yourself: your {obj.__name__}.{said}{_WHY}" if said else None
    said = _owner(obj, own)
    if said:
        return f"write the {what} yourself: your {what} is {said}{_WHY}"
    said = next((_calls(f, own) for f in _unwrap(obj) if inspect.isfunction(f) and _calls(f, own)), None)
    return f"write the {what} yourself: your {what} calls {said}{_WHY}" if said else None


_WHY = " -- a check that compared the engine (or the course) with itself would prove nothing about your code"
