"""Notebook 05's second exercise: the slot mapping and paged attention, with the engine's plug-point signatures.

Each runs on hand-built steps (:data:`STEPS`: tables out of order, partly filled blocks, stale K/V), a wrong answer
named by the mistake of :mod:`.ex05_mistakes` that recomputes it (every step runs: a mistake may crash on one and
show on another); then in the real engine, every token equal to ``model.generate``'s. No check prints a value.
"""
from __future__ import annotations

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
    """One sequence of a hand-built step."""

    computed: int  # num_computed_tokens: its tokens already in the cache
    scheduled: int  # num_scheduled_tokens: its tokens fed this step
    table: list  # its block table


class Step(NamedTuple):
    """A hand-built step: what it shows, its block size, its sequences."""

    what: str
    block_size: int
    seqs: list

    def args(self) -> tuple:  # a slot mapping's arguments
        return ([list(s.table) for s in self.seqs], [s.computed for s in self.seqs],
                [s.scheduled for s in self.seqs], self.block_size)


class Heads(NamedTuple):
    """Attention on one of :data:`STEPS`: its heads, head size and scaling."""

    step: int  # the index of the step in STEPS
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
    if failures:
        raise next((f for f in failures if f.named), failures[0])


def _case_text(case: Step) -> str:
    tables, computed, scheduled, bs = case.args()
    return (f"({case.what}; block_size {bs}, block_tables {tables}, num_computed_tokens {computed}, "
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
        got = got.flatten().tolist()
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


def _diagnose_slots(got, case: Step) -> tuple[str, bool]:
    args = case.args()
    hint = first_mistake(SLOT_MISTAKES, lambda name: slots(*args, mistake=name) == got, skip=IndexError)
    if hint:
        return hint, True
    right = slots(*args)
    if sorted(right) == sorted(got):
        return ("the right slots in the wrong order: packed order is sequence 0's tokens first, in position "
                "order, then sequence 1's, ..."), True
    wrong, start = [], 0
    for c, n, _ in case.seqs:
        if got[start:start + n] != right[start:start + n]:
            wrong.append(_kind(c, n))
        start += n
    return ("these tokens' slots are not where their block tables put them: " + ", ".join(wrong) +
            ". A token at position p lies in block p // block_size of its table, at offset p % block_size"), False


def _padded(case: Step) -> Step:
    """The step with every block table lengthened by blocks nobody owns: a mapping that reads past a table runs."""
    used = {b for s in case.seqs for b in s.table}
    spare = iter(b for b in range(100, 1000) if b not in used)
    width = max(len(s.table) for s in case.seqs) + 2
    return case._replace(seqs=[s._replace(table=list(s.table) + [next(spare) for _ in range(width - len(s.table))])
                               for s in case.seqs])


def _crashed_slots(slot_mapping, case, err) -> Fail:
    """The failure for a slot mapping that raised on ``case``; an index past a table is named on :func:`_padded`."""
    said = f"your slot mapping raised {raised(err)}\n  on the step {_case_text(case)}"
    if not isinstance(err, IndexError):
        return Fail(said)
    padded = _padded(case)
    args = padded.args()
    try:
        got = _as_slots(slot_mapping(*args), sum(args[2]))
        hint, named = _diagnose_slots(got, padded) if got != slots(*args) else ("", False)
    except Exception:  # noqa: BLE001 -- the learner's code again: the first error is the one to show
        hint, named = "", False
    if named:
        return Fail(f"{hint}\n  on the step {_case_text(case)}, where your code raised {type(err).__name__}: {err}",
                    named=True)
    return Fail(f"{said}\n  An index past the end of a block table: a table holds exactly the blocks its own "
                "sequence's tokens need -- position p is in block p // block_size of that sequence's table")


def check_slot_mapping_cases(slot_mapping) -> None:
    """Run ``slot_mapping`` on every hand-built step; raise :class:`Fail` naming the mistake."""
    refused = guard.refusal("slot_mapping", slot_mapping)
    if refused:
        raise Fail(refused, named=True)
    failures = []
    for case in STEPS:
        args = case.args()
        try:
            got = slot_mapping(*args)
        except Exception as err:  # the learner's code
            failures.append(_crashed_slots(slot_mapping, case, err))
            continue
        got = _as_slots(got, sum(args[2]))
        if got != slots(*args):
            hint, named = _diagnose_slots(got, case)
            failures.append(Fail(f"{hint}\n  on the step {_case_text(case)}", named))
    _first_named(failures)


# -- paged attention -------------------------------------------------------------------------------

def _step(case: Step, heads, kv_heads, head_dim, seed):
    """A hand-built step's metadata, on a pool full of random K/V, and random queries, keys and values."""
    tables, computed, scheduled, bs = case.args()
    g = torch.Generator().manual_seed(seed)
    num_blocks = 1 + max(b for t in tables for b in t)
    pool = PagedKVPool(num_layers=2, num_blocks=num_blocks, block_size=bs, num_kv_heads=kv_heads, head_dim=head_dim)
    for t in pool.k + pool.v:
        t.copy_(torch.randn(t.shape, generator=g))
    meta = build([1] * sum(scheduled), computed, scheduled, "cpu", block_tables=tables, block_size=bs)
    meta.pool = pool
    T = sum(scheduled)
    q = torch.randn(1, heads, T, head_dim, generator=g)
    k, v = torch.randn(1, kv_heads, T, head_dim, generator=g), torch.randn(1, kv_heads, T, head_dim, generator=g)
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
        others = [i for i in range(len(pool.k)) if i != layer and torch.allclose(flat(pool.k[i])[idx], new_k)]
        if others:
            raise Fail("you wrote this step's K/V into another layer's pool: every layer has its own -- write "
                        "into the layer your function was called for")
        raise Fail("after your function ran, the pool at meta.slot_mapping does not hold this step's keys and "
                    "values: write them there (meta.pool.write) before reading the context")
    keep = torch.ones(flat(pool.k[0]).shape[0], dtype=torch.bool)
    keep[idx] = False
    for i, (a, b) in enumerate(zip(pool.k + pool.v, before.k + before.v)):
        if not torch.equal(flat(a)[keep], flat(b)[keep]):
            raise Fail("your function changed pool slots that are not this step's: they hold other tokens' K/V "
                        "(this sequence's history, or another sequence's)")


def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4, equal_nan=True)


