"""Notebook 10: predict a small run's schedule and KV state by hand; :func:`check_schedule` reads the six answers
off the real engines' records (static waves, a paged engine, a token budget); a wrong one gets a hint, never the value.
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
        "_near": {d: {s.request_id: s.kind for s in engine.records[STEP + d].seqs} for d in (-1, 1)},
        "_admitted": admitted, "_finished": finished, "_fed": focus.num_computed_tokens + focus.num_scheduled_tokens,
    }


# -- hints: each names the rule that was missed, never the value ---------------------------------
def _running_hint(got, m) -> str:
    truth, admitted, finished = m["running"], m["_admitted"], m["_finished"]
    if got in m["_near"].values() and set(got) != set(truth):
        return (f"that is step {STEP - 1 if got == m['_near'][-1] else STEP + 1}'s batch: the steps are counted "
                f"from 0, so step {STEP} is the {STEP + 1}th step the engine runs")
    for rid in got:
        if rid not in truth and rid not in admitted:
            return f"{rid!r} is not a request of the workload (the ids are {', '.join(IDS)})"
        if rid not in truth:
            when = "has already finished" if finished[rid] < STEP else "has not been admitted yet"
            return f"{rid!r} does not run on that step: it {when} (L new tokens: L steps from its admission)"
    missing = len(set(truth) - set(got))
    if missing:
        return f"{missing} request(s) that run on that step are missing: a freed slot is refilled on the next step"
    return "the requests are right, but not every kind is: a request's first step is its prefill, later ones decodes"


WAVES = math.ceil(len(OUTPUT_LENS) / BATCH_SIZE)
BOUND = max(math.ceil(sum(OUTPUT_LENS) / BATCH_SIZE), max(OUTPUT_LENS))  # a perfect packing's steps
FULL_WAVES = sum(max(OUTPUT_LENS[i:i + BATCH_SIZE]) for i in range(0, len(OUTPUT_LENS) - BATCH_SIZE + 1, BATCH_SIZE))


def _refilled_late(gap: int = 1, lengths=OUTPUT_LENS) -> int:
    """Continuous batching's steps if a freed slot were refilled ``gap`` steps late (FCFS, slot by slot), the
    requests coming in the order of ``lengths``."""
    free = [0] * BATCH_SIZE  # the step each slot may take its next request
    for n in lengths:
        k = min(range(BATCH_SIZE), key=free.__getitem__)
        free[k] += n + gap
    return max(free) - gap
N, C, P = "num_blocks", "num_computed_tokens", PROMPT_LENS[IDS.index(FOCUS)]

# Per field: its typical mistakes, (the answers each gives, from the measured run m; its hint), and the hint for any
# other wrong answer ("running" has a function).
HINTS = {
    "static_steps": [
        (lambda m: [sum(OUTPUT_LENS)], "that is one request at a time; a wave's requests run side by side"),
        (lambda m: [WAVES * max(OUTPUT_LENS)], "each wave waits for its own longest request, not the workload's"),
        (lambda m: [m["static_steps"] + WAVES, m["static_steps"] - WAVES],
         "a wave's prefill step already makes each first token: a wave whose longest answer is L runs L steps"),
        (lambda m: [FULL_WAVES] if len(OUTPUT_LENS) % BATCH_SIZE else [],
         "the last wave is not full, but it runs too (the leftover request is a wave of its own); and static "
         "batching cannot refill a slot mid-wave"),
        (lambda m: [m["continuous_steps"]], "static batching cannot refill a slot mid-wave: waves run one by one"),
        (None, "split the requests, in order, into waves of max_batch_size and add up each wave's longest answer")],
    "continuous_steps": [
        (lambda m: [_refilled_late()], "a freed slot is refilled on the very next step -- no step in between, and no "
                                       "waiting for a wave"),
        (lambda m: [m["static_steps"]], "continuous batching has no waves: a freed slot is refilled on the next step"),
        (lambda m: [_refilled_late(0, sorted(OUTPUT_LENS))], "you served the shortest requests first; FCFS admits "
                                                              "them in arrival order, whatever their length"),
        (lambda m: [BOUND], "that is the lower bound, a perfect packing: at the end, slots drain one by one"),
        (lambda m: [m["continuous_steps"] + 1, m["continuous_steps"] - 1],
         "off by one: a request with L new tokens holds its slot for L steps, and a freed slot is refilled next"),
        (lambda m: [sum(OUTPUT_LENS)], "that is one request at a time; every step runs every free slot's request"),
        (None, "follow the slots step by step, as in notebook 02: who is admitted when, and when each finishes")],
    "running": _running_hint,
    C: [(lambda m: [m["_fed"]], "num_computed_tokens counts the tokens cached *before* the step, not the one fed"),
        (lambda m: [m[C] - P, m[C] - P + 1], "it counts the prompt's tokens too: every token already in the cache"),
        (lambda m: [m[C] - 1], "too low by one: the prefill caches the whole prompt, each decode since one more"),
        (None, f"what did the prefill step cache for {FOCUS}, and each step after it, before this step?")],
    N: [(lambda m: [math.ceil(m[C] / BLOCK_SIZE)], "the scheduler also makes room for the token fed on this step"),
        (lambda m: [m["_fed"] // BLOCK_SIZE], "a partly filled block is still a whole block of the table: round up"),
        (lambda m: [m[C], m["_fed"]], "count blocks of block_size tokens, not tokens"),
        (None, "a block table covers, in whole blocks, every token the cache holds once the step has run")],
    "prefill_steps": [
        (lambda m: [math.ceil(LONG_PROMPT / TOKEN_BUDGET), LONG_PROMPT // (TOKEN_BUDGET - 1)],
         "decodes are scheduled first: X's decode takes one token of the budget every step, Y's chunk the rest -- "
         "and the last, shorter chunk is a step too"),
        (lambda m: [1], "the prompt is longer than the token budget, so it is fed in chunks over several steps"),
        (lambda m: [m["prefill_steps"] + 1, m["prefill_steps"] - 1],
         "off by one: each step feeds what the budget leaves after the decode, the last chunk only what remains"),
        (None, "a waiting prompt's chunk gets only what the budget leaves after the decodes: follow Y step by step")],
}
GOOD = {
    "static_steps": "static batching: each wave lasts as long as its longest answer (the batch barrier)",
    "continuous_steps": "continuous batching: every freed slot is refilled on the next step (Orca)",
    "running": "who runs, and as what, on that step: a fused step when a prefill rides with decodes",
    C: "the prompt plus one token per decode step so far, all cached before the step",
    N: "the block table covers the cached tokens and the one fed on this step, in whole blocks",
    "prefill_steps": "decodes first, then the prompt in chunks of what the token budget leaves (Sarathi-Serve)",
}


def _problem(name, got, m) -> str:
    """What is wrong with the answer to ``name``: its form, else the first typical mistake that gives it."""
    if got is Ellipsis or got is None:
        return "not done yet: assign it in the cell above"
    if name == "running" and (not isinstance(got, dict) or not all(v in ("prefill", "decode") for v in got.values())):
        return f'running should be a dict from request id to "prefill" or "decode", e.g. {{"A": "decode"}}; got {got!r}'
    if name != "running" and not is_int(got):
        return f"{name} should be a whole number (an int); got {got!r}"
    table = HINTS[name]
    if callable(table):
        why = table(got, m)
    else:  # (two mistakes can give the same number: both named)
        why = " -- or ".join([h for gives, h in table if gives is not None and got in gives(m)][:2]) or table[-1][1]
    return f"{got!r} is not what the engine did -- {why}"


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
        if (is_int(got) or name == "running" and isinstance(got, dict)) and got == m[name]:
            passed(f"{name} = {got!r}: {GOOD[name]}")
        else:
            ok = fail(f"{name}: {_problem(name, got, m)}")
    if ok:
        print("All six match the engines: you can read a schedule before it runs.")
    return ok
