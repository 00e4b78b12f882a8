"""Notebook 05's second exercise: the slot mapping and paged attention, with the engine's plug-point signatures.

Each runs first on hand-built steps that show the typical mistakes (:mod:`.ex05_steps`), then in the real
engine (prefill chunks beside decodes, preemption, reused blocks, one KV head): every token must equal
per-prompt ``model.generate``'s. Hints name the idea; no check prints a slot or an output.
"""
from __future__ import annotations

import numbers


from ..core.request import Request
from ..engine.engine import Engine
from . import Fail, generated, report, self_check, uncallable
from .ex05_steps import HEADS, STEPS, check_attention_cases, check_slot_mapping_cases

MAX_NEW_TOKENS = 16  # per request, in the engine runs


# -- the real engine ----------------------------------------------------------------------------------

def engine_runs(model, prompts, max_new_tokens: int = MAX_NEW_TOKENS):
    """What the check serves: ``(what, model, prompts, engine options)``; the notebook's model first.
    The token budget is under the longest prompt, so prompts are cut into chunks that run beside other
    requests' decodes; the small pool holds two requests, so four preempt each other and reuse blocks."""
    from .ex09 import small_model

    longest = max(len(p) for p in prompts)
    budget = max(2, longest // 2 + 1)
    tight = 2 * -(-(longest + max_new_tokens) // 2)  # blocks of 2: room for two requests at full length
    toy = [[10 + (7 * i + 3 * j) % 80 for j in range(5 + 3 * i)] for i in range(5)]
    return [(f"your prompts, blocks of 4, a token budget of {budget}: prompt chunks beside decodes", model, prompts,
             dict(max_batch_size=4, block_size=4, token_budget=budget)),
            (f"your prompts, blocks of 2, a pool of {tight} blocks: the engine preempts and reuses blocks", model,
             prompts, dict(max_batch_size=4, block_size=2, num_blocks=tight)),
            ("a small random model with one KV head for four query heads, blocks of 8, a budget of 8",
             small_model("mqa"), toy, dict(max_batch_size=3, block_size=8, token_budget=8))]


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
                raise Fail(f"in the real engine ({what}): request {c.request_id}'s tokens differ from "
                           f"generate's from new token {j} on. The hand-built steps passed, so look at what "
                           "changes over a run: blocks reused after a request finished or was preempted, "
                           "longer contexts, other shapes")
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
    if uncallable(slot_mapping, "my_slot_mapping"):
        return False
    try:
        check_slot_mapping_cases(slot_mapping)
        served, tokens = _in_engine(model, _prompts(tok, prompts), None, slot_mapping)
    except Fail as err:
        return report(False, "", str(err))
    return report(True, f"your slot mapping is right on {len(STEPS)} hand-built steps, and the real engine wrote "
                        f"every K/V where it said: {served} requests, {tokens} tokens, each equal to generate's", "")


@self_check
def check_paged_attention(attention, model, tok=None, prompts=None, slot_mapping=None) -> bool:
    """``attention(query, key, value, meta, layer, scaling)``: write this step's K/V at ``meta.slot_mapping``,
    read each sequence's context through its block table, attend causally; ``[1, heads, T, head_dim]``.
    With ``slot_mapping`` the engine runs on both of your pieces."""
    if uncallable(attention, "my_attention"):
        return False
    if slot_mapping is not None and not callable(slot_mapping):
        return report(False, "", "slot_mapping= takes your slot-mapping function itself (or None)")
    try:
        if slot_mapping is not None:
            check_slot_mapping_cases(slot_mapping)
        check_attention_cases(attention)
        served, tokens = _in_engine(model, _prompts(tok, prompts), attention, slot_mapping)
    except Fail as err:
        return report(False, "", str(err))
    pieces = "your attention and your slot mapping" if slot_mapping is not None else "your attention"
    return report(True, f"{pieces}: right on {len(HEADS)} hand-built steps (mixed prefill chunks and decodes, "
                        f"grouped-query heads, stale slots), and the real engine ran on them: {served} requests, "
                        f"{tokens} tokens, each equal to generate's", "")
