"""Notebook 05b: write the paged-attention kernel's inner loop in Triton, then run the engine on it.

The learner writes ``my_attend_blocks``, a ``@triton.jit`` function with the signature of the
course's :func:`cbteach.attention.triton_unified.attend_blocks`: one program's walk over its
sequence's keys, ``TILE_N`` at a time, each found through the block table -- load K and V, scores,
masks, FlashAttention's online-softmax update, accumulate -- returning ``(acc, total)``. The course's
launcher (:func:`~cbteach.attention.triton_unified.unified_attention`) runs it, in Triton's
interpreter on a CPU.

The check first runs it on hand-built steps (:data:`STEPS`). Each adds one thing to the steps before
it -- several tiles with a growing max, blocks out of order, a partly filled last block with stale
slots, tiles that span blocks, a prefill chunk, a masked key with a huge score, grouped-query heads
-- so the first step that fails names the mistake, in a hint that never gives the code. Then the
real engine runs on the learner's loop (prompt chunks beside decodes, a pool small enough to
preempt) and every request's tokens must equal per-prompt ``model.generate``'s. A loop that calls
the course's own is refused.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import types

import torch

from ..attention.metadata import build
from ..attention.paged import reference_attention
from ..kv.pool import PagedKVPool
from . import raised, report, self_check

NOT_INSTALLED = 'Triton is not installed here: pip install "cbteach[kernels]" (Colab has it), then restart the kernel'

# (name, what the step is, hint if it is the first to fail, spec). A spec: the sequences
# [(num_computed_tokens, num_scheduled_tokens)], block_size, tile_n, heads, kv_heads, how the blocks
# lie ("in order" / "shuffled"), what stale slots hold ("random" / "nan") and how keys are drawn.
STEPS = [
    ("basic", "one decode over one full block, one head", (
        "even the simplest step is wrong -- one decode, one full block of 4 keys, one head, one tile: check "
        "the loads (the pointer of a key: its block, its slot in the block, its KV head, the column), the "
        "scores (q times k transposed, times scale) and what you return: (acc, total) before dividing"),
     dict(seqs=[(3, 1)], block_size=4, tile_n=4, heads=1, kv_heads=1, blocks="in order", stale="random")),
    ("not_rescaled", "one decode over three blocks, tiles of 4, scores rising tile by tile", (
        "the running max grew from one tile to the next, and what was summed under the old max was kept "
        "as it was: when m changes, the running sum and the output so far must both be rescaled, by "
        "exp(m_old - m_new)"),
     dict(seqs=[(11, 1)], block_size=4, tile_n=4, heads=1, kv_heads=1, blocks="in order", stale="random",
          keys="rising")),
    ("logical_as_physical", "the same decode, its blocks out of order in the pool", (
        "the sequence's blocks lie out of order in the pool here, and your loop read logical block b as if "
        "it were pool block b: the block table says which pool block holds each logical block"),
     dict(seqs=[(11, 1)], block_size=4, tile_n=4, heads=1, kv_heads=1, blocks="shuffled", stale="random")),
    ("past_the_length", "a decode whose last block is partly filled, stale slots after it", (
        "this sequence's last block is only partly filled; the slots after its length hold stale K/V of "
        "earlier requests (here NaN), and your loop read them: a key at a position >= seq_len is not the "
        "sequence's, whatever a load finds there -- mask the loads, not only the scores"),
     dict(seqs=[(9, 1)], block_size=4, tile_n=4, heads=1, kv_heads=1, blocks="shuffled", stale="nan")),
    ("tile_spans_blocks", "blocks of 3 tokens, tiles of 8 keys", (
        "a tile here spans several blocks (blocks of 3, tiles of 8 keys): each key of a tile has its own "
        "logical block and its own slot in it, from its own position"),
     dict(seqs=[(12, 1)], block_size=3, tile_n=8, heads=1, kv_heads=1, blocks="shuffled", stale="nan")),
    ("no_causal_mask", "a prefill chunk of 6 after 3 cached tokens, across a block boundary", (
        "a prefill chunk: its queries saw keys after their own positions. Query j of a chunk sits at "
        "position seq_len - num_queries + j (q_pos) and may see keys 0 .. q_pos only; earlier chunks are "
        "all in its past"),
     dict(seqs=[(3, 6)], block_size=4, tile_n=4, heads=1, kv_heads=1, blocks="shuffled", stale="nan")),
    ("max_before_masking", "a chunk where a key after the first query scores far above the rest", (
        "a key this query may not see scores far above the others, and your running max took it in: the "
        "max must be taken over the scores that survive the masks, or every kept exp(score - max) "
        "underflows to 0"),
     dict(seqs=[(2, 5)], block_size=4, tile_n=4, heads=1, kv_heads=1, blocks="shuffled", stale="nan",
          keys="spike")),
    ("wrong_kv_head", "grouped-query attention: 4 query heads on 2 KV heads", (
        "a query head read the wrong KV head: here 4 query heads share 2 KV heads, consecutive query heads "
        "sharing one (GROUP = heads // kv_heads query heads per KV head)"),
     dict(seqs=[(5, 1), (2, 3)], block_size=4, tile_n=4, heads=4, kv_heads=2, blocks="shuffled", stale="nan")),
    ("mixed", "decodes, chunks and a prompt together, blocks of 3, tiles of 8, 6 heads on 2 KV heads", (
        "every step with one thing at a time passes, but a step with all of them together does not: look at "
        "what changes between sequences of one step -- each has its own length, queries and block table"),
     dict(seqs=[(7, 1), (0, 9), (13, 4), (20, 1)], block_size=3, tile_n=8, heads=6, kv_heads=2,
          blocks="shuffled", stale="nan")),
]
HEAD_DIM = 8


def make_step(seqs, block_size, heads, kv_heads, blocks="shuffled", stale="nan", keys="random", seed=0,
              device="cpu", **_):
    """A hand-built packed step: ``(query, pool, meta)``. Every table is padded with a stale block and
    the pool keeps spare blocks after the last, so a loop that reads past a sequence reads stale K/V
    (never memory outside the tensors)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-(c + n) // block_size) for c, n in seqs]
    used = sum(need)
    num_blocks = 2 * used + 3  # as many blocks again hold other (stale) K/V, and spares after the last
    pool = PagedKVPool(num_layers=1, num_blocks=num_blocks, block_size=block_size, num_kv_heads=kv_heads,
                       head_dim=HEAD_DIM)
    for t in (pool.k[0], pool.v[0]):
        t.copy_(torch.full_like(t, float("nan")) if stale == "nan" else torch.randn(t.shape, generator=g))
    order = list(range(used))
    if blocks == "shuffled":  # scattered over twice the blocks, none where its own number would put it
        order = torch.randperm(2 * used, generator=g).tolist()
        order = [b for j, b in enumerate(order) if b != j][:used]
    tables, taken, spare = [], 0, num_blocks - 1
    for k in need:
        tables.append(order[taken:taken + k] + [spare] * 3)  # padded with a stale block, as engines pad
        taken += k
    query = torch.randn(1, heads, sum(n for _, n in seqs), HEAD_DIM, generator=g)
    for i, (c, n) in enumerate(seqs):
        pos = torch.arange(c + n)
        slots = torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size
        k = torch.randn(c + n, kv_heads, HEAD_DIM, generator=g)
        if keys == "rising":  # each block's keys point further along the query: the max grows tile by tile
            k = 0.5 * k + (pos // block_size + 1).float()[:, None, None] * query[0, :, -1].mean(0)
        elif keys == "spike":  # the last key scores 400 against the chunk's first query, who may not see it
            first = query[0, ::heads // kv_heads, int(meta_rows(seqs)[i])]  # [kv_heads, D]
            k[-1] = first * (400.0 * HEAD_DIM ** 0.5 / (first * first).sum(-1, keepdim=True))
        pool.k[0].view(-1, kv_heads, HEAD_DIM)[slots] = k
        pool.v[0].view(-1, kv_heads, HEAD_DIM)[slots] = torch.randn(c + n, kv_heads, HEAD_DIM, generator=g)
    if device != "cpu":
        for t in (pool.k, pool.v):
            t[0] = t[0].to(device)
        query = query.to(device)
    meta = build([1] * query.shape[2], [c for c, _ in seqs], [n for _, n in seqs], device, block_tables=tables,
                 block_size=block_size)
    meta.pool = pool
    return query, pool, meta


def meta_rows(seqs) -> list[int]:
    """The packed row of each sequence's first query."""
    rows, start = [], 0
    for _, n in seqs:
        rows.append(start)
        start += n
    return rows


class Fail(Exception):
    """The learner's loop is wrong; the message says how."""


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


def scaled(spec: dict, k: int) -> dict:
    """``spec`` with lengths, blocks and tiles ``k`` times larger: compiled for a GPU, ``tl.dot`` wants
    tiles of 16 or more. Lengths scale with the blocks, so a full block stays full and a partial one
    partial; a decode stays one token."""
    seqs = [((c + n) * k - (1 if n == 1 else n * k), 1 if n == 1 else n * k) for c, n in spec["seqs"]]
    return {**spec, "seqs": seqs, "block_size": spec["block_size"] * k, "tile_n": spec["tile_n"] * k}


def run_steps(inner, scale: int | None = None) -> int:
    """Run ``inner`` on every hand-built step in order; :class:`Fail` with the first failure's hint.
    ``scale``: the steps' sizes times this (default: 1 in Triton's interpreter, 4 compiled for a GPU,
    where fp32 ``tl.dot`` may also round through TF32, so the tolerance is wider)."""
    course = _course()
    scale = scale or (1 if course.INTERPRETED else 4)
    device, tol = ("cpu", 1e-4) if course.INTERPRETED else ("cuda", 2e-2)
    for i, (name, what, hint, spec) in enumerate(STEPS, 1):
        spec = scaled(spec, scale) if scale > 1 else spec
        query, pool, meta = make_step(**spec, device=device)
        try:
            got = course.unified_attention(query, pool.k[0], pool.v[0], meta, None, inner=inner,
                                           tile_n=spec["tile_n"])
        except Exception as err:  # the learner's code, inside the interpreter
            raise Fail(f"step {i} of {len(STEPS)} ({what}): your loop stopped with {raised(err)}") from None
        want = reference_attention(query, 0, meta, None)
        if not (torch.isfinite(got).all() and torch.allclose(got, want, rtol=tol, atol=tol / 10)):
            raise Fail(f"step {i} of {len(STEPS)} ({what}) differs from the reference attention: {hint}")
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
    try:
        done = engine.run([Request(p, max_new_tokens, request_id=f"r{i}") for i, p in enumerate(prompts)])
    except Exception as err:
        raise Fail(f"in the real engine: {raised(err)}") from None
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    for p, c in zip(prompts, done):
        ids = torch.tensor([p], device=model.device)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad[0] if isinstance(pad, list) else pad)
        if c.output_ids != out[0, len(p):].tolist():
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
    if not callable(inner):
        return report(False, "", f"pass your function itself (my_attend_blocks, not my_attend_blocks(...)); got "
                                 f"{type(inner).__name__}")
    if not written(inner):
        return report(False, "", "my_attend_blocks is still the stub: write its loop (and decorate it with "
                                 "@triton.jit), then run this cell again")
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
