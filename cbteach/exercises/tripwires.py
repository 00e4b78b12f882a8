"""While a check runs a learner's piece, the course's own implementations of it refuse to run -- on every thread.

A :class:`~cbteach.exercises.delegation.Watch` is a *window* around the learner's code. While one is
open, every function that implements its piece -- the engine's, the course's references, notebook
05b's kernel loop -- has its code swapped for a **tripwire**: a stand-in that asks the open windows
whether this call is the learner's work handed on (``window.claim``); if one says so it raises
:class:`Delegated` (and the window remembers why, should the learner's code catch it), else it runs the
original code. A function's code belongs to the function object, not to a thread or a tracing hook,
so the tripwire holds however the function is reached: from a helper thread, after
``sys.settrace(None)`` or ``sys.setprofile(None)``, through frames walked up to the check's globals,
through ``importlib``, a closure or another name. When the last window that armed it closes, its code
is put back (windows nest and overlap across threads: each function counts its windows).

Two more things hold for the whole process while a window is open:

* an **audit hook** (:pep:`578`: added once, never removed, idle while no window is open) sees code
  executed by ``exec`` -- a module's source, a notebook cell read from disk -- and functions made from
  a code object (``types.FunctionType``): a copy of an own implementation or of a course solution made
  while the learner's code runs is refused as it is made (``window.made``). It also notes the threads
  the learner's code starts (``window.spawning``);
* **torch's scaled_dot_product_attention**, where attention itself is the exercise (notebook 05b's
  loop): its kernel is overridden for the window through ``torch.library`` -- PyTorch's documented way
  to register an operator's implementation, which holds on every thread -- and the override is removed
  when the window closes. A call no window claims (another thread's model, say) still gets attention,
  from PyTorch's reference ``math`` implementation.
"""
from __future__ import annotations

import functools
import sys
import threading
import types
import warnings

KEYWORD = "_cbteach_tripwire_"  # the tripwire's keyword-only argument that carries its dispatcher
SDPA = "scaled_dot_product_attention"

_lock = threading.RLock()
_armed: dict = {}  # id(function) -> _Armed
_windows: list = []  # the windows open now, on any thread
_sdpa = {"windows": 0, "library": None, "records": ()}
_audit_added = False


class Delegated(Exception):
    """A piece handed its work to the engine's or the course's own implementation (the message says whose)."""


class _Armed:
    def __init__(self, function, records):
        self.function, self.records, self.windows, self.tripwire = function, list(records), 0, None
        self.code, self.kwdefaults = function.__code__, function.__kwdefaults__
        self.original = types.FunctionType(function.__code__, function.__globals__, function.__name__,
                                           function.__defaults__, function.__closure__)
        self.original.__kwdefaults__ = function.__kwdefaults__
        self.original.__qualname__ = function.__qualname__


@functools.lru_cache(maxsize=None)
def _tripwire_code(num_free: int) -> types.CodeType:
    """A function body that hands its arguments to its dispatcher, with ``num_free`` free variables so it
    fits a function with that many closure cells (a method using ``super()`` has one)."""
    free = [f"_free{i}" for i in range(num_free)]
    lines = ["def _outer():", *[f"    {n} = None" for n in free],
             f"    def tripwire(*args, {KEYWORD}, **kwargs):",
             f"        return {KEYWORD}(args, kwargs)"]
    if free:  # after the return: never run, but it makes them free variables of the tripwire
        lines.append(f"        {', '.join(free)}")
    lines.append("    return tripwire")
    outer = next(c for c in compile("\n".join(lines), "<cbteach check: tripwire>", "exec").co_consts
                 if isinstance(c, types.CodeType))
    return next(c for c in outer.co_consts if isinstance(c, types.CodeType))


def claimed(records, frame, code=None) -> str | None:
    """The refusal of the first open window that claims a call of an implementation known by ``records``
    (its code: ``code``) made from ``frame`` (None: the call is nobody's delegation -- the check's own, or
    another thread's)."""
    for window in list(_windows):
        said = window.claim(records, frame, code)
        if said:
            return said
    return None


def _dispatcher(armed: _Armed):
    def dispatch(args, kwargs):
        said = claimed(armed.records, sys._getframe(2), armed.code)  # 1: the tripwire; 2: whoever called it
        if said:
            raise Delegated(said)
        return armed.original(*args, **kwargs)
    return dispatch


