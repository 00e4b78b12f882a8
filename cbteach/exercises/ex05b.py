"""Notebook 05b: the paged-attention kernel's inner loop in Triton, run by the course's launcher.

The learner's ``my_attend_blocks`` runs on hand-built steps (:data:`STEPS`), each adding one difficulty; the first
that fails is named by :func:`diagnose`. Then the real engine runs on it, its tokens equal to ``model.generate``'s.
"""
from __future__ import annotations

import types
from typing import NamedTuple

import torch

from ..attention.metadata import build
from ..attention.reference import reference_attention
from ..kv.paged import PagedKVPool
from . import Fail, ex05b_mistakes as mistakes, fail, first_mistake, is_stub, need_function, passed, raised, self_check

NOT_INSTALLED = 'Triton is not installed here: pip install "cbteach[kernels]" (Colab has it), then restart the kernel'
GPU_SCALE = 4  # compiled for a GPU the steps are this much larger: tl.dot wants tiles of 16 or more
TOLERANCE = {"cpu": 1e-4, "cuda": 2e-2}  # the interpreter computes exactly; a GPU's fp32 tl.dot may use TF32
HEAD_DIM = 8


class Step(NamedTuple):
    """A hand-built step: what it is, the hint if it is the first to fail (a mistake of
    :data:`.ex05b_mistakes.MISTAKES` by name, or a text), and :func:`make_step`'s arguments (:func:`_spec`)."""

    name: str
    what: str
    hint: str
    spec: dict


def _spec(*seqs, **kw) -> dict:
    """Sequences ``(computed, scheduled)``; blocks of 4, tiles of 4 keys, one head of :data:`HEAD_DIM`, blocks
    shuffled, stale slots NaN."""
    return dict(seqs=list(seqs), block_size=4, tile_n=4, heads=1, kv_heads=1, head_dim=HEAD_DIM, blocks="shuffled",
                stale="nan") | kw


IN_ORDER = dict(blocks="in order", stale="random")
STEPS = [
    Step("basic", "one decode over one full block, one head",
         "even the simplest step is wrong: check the loads (a key's block, its slot, its KV head, the column), the "
         "scores (q times k transposed, times scale) and what you return: (acc, total) before dividing",
         _spec((3, 1), **IN_ORDER)),
    Step("not_rescaled", "one decode over three blocks, tiles of 4, scores rising tile by tile",
         "the running max grew from one tile to the next: when m changes, the running sum and the output so far "
         "must both be rescaled, by exp(m_old - m_new)", _spec((11, 1), keys="rising", **IN_ORDER)),
    Step("overflow", "two decodes over three blocks, one scoring in the hundreds, one far below zero",
         "one decode's scores reach the hundreds (exp above about 88 overflows float32), the other's all lie near "
         "-150 (exp below about -104 underflows to 0): the online softmax keeps every exp(score - m) at most 1 and "
         "the largest exactly 1 -- check what your loop subtracts before exp, and its rescale",
         _spec((11, 1), (11, 1), keys="extremes", **IN_ORDER)),
    Step("logical_as_physical", "the same decode, its blocks out of order in the pool", "logical_as_physical",
         _spec((11, 1), stale="random")),
    Step("past_the_length", "a decode whose last block is partly filled, stale slots after it", "loads_unmasked",
         _spec((9, 1))),
    Step("tile_spans_blocks", "blocks of 3 tokens, tiles of 8 keys", "one_block_per_tile",
         _spec((12, 1), block_size=3, tile_n=8)),
    Step("no_causal_mask", "a prefill chunk of 6 after 3 cached tokens, across a block boundary", "no_causal",
         _spec((3, 6))),
    Step("max_before_masking", "a chunk where a key after the first query scores far above the rest",
         "max_before_masking", _spec((2, 5), keys="spike")),
    Step("wrong_kv_head", "grouped-query attention: 4 query heads on 2 KV heads", "kv_head_is_head",
         _spec((5, 1), (2, 3), heads=4, kv_heads=2)),
    Step("head_dim_columns", "heads of 6 numbers, 2 KV heads: a tile's BLOCK_D columns run past a head's own",
         "head_columns_unmasked", _spec((5, 1), (2, 3), heads=2, kv_heads=2, head_dim=6)),
    Step("mixed", "decodes, chunks and a prompt together, blocks of 3, tiles of 8, 6 heads on 2 KV heads",
         "every step with one thing at a time passes, but a step with all of them together does not: look at what "
         "changes between sequences of one step -- each has its own length, queries and block table",
         _spec((7, 1), (0, 9), (13, 4), (20, 1), block_size=3, tile_n=8, heads=6, kv_heads=2)),
]


