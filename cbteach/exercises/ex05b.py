"""Notebook 05b: the paged-attention kernel's inner loop in Triton, run by the course's launcher.

The learner's ``my_attend_blocks`` runs on hand-built steps, each adding one difficulty (:mod:`.ex05b_steps`);
the first that fails names the mistake, then the real engine runs on it and its tokens must equal
``model.generate``'s. A loop that is the course's, or names cbteach, is refused.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types

import torch

from ..attention.paged import reference_attention
from . import Fail, generated, raised, report, self_check, uncallable
from .ex05b_steps import HEAD_DIM, STEPS, diagnose, make_step, meta_rows, scaled

__all__ = ["HEAD_DIM", "STEPS", "Fail", "check_attend_blocks", "make_step", "meta_rows", "run_engine", "run_steps",
           "scaled"]

NOT_INSTALLED = 'Triton is not installed here: pip install "cbteach[kernels]" (Colab has it), then restart the kernel'
GPU_SCALE = 4  # compiled for a GPU the steps are this much larger: tl.dot wants tiles of 16 or more
TOLERANCE = {"cpu": 1e-4, "cuda": 2e-2}  # the interpreter computes exactly; a GPU's fp32 tl.dot may use TF32


def _course():
    from ..attention import triton_unified  # raises ImportError without Triton

    return triton_unified


def written(fn) -> bool:
    """False for the student copy's stub: a body of only ``...``, ``pass`` or a docstring."""
    raw = getattr(fn, "fn", fn)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(raw)))
    except (OSError, TypeError, SyntaxError):
        return True  # no source to look at: let the run decide
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    return not all(isinstance(s, ast.Pass) or (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                   for s in body)


def delegates(fn) -> bool:
    """Whether the loop is the course's own, or reaches for it (or anything else of cbteach's) by name."""
    course = _course()
    raw, own = getattr(fn, "fn", fn), course.attend_blocks.fn
    if raw is own or getattr(raw, "__code__", None) is own.__code__:
        return True
    code = getattr(raw, "__code__", None)
    for name in (code.co_names if code else ()):
        obj = getattr(raw, "__globals__", {}).get(name)
        if isinstance(obj, types.ModuleType) and obj.__name__.startswith("cbteach"):
            return True
        target = getattr(obj, "fn", obj)
        if target is own or getattr(target, "__module__", None) == course.__name__:
            return True
    return False


def _attempt(course, inner, query, pool, meta, tile_n: int):
    """The launcher on one step with ``inner`` as its loop: its output, or the exception it stopped with."""
    try:
        return course.unified_attention(query, pool.k[0], pool.v[0], meta, None, inner=inner, tile_n=tile_n)
    except Exception as err:  # the learner's code, inside the interpreter
        return err


def run_steps(inner, scale: int | None = None) -> int:
    """Run ``inner`` on every hand-built step in order; :class:`Fail` with the first failure's hint. ``scale``: the
    steps' sizes times this (default 1 in the interpreter, :data:`GPU_SCALE` on a GPU, with a wider tolerance)."""
    course = _course()
    scale = scale or (1 if course.INTERPRETED else GPU_SCALE)
    device = "cpu" if course.INTERPRETED else "cuda"
    tol = TOLERANCE[device]
    for i, (name, what, hint, spec) in enumerate(STEPS, 1):
        spec = scaled(spec, scale) if scale > 1 else spec
        query, pool, meta = make_step(**spec, device=device)
        got = _attempt(course, inner, query, pool, meta, spec["tile_n"])
        if isinstance(got, Exception):
            raise Fail(f"step {i} of {len(STEPS)} ({what}): your loop stopped with {raised(got)}") from None
        want = reference_attention(query, 0, meta, None)
        if not (torch.isfinite(got).all() and torch.allclose(got, want, rtol=tol, atol=tol / 10)):
            def again(q, p, m):
                out = _attempt(course, inner, q, p, m, spec["tile_n"])
                return None if isinstance(out, Exception) else out
            said = diagnose(again, spec, got, want, tol, hint, device, None if course.INTERPRETED else 16)
            raise Fail(f"step {i} of {len(STEPS)} ({what}) differs from the reference attention: {said}")
    return len(STEPS)


def engine_prompts(tok=None) -> list[list[int]]:
    texts = ("ABSURDITY, n.", "CYNIC, n. A blackguard", "WIT, n.")
    if tok is not None:
        return [tok(t)["input_ids"] for t in texts]
    return [[10 + (5 * i + 3 * j) % 80 for j in range(5 + 3 * i)] for i in range(3)]


def run_engine(model, tok, inner, max_new_tokens: int = 4) -> tuple[int, int]:
    """Serve three prompts on a paged engine whose attention is the kernel with ``inner`` as its loop:
    blocks of 4, a token budget of 6 (prompts cut into chunks beside decodes), a pool that preempts.
    Every request's tokens must equal per-prompt ``model.generate``'s."""
    from ..core.request import Request
    from ..engine.engine import Engine

    prompts = engine_prompts(tok)
    blocks = 2 * -(-(max(len(p) for p in prompts) + max_new_tokens) // 4)  # two requests at full length
    engine = Engine(model, tok, max_batch_size=3, kv="paged", block_size=4, num_blocks=blocks, token_budget=6,
                    attention=_course().kernel_attention(inner))
    requests = [Request(p, max_new_tokens, request_id=f"r{i}") for i, p in enumerate(prompts)]
    try:
        done = engine.run(requests)
    except Exception as err:  # the learner's code, inside the engine's forward pass
        raise Fail(f"in the real engine: {raised(err)}") from None
    for p, c in zip(prompts, done):
        if c.output_ids != generated(model, p, max_new_tokens):
            raise Fail(f"in the real engine, request {c.request_id}'s tokens differ from generate's, though every "
                       "hand-built step passed: look at what a real step adds -- longer contexts, several "
                       "sequences of different lengths, the engine's own tile size")
    return len(prompts), sum(len(c.output_ids) for c in done)


@self_check
def check_attend_blocks(inner, model=None, tok=None) -> bool:
    """``inner``: your ``@triton.jit`` inner loop, with :func:`~cbteach.attention.triton_unified.attend_blocks`'s
    signature. Hand-built steps first; then, with ``model``, the real engine on it."""
    try:
        _course()
    except ImportError:
        return report(False, "", NOT_INSTALLED)
    if uncallable(inner, "my_attend_blocks"):
        return False
    if not written(inner):
        return report(False, "", "my_attend_blocks is still the stub: write its loop below the cell's "
                                 "@triton.jit line (replace the ...), then run this cell again")
    if delegates(inner):
        return report(False, "", "your loop calls the course's own (cbteach's attend_blocks or another piece of "
                                 "cbteach): write the loop yourself")
    try:
        steps = run_steps(inner)
        served = run_engine(model, tok, inner) if model is not None else None
    except Fail as err:
        return report(False, "", str(err))
    engine = (f", and the real engine ran on it: {served[0]} requests, {served[1]} tokens, each equal to "
              "generate's") if served else ""
    return report(True, f"your loop equals the reference attention on {steps} hand-built steps{engine}", "")
