"""Is a learner's piece the course's own? One that *is* the engine's (or a wrapper of it), inherits it, calls
``super()``'s, or calls the engine's function for that piece by name is refused with the course's piece
named: the check would compare the engine with itself. Read from the source, nothing hooked. Deliberate
copying is not policed.
"""
from __future__ import annotations

import ast
import functools
import importlib
import inspect
import textwrap

WHAT = {"slot_mapping": "slot mapping", "kv_manager": "KV manager", "tp": "answer", "update_batch": "batch update"}
METHODS = {"kv_manager": ("allocate_slots", "free"), "scheduler": ("schedule",)}  # a class piece's own methods
_WHY = " -- a check that compared the engine (or the course) with itself would prove nothing about your code"


@functools.lru_cache(maxsize=None)
def registry() -> dict:
    """piece -> ``{function: whose name}``: the engine's and the course's implementations of it."""
    from ..attention import metadata, paged, reference
    from ..engine.scheduler import Scheduler as S
    from ..kv.manager import KVCacheManager as K
    from ..kv.paged import PagedKVCache
    from ..parallel.shard import Layout
    from ..sim.cost import ring_all_reduce_bytes
    from ..worker import model_runner
    from . import ex05_mistakes as course

    def engine(*fs, owner=""):  # owner: the class a learner knows the method by (default: where it is defined)
        return {f: f"the engine's {owner or (f.__qualname__.rpartition('.')[0] + '.').lstrip('.')}{f.__name__}"
                for f in fs}

    theirs = "the course's own answer {} (cbteach.exercises.ex05_mistakes), the very one the check compares with"
    return {"slot_mapping": {**engine(metadata.build, PagedKVCache.slots), course.slots: theirs.format("slots")},
            "attention": {**engine(paged.default_attention, paged.vectorised_attention, reference.reference_attention,
                                   paged.paged_attention_forward), course.attend: theirs.format("attend")},
            "kv_manager": engine(K.allocate_slots, K.free),
            "scheduler": engine(S.schedule, S.schedule_running, S.schedule_waiting, S.allocate_or_preempt,
                                S.update_from_output, owner="Scheduler."),
            "tp": {**engine(Layout.kv_heads, Layout.q_heads),
                   ring_all_reduce_bytes: "the simulator's ring_all_reduce_bytes"},
            "update_batch": {model_runner.update_batch:
                             "the worker's own update_batch (cbteach.worker.model_runner)"}}


def _chain(obj):
    """``obj`` and what it wraps (a bound method's function, a partial's, a wrapper's, a kernel's)."""
    for _ in range(12):  # bounded: an object's attributes may lead back to it
        yield obj
        obj = next((x for a in ("__func__", "func", "__wrapped__", "fn") if callable(x := getattr(obj, a, None))), None)


def _owner(obj, own: dict) -> str | None:  # whose name, if obj is or wraps one of own
    return next((w for o in _chain(obj) for f, w in own.items() if o is f), None)


def _calls(fn, own: dict, cls=None) -> str | None:
    """Whose function of ``own`` the source of ``fn`` calls by name (or builds, for a class), or via ``super()``."""
    names = inspect.getclosurevars(fn)
    scope = {**names.builtins, **names.globals, **names.nonlocals, "self": cls}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):  # no source (a lambda inside an expression, exec'd code): its names
        return next(filter(None, (_owner(v, own) for v in scope.values())), None)
    for node in ast.walk(tree):  # breadth first: a statement's local import comes before the calls below it
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("cbteach"):
            module = importlib.import_module(node.module)
            scope.update({a.asname or a.name: getattr(module, a.name, None) for a in node.names})
        if isinstance(node, ast.Import):  # import cbteach.x.y as z (z: that module), or import cbteach.x (cbteach)
            for a in node.names:
                if a.name.startswith("cbteach"):
                    top = a.name.partition(".")[0]
                    scope[a.asname or top] = importlib.import_module(a.name if a.asname else top)
        f, chain = (node.func if isinstance(node, ast.Call) else None), []
        while isinstance(f, ast.Attribute):
            chain, f = [f.attr, *chain], f.value
        if isinstance(f, ast.Call) and getattr(f.func, "id", "") == "super" and chain == [fn.__name__] and cls:
            later = [c for c in cls.__mro__ if vars(c).get(fn.__name__, fn) is not fn]
            if later and _owner(vars(later[0])[fn.__name__], own):
                return f"{_owner(vars(later[0])[fn.__name__], own)} (through super().{fn.__name__})"
        obj = scope.get(f.id) if isinstance(f, ast.Name) else None
        for attr in chain:
            obj = getattr(obj, attr, None)
        if _owner(obj, own) or isinstance(obj, type) and any(getattr(obj, o.__name__, None) is o for o in own):
            return _owner(obj, own) or f"the engine's {obj.__name__}"
    return None


def refusal(piece: str, obj, methods=None) -> str | None:
    """The refusal if ``obj`` is, inherits or calls the engine's or the course's own ``piece`` (else None)."""
    if piece not in registry():
        raise ValueError(f"piece must be one of {sorted(registry())}, got {piece!r}")
    own, what = registry()[piece], WHAT.get(piece, piece)
    if not isinstance(obj, type):  # a function: is it, or does it call, one of own?
        said = _owner(obj, own) and f"is {_owner(obj, own)}" or next(
            (f"calls {_calls(f, own)}" for f in _chain(obj) if inspect.isfunction(f) and _calls(f, own)), None)
        return f"write the {what} yourself: your {what} {said}{_WHY}" if said else None
    wanted = methods if methods is not None else METHODS.get(piece, ())
    for m in wanted:
        if _owner(inspect.getattr_static(obj, m, None), own):
            still = _owner(getattr(obj, m), own)
            return f"not done yet: {obj.__name__}.{m} is still {still}: write the {what} yourself"
    others = {o.__name__ for o in own} - set(wanted)  # the engine's other methods: a learner may override them
    mine = [(n, f) for c in obj.__mro__ if not c.__module__.startswith("cbteach.") and c is not object
            for n, f in vars(c).items() if inspect.isfunction(f) and n not in others]
    said = next((f"{n} calls {s}" for n, f in mine for s in [_calls(f, own, obj)] if s), None)
    return f"write the {what} yourself: your {obj.__name__}.{said}{_WHY}" if said else None

