"""The rules a scheduler is held to, each checked where it can be broken, and the hint for each.

:func:`~cbteach.exercises.scheduler_check.watched` calls these from inside the learner's class:
:func:`check_admission` and :func:`check_preemption` the moment ``admit``/``preempt`` is called,
:func:`check_plan` when ``schedule`` returns, :func:`check_update` when ``update_from_output``
returns. A broken rule raises :class:`SchedulerMistake` with a hint that names the misconception
and where it showed -- never the engine's choice or a value.

Two sets: the **safety** rules keep any engine correct whatever its policy (a plan within the token
budget and the batch, room from ``allocate_slots`` before every chunk, nobody admitted before
arriving or planned twice, no blocks held by a request that left the batch -- the tournament's
rules); the **exercise** rules are vLLM V1's as notebook 06 teaches them (running requests first and
in order, the policy's order and victim, no admission in a step that preempted). Hints depend on
the stage: stage 1 has no memory limit and no budget, so its hints speak of neither.
"""
from __future__ import annotations

import math

from ..core.request import RequestStatus
from ..core.sampling import stop_reason
from ..core.scheduler_output import SchedulerOutput


class SchedulerMistake(Exception):
    """The learner's scheduler broke a rule; the message is the hint (a misconception, never a value)."""


class NotDone(SchedulerMistake):
    """A method is still the stub (it returned None, or the class does not define it)."""


ROOM_STAGE = 3  # the first stage with a pool that can refuse room (and so preemption)
HINTS = {
    "idle": "a step planned nothing although a request that had arrived could have run: a request that has not "
            "arrived yet is skipped, not waited for",
    "idle+": "; a long prompt is fed in chunks, not kept waiting to fit whole",
    "unfinished": "requests were still unfinished after {} steps: is one never given its tokens?",
    "unfinished+": " Or are the same requests preempted over and over?",
    "called_reference": "your schedule() ran the engine's own scheduling ({}): the exercise is to write the step "
                        "yourself, from allocate_slots, pick_victim, preempt, admit and SchedulerOutput.add",
    "walked_waiting": "your loop walked self.waiting itself while admit() removed requests from it, so the request "
                      "after each admitted one was skipped: walk a copy (a list made before the loop)",
    "not_a_plan": "schedule() returned a {}; it must return a SchedulerOutput",
    "plan_none": "not done yet: schedule() returned None -- it must build and return the step's SchedulerOutput",
    "no_update_after_schedule": "the planned tokens were not counted as computed: schedule() ends with "
                                "self.update_after_schedule(out), then returns out (vLLM V1's _update_after_schedule)",
    "no_room": "a chunk was planned without KV room: every planned chunk first gets room from "
               "self.kv_manager.allocate_slots(seq, n), for exactly those n tokens, before out.add(seq, n)",
    "no_room1": " (here the pool has room for everyone, so allocate_slots never refuses)",
    "no_room3": " -- None means refused: preempt the victim and ask again",
    "refused_planned": "tokens were planned without KV room: allocate_slots refused them (None) and the chunk was "
                       "planned anyway -- on a refusal, preempt the policy's victim and ask again",
    "start_mismatch": "a chunk was planned from another position than its room was given for: with prefix caching "
                      "an admission passes the cached blocks to allocate_slots (new_computed_blocks=cached) and then "
                      "starts past them (seq.num_computed_tokens = num_cached_tokens); without, it starts where it is",
    "admitted_unplanned": "a request was admitted but not planned: admit() moves it into the batch, "
                          "out.add(seq, n) plans its chunk -- an admission needs both",
    "twice_admitted": "a request admitted in this step was planned a second time, as a running one: running "
                      "requests come first, admissions after them get what is left",
    "twice": "a request was added to the plan twice in one step",
    "no_tokens": "a request was planned for no tokens: plan only what feeds at least one token",
    "not_running": "the plan holds a request that is not running (preempted in this step, or never admitted): "
                   "preempt() takes a request out of the plan, and admit() does not put one in -- out.add does",
    "not_running1": "the plan holds a request that is not running (never admitted): admit() moves a request into "
                    "the batch but does not plan it -- out.add(seq, n) does, after admit",
    "over_lacks": "a request was given more tokens than it lacks (num_tokens - num_computed_tokens)",
    "budget": "the chunk exceeds the token budget: the step's plan feeds more tokens than token_budget; cut a "
              "prefill to the budget that is left (chunked prefill)",
    "batch": "more requests run than max_batch_size allows",
    "waiting_first": "a waiting request was planned before a running one: running requests come first, admissions "
                     "get what is left",
    "running_order": "running requests were not planned in the running list's order (self.running)",
    "skipped_refused": "a running request was refused KV room and nobody was preempted: when allocate_slots "
                       "returns None, preempt the policy's victim and ask again",
    "skipped": "a running request was skipped while budget was left: every running request gets what it lacks"
               "{}, before anyone is admitted",
    "held_victim": "a request taken out of the batch still holds its KV blocks: preempting frees them -- "
                   "self.preempt(seq, out) frees the blocks, queues the request again and returns its planned tokens",
    "held_waiting": "a waiting request holds KV blocks after the step: only running requests hold room",
    "left_unpreempted": "a request left the batch without self.preempt(seq, out): preempt is what frees its blocks, "
                        "queues it again and records it in out.preempted",
    "not_started": "a request is in self.running without admit(): self.admit(seq, out) moves it from the queue into "
                   "the batch",
    "before_arrival": "a request was admitted before it arrived: only requests whose arrival_time is at or before "
                      "`now` may be admitted",
    "after_preempt": "admitted in a step that preempted: when this step had to preempt, room is short -- a newcomer "
                     "admitted now would only be preempted again (vLLM V1 admits nobody)",
    "past_batch": "admitted past max_batch_size: every slot of the batch was already taken",
    "not_waiting": "admit() was given a request that is not waiting",
    "overtook": "a waiting request overtook an earlier one that did not fit: the first request (in the policy's "
                "order) that is refused room ends the admissions of the step",
    "out_of_order": "admitted out of the policy's order: walk self.waiting in its own order (it is the policy), "
                    "skipping only requests that have not arrived yet",
    "victim_not_running": "preempt() was given a request that is not running: only a running request holds KV "
                          "blocks to give back",
    "wrong_victim": "the victim is not the policy's: when room is refused, the request to preempt is the one "
                    "self.waiting.pick_victim(self.running) names, whoever asked",
}


