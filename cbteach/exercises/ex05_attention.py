"""Notebook 05's second exercise: the slot mapping and paged attention, with the engine's plug-point signatures.

Each runs on hand-built steps (:data:`STEPS`: tables out of order, partly filled blocks, stale K/V), a wrong answer
named by the mistake of :mod:`.ex05_mistakes` that recomputes it (every step runs: a mistake may crash on one and
show on another); then in the real engine, every token equal to ``model.generate``'s. No check prints a value.
"""
from __future__ import annotations

import contextlib
import copy
import numbers
from typing import NamedTuple

import torch

from ..attention.metadata import build
from ..core.request import Request
from ..engine.engine import Engine
from ..kv.paged import PagedKVPool
from . import Fail, fail, first_mistake, generated, guard, is_int, need_function, passed, raised, self_check
from .ex05_mistakes import ATTENTION_MISTAKES, SLOT_MISTAKES, attend, slots

MAX_NEW_TOKENS = 16  # per request, in the engine runs


class Seq(NamedTuple):
    computed: int  # num_computed_tokens: its tokens already in the cache
    scheduled: int  # num_scheduled_tokens: its tokens fed this step
    table: list  # its block table


class Step(NamedTuple):
    what: str
    block_size: int
    seqs: list

    def args(self, pad: bool = False) -> tuple:
        """A slot mapping's arguments; ``pad``: every table lengthened by blocks nobody owns (sequence i's from
        ``100 * (i + 1)`` on), so that a mapping reading past a table runs."""
        width = max(len(s.table) for s in self.seqs) + 2 if pad else 0
        return ([list(s.table) + [100 * (i + 1) + k for k in range(width - len(s.table))]
                 for i, s in enumerate(self.seqs)],
                [s.computed for s in self.seqs], [s.scheduled for s in self.seqs], self.block_size)


class Heads(NamedTuple):
    """Attention on one of :data:`STEPS`."""

    step: int  # its index in STEPS
    heads: int  # query heads
    kv_heads: int
    head_dim: int
    scaling: float | None  # None: head_dim ** -0.5


STEPS = [
    Step(what="three decodes, one of them the first token of a new block", block_size=4, seqs=[
        Seq(computed=5, scheduled=1, table=[7, 2]), Seq(computed=2, scheduled=1, table=[4]),
        Seq(computed=8, scheduled=1, table=[1, 9, 3])]),
    Step(what="a prompt, a chunk that continues a prompt across a block boundary, a decode", block_size=4, seqs=[
        Seq(computed=0, scheduled=6, table=[3, 8]), Seq(computed=5, scheduled=4, table=[6, 0, 10]),
        Seq(computed=3, scheduled=1, table=[11])]),
    Step(what="blocks of two: a chunk, a prompt, a decode", block_size=2, seqs=[
        Seq(computed=3, scheduled=2, table=[5, 1, 4]), Seq(computed=0, scheduled=3, table=[0, 2]),
        Seq(computed=4, scheduled=1, table=[3, 6, 7])]),
    Step(what="blocks of one token", block_size=1, seqs=[
        Seq(computed=1, scheduled=2, table=[4, 0, 2]), Seq(computed=0, scheduled=2, table=[1, 3])]),
    Step(what="blocks of 16: a long chunk, a decode, a short prompt", block_size=16, seqs=[
        Seq(computed=20, scheduled=12, table=[2, 0]), Seq(computed=31, scheduled=1, table=[1, 3]),
        Seq(computed=0, scheduled=5, table=[4])]),
]
HEADS = [Heads(step=0, heads=2, kv_heads=2, head_dim=8, scaling=None),
         Heads(step=1, heads=4, kv_heads=2, head_dim=8, scaling=None),
         Heads(step=2, heads=4, kv_heads=1, head_dim=8, scaling=0.6),
         Heads(step=1, heads=6, kv_heads=3, head_dim=4, scaling=0.35),
         Heads(step=4, heads=4, kv_heads=2, head_dim=8, scaling=None)]