def make_step(seqs, block_size, heads, kv_heads, head_dim=HEAD_DIM, blocks="shuffled", stale="nan", keys="random",
              seed=0, device="cpu", **_):
    """A hand-built packed step ``(query [1, heads, T, head_dim], pool, meta)``. A loop reading past a sequence
    reads stale K/V (NaN or random), never outside the tensors (the interpreter would crash)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    used = sum(need)
    pool = PagedKVPool(num_layers=1, num_blocks=2 * used + 3, block_size=block_size, num_kv_heads=kv_heads,
                       head_dim=head_dim)  # as many blocks again hold other (stale) K/V, and spares after the last
    for t in (pool.k[0], pool.v[0]):
        t.copy_(torch.full_like(t, float("nan")) if stale == "nan" else torch.randn(t.shape, generator=g))
    order = list(range(used))
    if blocks == "shuffled":  # scattered over twice the blocks, none where its own number would put it
        order = [b for j, b in enumerate(torch.randperm(2 * used, generator=g).tolist()) if b != j][:used]
    tables, taken = [], 0
    for k in need:  # padded with a stale block, at least block_size wide (a loop that swaps block and slot
        tables.append(order[taken:taken + k] + [2 * used + 2] * max(3, block_size - k))  # reads that far)
        taken += k
    query = torch.randn(1, heads, sum(n for _, n in seqs), head_dim, generator=g)
    for i, (c, n) in enumerate(seqs):
        pos = torch.arange(c + n)
        slots = torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size
        k = torch.randn(c + n, kv_heads, head_dim, generator=g)
        if keys == "rising":  # each block's keys point further along the query: the max grows tile by tile
            k = 0.5 * k + (pos // block_size + 1).float()[:, None, None] * query[0, :, -1].mean(0)
        elif keys == "extremes":  # every key along (or against) the decode's query: scores around 120 -- exp(120)
            along = query[0, :, sum(m for _, m in seqs[:i + 1]) - 1].mean(0)  # overflows float32 -- or -150
            k = 0.5 * k + along * ((120.0 if i % 2 == 0 else -150.0) * head_dim ** 0.5 / (along @ along))
        elif keys == "spike":  # the last key scores 400 against the chunk's first query, who may not see it
            first = query[0, ::heads // kv_heads, sum(m for _, m in seqs[:i])]  # [kv_heads, D]
            k[-1] = first * (400.0 * head_dim ** 0.5 / (first * first).sum(-1, keepdim=True))
        pool.k[0].view(-1, kv_heads, head_dim)[slots] = k
        pool.v[0].view(-1, kv_heads, head_dim)[slots] = torch.randn(c + n, kv_heads, head_dim, generator=g)
    if device != "cpu":
        pool.k[0], pool.v[0], query = pool.k[0].to(device), pool.v[0].to(device), query.to(device)
    meta = build([1] * query.shape[2], [c for c, _ in seqs], [n for _, n in seqs], device, block_tables=tables,
                 block_size=block_size)
    meta.pool = pool
    return query, pool, meta


def scaled(spec: dict, k: int) -> dict:
    """``spec`` with lengths, blocks and tiles ``k`` times larger (a GPU's ``tl.dot`` wants tiles of 16 or more);
    a full block stays full, a partial one partial, a decode one token."""
    seqs = [((c + n) * k - (1 if n == 1 else n * k), 1 if n == 1 else n * k) for c, n in spec["seqs"]]
    return {**spec, "seqs": seqs, "block_size": spec["block_size"] * k, "tile_n": spec["tile_n"] * k}


def _close(a, b, tol: float) -> bool:
    return a is not None and b is not None and torch.allclose(a, b, rtol=tol, atol=tol / 10, equal_nan=True)


def diagnose(run, spec: dict, got, want, tol: float, hint: str, device: str = "cpu", block_q: int | None = None) -> str:
    """The hint for ``got`` (not ``want``) on the step ``spec``: the simulated wrong loop that gives it here and
    (``run(query, pool, meta)``) on the step with finite stale slots, else the symptom, else ``hint``."""
    query, pool, meta = make_step(**spec, device=device)
    again = make_step(**{**spec, "stale": "random"}, seed=1, device=device)
    got_again = run(*again)
    said = first_mistake(mistakes.MISTAKES, lambda name: (
        _close(got, mistakes.loop(query, pool, meta, spec["tile_n"], name, block_q), tol)
        and (got_again is None or _close(got_again, mistakes.loop(*again, spec["tile_n"], name, block_q), tol))))
    if said:
        return said
    if not torch.isfinite(got).all():
        stale = spec.get("stale", "nan") == "nan"
        return mistakes.NAN + ("; or from a stale slot: here every slot no sequence owns holds NaN" if stale else "")
    if torch.allclose(got, want, rtol=100 * tol, atol=10 * tol):
        return mistakes.ROUNDING
    if hint in mistakes.MISTAKES:  # the mistake this step is for, simulated above, is not what your loop gives
        several = max(spec["seqs"], key=lambda cn: cn[1])[1] > 1
        return ("not one of the typical mistakes the check knows; what this step adds is where to look"
                + ("; and with several queries per program, a factor per query ([BLOCK_Q]) scales the rows of a "
                   "[BLOCK_Q, BLOCK_D] tile only as x[:, None]" if several else ""))
    return hint


def _course():
    from ..attention import triton_unified  # raises ImportError without Triton

    return triton_unified


def delegates(fn) -> bool:
    """Whether the loop is the course's own, or names it (or a module of cbteach's) in its code."""
    course = _course()
    raw, own = getattr(fn, "fn", fn), course.attend_blocks.fn
    code = getattr(raw, "__code__", None)
    if raw is own or code is own.__code__:
        return True
    for name in code.co_names if code else ():
        obj = getattr(raw, "__globals__", {}).get(name)
        if isinstance(obj, types.ModuleType) and obj.__name__.startswith("cbteach"):
            return True
        if getattr(obj, "fn", obj) is own or getattr(obj, "__module__", None) == course.__name__:
            return True
    return False


def _attempt(course, inner, query, pool, meta, tile_n: int):
    """The launcher on one step with ``inner`` as its loop: (its output, None), or (None, the error it raised)."""
    try:
        return course.unified_attention(query, pool.k[0], pool.v[0], meta, None, inner=inner, tile_n=tile_n), None
    except Exception as err:  # the learner's code, inside the interpreter
        return None, err


def run_steps(inner, scale: int | None = None) -> int:
    """Run ``inner`` on every hand-built step in order (sizes times ``scale``, default :data:`GPU_SCALE` on a GPU);
    :class:`Fail` with the first failure's hint."""
    course = _course()
    scale = scale or (1 if course.INTERPRETED else GPU_SCALE)
    device = "cpu" if course.INTERPRETED else "cuda"
    tol = TOLERANCE[device]
    for i, (_, what, hint, spec) in enumerate(STEPS, 1):
        spec = scaled(spec, scale) if scale > 1 else spec
        query, pool, meta = make_step(**spec, device=device)
        got, err = _attempt(course, inner, query, pool, meta, spec["tile_n"])
        if err is not None:
            said = next((f" -- {h}" for text, h in mistakes.STOPPED.items() if text in str(err)), "")
            raise Fail(f"step {i} of {len(STEPS)} ({what}): your loop stopped with {raised(err)}{said}") from None
        want = reference_attention(query, 0, meta, None)
        if not (torch.isfinite(got).all() and torch.allclose(got, want, rtol=tol, atol=tol / 10)):
            run = lambda *step: _attempt(course, inner, *step, spec["tile_n"])[0]  # noqa: E731
            said = diagnose(run, spec, got, want, tol, hint, device, None if course.INTERPRETED else 16)
            raise Fail(f"step {i} of {len(STEPS)} ({what}) differs from the reference attention: {said}")
    return len(STEPS)


