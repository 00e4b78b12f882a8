"""What the worker must hold after each message, and the hint for each way a learner's ``update_batch``
leaves it otherwise (notebook 06b, section 3; checked by :mod:`.ex06_batch`). :func:`state_hint` compares
in the order vLLM V1's ``_update_states`` changes the state and names the first difference, never a value.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

HINTS = {
    "nothing": "not done yet: your update_batch changed nothing -- the message's new requests have no state in "
               "runner.requests and no row in the batch",
    "finished_state": "a finished request (scheduler_output.finished_req_ids) still has its state in runner.requests",
    "finished_row": "a request in scheduler_output.finished_req_ids still has a row in the batch: "
                    "batch.remove_request(req_id)",
    "never_held": "scheduler_output.finished_req_ids named {who}, a request the worker never held (aborted while it "
                  "waited, as V1 sends it too): forgetting a request the worker does not hold must not fail",
    "state_dropped": "a request that has not finished lost its state (runner.requests): a request preempted or left "
                     "out of this step loses only its row",
    "new_no_state": "a new request (scheduler_output.scheduled_new_reqs) has no state in runner.requests: each gets a "
                    "CachedRequestState",
    "stranger": "runner.requests holds a request the worker was never told of",
    "unscheduled_row": "a request not scheduled in this step still has a row: the batch is this step's requests only "
                       "(scheduler_output.num_scheduled_tokens)",
    "missing_row": "a request scheduled in this step has no row: {who} is added to the batch "
                   "(batch.add_request(state))",
    "holes": "rows were left empty in the batch: the last rows move into the holes (batch.condense(), after adding)",
    "twice": "a request has two rows: batch.add_request was called for a request that still had its row -- a cached "
             "request that kept its row is changed in place",
    "index": "batch.req_ids and batch.req_id_to_index disagree: change rows only through the batch's methods",
    "prefix": "a new request starts at 0, but the message says it starts past its prefix-cache hit: its "
              "num_computed_tokens is the message's",
    "computed": "a running request's row still starts where it started in the step before: set "
                "batch.num_computed_tokens[row] to the message's cached.num_computed_tokens[i]",
    "computed_end": "a running request's row was set to where this step ends: it holds where the step starts, the "
                    "message's cached.num_computed_tokens[i]",
    "computed_state": "a request's state (runner.requests) does not start where the message says: the state's "
                      "num_computed_tokens is the message's too, not only its row's",
    "computed_cached": "a cached request does not start at cached.num_computed_tokens[i], in its state and its row",
    "computed_other": "a request's num_computed_tokens is not the message's",
    "appended": "{which} request's block table was appended to: {why}, and cached.new_block_ids[i] is its whole table",
    "replaced": "a running request's block table was replaced by cached.new_block_ids[i]: for a running request "
                "those are only the blocks allocated since the last step, and they go after its others",
    "wrong_row": "a request's {what} went into another request's row: a cached request's row is "
                 "batch.req_id_to_index[req_id], not its place i in the message's lists",
    "not_appended": "a running request's row is missing the blocks allocated to it since the last step: "
                    "cached.new_block_ids[i] go after its others (batch.block_table.append_row(new_block_ids, row))",
    "blocks_state": "a request's state (its block_ids) and its row's block table disagree: both follow the message",
    "blocks_other": "a request's block table is not the one the message gives it",
    "all_tokens": "a resumed request's tokens are wrong: cached.all_token_ids[req_id] is its prompt, then its output",
    "new_output": "a new request's row is missing tokens it already had: new.output_token_ids come after its prompt",
    "tokens": "a request's row does not hold its prompt then its output, as its state does",
    "tokens_state": "a request's state (prompt_token_ids + output_token_ids) is not its prompt then its output",
    "params": "a row's sampling parameters are not its request's",
    "forked": "a forked sample (a new request the worker already holds a state for: runner.requests.get(new.req_id)) "
              "got a fresh random stream, which draws its first token's number again: keep the held state's generator",
    "forked_stale": "a forked sample (a new request the worker already holds a state for) kept the held state as it "
                    "was: it is a new request of the message, whose prompt, block ids and num_computed_tokens its "
                    "state takes -- only the held state's generator is kept",
    "seeded": "a new seeded request's random stream is not new_generator(new) (its seed plus its sample index)",
    "kept_generator": "a cached request's random stream was replaced: a cached request keeps its state's generator",
    "row_generator": "a row's generator is not its request's state's generator",
}
WHY = {"resumed": ("A resumed", "its blocks were taken back when it was preempted (cached.resumed_req_ids)"),
       "replaced": ("A", "a copy on write changed its table (cached.replaced_req_ids)")}


@dataclass
class Expect:
    """What a scheduled request's row and state must hold after the message. ``how``: ``new``, ``forked``
    (a new request the worker held a state for), ``resumed``, ``replaced`` or ``running``."""

    how: str
    tokens: list
    num_computed_tokens: int
    blocks: list
    generator: object
    sampling_params: object = None  # a new request's (a cached one keeps its state's)
    held: object = None  # a cached request's state before the message (a copy)


def _same_stream(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a.get_state(), b.get_state())


def state_hint(runner, msg, before: dict, expect: dict, rows_before: list) -> str | None:
    """The hint for the first way ``runner``'s state differs from what ``msg`` says (None: it is right);
    ``before`` and ``rows_before``: the states and the batch's rows before the learner's update ran."""
    reqs, b = runner.requests, runner.input_batch
    sched, rows = set(msg.num_scheduled_tokens), set(b.req_id_to_index)
    finished = set(msg.finished_req_ids) - sched
    held = [rid for rid in b.req_ids if rid is not None]
    first = next((key for key, wrong in (
        ("nothing", lambda: msg.scheduled_new_reqs and set(reqs) == set(before) and list(b.req_ids) == rows_before),
        ("finished_state", lambda: finished & set(reqs)),
        ("finished_row", lambda: finished & rows),
        ("state_dropped", lambda: set(before) - finished - set(reqs)),
        ("new_no_state", lambda: any(new.req_id not in reqs for new in msg.scheduled_new_reqs)),
        ("stranger", lambda: set(reqs) - set(before) - set(expect)),
        ("unscheduled_row", lambda: rows - sched),
        ("missing_row", lambda: sched - rows),
        ("twice", lambda: len(set(held)) != len(held)),
        ("holes", lambda: len(b.req_ids) != b.num_reqs or None in b.req_ids)) if wrong()), None)
    if first == "missing_row":
        new = expect[next(iter(sched - rows))].how in ("new", "forked")
        return HINTS[first].format(who="a new request" if new else
                                   "a cached request without a row -- resumed, or left out of the step before --")
    if first is not None:
        return HINTS[first]
    lost = [rid for rid, row in b.req_id_to_index.items() if row >= len(b.req_ids) or b.req_ids[row] != rid]
    if lost or any(b.req_id_to_index[rid] != row for row, rid in enumerate(b.req_ids)):
        # added again while it had its row: the batch gave it a second row, and condense() cut one off
        return HINTS["twice"] if any(rid in rows_before for rid in lost) else HINTS["index"]
    return _wrong_row(b, expect) or next(filter(None, (_row_hint(b, b.req_id_to_index[rid], reqs[rid], e)
                                                       for rid, e in expect.items())), None)


def _wrong_row(b, expect: dict) -> str | None:
    """The hint if a cached request's row was left as it was, or changed, while what the message gives it went
    into another request's row (the row taken as the request's place in the message's lists)."""
    rows = {rid: b.req_id_to_index[rid] for rid in expect}
    for what, key, read in (("num_computed_tokens", "num_computed_tokens", lambda r: int(b.num_computed_tokens[r])),
                            ("block table", "blocks", b.block_table.row)):
        for rid, e in expect.items():
            want = getattr(e, key)
            old = e.held and (e.held.num_computed_tokens if key != "blocks" else e.held.block_ids)
            if e.how in ("new", "forked") or read(rows[rid]) == want or want == old:
                continue
            if any(read(r) == want != getattr(expect[o], key) for o, r in rows.items() if o != rid):
                return HINTS["wrong_row"].format(what=what)
    return None