def hint(key: str, stage: int | None) -> str:
    """The hint ``key`` in the words of ``stage`` (None: every idea is known)."""
    text = HINTS[key]
    room = stage is None or stage >= ROOM_STAGE
    if key in ("idle", "unfinished") and (stage is None or stage >= (2 if key == "idle" else ROOM_STAGE)):
        text += HINTS[key + "+"]
    if key == "no_room":
        text += HINTS["no_room3"] if room else HINTS["no_room1"]
    if key == "not_running" and not room:
        text = HINTS["not_running1"]
    if key == "skipped":
        text = text.format(", cut to the budget" if stage is None or stage >= 2 else "")
    return text


def _mistake(key: str, stage, *args):
    return SchedulerMistake(hint(key, stage).format(*args) if args else hint(key, stage))


def _has(seqs, seq) -> bool:
    return any(s is seq for s in seqs)


def check_admission(sched, seq, out, stage, exercise: bool) -> None:
    """The admission rules, checked at the moment ``sched.admit(seq, out)`` is called."""
    if seq not in sched.waiting:
        raise _mistake("not_waiting", stage)
    if seq.arrival_time > sched.check_now:
        raise _mistake("before_arrival", stage)
    if sched.num_slots_taken() + seq.num_slots > sched.max_batch_size:
        raise _mistake("past_batch", stage)
    if not exercise:
        return
    if out.preempted:
        raise _mistake("after_preempt", stage)
    first = next(s for s in sched.waiting if s.arrival_time <= sched.check_now)
    if first is not seq:
        left = math.inf if sched.token_budget is None else sched.token_budget - out.total_num_scheduled_tokens
        if sched.kv_manager.num_admittable_tokens(first) < min(first.num_tokens - first.num_computed_tokens, left):
            raise _mistake("overtook", stage)
        raise _mistake("out_of_order", stage)