def run_engine(model, tok, inner, max_new_tokens: int = 4) -> tuple[int, int]:
    """Serve three prompts (in chunks beside decodes, a pool that preempts) on the kernel with ``inner`` as its
    loop; every request's tokens must equal ``model.generate``'s."""
    from .ex05_attention import serve_like_generate

    texts = ("ABSURDITY, n.", "CYNIC, n. A blackguard", "WIT, n.")
    prompts = ([tok(t)["input_ids"] for t in texts] if tok is not None else
               [[10 + (5 * i + 3 * j) % 80 for j in range(5 + 3 * i)] for i in range(3)])
    blocks = 2 * -(-(max(len(p) for p in prompts) + max_new_tokens) // 4)  # two requests at full length
    tokens = serve_like_generate(model, prompts, max_new_tokens, "every hand-built step passed", "look at what a real "
                                 "step adds -- longer contexts, several sequences of different lengths, the engine's "
                                 "own tile size", max_batch_size=3, block_size=4, num_blocks=blocks, token_budget=6,
                                 attention=_course().kernel_attention(inner))
    return len(prompts), tokens


@self_check
def check_attend_blocks(inner, model=None, tok=None) -> bool:
    """``inner``: your ``@triton.jit`` inner loop, with :func:`~cbteach.attention.triton_unified.attend_blocks`'s
    signature. Hand-built steps first; then, with ``model``, the real engine on it."""
    try:
        _course()
    except ImportError:
        return fail(NOT_INSTALLED)
    need_function(inner, "my_attend_blocks")
    if is_stub(inner):
        return fail("not done yet: my_attend_blocks is still the stub -- write its loop below the cell's "
                    "@triton.jit line (replace the ...), then run this cell again")
    if delegates(inner):
        return fail("your loop calls the course's own (cbteach's attend_blocks or another piece of "
                    "cbteach): write the loop yourself")
    steps = run_steps(inner)
    served = run_engine(model, tok, inner) if model is not None else None
    engine = (f", and the real engine ran on it: {served[0]} requests, {served[1]} tokens, each equal to "
              "generate's") if served else ""
    return passed(f"your loop equals the reference attention on {steps} hand-built steps{engine}")