def _row_hint(b, row: int, state, e: Expect) -> str | None:
    computed = int(b.num_computed_tokens[row])
    if e.how == "forked" and (computed, list(state.block_ids)) != (e.num_computed_tokens, e.blocks):
        return HINTS["forked_stale"]
    if computed != e.num_computed_tokens:
        if e.how in ("new", "forked"):
            return HINTS["prefix"] if computed == 0 else HINTS["computed_other"]
        if computed > e.num_computed_tokens and state.num_computed_tokens == e.num_computed_tokens:
            return HINTS["computed_end"]
        return HINTS["computed"] if state.num_computed_tokens == e.num_computed_tokens else HINTS["computed_cached"]
    if state.num_computed_tokens != e.num_computed_tokens:
        return HINTS["computed_state"]
    table = b.block_table.row(row)
    if table != e.blocks:
        if e.how in WHY and table == e.held.block_ids + e.blocks:
            return HINTS["appended"].format(which=WHY[e.how][0], why=WHY[e.how][1])
        if e.how == "running" and table == e.held.block_ids:
            return HINTS["not_appended"]
        if e.how == "running" and table == e.blocks[len(e.held.block_ids):]:
            return HINTS["replaced"]
        return HINTS["blocks_state"] if list(state.block_ids) == e.blocks else HINTS["blocks_other"]
    if list(state.block_ids) != e.blocks:
        return HINTS["blocks_state"]
    tokens, theirs = b.token_row(row), list(state.prompt_token_ids) + list(state.output_token_ids)
    if tokens != e.tokens or theirs != e.tokens:
        if e.how == "resumed" and len(tokens) > len(e.tokens):
            return HINTS["all_tokens"]
        if e.how in ("new", "forked") and len(tokens) < len(e.tokens):
            return HINTS["new_output"]
        return HINTS["tokens"] if theirs == e.tokens else HINTS["tokens_state"]
    params = e.sampling_params if e.sampling_params is not None else state.sampling_params
    if b.sampling_params[row] != params or state.sampling_params != params:
        return HINTS["params"]
    if e.how == "forked" and state.generator is not e.generator:
        return HINTS["forked"]
    if e.how == "new" and not _same_stream(state.generator, e.generator):
        return HINTS["seeded"]
    if e.how not in ("new", "forked") and state.generator is not e.generator:
        return HINTS["kept_generator"]
    if b.generators.get(row) is not state.generator:
        return HINTS["row_generator"]
    return None
