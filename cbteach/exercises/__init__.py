"""Self-checks for the notebooks' exercises, one module per notebook (``ex00`` for notebook 00 ...).

A check runs the learner's answer against the real engine or model and prints what is right or which
mistake it found (``True``/``False``). A piece that is, or directly calls, the course's own is refused
(:mod:`.guard`); deliberate copying is not policed. :func:`self_check` turns whatever a learner passes
into a hint, never a traceback.
"""
import ast
import functools
import inspect
import numbers
import os
import sys
import textwrap
import traceback

_NOT_YOURS = tuple(os.path.abspath(p) + os.sep for p in
                   {os.path.dirname(os.path.dirname(__file__)), sys.prefix, sys.base_prefix, sys.exec_prefix})


class Fail(Exception):
    """The learner's answer is wrong; the message is the hint (``named``: it names a known mistake)."""

    def __init__(self, message: str, named: bool = False):
        super().__init__(message)
        self.named = named


def report(ok: bool, good: str, bad: str) -> bool:
    print(("✓ " + good) if ok else ("✗ " + bad))
    return ok


def passed(good: str) -> bool:
    """Print ``good``, what the learner's right answer shows; True."""
    return report(True, good, "")


def fail(hint: str) -> bool:
    """Print ``hint``, what is wrong with the learner's answer; False."""
    return report(False, "", hint)


def need_function(fn, name: str) -> None:
    """Raise :class:`Fail` when ``fn`` is not a function (the learner passed its result, or nothing)."""
    if not callable(fn):
        raise Fail(f"pass your function itself ({name}, not {name}(...)); got {type(fn).__name__}")


def raised(err: BaseException) -> str:
    """``"IndexError: list index out of range (line 7 of your code: out[i] = x)"``: the error, and the last
    line of the learner's own code it passed through -- found in the traceback as the deepest frame
    outside cbteach and the Python installation (a notebook cell, a file of theirs)."""
    said = f"{type(err).__name__}: {err}"
    frames = [f for f in traceback.extract_tb(err.__traceback__)
              if not os.path.abspath(f.filename).startswith(_NOT_YOURS)]
    if not frames:
        return said
    line = frames[-1]
    code = f": {line.line.strip()}" if line.line else ""
    return f"{said} (line {line.lineno} of your code{code})"


def ask(fn, *args, shown: str):
    """The learner's ``fn(*args)``; :class:`Fail` if it raised (``shown``: the call as the hint names it) or
    returned None (the student copy's stub)."""
    try:
        got = fn(*args)
    except Exception as err:  # the learner's code: say what failed, and on which input
        raise Fail(f"{shown} raised {raised(err)}") from err
    if got is None:
        raise Fail(f"not done yet: {shown.partition('(')[0]} returned None -- write it in the cell above")
    return got


def first_mistake(mistakes, gives, skip=()) -> str | None:
    """The hint of the first typical mistake that gives the learner's answer. ``mistakes``: the table, mistake ->
    hint (a dict) or (mistake, hint) pairs; ``gives(mistake)`` recomputes the case with that mistake and says
    whether it is what the learner got. A mistake that raises one of ``skip`` there cannot be it."""
    for mistake, hint in (mistakes.items() if isinstance(mistakes, dict) else mistakes):
        try:
            if gives(mistake):
                return hint
        except skip:
            continue
    return None


def self_check(check):
    """Make ``check`` return ``False`` with a hint, never raise, whatever the learner passed to it (a
    :class:`Fail` raised inside it: its message is the hint)."""
    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        try:
            return check(*args, **kwargs)
        except Fail as err:
            return fail(str(err))
        except Exception as err:  # the learner's code, or an answer of a kind the check could not use
            return fail(f"the check stopped with {raised(err)}\n  Run your code on a "
                          "small case by hand and look at what it returns (its type, length and values).")
    return wrapper


def generated(model, prompt, max_new_tokens: int, stop_at_eos: bool = True) -> list[int]:
    """Greedy per-prompt ``model.generate``'s new tokens: the ground truth the checks compare the engine with.
    ``stop_at_eos=False``: past the model's EOS too (a request that ignores EOS)."""
    import torch

    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    ids = torch.tensor([list(prompt)], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=pad[0] if isinstance(pad, list) else pad,
                         **({} if stop_at_eos else {"eos_token_id": None}))
    return out[0, ids.shape[1]:].tolist()


def generated_all(model, requests) -> dict:
    """Per-prompt greedy ``model.generate`` of every request (past EOS for a request that ignores it)."""
    return {r.request_id: generated(model, r.prompt, r.max_new_tokens, stop_at_eos=not r.ignore_eos) for r in requests}


@functools.lru_cache(maxsize=1)
def bierce():
    """The course's model, loaded once: a check's model when none is given."""
    from ..models import load_model

    return load_model()[0]


def is_stub(obj) -> bool:
    """Not written yet: ``None``, ``...``, a function whose body is only ``...``, ``pass`` or a docstring (the student
    copy's stub; a Triton kernel's too), or a class whose own methods all are."""
    if obj is None or obj is Ellipsis:
        return True
    if isinstance(obj, type):
        own = [f for f in vars(obj).values() if inspect.isfunction(f)]
        return bool(own) and all(is_stub(f) for f in own)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(obj, "fn", obj))))
    except (OSError, TypeError, SyntaxError):
        return False  # no source to look at: let the run decide
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else [None]
    return all(isinstance(s, ast.Pass) or isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) for s in body)


def is_int(x) -> bool:
    """A whole number as an answer: a Python or NumPy integer (``True`` is not a count)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def as_ints(got) -> list[int] | None:
    """A flat answer of whole numbers as a list of ints -- whether the learner gave a list, a tuple, a generator, a
    tensor or a NumPy array (``[N]``, ``[1, N]``, or one number), of Python, NumPy or one-element tensor integers;
    None if it is not one."""
    if hasattr(got, "tolist") and hasattr(got, "shape"):  # a tensor, a NumPy array
        if len(got.shape) == 0:
            got = got.reshape(1)
        if len(got.shape) == 2 and got.shape[0] == 1:
            got = got[0]
        if len(got.shape) != 1:
            return None
        got = got.tolist()
    if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__"):
        return None
    got = [t.item() if hasattr(t, "item") and getattr(t, "shape", None) in ((), (1,)) else t for t in got]
    return [int(t) for t in got] if all(is_int(t) for t in got) else None