def check_preemption(sched, seq, stage, exercise: bool) -> None:
    if seq not in sched.running:
        raise _mistake("victim_not_running", stage)
    if exercise and seq is not sched.waiting.pick_victim(sched.running):
        raise _mistake("wrong_victim", stage)


def check_plan(sched, out, before: list, stage, exercise: bool) -> None:
    """What must hold of the plan ``schedule`` returned (``before``: who ran when it was called)."""
    if out is None:
        raise NotDone(hint("plan_none", stage))
    if not isinstance(out, SchedulerOutput):
        raise _mistake("not_a_plan", stage, type(out).__name__)
    seqs, starts, counts = list(out.seqs), list(out.num_computed_tokens), list(out.num_scheduled_tokens)
    if len(set(map(id, seqs))) != len(seqs):
        raise _mistake("twice_admitted" if any(seqs.count(s) > 1 for s in out.admitted) else "twice", stage)
    for seq, c, n in zip(seqs, starts, counts):
        if n < 1:
            raise _mistake("no_tokens", stage)
        if seq not in sched.running:
            raise _mistake("not_running", stage)
        if seq.status is not RequestStatus.RUNNING:
            raise _mistake("not_started", stage)
        if c + n > seq.num_tokens + len(seq.draft_ids):
            raise _mistake("over_lacks", stage)
        grant = sched.kv_manager.granted.get(id(seq))
        if grant is None and id(seq) in sched.kv_manager.refused:
            raise _mistake("refused_planned", stage)
        if grant is not None and grant[0] != c:
            raise _mistake("start_mismatch", stage)
        if grant is None or grant[1] < n or len(seq.block_table) * sched.kv_manager.block_size < c + n:
            raise _mistake("no_room", stage)
        if hasattr(sched, "update_after_schedule") and seq.num_computed_tokens != c + n:
            raise _mistake("no_update_after_schedule", stage)
    if sched.token_budget is not None and sum(counts) > sched.token_budget:
        raise _mistake("budget", stage)
    if sched.num_slots_taken() > sched.max_batch_size:
        raise _mistake("batch", stage)
    for seq in sched.running:
        if seq.arrival_time > sched.check_now:
            raise _mistake("before_arrival", stage)
        if seq.status is not RequestStatus.RUNNING:
            raise _mistake("not_started", stage)
    for seq in before:
        if seq not in sched.running and not seq.status.is_finished:
            if seq.block_table:
                raise _mistake("held_victim", stage)
            if not _has(out.preempted, seq):
                raise _mistake("left_unpreempted", stage)
    if any(s.block_table for s in sched.waiting):
        raise _mistake("held_waiting", stage)
    if exercise:
        if any(not _has(seqs, s) for s in out.admitted if s in sched.running):
            raise _mistake("admitted_unplanned", stage)
        _check_v1_order(sched, out, seqs, counts, stage)


def _check_v1_order(sched, out, seqs, counts, stage) -> None:
    """vLLM V1's order of a plan: running requests first, in order, none skipped while budget is left."""
    admitted = [s for s in seqs if _has(out.admitted, s)]
    running = [s for s in seqs if not _has(out.admitted, s)]
    if seqs != running + admitted:
        raise _mistake("waiting_first", stage)
    if running != [s for s in sched.running if _has(running, s)]:
        raise _mistake("running_order", stage)
    left = math.inf if sched.token_budget is None else sched.token_budget - sum(counts)
    skipped = [s for s in sched.running if not _has(seqs, s)]
    if skipped and left > 0 and not out.preempted:
        seq = skipped[0]
        need = seq.num_computed_tokens + min(seq.num_tokens - seq.num_computed_tokens, left)
        refused = len(seq.block_table) * sched.kv_manager.block_size < need
        raise _mistake("skipped_refused" if refused and (stage is None or stage >= ROOM_STAGE) else "skipped", stage)