def _first_named(failures: list) -> None:
    """Raise the most telling failure: one that names a known mistake, else the first."""
    failures = [f for f in failures if f is not None]
    if failures:
        raise next((f for f in failures if f.named), failures[0])


def _text(step: Step) -> str:
    tables, computed, scheduled, bs = step.args()
    return (f"({step.what}; block_size {bs}, block_tables {tables}, num_computed_tokens {computed}, "
            f"num_scheduled_tokens {scheduled})")


def _kind(c: int, n: int) -> str:
    if n == 1:
        return f"the decode at position {c}"
    return f"the prompt of {n} tokens" if c == 0 else f"the chunk of {n} tokens after {c} computed"


# -- the slot mapping ------------------------------------------------------------------------------

def _as_slots(got, total: int) -> list[int]:
    if got is None:
        raise Fail("not done yet: your slot mapping returned None -- write it in the cell above")
    if isinstance(got, torch.Tensor):
        if got.dim() != 1:  # (the engine takes a flat list or a 1-D tensor: [T], as its own slot_mapping)
            raise Fail(f"your slot mapping returned a tensor of shape {tuple(got.shape)}: return one flat list (or a "
                       "1-D tensor) of pool slots, one per scheduled token in packed order")
        got = got.tolist()
    try:
        got = list(got)
    except TypeError:
        raise Fail(f"return a list of pool slots, one int per scheduled token; got {type(got).__name__}") from None
    if got and all(isinstance(x, (list, tuple)) for x in got):
        raise Fail("return one flat list in packed order (sequence 0's tokens, then 1's, ...), not a list per sequence")
    if not all(is_int(x) for x in got):
        raise Fail("a slot is a whole number (an int): block id times block_size plus an offset")
    if len(got) != total:
        raise Fail(f"you returned {len(got)} slots for {total} scheduled tokens: one slot per token fed this step")
    return [int(x) for x in got]


def _diagnose_slots(got, step: Step, pad: bool = False) -> tuple[str, bool]:
    """The hint for wrong slots ``got``, and whether it names a mistake."""
    args = step.args(pad)
    hint = first_mistake(SLOT_MISTAKES, lambda name: slots(*args, mistake=name) == got, skip=IndexError)
    if hint:
        return hint, True
    right = slots(*args)
    if sorted(right) == sorted(got):
        return ("the right slots in the wrong order: packed order is sequence 0's tokens first, in position "
                "order, then sequence 1's, ..."), True
    starts = [sum(s.scheduled for s in step.seqs[:i]) for i in range(len(step.seqs) + 1)]
    wrong = [_kind(c, n) for (c, n, _), a, b in zip(step.seqs, starts, starts[1:]) if got[a:b] != right[a:b]]
    return ("these tokens' slots are not where their block tables put them: " + ", ".join(wrong) +
            ". A token at position p lies in block p // block_size of its table, at offset p % block_size"), False


def _slot_failure(slot_mapping, step: Step) -> Fail | None:
    """What is wrong on ``step`` (None: nothing). A mapping that indexes past a table runs again on padded
    tables (:meth:`Step.args`), where the mistake that reads there can be named."""
    where, total = f"\n  on the step {_text(step)}", sum(s.scheduled for s in step.seqs)
    try:
        got = slot_mapping(*step.args())
    except Exception as err:  # the learner's code
        said = f"your slot mapping raised {raised(err)}{where}"
        if not isinstance(err, IndexError):
            return Fail(said)
        with contextlib.suppress(Exception):  # the learner's code again: the first error is the one to show
            padded = _as_slots(slot_mapping(*step.args(pad=True)), total)
            hint, named = _diagnose_slots(padded, step, pad=True)
            if named and padded != slots(*step.args(pad=True)):
                return Fail(f"{hint}{where}, where your code raised {type(err).__name__}: {err}", named=True)
        return Fail(f"{said}\n  An index past the end of a block table: a table holds exactly the blocks its own "
                    "sequence's tokens need -- position p is in block p // block_size of that sequence's table")
    got = _as_slots(got, total)
    if got == slots(*step.args()):
        return None
    hint, named = _diagnose_slots(got, step)
    return Fail(hint + where, named)