def _diagnose(out, meta, q, k, v, layer, scaling) -> tuple[str, bool]:
    gives = lambda name: _close(out, attend(q, k, v, _fresh(meta), layer, scaling, mistake=name))  # noqa: E731
    hint = first_mistake(ATTENTION_MISTAKES, gives, skip=(IndexError, RuntimeError))  # or would not even run here
    if hint:
        return hint, True
    right = attend(q, k, v, _fresh(meta), layer, scaling)
    wrong = [_kind(c, n) for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens))
             if not _close(out[:, :, int(meta.query_start_loc[i]):int(meta.query_start_loc[i + 1])],
                           right[:, :, int(meta.query_start_loc[i]):int(meta.query_start_loc[i + 1])])]
    return ("the output is wrong for " + ", ".join(wrong) + ". Each sequence's queries attend to its own "
            "context only, read through its block table, each query up to its own position"), False


def check_attention_cases(attention) -> None:
    """Run ``attention`` on every hand-built step; raise :class:`Fail` naming the mistake."""
    refused = guard.refusal("attention", attention)
    if refused:
        raise Fail(refused, named=True)
    passed_plain, failures = False, []
    for n, (index, heads, kv_heads, head_dim, scaling) in enumerate(HEADS):
        case = STEPS[index]
        meta, q, k, v = _step(case, heads, kv_heads, head_dim, seed=n)
        scale = scaling if scaling is not None else head_dim ** -0.5
        where = (f"{_case_text(case)[:-1]}; {heads} query heads, {kv_heads} KV heads, head_dim {head_dim}, "
                 f"scaling {scale:g}, layer 1)")
        mine, before = _fresh(meta), _fresh(meta).pool
        try:
            out = attention(q.clone(), k.clone(), v.clone(), mine, 1, scale)
        except Exception as err:  # the learner's code
            more = ""
            if heads != kv_heads and passed_plain:
                more = (f"\n  It ran when every query head had its own KV head; here {heads} query heads share "
                        f"{kv_heads} KV heads (grouped-query attention): each KV head serves a group of "
                        f"{heads // kv_heads} consecutive query heads")
            failures.append(Fail(f"your attention raised {raised(err)}\n  on the step {where}{more}",
                                  named=bool(more)))
            continue
        if out is None:
            raise Fail("not done yet: your attention returned None -- write it in the cell above")
        if not isinstance(out, torch.Tensor) or out.shape != q.shape:
            got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise Fail(f"your attention returned {got}; return a tensor shaped like the queries, [1, heads, "
                        f"tokens, head_dim] = {tuple(q.shape)} {where}")
        _check_writes(mine, before, k, v, 1)
        if not _close(out, attend(q, k, v, _fresh(meta), 1, scale)):
            hint, named = _diagnose(out, meta, q, k, v, 1, scale)
            failures.append(Fail(f"{hint}\n  on the step {where}", named))
            continue
        passed_plain = passed_plain or heads == kv_heads
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


def _in_engine(model, prompts, attention, slot_mapping, max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[int, int]:
    steps = tokens = 0
    for what, m, ps, options in engine_runs(model, prompts, max_new_tokens):
        expected = [generated(m, p, max_new_tokens) for p in ps]
        try:
            engine = Engine(m, None, kv="paged", attention=attention, slot_mapping=slot_mapping, **options)
            done = engine.run([Request(list(p), max_new_tokens, request_id=f"r{i}") for i, p in enumerate(ps)])
        except Exception as err:  # a rule the engine enforces, or the learner's code inside the forward pass
            raise Fail(f"in the real engine ({what}): {type(err).__name__}: {err}") from None
        for c, exp in zip(done, expected):
            if getattr(c, "error", None):
                raise Fail(f"in the real engine ({what}): request {c.request_id} failed: {c.error}")
            if c.output_ids != exp:
                j = next((j for j, (a, b) in enumerate(zip(c.output_ids, exp)) if a != b),
                         min(len(exp), len(c.output_ids)))  # or where the shorter one ends
                raise Fail(f"in the real engine ({what}): request {c.request_id}'s tokens differ from generate's from "
                           f"new token {j} on: look at what a run adds -- reused blocks, longer contexts, other shapes")
        steps += len(ps)
        tokens += sum(len(e) for e in expected)
    return steps, tokens


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
