"""The rules a scheduler is held to, each checked where it can be broken, and the hint for each.

The **safety** rules keep any engine correct (the tournament's); the **exercise** rules are vLLM V1's as
notebook 06 teaches them. A broken rule raises :class:`SchedulerMistake` naming the misconception, never
a value; hints are worded for the stage (stage 1 has no memory limit and no budget).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..core.request import RequestStatus
from ..core.scheduler_output import SchedulerOutput, StepPlan


@dataclass
class Made:
    """A step's message and the plan it was built from (``make_output``), with where each planned
    sequence started (its ``num_computed_tokens`` before ``update_after_schedule``)."""

    plan: StepPlan
    output: SchedulerOutput
    starts: list


class SchedulerMistake(Exception):
    """The learner's scheduler broke a rule; the message is the hint (a misconception, never a value)."""


class NotDone(SchedulerMistake):
    """A method is still the stub (it returned None, or the class does not define it)."""


ROOM_STAGE = 3  # the first stage with a pool that can refuse room (and so preemption)
# key -> the hint; or (its start, the stage from which it says more, its end before, its end from then on)
HINTS = {
    "idle": ("a step planned nothing although a request that had arrived could run: a request not arrived yet is "
             "skipped, not waited for (and one whose arrival_time is now has arrived)", 2, "", "; a long prompt is fed in chunks, not kept waiting to fit whole"),
    "unfinished": ("requests were still unfinished after {} steps: is one never given its tokens?", ROOM_STAGE, "",
                   " Or are the same requests preempted over and over?"),
    "walked_waiting": "your loop walked self.waiting while admit() removed from it, so the request after each "
                      "admitted one was skipped: walk a copy (a list made before the loop)",
    "walked_running": "your loop walked self.running while preempt() removed from it, so the request after the "
                      "victim was skipped: walk a copy (list(self.running)), skipping those preempted",
    "not_a_plan": "schedule() returned a {}; it must return the SchedulerOutput that self.make_output(plan) builds",
    "plan_none": "not done yet: schedule() returned None -- it must return the step's message, self.make_output(plan)",
    "no_message": "schedule() did not return the message made from its plan: end with output = "
                  "self.make_output(plan), self.update_after_schedule(output), return output",
    "updated_before_message": "the message was made after its tokens were counted as computed, so it says each "
                              "request starts where this step ends: make the message from the plan first, then count",
    "no_update_after_schedule": "the planned tokens were not counted as computed: call "
                                "self.update_after_schedule(output) before return output (as vLLM V1 does)",
    "no_room": ("a chunk was planned without KV room: every planned chunk first gets room from "
                "self.kv_manager.allocate_slots(seq, n), for exactly those n tokens, before plan.add(seq, n)",
                ROOM_STAGE, " (here the pool has room for everyone, so allocate_slots never refuses)",
                " -- None means refused: preempt the victim and ask again"),
    "room_for_more": "allocate_slots was asked for more tokens than the chunk planned: ask for exactly the n tokens "
                     "you plan (cut to the budget first)",
    "refused_planned": "tokens were planned without KV room: allocate_slots refused them (None) and the chunk was "
                       "planned anyway -- on a refusal, preempt the policy's victim and ask again",
    "start_mismatch": "a chunk was planned from another position than its room was given for: an admission passes "
                      "its cached blocks to allocate_slots (new_computed_blocks=cached) and starts past them "
                      "(seq.num_computed_tokens = num_cached_tokens)",
    "admitted_without_room": "a request was admitted although it got no KV room: admit it only once allocate_slots "
                             "has granted its chunk",
    "admitted_unplanned": "a request was admitted but not planned: admit() moves it into the batch, "
                          "plan.add(seq, n) plans its chunk -- an admission needs both",
    "twice_admitted": "a request admitted in this step was planned again as a running one: running requests come first",
    "twice": "a request was added to the plan twice in one step",
    "no_tokens": "a request was planned for no tokens: plan only what feeds at least one token",
    "no_tokens_budget": "a request was planned for no tokens while a token of budget was left: a chunk is cut to "
                        "min(what it lacks, budget) -- not to one less",
    "not_running": ("the plan holds a request that is not running ", ROOM_STAGE, "(never admitted): admit() moves it "
                    "into the batch, plan.add(seq, n) plans it", "(preempted in this step, or never admitted): "
                    "preempt() takes a request out of the plan, and only plan.add puts one in"),
    "over_lacks_cached": "a newcomer was given more tokens than it lacks past its cached prefix: its chunk is what "
                         "it lacks past num_cached_tokens (get_computed_blocks), and it starts there",
    "over_lacks": "a request was given more tokens than it lacks (num_tokens - num_computed_tokens)",
    "budget": "the step's tokens exceed the token budget: cut each chunk to the budget left after the chunks "
              "planned before it (chunked prefill)",
    "batch": "more requests run than max_batch_size allows",
    "waiting_first": "a waiting request was planned before a running one: running requests come first",
    "running_order": "running requests were not planned in the running list's order (self.running)",
    "skipped_refused": "a running request was refused KV room and nobody was preempted: when allocate_slots "
                       "returns None, preempt the policy's victim and ask again",
    "skipped": ("a running request was skipped", 2, ": every running request gets what it lacks, before anyone is "
                "admitted", " while budget was left: every running request gets what it lacks, cut to the budget, "
                "before anyone is admitted"),
    "granted_skipped": "a running request was left out of the plan although allocate_slots gave it room: it returns "
                       "the blocks it added -- [] when the chunk fits the blocks the request has -- and None only "
                       "to refuse",
    "regranted": "a request preempted in this step was given KV room again afterwards: once it was the victim "
                 "(perhaps of its own request for room), stop asking room for it",
    "held_victim": "a request taken out of the batch still holds its KV blocks: self.preempt(seq, plan) frees them",
    "held_waiting": "a waiting request holds KV blocks after the step: only running requests hold room",
    "left_unpreempted": "a request left the batch without self.preempt(seq, plan), which records it in plan.preempted",
    "not_started": "a request is in self.running without self.admit(seq, plan), which moves it into the batch",
    "before_arrival": "a request was admitted before it arrived: its arrival_time must be at or before `now`",
    "after_preempt": "admitted in a step that preempted: room is short, a newcomer would only be preempted again "
                     "(vLLM V1 admits nobody then)",
    "past_batch": "admitted past max_batch_size: every slot of the batch was already taken",
    "not_waiting": "admit() was given a request that is not waiting",
    "overtook": "a waiting request overtook an earlier one that did not fit: the first request refused room ends "
                "the step's admissions",
    "out_of_order": "admitted out of the policy's order: walk self.waiting in its own order, skipping only requests "
                    "not arrived yet",
    "victim_not_running": "preempt() was given a request that is not running: only a running one holds KV blocks",
    "wrong_victim": "the victim is not the policy's: the request to preempt is the one "
                    "self.waiting.pick_victim(self.running) names, whoever asked",
}