def check_slot_mapping_cases(slot_mapping) -> None:
    """Run ``slot_mapping`` on every hand-built step; raise :class:`Fail` naming the mistake."""
    refused = guard.refusal("slot_mapping", slot_mapping)
    if refused:
        raise Fail(refused, named=True)
    _first_named([_slot_failure(slot_mapping, step) for step in STEPS])


# -- paged attention -------------------------------------------------------------------------------

def _step(step: Step, heads, kv_heads, head_dim, seed):
    """A hand-built step's metadata on a pool (2 layers) of random K/V, and random q ``[1, heads, T, head_dim]``,
    k and v ``[1, kv_heads, T, head_dim]``."""
    tables, computed, scheduled, bs = step.args()
    g = torch.Generator().manual_seed(seed)
    pool = PagedKVPool(num_layers=2, num_blocks=1 + max(b for t in tables for b in t), block_size=bs,
                       num_kv_heads=kv_heads, head_dim=head_dim)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    meta = build([1] * sum(scheduled), computed, scheduled, "cpu", block_tables=tables, block_size=bs)
    meta.pool = pool
    q, k, v = (torch.randn(1, h, sum(scheduled), head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    return meta, q, k, v


_fresh = copy.deepcopy  # the same step on a copy of its pool (each run writes into its own)


def _check_writes(meta, before, k, v, layer) -> None:
    """This step's K/V at its slots of ``layer``, and nothing else changed anywhere in the pool."""
    pool, idx = meta.pool, meta.slot_mapping
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    new_k, new_v = k[0].transpose(0, 1), v[0].transpose(0, 1)
    K, V = flat(pool.k[layer])[idx], flat(pool.v[layer])[idx]
    if not (torch.allclose(K, new_k) and torch.allclose(V, new_v)):
        if torch.allclose(K, new_v) and torch.allclose(V, new_k):
            raise Fail("the keys went where the values go and the other way round")
        if any(torch.allclose(flat(pool.k[i])[idx], new_k) for i in range(len(pool.k)) if i != layer):
            raise Fail("you wrote this step's K/V into another layer's pool: every layer has its own -- write "
                       "into the layer your function was called for")
        raise Fail("after your function ran, the pool at meta.slot_mapping does not hold this step's keys and "
                   "values: write them there (meta.pool.write) before reading the context")
    keep = torch.ones(flat(pool.k[0]).shape[0], dtype=torch.bool)
    keep[idx] = False
    if any(not torch.equal(flat(a)[keep], flat(b)[keep]) for a, b in zip(pool.k + pool.v, before.k + before.v)):
        raise Fail("your function changed pool slots that are not this step's: they hold other tokens' K/V "
                   "(this sequence's history, or another sequence's)")


def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4, equal_nan=True)


def _diagnose(out, meta, q, k, v, layer, scaling) -> tuple[str, bool]:
    gives = lambda name: _close(out, attend(q, k, v, _fresh(meta), layer, scaling, mistake=name))  # noqa: E731
    hint = first_mistake(ATTENTION_MISTAKES, gives, skip=(IndexError, RuntimeError))  # or would not even run here
    if hint:
        return hint, True
    right, at = attend(q, k, v, _fresh(meta), layer, scaling), meta.query_start_loc.tolist()
    wrong = [_kind(c, n) for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens))
             if not _close(out[:, :, at[i]:at[i + 1]], right[:, :, at[i]:at[i + 1]])]
    return ("the output is wrong for " + ", ".join(wrong) + ". Each sequence's queries attend to its own "
            "context only, read through its block table, each query up to its own position"), False


