"""Notebook 10: predict a small run's schedule and KV state by hand; :func:`check_schedule` reads the six
answers off the real engines' records (static waves, a paged engine, a token budget) and gives each wrong one a
hint, never the engine's value.
"""
from __future__ import annotations

import math

from ..engine.engine import Engine
from ..core.request import Request
from ..engine.static import static_batching
from . import fail, is_int, passed, self_check

# The main run: five requests served two at a time by a paged engine with tiny blocks.
IDS = ("A", "B", "C", "D", "E")
PROMPT_LENS = (3, 6, 3, 5, 4)  # prompt tokens of each request
OUTPUT_LENS = (4, 2, 5, 3, 2)  # new tokens each produces (EOS ignored)
BATCH_SIZE = 2  # max_batch_size of the engine, batch_size of static batching
BLOCK_SIZE = 4  # tokens per KV block
STEP = 4  # the step (counted from 0) the questions ask about
FOCUS = "C"  # the request whose KV state is asked about

# The chunked-prefill scenario: X is decoding when Y's long prompt arrives (added after step 0).
DECODER_PROMPT, DECODER_OUTPUT = 2, 10  # X: prompt tokens, new tokens
LONG_PROMPT = 14  # Y: prompt tokens
TOKEN_BUDGET = 4  # tokens one step may feed

FIELDS = ("static_steps", "continuous_steps", "running", "num_computed_tokens", "num_blocks", "prefill_steps")


def workload() -> list[Request]:
    """The main run's requests (token-id prompts, fresh objects for every run)."""
    return [Request([20 + i] * p, n, request_id=rid, ignore_eos=True)
            for i, (rid, p, n) in enumerate(zip(IDS, PROMPT_LENS, OUTPUT_LENS))]


def measure(model) -> dict:
    """Run the engines and read the six answers, plus the facts the hints need."""
    static = static_batching(model, None, workload(), batch_size=BATCH_SIZE)
    engine = Engine(model, None, max_batch_size=BATCH_SIZE, kv="paged", block_size=BLOCK_SIZE)
    engine.run(workload())
    rec = engine.records[STEP]
    focus = next(s for s in rec.seqs if s.request_id == FOCUS)
    admitted = {rid: r.step for r in engine.records for rid in r.admitted}
    finished = {rid: r.step for r in engine.records for rid in r.finished}

    chunked = Engine(model, None, max_batch_size=2, token_budget=TOKEN_BUDGET)
    chunked.add_request(Request([30] * DECODER_PROMPT, DECODER_OUTPUT, request_id="X", ignore_eos=True))
    chunked.step()
    chunked.add_request(Request(list(range(40, 40 + LONG_PROMPT)), 2, request_id="Y", ignore_eos=True))
    while chunked.has_unfinished():
        chunked.step()
    return {
        "static_steps": len(static.steps),
        "continuous_steps": len(engine.records),
        "running": {s.request_id: s.kind for s in rec.seqs},
        "num_computed_tokens": focus.num_computed_tokens,
        "num_blocks": len(rec.kv_usage["block_tables"][FOCUS]),  # the table during the step
        "prefill_steps": sum(s.kind == "prefill" for r in chunked.records for s in r.seqs if s.request_id == "Y"),
        "_admitted": admitted, "_finished": finished, "_focus_scheduled": focus.num_scheduled_tokens,
    }


# -- hints: each names the rule that was missed, never the value ---------------------------------
def _static_hint(got, m) -> str:
    waves = [OUTPUT_LENS[i:i + BATCH_SIZE] for i in range(0, len(OUTPUT_LENS), BATCH_SIZE)]
    if got == sum(OUTPUT_LENS):
        return "that serves one request at a time; a wave's requests run side by side"
    if got == len(waves) * max(OUTPUT_LENS):
        return "each wave waits for its own longest request, not for the longest of the whole workload"
    if got in (m["static_steps"] + len(waves), m["static_steps"] - len(waves)):
        return "a wave's prefill step already makes each first token: a wave whose longest answer is L runs L steps"
    if got == m["continuous_steps"]:
        return "static batching cannot refill a slot mid-wave: the next wave starts only when the whole wave is done"
    return "split the requests, in order, into waves of max_batch_size and add up each wave's longest answer"


def _continuous_hint(got, m) -> str:
    bound = max(math.ceil(sum(OUTPUT_LENS) / BATCH_SIZE), max(OUTPUT_LENS))
    if got == m["static_steps"]:
        return "continuous batching has no waves: a slot freed on step t takes the next request on step t + 1"
    if got == bound:
        return "that is the lower bound, a perfect packing: at the end, slots drain while the last requests finish"
    if got in (m["continuous_steps"] + 1, m["continuous_steps"] - 1):
        return "off by one: a request with L new tokens holds its slot for L steps, and a freed slot is refilled next"
    if got == sum(OUTPUT_LENS):
        return "that is one request at a time; every step runs as many requests as there are free slots"
    return "follow the slots step by step, as in notebook 02's exercise: who is admitted when, and when each finishes"