def functions_of(obj) -> list:
    """The plain functions a call of ``obj`` runs first: a function, a property's getter, and for a Triton
    kernel in the interpreter both its Python function and the rewritten one the interpreter calls (compiled
    for a GPU, a kernel runs no Python: only the check's reading of the source can catch it there)."""
    if isinstance(obj, property):
        obj = obj.fget
    while not isinstance(obj, types.FunctionType) and isinstance(getattr(obj, "__wrapped__", None), types.FunctionType):
        obj = obj.__wrapped__  # a functools.wraps wrapper (lru_cache, ...) calls the function it wraps
    if isinstance(obj, types.FunctionType):
        return [obj]
    raw = getattr(obj, "fn", None)
    if isinstance(raw, types.FunctionType) and callable(getattr(obj, "rewrite", None)):
        rewritten = obj.rewrite()  # the interpreter's own cache: made now, before any window needs it
        return [raw] + ([rewritten] if isinstance(rewritten, types.FunctionType) and rewritten is not raw else [])
    return []


def arm(window, entries) -> None:
    """Open ``window``: trip every function of ``entries`` (``[(object, record)]``; ``object`` ``SDPA``:
    torch's scaled_dot_product_attention) until :func:`disarm`."""
    _add_audit_hook()
    with _lock:
        for obj, record in entries:
            if obj == SDPA:
                _arm_sdpa(record)
                continue
            for function in functions_of(obj):
                armed = _armed.get(id(function))
                if armed is None:
                    armed = _armed[id(function)] = _Armed(function, [record])
                elif record not in armed.records:
                    armed.records.append(record)
                armed.windows += 1
                if armed.windows == 1:  # a tripwire of its own (a copy of it made meanwhile is known: tripped),
                    code = function.__code__  # where the function is: inspect.getsource still reads it
                    armed.tripwire = _tripwire_code(len(function.__closure__ or ())).replace(
                        co_name=code.co_name, co_qualname=function.__qualname__, co_filename=code.co_filename,
                        co_firstlineno=code.co_firstlineno)
                    function.__code__ = armed.tripwire
                    function.__kwdefaults__ = {KEYWORD: _dispatcher(armed)}
        _windows.append(window)


def disarm(window, entries) -> None:
    """Close ``window``: every function it tripped gets its own code back once no other window holds it."""
    with _lock:
        if window in _windows:
            _windows.remove(window)
        for obj, _ in entries:
            if obj == SDPA:
                _disarm_sdpa()
                continue
            for function in functions_of(obj):
                armed = _armed.get(id(function))
                if armed is None:
                    continue
                armed.windows -= 1
                if armed.windows == 0:
                    function.__code__, function.__kwdefaults__ = armed.code, armed.kwdefaults
                    del _armed[id(function)]


def tripped(code) -> list:
    """The records of the armed function whose tripwire ``code`` is (a learner's copy of its ``__code__``
    made inside a window), else ``[]``."""
    return next((a.records for a in list(_armed.values()) if a.windows and a.tripwire is code), [])


# -- torch's scaled_dot_product_attention ------------------------------------------------------------

def _sdpa_kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *args, **kwargs):
    said = claimed(_sdpa["records"], sys._getframe(1))
    if said:
        raise Delegated(said)
    import torch

    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as torch's own front end does first
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    math = torch.ops.aten._scaled_dot_product_attention_math
    return math(query, key, value, attn_mask, dropout_p, is_causal, *args, **kwargs)[0]


def _arm_sdpa(record) -> None:
    _sdpa["records"] = (record,)
    _sdpa["windows"] += 1
    if _sdpa["windows"] == 1:
        import torch

        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore")
            library.impl(SDPA, _sdpa_kernel, "CompositeImplicitAutograd")
        _sdpa["library"] = library


def _disarm_sdpa() -> None:
    _sdpa["windows"] -= 1
    if _sdpa["windows"] == 0 and _sdpa["library"] is not None:
        _sdpa["library"]._destroy()  # the registration goes, torch's own kernel is back
        _sdpa["library"] = None


# -- the audit hook ---------------------------------------------------------------------------------

def _audit(event: str, args: tuple) -> None:
    if not _windows:
        return
    if event in ("exec", "function.__new__") and args and isinstance(args[0], types.CodeType):
        for window in list(_windows):
            said = window.made(args[0], sys._getframe(1))
            if said:
                raise Delegated(said)
    elif event == "_thread.start_new_thread" and args:
        for window in list(_windows):
            window.spawning(args[0], sys._getframe(1))


def _add_audit_hook() -> None:
    global _audit_added
    with _lock:
        if not _audit_added:
            sys.addaudithook(_audit)
            _audit_added = True