def _attention_failure(attention, n: int, h: Heads, ran_plain: bool) -> Fail | None:
    """What is wrong on :data:`HEADS` ``[n]`` (None: nothing); ``ran_plain``: right on a step without GQA."""
    meta, q, k, v = _step(STEPS[h.step], h.heads, h.kv_heads, h.head_dim, seed=n)
    scale = h.scaling if h.scaling is not None else h.head_dim ** -0.5
    where = (f"{_text(STEPS[h.step])[:-1]}; {h.heads} query heads, {h.kv_heads} KV heads, head_dim {h.head_dim}, "
             f"scaling {scale:g}, layer 1)")
    mine, before = _fresh(meta), _fresh(meta).pool
    try:
        out = attention(q.clone(), k.clone(), v.clone(), mine, 1, scale)
    except Exception as err:  # the learner's code
        gqa = h.heads != h.kv_heads and ran_plain
        more = (f"\n  It ran when every query head had its own KV head; here {h.heads} query heads share "
                f"{h.kv_heads} KV heads (grouped-query attention): each KV head serves a group of "
                f"{h.heads // h.kv_heads} consecutive query heads") if gqa else (
            "\n  An index past the pool or a block table: a block holds meta.block_size tokens (here "
            f"{STEPS[h.step].block_size}; the steps use blocks of 1, 2, 4 and 16), not a number of your own"
            if isinstance(err, IndexError) else "\n  Sizes that do not match: read the head counts from the tensors "
            "you are given (query.shape[1] query heads, key.shape[1] KV heads), not from a model of your own"
            if isinstance(err, RuntimeError) and "size" in str(err) else "")
        return Fail(f"your attention raised {raised(err)}\n  on the step {where}{more}", named=gqa)
    if out is None:
        raise Fail("not done yet: your attention returned None -- write it in the cell above")
    if not isinstance(out, torch.Tensor) or out.shape != q.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise Fail(f"your attention returned {got}; return a tensor shaped like the queries, [1, heads, "
                   f"tokens, head_dim] = {tuple(q.shape)} {where}")
    if out.dtype != q.dtype:  # (the model's next layer takes the queries' dtype)
        raise Fail(f"your attention returned {out.dtype} numbers; return the queries' dtype, {q.dtype} (compute in "
                   "another if you like, then .to(query.dtype))")
    _check_writes(mine, before, k, v, 1)
    if _close(out, attend(q, k, v, _fresh(meta), 1, scale)):
        return None
    hint, named = _diagnose(out, meta, q, k, v, 1, scale)
    return Fail(f"{hint}\n  on the step {where}", named)


def check_attention_cases(attention) -> None:
    """Run ``attention`` on every hand-built step; raise :class:`Fail` naming the mistake."""
    refused = guard.refusal("attention", attention)
    if refused:
        raise Fail(refused, named=True)
    ran_plain, failures = False, []
    for n, h in enumerate(HEADS):
        failures.append(_attention_failure(attention, n, h, ran_plain))
        ran_plain = ran_plain or (failures[-1] is None and h.heads == h.kv_heads)
    _first_named(failures)


# -- the real engine ----------------------------------------------------------------------------------

class Run(NamedTuple):
    what: str
    model: object
    prompts: list
    options: dict  # the Engine's