def _running_hint(got, m) -> str:
    truth, admitted, finished = m["running"], m["_admitted"], m["_finished"]
    for rid in got:
        if rid not in truth:
            if rid not in admitted:
                return f"{rid!r} is not a request of the workload (the ids are {', '.join(IDS)})"
            when = "has already finished" if finished[rid] < STEP else "has not been admitted yet"
            return (f"{rid!r} does not run on that step: it {when}. A request with L new tokens runs on L "
                    "consecutive steps, from the step it is admitted on")
    missing = len(set(truth) - set(got))
    if missing:
        return (f"{missing} request(s) that run on that step are missing: a freed slot is refilled on the very "
                "next step while requests wait")
    return "the requests are right, but not every kind is: a request's first step is its prefill, later ones decodes"


def _computed_hint(got, m) -> str:
    c, p = m["num_computed_tokens"], PROMPT_LENS[IDS.index(FOCUS)]
    if got == c + m["_focus_scheduled"]:
        return "num_computed_tokens counts the tokens cached *before* the step, not the one fed on it"
    if got in (c - p, c - p + 1):
        return "it counts the prompt's tokens too: every token of the sequence already in the cache"
    if got == c - 1:
        return "too low by one: the prefill caches the whole prompt, and each decode since then one more token"
    return ("num_computed_tokens is what the cache already holds before the step: what did the prefill step "
            f"cache for {FOCUS}, and what did each step after it add?")


def _blocks_hint(got, m) -> str:
    c, n = m["num_computed_tokens"], m["_focus_scheduled"]
    if got == math.ceil(c / BLOCK_SIZE):
        return "the scheduler also makes room for the token fed on this step, before the forward pass"
    if got == (c + n) // BLOCK_SIZE:
        return "a partly filled block is still a whole block of the table: round up"
    if got in (c, c + n):
        return "count blocks of block_size tokens, not tokens"
    return ("a block table covers, in whole blocks, every token the cache will hold once the step has run -- "
            "not only the ones it held before")


def _prefill_hint(got, m) -> str:
    if got == math.ceil(LONG_PROMPT / TOKEN_BUDGET):
        return "decodes are scheduled first: X's decode takes one token of the budget every step, Y's chunk the rest"
    if got == 1:
        return "the prompt is longer than the token budget, so it is fed in chunks over several steps"
    if got in (m["prefill_steps"] + 1, m["prefill_steps"] - 1):
        return "off by one: each step feeds what the budget leaves after the decode, the last chunk only what remains"
    return ("a running decode is scheduled before a waiting prompt's chunk, and the chunk gets only what the "
            "budget has left: follow Y's prompt step by step")


HINTS = {"static_steps": _static_hint, "continuous_steps": _continuous_hint, "running": _running_hint,
         "num_computed_tokens": _computed_hint, "num_blocks": _blocks_hint, "prefill_steps": _prefill_hint}
GOOD = {
    "static_steps": "static batching: each wave lasts as long as its longest answer (the batch barrier)",
    "continuous_steps": "continuous batching: every freed slot is refilled on the next step (Orca)",
    "running": "who runs, and as what, on that step: a fused step when a prefill rides with decodes",
    "num_computed_tokens": "the prompt plus one token per decode step so far, all cached before the step",
    "num_blocks": "the block table covers the cached tokens and the one fed on this step, in whole blocks",
    "prefill_steps": "decodes first, then the prompt in chunks of what the token budget leaves (Sarathi-Serve)",
}


def _malformed(name, value) -> str | None:
    if value is Ellipsis or value is None:
        return f"{name} has no answer yet: assign it in the cell above"
    if name == "running":
        if not isinstance(value, dict) or not all(v in ("prefill", "decode") for v in value.values()):
            return ('running should be a dict from request id to "prefill" or "decode", e.g. '
                    '{"A": "decode", "B": "prefill"}' + f"; got {value!r}")
        return None
    if not is_int(value):
        return f"{name} should be a whole number (an int); got {value!r}"
    return None


@self_check
def check_schedule(model, *, static_steps, continuous_steps, running, num_computed_tokens, num_blocks,
                   prefill_steps) -> bool:
    """Six predictions about the module's workload against live runs of the engines: a line each (``✓`` with the
    rule it shows, ``✗`` with a hint); ``True`` when all six are right."""
    answers = dict(static_steps=static_steps, continuous_steps=continuous_steps, running=running,
                   num_computed_tokens=num_computed_tokens, num_blocks=num_blocks, prefill_steps=prefill_steps)
    m = measure(model)
    ok = True
    for name in FIELDS:
        got = answers[name]
        problem = _malformed(name, got)
        if problem is None and got == m[name]:
            passed(f"{name} = {got!r}: {GOOD[name]}")
            continue
        ok = False
        fail(f"{name}: {problem}" if problem else f"{name} = {got!r} is not what the engine did -- "
                                                  f"{HINTS[name](got, m)}")
    if ok:
        print("All six match the engines: you can read a schedule before it runs.")
    return ok
