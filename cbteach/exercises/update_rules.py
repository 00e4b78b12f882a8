"""The rules of ``update_from_output`` (notebook 06, stage 5), checked when it returns, and their hints:
tokens appended with their times, the stop rules after each, a finished request out of ``running``, its
blocks freed after its last token, rejected speculative guesses taken back."""
from __future__ import annotations

import math

from ..core.request import RequestStatus
from ..core.sampling import stop_reason
from .rules import NotDone, SchedulerMistake, enforce, includes

UPDATE_HINTS = {
    "update_none": "not done yet: update_from_output() returned None -- it must return the sequences that finished",
    "not_a_list": "update_from_output() returned a {}; it must return a list of the sequences that finished",
    "none_token": "the update tripped over a prefill chunk that stopped short of its prompt's end: its "
                  "output.sampled[i] is None -- skip it",
    "short_chunk_token": "a prefill chunk that stopped short of its prompt's end was given a token: its "
                         "output.sampled[i] is None -- nothing is appended for it, and it has no first token yet",
    "first_token_time": "a request's first_token_time is wrong: it is set once, to `now`, when its first token is "
                        "appended",
    "token_times": "every appended token needs its time: seq.token_times gets `now` for each (TTFT, ITL read them)",
    "token_missing": "a token the step sampled for a request was not appended to seq.output_ids",
    "tokens_wrong": "the tokens appended are not the ones the step sampled (output.sampled[i], in order)",
    "output_changed": "your update changed the step's output (output.sampled): it is the worker's answer, read it "
                      "without popping or editing it (copy it first if you need to)",
    "eos_not_recorded": "a request that stopped at EOS did not keep its EOS token: append the token, then check "
                        "the stop -- output_ids ends with the EOS id, as generate's does",
    "missed_eos": "a request that produced an EOS token went on: after each appended token check the stop "
                  "(stop_reason: EOS unless ignore_eos, the request's stop_token_ids, max_new_tokens)",
    "missed_stop": "a request went on past one of its stop_token_ids: after each appended token check the stop "
                   "(stop_reason takes the request's sampling_params.stop_token_ids)",
    "missed_length": "a request went past max_new_tokens: after each appended token check the stop (stop_reason)",
    "early_stop": "a request stopped although no stop rule held: EOS stops a request only without ignore_eos "
                  "(stop_reason says which rule holds, or None)",
    "length_short": "a request stopped one token before max_new_tokens: it stops once its output holds "
                    "max_new_tokens tokens, the last one counted (stop_reason says which rule holds, or None)",
    "wrong_reason": "finish_reason does not name the rule that stopped the request (stop_reason returns it)",
    "after_stop": "tokens were appended after the one that stopped the request: a stop drops the guesses after it",
    "left_running": "a finished request was left in self.running: it leaves the batch (self.running.remove(seq)), "
                    "or it would be planned again",
    "status": "a finished request's status is not RequestStatus.FINISHED",
    "not_freed": "a finished request still holds its KV blocks: free them when it stops (self.kv_manager.free(seq))",
    "freed_early": "a finished request's blocks were freed before its last token was recorded: append it, then free",
    "returned_ids": "update_from_output returned request ids: it returns the finished sequences themselves",
    "not_returned": "a request that finished in this step is missing from the list update_from_output returned",
    "returned_unfinished": "the list update_from_output returned holds a request that has not finished",
    "drafts_not_taken_back": "num_computed_tokens still counts the guesses the model rejected: take them back "
                             "(scheduler_output.num_draft_tokens(req_id) were fed, len(tokens) - 1 accepted)",
    "drafts_over": "num_computed_tokens went down by more than the rejected guesses: take back only those",
    "moved": "num_computed_tokens changed in update_from_output for a request that fed no guesses: schedule() "
             "already counted the planned tokens (update_after_schedule); the update only takes rejected guesses back",
    "freed_running": "a request that goes on was freed: free(seq) gives back every block it holds, for a request "
                     "that finished; the blocks of rejected guesses go back with self.kv_manager.trim(seq)",
    "not_trimmed": "blocks that held only rejected guesses were kept: give them back with self.kv_manager.trim(seq)",
    "trimmed_early": "blocks that held only rejected guesses were kept: trim(seq) ran before num_computed_tokens was "
                     "taken back, so they still counted as computed -- take the guesses back first, then trim",
    "drafts_kept": "seq.draft_ids still holds this step's guesses after the update: clear them",
}


