"""What a learner's piece may not hand its work to -- the engine's and the course's own implementations -- and
how a refusal names them (:mod:`cbteach.exercises.delegation` asks the questions).

:func:`registry` lists them by piece: the engine's (``default_attention``, ``KVCacheManager.allocate_slots``,
``Scheduler.schedule``, the tensor-parallel ``Layout``'s heads, ...), the course's references the checks
compute with (:mod:`.ex05_mistakes`, :mod:`.ex05b_mistakes`), the simulator's formula, notebook 05b's kernel
loop once Triton is imported, and torch's ``scaled_dot_product_attention`` where attention is the exercise.
:func:`copy_of` finds the one a piece of code is a copy of, by its shape (:mod:`.shapes`) -- the course's
distinctive solution cells among them -- and :func:`refusal` says so.
"""
from __future__ import annotations

import functools
import sys
import types
import weakref

from . import shapes
from .tripwires import SDPA

WHAT = {"slot_mapping": "slot mapping", "attention": "attention", "kv_manager": "KV manager", "scheduler": "scheduler",
        "loop": "loop", "tp": "answer"}


@functools.lru_cache(maxsize=None)
def _base() -> dict:
    """piece -> ``[(who, name, object)]`` of every implementation a piece may not hand its work to."""
    from ..attention import metadata, paged
    from ..engine.scheduler import Scheduler
    from ..kv.fork import ForkingKVCacheManager
    from ..kv.manager import BlockAllocator, KVCacheManager
    from ..kv.paged import PagedKVCache
    from ..parallel.shard import Layout
    from ..sim.cost import ring_all_reduce_bytes
    from . import ex05_mistakes, ex05b_mistakes

    attention = [paged.default_attention, paged.vectorised_attention, paged.reference_attention, paged._attend]
    scheduling = [getattr(Scheduler, n) for n in ("schedule", "schedule_running", "schedule_waiting",
                                                  "allocate_or_preempt", "update_from_output") if hasattr(Scheduler, n)]
    engine = {"slot_mapping": [metadata.build, PagedKVCache.slots],
              "attention": attention + [paged.paged_attention_forward],
              "kv_manager": [KVCacheManager.allocate_slots, ForkingKVCacheManager.allocate_slots, KVCacheManager.free,
                             BlockAllocator.allocate, BlockAllocator.release],
              "scheduler": scheduling, "loop": attention,
              "tp": [Layout.kv_heads, Layout.q_heads] + [vars(Layout)[n] for n in ("heads_per_rank", "kv_replicas",
                                                                                    "kv_heads_per_rank")]}
    out = {piece: [("engine", _name(f), f) for f in fs] for piece, fs in engine.items()}
    out["slot_mapping"].append(("course", "slots", ex05_mistakes.slots))
    out["attention"].append(("course", "attend", ex05_mistakes.attend))
    out["loop"] += [("course", "attend", ex05_mistakes.attend), ("course:ex05b_mistakes", "loop", ex05b_mistakes.loop),
                    ("torch", SDPA, SDPA)]
    out["tp"].append(("simulator", "ring_all_reduce_bytes", ring_all_reduce_bytes))
    return out


def _name(f) -> str:
    f = f.fget if isinstance(f, property) else getattr(f, "fn", f)
    return f.__qualname__ if "." in f.__qualname__ and "<locals>" not in f.__qualname__ else f.__name__


@functools.lru_cache(maxsize=None)
def _kernel(module) -> dict:
    """The Triton kernel's pieces (:mod:`cbteach.attention.triton_unified`), once it is imported."""
    nested = next(c for c in module.kernel_attention.__code__.co_consts
                  if isinstance(c, types.CodeType) and c.co_name == "attention")
    return {"attention": [("engine", "unified_attention", module.unified_attention),
                          ("engine", "kernel_attention", module.kernel_attention),
                          ("engine", "attend_blocks", module.attend_blocks),
                          ("engine", "kernel_attention (the Triton kernel)", nested)],
            "loop": [("engine", "attend_blocks", module.attend_blocks)]}