def hint(key: str, stage: int | None) -> str:
    """The hint ``key`` in the words of ``stage`` (None: every idea is known)."""
    text = HINTS[key]
    if isinstance(text, tuple):
        start, since, before, after = text
        text = start + (after if stage is None or stage >= since else before)
    return text


def enforce(rules, words) -> None:
    """Raise the mistake of the first rule broken. ``rules`` yields (hint key, broken?) in order, and lazily: a
    rule may rely on the ones before it; ``words(key)`` is the hint."""
    for key, broken in rules:
        if broken:
            raise SchedulerMistake(words(key))


def includes(seqs, seq) -> bool:
    """Whether ``seq`` itself (not an equal one) is in ``seqs``."""
    return any(s is seq for s in seqs)


def _left(sched, used: int) -> float:
    """The token budget left once ``used`` tokens are planned. The limits are read from the scheduler's config
    (frozen), never from attributes a scheduler could change."""
    return math.inf if sched.config.token_budget is None else sched.config.token_budget - used


def admission_rules(sched, seq, plan, exercise: bool):
    """The admission rules, checked when ``sched.admit(seq, plan)`` is called."""
    yield "not_waiting", seq not in sched.waiting
    yield "before_arrival", seq.arrival_time > sched.check_now
    yield "past_batch", sched.num_slots_taken() + seq.num_slots > sched.config.max_batch_size
    if exercise:
        yield "after_preempt", plan.preempted
        first = next(s for s in sched.waiting if s.arrival_time <= sched.check_now)
        if first is not seq:
            lacks = min(first.num_tokens - first.num_computed_tokens, _left(sched, plan.total_num_scheduled_tokens))
            yield ("overtook" if sched.kv_manager.num_admittable_tokens(first) < lacks else "out_of_order"), True