def _stop_rule(sched, seq, outputs: list) -> str | None:
    params = seq.request.sampling_params
    return stop_reason(outputs, seq.request.max_new_tokens, sched.eos_ids, seq.request.ignore_eos,
                       getattr(params, "stop_token_ids", ()))


def check_update(sched, made, output, finished) -> None:
    """What must hold after ``update_from_output(scheduler_output, output, now)`` returned ``finished``
    (``made``: the step's message and the plan it was made from, :class:`~cbteach.exercises.rules.Made`)."""
    if finished is None:
        raise NotDone(UPDATE_HINTS["update_none"])
    if not isinstance(finished, (list, tuple)):
        raise SchedulerMistake(UPDATE_HINTS["not_a_list"].format(type(finished).__name__))
    enforce(_update_rules(sched, made, output, finished), UPDATE_HINTS.get)


def _update_rules(sched, made, output, finished):
    yield "returned_ids", any(not hasattr(f, "request_id") for f in finished)
    yield "output_changed", [None if t is None else list(t) for t in output.sampled] != sched.check_sampled
    plan = made.plan
    errors = getattr(output, "errors", None) or [None] * len(output.sampled)
    size = getattr(sched.kv_manager, "block_size", None)
    for i, (seq, c, n) in enumerate(zip(plan.seqs, made.starts, plan.num_scheduled_tokens)):
        j = output.req_id_to_index[seq.request_id]  # the worker's order, not the plan's
        if errors[j] is not None or seq.status is RequestStatus.ABORTED:
            continue  # a failure of its own, the engine's business
        yield from _token_rules(sched, seq, sched.check_sampled[j], sched.outputs_before[i])
        if seq.finish_reason:
            yield from _finished_rules(sched, seq, finished)
            continue
        yield "freed_running", id(seq) in sched.kv_manager.frees
        d = made.output.num_draft_tokens(seq.request_id)
        want = c + n - d + (len(output.sampled[j]) - 1 if d else 0)
        if seq.num_computed_tokens != want:
            yield ("drafts_not_taken_back" if seq.num_computed_tokens > want else "drafts_over") if d else "moved", True
        kept = d and size and len(seq.block_table) > math.ceil(seq.num_computed_tokens / size)
        yield "trimmed_early" if id(seq) in sched.kv_manager.trims else "not_trimmed", kept
        yield "drafts_kept", seq.draft_ids
    yield "returned_unfinished", any(not getattr(s, "finish_reason", None) for s in finished)


def _token_rules(sched, seq, got, before: int):
    """The tokens appended to ``seq`` (``got``: what the step sampled for it; ``before``: outputs it had)."""
    new, stopped = seq.output_ids[before:], seq.finish_reason
    if got is None:
        yield "short_chunk_token", new
        yield "first_token_time", not seq.output_ids and seq.first_token_time is not None
        return
    got, head = list(got), seq.output_ids[:before]
    # what should have happened: got[:k] appended, k the first token on which a stop rule holds
    k = next((j + 1 for j in range(len(got)) if _stop_rule(sched, seq, head + got[:j + 1])), len(got))
    rule = _stop_rule(sched, seq, head + got[:k])
    missed = {"eos": "missed_eos", "stop": "missed_stop"}.get(rule, "missed_length")
    yield "tokens_wrong", new != got[:len(new)]
    yield ("after_stop" if stopped else missed), len(new) > k
    early = "length_short" if stopped == "length" and len(seq.output_ids) == seq.request.max_new_tokens - 1 \
        else "early_stop"
    if len(new) < k:
        eos_dropped = rule == "eos" and len(new) == k - 1 and stopped == "eos"
        yield ("eos_not_recorded" if eos_dropped else early) if stopped else "token_missing", True
    yield missed, rule and not stopped
    yield early, stopped and not rule
    yield "wrong_reason", stopped != rule
    yield "token_times", len(seq.token_times) != len(seq.output_ids)
    yield "first_token_time", seq.first_token_time is None or bool(seq.token_times) and seq.first_token_time != seq.token_times[0]


def _finished_rules(sched, seq, finished):
    freed = sched.kv_manager.frees.get(id(seq))
    yield "left_running", seq in sched.running
    yield "not_freed", seq.block_table or freed is None
    yield "freed_early", freed[0] < len(seq.output_ids) or freed[1] is None
    yield "status", seq.status is not RequestStatus.FINISHED
    yield "not_returned", not includes(finished, seq)