def registry() -> dict:
    """piece -> ``[(who, name, object)]``: :func:`_base`, and the Triton kernel's once it is imported."""
    module = sys.modules.get("cbteach.attention.triton_unified")
    if module is None:
        return _base()
    kernel = _kernel(module)
    return {piece: entries + kernel.get(piece, []) for piece, entries in _base().items()}


def _code(obj):
    if isinstance(obj, types.CodeType):
        return obj
    f = obj.fget if isinstance(obj, property) else getattr(obj, "fn", obj)
    return getattr(f, "__code__", None)


def own_codes() -> dict:
    """``{code object: [(piece, who, name), ...]}`` of every own implementation."""
    out: dict = {}
    for piece, entries in registry().items():
        for who, name, obj in entries:
            code = _code(obj)
            if code is not None:
                out.setdefault(code, []).append((piece, who, name))
    return out


def _shapes() -> dict:
    """``{fingerprint: [(piece, who, name)]}``: every own implementation's, then every course solution's."""
    return _shapes_with("cbteach.attention.triton_unified" in sys.modules)


@functools.lru_cache(maxsize=None)
def _shapes_with(kernel: bool) -> dict:  # kernel: whether the Triton kernel's pieces are in the registry yet
    out: dict = {}
    for code, records in own_codes().items():
        out.setdefault(shapes.fingerprint(code), []).extend(records)
    for shape, (piece, number, name, distinctive) in shapes.solutions().items():
        if distinctive:  # a short solution is what every learner writes: only a long one is a copy's mark
            out.setdefault(shape, []).append((piece, f"solution:{number}", name))
    return out


def _keys() -> frozenset:
    return _keys_with("cbteach.attention.triton_unified" in sys.modules)


@functools.lru_cache(maxsize=None)
def _keys_with(kernel: bool) -> frozenset:
    return frozenset(shape[:3] for shape in _shapes_with(kernel))  # a fingerprint starts with _key


def _key(code) -> tuple:  # what a copy keeps of the signature: a cheap first look before the fingerprint
    return code.co_argcount, code.co_kwonlyargcount, code.co_flags & 0x0C


_copies: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shape_of(code) -> tuple:
    if code not in _fingerprints:
        _fingerprints[code] = shapes.fingerprint(code)
    return _fingerprints[code]


def copy_of(code, pieces, solutions: bool = True):
    """The ``(piece, who, name)`` of ``pieces`` whose shape ``code`` has (a course solution's too, with
    ``solutions``), or None."""
    if _key(code) not in _keys():
        return None
    kernel = "cbteach.attention.triton_unified" in sys.modules
    if _copies.get(code, (None,))[0] is not kernel:
        _copies[code] = (kernel, tuple(_shapes().get(_shape_of(code), ())))
    return next((r for r in _copies[code][1] if (r[0] in pieces or r[0] is None)
                 and (solutions or not r[1].startswith("solution:"))), None)


def whose(who: str, name: str) -> str:
    if who.startswith("course"):
        module = who.split(":")[1] if ":" in who else "ex05_mistakes"
        return f"the course's own answer {name} (cbteach.exercises.{module}), the very one the check compares with"
    if who.startswith("solution:"):
        return f"the course's solution {name} (notebook {who.split(':')[1]}'s solution cell)"
    return {"torch": f"torch's {name}", "simulator": f"the simulator's {name} (cbteach.sim.cost)"}.get(
        who, f"the engine's {name}")


def refusal(piece: str, who: str, name: str, how: str = "called", where: str = "") -> str:
    """The hint: whose implementation it was (``where`` the learner's code keeps it), and why that cannot pass."""
    what = WHAT.get(piece, "piece")
    return (f"write the {what} yourself: your {what} {how} {whose(who, name)}{f' ({where})' if where else ''} -- a "
            "check that compared the engine (or the course) with itself would prove nothing about your code")


def _escaped(piece: str, name: str) -> str:
    what = WHAT.get(piece, "piece")
    return (f"write the {what} yourself: your {what} switched off the check's watch ({name}) -- a check that cannot "
            "see what your code calls cannot tell your work from the course's (a debugger does this too: run the "
            "check without one)")


def prepare() -> None:
    """Make every table now (a window's hooks must not import modules or read files while they run)."""
    _keys()