def engine_runs(model, prompts, max_new_tokens: int = MAX_NEW_TOKENS) -> list[Run]:
    """What the check serves: prompt chunks beside decodes, a pool of two requests' room (preemption, reused
    blocks), and a small model with one KV head."""
    from .ex09 import small_model

    longest = max(len(p) for p in prompts)
    budget = max(2, longest // 2 + 1)
    tight = 2 * -(-(longest + max_new_tokens) // 2)  # blocks of 2: room for two requests at full length
    toy = [[10 + (7 * i + 3 * j) % 80 for j in range(5 + 3 * i)] for i in range(5)]
    return [Run(what=f"your prompts, blocks of 4, a token budget of {budget}: prompt chunks beside decodes",
                model=model, prompts=prompts, options=dict(max_batch_size=4, block_size=4, token_budget=budget)),
            Run(what=f"your prompts, blocks of 2, a pool of {tight} blocks: the engine preempts and reuses blocks",
                model=model, prompts=prompts, options=dict(max_batch_size=4, block_size=2, num_blocks=tight)),
            Run(what="a small random model with one KV head for four query heads, blocks of 8, a budget of 8",
                model=small_model("mqa"), prompts=toy, options=dict(max_batch_size=3, block_size=8, token_budget=8))]


def serve_like_generate(model, prompts, max_new_tokens: int, what: str, look: str, **options) -> int:
    """Serve ``prompts`` on a paged engine with ``options``: :class:`Fail` (``what``: the run, ``look``: where to
    look) unless every request's tokens equal ``model.generate``'s; the tokens served."""
    expected = [generated(model, p, max_new_tokens) for p in prompts]
    try:
        done = Engine(model, None, kv="paged", **options).run(
            [Request(list(p), max_new_tokens, request_id=f"r{i}") for i, p in enumerate(prompts)])
    except Exception as err:  # a rule the engine enforces, or the learner's code inside the forward pass
        raise Fail(f"in the real engine ({what}): {raised(err)}") from None
    for c, exp in zip(done, expected):
        if getattr(c, "error", None):
            raise Fail(f"in the real engine ({what}): request {c.request_id} failed: {c.error}")
        if c.output_ids != exp:
            j = next((j for j, (a, b) in enumerate(zip(c.output_ids, exp)) if a != b),
                     min(len(exp), len(c.output_ids)))  # or where the shorter one ends
            raise Fail(f"in the real engine ({what}): request {c.request_id}'s tokens differ from generate's from "
                       f"new token {j} on: {look}")
    return sum(len(e) for e in expected)


def _in_engine(model, prompts, attention, slot_mapping) -> tuple[int, int]:
    runs = engine_runs(model, prompts)
    look = "look at what a run adds -- reused blocks, longer contexts, other shapes"
    tokens = sum(serve_like_generate(m, ps, MAX_NEW_TOKENS, what, look, attention=attention, slot_mapping=slot_mapping,
                                     **options) for what, m, ps, options in runs)
    return sum(len(r.prompts) for r in runs), tokens


def _prompts(tok, prompts):
    if prompts is None:  # token ids every model of the course can read (vocabularies of 97 and more)
        prompts = [[10 + (5 * i + 3 * j) % 80 for j in range(6 + 2 * i)] for i in range(6)]
    out = [tok(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompts]
    if not out or not all(out) or not all(isinstance(t, numbers.Integral) for p in out for t in p):
        raise ValueError("prompts: a list of strings (with a tokenizer) or of token-id lists")
    return out


@self_check
def check_slot_mapping(slot_mapping, model, tok=None, prompts=None) -> bool:
    """``slot_mapping(block_tables, num_computed_tokens, num_scheduled_tokens, block_size)``: every
    scheduled token's pool slot, in packed order. Hand-built steps first, then the real engine."""
    need_function(slot_mapping, "my_slot_mapping")
    check_slot_mapping_cases(slot_mapping)
    served, tokens = _in_engine(model, _prompts(tok, prompts), None, slot_mapping)
    return passed(f"your slot mapping is right on {len(STEPS)} hand-built steps, and the real engine wrote "
                  f"every K/V where it said: {served} requests, {tokens} tokens, each equal to generate's")


@self_check
def check_paged_attention(attention, model, tok=None, prompts=None, slot_mapping=None) -> bool:
    """``attention(query, key, value, meta, layer, scaling)``: write this step's K/V at ``meta.slot_mapping``,
    read each sequence's context through its block table, attend causally; ``[1, heads, T, head_dim]``.
    With ``slot_mapping`` the engine runs on both of your pieces."""
    need_function(attention, "my_attention")
    if slot_mapping is not None and not callable(slot_mapping):
        return fail("slot_mapping= takes your slot-mapping function itself (or None)")
    if slot_mapping is not None:
        check_slot_mapping_cases(slot_mapping)
    check_attention_cases(attention)
    served, tokens = _in_engine(model, _prompts(tok, prompts), attention, slot_mapping)
    pieces = "your attention and your slot mapping" if slot_mapping is not None else "your attention"
    return passed(f"{pieces}: right on {len(HEADS)} hand-built steps (mixed prefill chunks and decodes, "
                  f"grouped-query heads, stale slots), and the real engine ran on them: {served} requests, "
                  f"{tokens} tokens, each equal to generate's")