# -- after the step: update_from_output (stage 5) ----------------------------------------------------
UPDATE_HINTS = {
    "update_none": "not done yet: update_from_output() returned None -- it must return the list of the sequences "
                   "that finished in this step",
    "not_a_list": "update_from_output() returned a {}; it must return a list of the sequences that finished",
    "short_chunk_token": "a prefill chunk that stopped short of its prompt's end was given a token: its "
                         "output.sampled[i] is None -- nothing is appended for it, and it has no first token yet",
    "first_token_time": "a request's first_token_time is wrong: it is set once, to `now`, in the step that appends its "
                        "first token -- not in a step that only fed a chunk of its prompt",
    "token_times": "every appended token needs its time: seq.token_times gets `now` for each token appended (the "
                   "latency metrics, TTFT and ITL, are read from them)",
    "token_missing": "a token the step sampled for a request was not appended to seq.output_ids",
    "tokens_wrong": "the tokens appended are not the ones the step sampled (output.sampled[i], in order)",
    "eos_not_recorded": "a request that stopped at EOS did not keep its EOS token: append the token first, then "
                        "check the stop -- output_ids ends with the EOS id, as generate's output does",
    "missed_eos": "a request that produced an EOS token went on: after each appended token check the stop "
                  "(stop_reason: EOS unless ignore_eos, the request's stop_token_ids, max_new_tokens)",
    "missed_stop": "a request went on past one of its stop_token_ids: after each appended token check the stop "
                   "(stop_reason takes the request's sampling_params.stop_token_ids)",
    "missed_length": "a request went past max_new_tokens: after each appended token check the stop (stop_reason)",
    "early_stop": "a request stopped although no stop rule held: EOS stops a request only without ignore_eos, "
                  "max_new_tokens counts output tokens (stop_reason says which rule holds, or None)",
    "wrong_reason": "finish_reason does not name the rule that stopped the request (stop_reason returns it)",
    "after_stop": "tokens were appended after the one that stopped the request: a stop inside accepted "
                  "speculative guesses drops the guesses after it",
    "left_running": "a finished request was left in self.running: a request that stops leaves the batch "
                    "(self.running.remove(seq)), or it would be planned again",
    "status": "a finished request's status is not RequestStatus.FINISHED",
    "not_freed": "a finished request still holds its KV blocks: free them when it stops "
                 "(self.kv_manager.free(seq)) -- the leak every engine has had once",
    "freed_early": "a finished request's blocks were freed before its last token was recorded: append the token "
                   "and check the stop first, free after",
    "not_returned": "a request that finished in this step is missing from the list update_from_output returned: the "
                    "engine completes only the sequences it is given back",
    "returned_unfinished": "the list update_from_output returned holds a request that has not finished",
    "drafts_not_taken_back": "after a step with speculative guesses, num_computed_tokens still counts the guesses "
                             "the model rejected: take them back (plan.num_draft_tokens[i] of them were fed, "
                             "len(tokens) - 1 were accepted)",
    "drafts_over": "num_computed_tokens went down by more than the rejected guesses: only guesses the model "
                   "rejected are taken back",
    "moved": "num_computed_tokens of a request changed in update_from_output although it fed no speculative "
             "guesses: schedule() already counted the planned tokens as computed (update_after_schedule, "
             "vLLM V1); the update only takes rejected guesses back",
    "not_trimmed": "blocks that held only rejected guesses were kept: give them back with "
                   "self.kv_manager.trim(seq) once num_computed_tokens is taken back",
    "drafts_kept": "seq.draft_ids still holds this step's guesses after the update: clear them (the next step's "
                   "guesses are proposed afresh)",
}


def _update_mistake(key: str, *args) -> SchedulerMistake:
    return SchedulerMistake(UPDATE_HINTS[key].format(*args) if args else UPDATE_HINTS[key])


def _stop_rule(sched, seq, outputs: list) -> str | None:
    params = seq.request.sampling_params
    return stop_reason(outputs, seq.request.max_new_tokens, sched.eos_ids, seq.request.ignore_eos,
                       getattr(params, "stop_token_ids", ()))