def preemption_rules(sched, seq, exercise: bool):
    """The preemption rules, checked when ``sched.preempt(seq, plan)`` is called."""
    yield "victim_not_running", seq not in sched.running
    yield "wrong_victim", exercise and seq is not sched.waiting.pick_victim(sched.running)


def check_plan(sched, out, made: Made | None, before: list, stage, exercise: bool) -> None:
    """What must hold of the message ``schedule`` returned and the plan it was made from (``made``: what
    ``make_output`` saw, None if it was not called; ``before``: who ran when it was called)."""
    if out is None:
        raise NotDone(hint("plan_none", stage))
    if not isinstance(out, SchedulerOutput):
        raise SchedulerMistake(hint("not_a_plan", stage).format(type(out).__name__))
    enforce(_plan_rules(sched, out, made, before, stage, exercise), functools.partial(hint, stage=stage))


def _plan_rules(sched, out, made, before, stage, exercise):
    yield "no_message", made is None or made.output is not out
    plan, kv = made.plan, sched.kv_manager
    seqs, counts = list(plan.seqs), list(plan.num_scheduled_tokens)
    if len(set(map(id, seqs))) != len(seqs):
        yield ("twice_admitted" if any(seqs.count(s) > 1 for s in plan.admitted) else "twice"), True
    for i, (seq, c, n) in enumerate(zip(seqs, made.starts, counts)):
        if n < 1:
            yield ("no_tokens_budget" if n == 0 and 1 <= _left(sched, sum(counts[:i])) < math.inf
                   else "no_tokens"), True
        yield "not_running", seq not in sched.running
        yield "not_started", seq.status is not RequestStatus.RUNNING
        grant = kv.granted.get(id(seq))
        yield "updated_before_message", n > 0 and grant is not None and grant[0] == c - n == seq.num_computed_tokens - n
        over = c + n > seq.num_tokens + len(seq.draft_ids)
        yield "over_lacks_cached", over and seq in plan.admitted and c > 0 and c + n - seq.num_tokens <= c
        yield "over_lacks", over
        yield "refused_planned", grant is None and id(seq) in kv.refused
        yield "start_mismatch", grant is not None and grant[0] != c
        yield "no_room", grant is None or grant[1] < n or len(seq.block_table) * kv.block_size < c + n
        yield "room_for_more", exercise and grant[1] > n
        yield "no_update_after_schedule", hasattr(sched, "update_after_schedule") and seq.num_computed_tokens != c + n
    yield "budget", _left(sched, sum(counts)) < 0
    yield "batch", sched.num_slots_taken() > sched.config.max_batch_size
    for seq in sched.running:
        yield "before_arrival", seq.arrival_time > sched.check_now
        yield "not_started", seq.status is not RequestStatus.RUNNING
    for seq in before:
        if seq not in sched.running and not seq.status.is_finished:
            yield "regranted", seq.block_table and id(seq) in getattr(sched.kv_manager, "frees", {})
            yield "held_victim", seq.block_table
            yield "left_unpreempted", not includes(plan.preempted, seq)
    yield "held_waiting", any(s.block_table for s in sched.waiting)
    if not exercise:
        return
    # vLLM V1's order: running requests first, in order, none skipped while budget is left
    unplanned = [s for s in plan.admitted if s in sched.running and not includes(seqs, s)]
    yield "admitted_without_room", any(not s.block_table for s in unplanned)
    yield "admitted_unplanned", bool(unplanned)
    admitted = [s for s in seqs if includes(plan.admitted, s)]
    running = [s for s in seqs if not includes(plan.admitted, s)]
    yield "waiting_first", seqs != running + admitted
    yield "running_order", running != [s for s in sched.running if includes(running, s)]
    left = _left(sched, sum(counts))
    skipped = [s for s in sched.running if not includes(seqs, s)]
    if skipped and left > 0 and not plan.preempted:
        seq = skipped[0]
        yield "granted_skipped", id(seq) in kv.granted
        refused = len(seq.block_table) * kv.block_size < seq.num_computed_tokens + min(
            seq.num_tokens - seq.num_computed_tokens, left)
        yield ("skipped_refused" if refused and (stage is None or stage >= ROOM_STAGE) else "skipped"), True