def check_update(sched, plan, output, finished, stage) -> None:
    """What must hold after ``update_from_output(plan, output, now)`` returned ``finished``."""
    if finished is None:
        raise NotDone(UPDATE_HINTS["update_none"])
    if not isinstance(finished, (list, tuple)):
        raise _update_mistake("not_a_list", type(finished).__name__)
    errors = getattr(output, "errors", None) or [None] * len(plan.seqs)
    for i, (seq, c, n, d) in enumerate(zip(plan.seqs, plan.num_computed_tokens, plan.num_scheduled_tokens,
                                           plan.num_draft_tokens)):
        if errors[i] is not None or seq.status is RequestStatus.ABORTED:
            continue  # a failure of its own, the engine's business
        _check_tokens(sched, seq, output.sampled[i], sched.outputs_before[i])
        if seq.finish_reason:
            _check_finished(sched, seq, finished)
            continue
        want = c + n - d + (len(output.sampled[i]) - 1 if d else 0)
        if seq.num_computed_tokens != want:
            raise _update_mistake(("drafts_not_taken_back" if seq.num_computed_tokens > want else "drafts_over")
                                  if d else "moved")
        size = getattr(sched.kv_manager, "block_size", None)
        if d and size and len(seq.block_table) > math.ceil(seq.num_computed_tokens / size):
            raise _update_mistake("not_trimmed")
        if seq.draft_ids:
            raise _update_mistake("drafts_kept")
    for seq in finished:
        if not getattr(seq, "finish_reason", None):
            raise _update_mistake("returned_unfinished")


def _check_tokens(sched, seq, got, before: int) -> None:
    """The tokens appended to ``seq`` (``got``: what the step sampled for it; ``before``: outputs it had)."""
    new = seq.output_ids[before:]
    if got is None:
        if new:
            raise _update_mistake("short_chunk_token")
        if not seq.output_ids and seq.first_token_time is not None:
            raise _update_mistake("first_token_time")
        return
    got, head = list(got), seq.output_ids[:before]
    # what should have happened: got[:k] appended, k the first token on which a stop rule holds
    k = next((j + 1 for j in range(len(got)) if _stop_rule(sched, seq, head + got[:j + 1])), len(got))
    rule = _stop_rule(sched, seq, head + got[:k])
    missed = {"eos": "missed_eos", "stop": "missed_stop"}.get(rule, "missed_length")
    if new != got[:len(new)]:
        raise _update_mistake("tokens_wrong")
    if len(new) > k:
        raise _update_mistake("after_stop" if seq.finish_reason else missed)
    if len(new) < k:
        if not seq.finish_reason:
            raise _update_mistake("token_missing")
        eos_dropped = rule == "eos" and len(new) == k - 1 and seq.finish_reason == "eos"
        raise _update_mistake("eos_not_recorded" if eos_dropped else "early_stop")
    if rule and not seq.finish_reason:
        raise _update_mistake(missed)
    if seq.finish_reason and not rule:
        raise _update_mistake("early_stop")
    if seq.finish_reason != rule:
        raise _update_mistake("wrong_reason")
    if len(seq.token_times) != len(seq.output_ids):
        raise _update_mistake("token_times")
    if seq.first_token_time is None or (before == 0 and seq.first_token_time != seq.token_times[0]):
        raise _update_mistake("first_token_time")


def _check_finished(sched, seq, finished) -> None:
    if seq in sched.running:
        raise _update_mistake("left_running")
    if seq.block_table:
        raise _update_mistake("not_freed")
    freed = sched.kv_manager.frees.get(id(seq))
    if freed is None:
        raise _update_mistake("not_freed")
    if freed[0] < len(seq.output_ids) or freed[1] is None:
        raise _update_mistake("freed_early")
    if seq.status is not RequestStatus.FINISHED:
        raise _update_mistake("status")
    if not _has(finished, seq):
        raise _update_mistake("not_returned")
