"""Notebook 06's exercise: the notebook's own solutions pass every stage, a scheduler written from one
stage's text alone passes that stage, and each typical mistake -- made once, in a copy of a solution --
fails its stage with the hint meant for it (stage 1 and 2 hints never speak of preemption); the
harness survives whatever a learner passes; the pictures and latency helpers the notebook uses."""
import contextlib
import dataclasses
import io
import json
import linecache
import math
import sys
from pathlib import Path

import pytest

from cbteach import Engine, Request
from cbteach.core.request import RequestStatus
from cbteach.core.sampling import stop_reason
from cbteach.core.scheduler_output import SchedulerOutput, StepPlan
from cbteach.engine.scheduler import Scheduler
from cbteach.exercises import ex06
from cbteach.exercises.scheduler_check import run
from cbteach.student import stub
from cbteach.viz import latency as lat
from cbteach.viz.schedule import first_difference, plan_of, plot_schedules
from conftest import tiny_model

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "06_scheduling_and_latency.ipynb"
SOLUTIONS = [c for c in json.loads(NOTEBOOK.read_text())["cells"] if "solution" in c.get("metadata", {}).get("tags", [])]
SOLUTION, UPDATE = ("".join(c["source"]) for c in SOLUTIONS[:2])  # (06b's update_batch: test_exercises_06_batch.py)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def defined(src, name="MyScheduler"):
    """The class ``name`` that ``src`` defines, with what the notebook imported before it."""
    namespace = {"math": math, "Scheduler": Scheduler, "SchedulerOutput": SchedulerOutput, "StepPlan": StepPlan,
                 "RequestStatus": RequestStatus, "stop_reason": stop_reason}
    filename = f"<cell {len(linecache.cache)}>"  # as a notebook keeps a cell's source: the check reads it
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    exec(compile(src, filename, "exec"), namespace)
    return namespace.get(name)


def scheduler_from(src):
    return defined(src)


def with_mistake(old, new, src=SOLUTION, name="MyScheduler"):
    assert old in src, f"the notebook's solution no longer contains {old!r}: update this mistake"
    return defined(src.replace(old, new), name)


def check(stage, cls, model):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = ex06.check_stage(stage, cls, model)
    return ok, out.getvalue()


RETRY = "while seq in self.running and self.kv_manager.allocate_slots(seq, n) is None:"
VICTIM = "victim = self.waiting.pick_victim(self.running)"
ARRIVED = "for seq in [s for s in self.waiting if s.arrival_time <= now]:"
STOP_RUNNING = "if seq not in self.running:  # it was the victim itself"
CACHED = "            cached, num_cached_tokens = self.kv_manager.get_computed_blocks(seq)  # prefix caching (none without it)\n"
ADMIT_N = "n = min(seq.num_tokens - num_cached_tokens, budget)"
WHOLE = "n = seq.num_tokens - num_cached_tokens"
ADMIT_ROOM = "if self.kv_manager.allocate_slots(seq, n, new_computed_blocks=cached) is None:"
START = "            seq.num_computed_tokens = num_cached_tokens\n"
ADD_ADMITTED = "            self.admit(seq, plan)\n            plan.add(seq, n)\n"
HAND_PREEMPT = ("self.running.remove(victim)\n                budget += plan.remove(victim)\n"
                "                plan.preempted.append(victim)\n                victim.status = RequestStatus.PREEMPTED\n"
                "                victim.num_computed_tokens = 0\n                self.waiting.readd_preempted(victim)")

# (the mistake, what it replaces in the solution, with what, the stage that must fail, words of its hint)
MISTAKES = [
    # stage 1: no memory limit
    ("last in, first out", ARRIVED, "for seq in reversed([s for s in self.waiting if s.arrival_time <= now]):", 1,
     "out of the policy's order"),
    ("admitting past max_batch_size", "len(self.running) >= self.max_batch_size", "len(self.running) > self.max_batch_size",
     1, "past max_batch_size"),
    ("batch limit off by one, under", "len(self.running) >= self.max_batch_size",
     "len(self.running) >= self.max_batch_size - 1", 1, "left waiting"),
    ("arrival_time ignored", "[s for s in self.waiting if s.arrival_time <= now]", "list(self.waiting)", 1,
     "before it arrived"),
    ("walking self.waiting while admit() removes from it", ARRIVED,
     "for seq in self.waiting:\n            if seq.arrival_time > now:\n                continue", 1, "walk a copy"),
    ("a running request's room never asked for", RETRY, "while False:", 1, "without KV room"),
    ("allocate_slots' [] (room, no new block) taken for a refusal", RETRY,  # (was "skipped while budget was left")
     "if not self.kv_manager.allocate_slots(seq, n):\n                continue\n            while False:", 1,
     "[] when the chunk fits the blocks the request has"),
    ("an admission's room never asked for", ADMIT_ROOM, "if False:", 1, "without KV room"),
    ("the plan not counted as computed", "        self.update_after_schedule(output)  # 4.", "        pass  # 4.", 1,
     "update_after_schedule"),
    ("the plan counted as computed before the message was made",  # (was "given more tokens than it lacks")
     "        output = self.make_output(plan)  # 3. the message for the model runner: plain data\n"
     "        self.update_after_schedule(output)  # 4.", "        for seq, n in zip(plan.seqs, plan.num_scheduled_tokens):\n"
     "            seq.num_computed_tokens += n\n        output = self.make_output(plan)\n        pass  # 4.", 1,
     "the message was made after its tokens were counted as computed"),
    ("admitted but never planned", ADD_ADMITTED, "            self.admit(seq, plan)\n", 1, "admitted but not planned"),
    ("walking self.running while preempt() removes from it", "for seq in list(self.running):  # 1.",
     "for seq in self.running:  # 1.", 4, "walk a copy (list(self.running))"),
    # stage 2: the token budget
    ("budget off by one, under", "budget)  # 1 (+ guesses)", "budget - 1)  # 1 (+ guesses)", 2, "fewer tokens"),
    ("the running requests' tokens never taken from the budget",  # (was told to cut a prefill to the budget)
     "            plan.add(seq, n)\n            budget -= n\n        for seq in [s",
     "            plan.add(seq, n)\n        for seq in [s", 2, "left after the chunks planned before it"),
    ("a running request taken for a decode: one token", "n = min(seq.num_tokens + len(seq.draft_ids) - "
     "seq.num_computed_tokens, budget)", "n = min(1 + len(seq.draft_ids), budget)", 2,
     "given one token although it lacks more"),  # (was asked "an off-by-one?")
    ("budget off by one, over", "            budget -= n\n        output =", "            budget -= n - 1\n"
     "        output =", 2, "exceed the token budget"),
    ("budget spent when below zero, not at zero", "or budget <= 0:", "or budget < 0:", 2, "no tokens"),
    ("every chunk cut to one less than the budget left", "budget)", "budget - 1)", 2, "not to one less"),
    ("a long prompt admitted whole, not chunked", ADMIT_N, WHOLE, 2, "exceed the token budget"),
    ("a long prompt kept waiting until it fits the budget whole", ADMIT_N,
     WHOLE + "\n            if n > budget:\n                break", 2, "fit whole"),
    ("a running prefill not chunked", "budget)  # 1 (+ guesses)", "math.inf)  # 1 (+ guesses)", 2, "exceed the token budget"),
    ("room asked for before the chunk is cut to the budget", "n = min(seq.num_tokens + len(seq.draft_ids) - "
     "seq.num_computed_tokens, budget)  # 1 (+ guesses), or a chunk\n"
     "            while seq in self.running and self.kv_manager.allocate_slots(seq, n) is None:",
     "n = min(seq.num_tokens + len(seq.draft_ids) - seq.num_computed_tokens, budget)  # 1 (+ guesses), or a chunk\n"
     "            while seq in self.running and self.kv_manager.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)"
     " is None:", 2,
     "more tokens than the chunk planned"),
    ("a running prefill that does not fit the budget skipped, not cut",
     "n = min(seq.num_tokens + len(seq.draft_ids) - seq.num_computed_tokens, budget)  # 1 (+ guesses), or a chunk",
     "n = seq.num_tokens + len(seq.draft_ids) - seq.num_computed_tokens\n            if n > budget:\n"
     "                continue", 2, "cut to the budget that is left"),
    ("only decodes run", "or seq not in self.running:  # budget spent",
     "or seq not in self.running or not seq.output_ids:  # budget spent", 2, "fewer tokens"),
    # stage 3: KV room, preemption, prefix caching
    ("no tie-break: the victim is the most urgent max, the oldest among equals", VICTIM,
     "victim = max(self.running, key=lambda s: s.request.priority)", 3, "victim is not the policy's"),
    ("forgotten preemption: returns without room", RETRY, "if self.kv_manager.allocate_slots(seq, n) is None:\n"
     "                return self.make_output(plan)\n            while False:", 3, "refused KV room and nobody was preempted"),
    ("forgotten preemption: skips the request", RETRY, "if self.kv_manager.allocate_slots(seq, n) is None:\n"
     "                continue\n            while False:", 3, "refused KV room and nobody was preempted"),
    ("the refusal ignored", RETRY, "self.kv_manager.allocate_slots(seq, n)\n            while False:", 3,
     "without KV room"),
    ("the wrong victim: the oldest", VICTIM, "victim = self.running[0]", 3, "victim is not the policy's"),
    ("the wrong victim: never the asker", VICTIM,
     "victim = self.waiting.pick_victim([s for s in self.running if s is not seq] or [seq])", 3,
     "victim is not the policy's"),
    ("the preempted asker still planned", STOP_RUNNING, "if False:  # it was the victim itself", 3, "not running"),
    ("a preemption by hand that keeps the victim's blocks", "budget += self.preempt(victim, plan)", HAND_PREEMPT, 3,
     "still holds its KV blocks"),
    ("admitting in a step that preempted", "if plan.preempted or len(", "if len(", 3, "admitted in a step that preempted"),
    ("a later request overtakes one that did not fit", "break  # nobody overtakes", "continue  # nobody overtakes", 3,
     "overtook an earlier one that did not fit"),
    ("a newcomer's chunk counted from its num_computed_tokens, not past its cached prefix", ADMIT_N,
     "n = min(seq.num_tokens - seq.num_computed_tokens, budget)", 3, "past its cached prefix"),
    ("a resumed request's chunk counted from its prompt alone", ADMIT_N,  # (was the generic "compare your loop")
     "n = min(len(seq.prompt_ids) - num_cached_tokens, budget)", 3, "comes back with the tokens it had generated"),
    ("room asked again for the request that was its own victim", RETRY,
     "while self.kv_manager.allocate_slots(seq, n) is None:", 3, "given KV room again afterwards"),
    ("admitted before its room is granted",
     "            " + ADMIT_ROOM + "\n                break  # nobody overtakes a request that does not fit\n" + START
     + ADD_ADMITTED, "            self.admit(seq, plan)\n            " + ADMIT_ROOM + "\n                break\n" + START
     + "            plan.add(seq, n)\n", 3, "admitted although it got no KV room"),
    ("V0's whole-prompt admission", ADMIT_ROOM,
     "if self.kv_manager.num_admittable_tokens(seq) < seq.num_tokens:\n                break\n            " + ADMIT_ROOM,
     3, "whole prompt"),
    ("prefix caching ignored", CACHED, "            cached, num_cached_tokens = [], 0\n", 3, "past the blocks"),
    ("cached blocks taken, the request not started past them", START, "", 3, "starts past them"),
    ("the request started past cached blocks it was not given", ADMIT_ROOM,
     "if self.kv_manager.allocate_slots(seq, n) is None:", 3, "new_computed_blocks"),
    # stage 4: priorities
    ("no tie-break, equal priorities: the victim taken among equals by max", VICTIM,
     "victim = max(self.running, key=lambda s: s.request.priority)", 4, "victim is not the policy's"),
    ("a tie of priority and arrival broken by max (the oldest), not by the policy", VICTIM,
     "victim = max(self.running, key=lambda r: (r.request.priority, r.arrival_time))", 4, "victim is not the policy's"),
    ("equal priorities ordered by request id", ARRIVED,
     "for seq in sorted([s for s in self.waiting if s.arrival_time <= now], key=lambda s: (s.request.priority, "
     "s.request_id)):", 4, "out of the policy's order"),
    ("a planned victim's tokens not given back", "budget += self.preempt(victim, plan)", "self.preempt(victim, plan)", 4,
     "gives its tokens back"),
    ("the running loop goes on after the asker was its own victim", "                break\n            plan.add",
     "                continue\n            plan.add", 4, "loop ends"),
    ("the running loop ends at a request preempted a moment ago", "            if budget <= 0 or seq not in self.running:"
     "  # budget spent, or preempted a moment ago\n                continue",
     "            if budget <= 0:\n                continue\n            if seq not in self.running:\n                break",
     4, "further down the list was left out"),
    ("a request arriving at now taken as not arrived yet", "s.arrival_time <= now]", "s.arrival_time < now]", 1,
     "arrival_time is now has arrived"),
    ("admissions stop at the first request not yet arrived", ARRIVED,
     "for seq in list(self.waiting):\n            if seq.arrival_time > now:\n                break", 4,
     "skipped, not waited for"),
]

FINISH = ("                seq.status = RequestStatus.FINISHED\n                self.running.remove(seq)\n"
          "                self.kv_manager.free(seq)\n                finished.append(seq)\n")
APPEND = ("                if seq.first_token_time is None:\n                    seq.first_token_time = now\n"
          "                seq.output_ids.append(token)\n                seq.token_times.append(now)\n")
STOP_ARGS = "self.eos_ids,\n                                                seq.request.ignore_eos, " \
            "seq.request.sampling_params.stop_token_ids)"
TAKE_BACK = "                seq.num_computed_tokens -= drafts - (len(tokens) - 1)\n"
TAIL = UPDATE[UPDATE.index("            for token in tokens:\n"):]
# the update checks the stop before appending, and lets a finished request go before its token is recorded
FREE_FIRST = """            for token in tokens:
                seq.finish_reason = stop_reason(seq.output_ids + [token], seq.request.max_new_tokens, self.eos_ids,
                                                seq.request.ignore_eos, seq.request.sampling_params.stop_token_ids)
                if seq.finish_reason:  # it stops: out of the batch, its blocks back
                    seq.status = RequestStatus.FINISHED
                    self.running.remove(seq)
                    self.kv_manager.free(seq)
                    finished.append(seq)
""" + APPEND + """                if seq.finish_reason:
                    break
        return finished
"""
EOS_DROPPED = ("                if token in self.eos_ids and not seq.request.ignore_eos:\n"
               "                    seq.finish_reason = \"eos\"\n                    break\n" + APPEND)
HAND_STOP = ("\"stop\" if token in seq.request.sampling_params.stop_token_ids else \"eos\" if token in self.eos_ids "
             "and not seq.request.ignore_eos else \"length\" if len(seq.output_ids) > seq.request.max_new_tokens "
             "else None")

UPDATE_MISTAKES = [
    ("a chunk that stopped short not skipped", "            if seq is None or tokens is None:",
     "            if seq is None:", "output.sampled[i] is None"),
    ("only the first of the accepted guesses appended", "            for token in tokens:\n",
     "            for token in tokens[:1]:\n", "not appended"),
    ("blocks never freed", FINISH, FINISH.replace("                self.kv_manager.free(seq)\n", ""), "still holds its KV blocks"),
    ("blocks freed before the last token is recorded", TAIL, FREE_FIRST, "freed before its last token was recorded"),
    ("a chunk that stopped short counted as a token (its first token time set)",
     "            if seq is None or tokens is None:", "            if seq.first_token_time is None:\n"
     "                seq.first_token_time = now\n            if seq is None or tokens is None:", "first_token_time"),
    ("EOS stops the request but is not recorded", APPEND, EOS_DROPPED, "did not keep its EOS token"),
    ("a finished request left in running", FINISH, FINISH.replace("                self.running.remove(seq)\n", ""),
     "left in self.running"),
    ("rejected speculative guesses not taken back", TAKE_BACK, "", "rejected"),
    ("every guess taken back, the accepted ones too", TAKE_BACK,
     "                seq.num_computed_tokens -= drafts\n", "more than the rejected guesses"),
    ("blocks of rejected guesses kept", "                self.kv_manager.trim(seq)  # blocks", "                pass  # blocks",
     "kv_manager.trim"),
    ("a request with rejected guesses freed, not trimmed", "                self.kv_manager.trim(seq)  # blocks",
     "                self.kv_manager.free(seq)  # blocks", "a request that goes on was freed"),  # (was generic)
    ("guesses kept after the step", "            seq.draft_ids = []\n", "", "draft_ids"),
    ("num_computed_tokens moved a second time (V0's habit)", "            drafts = scheduler_output",
     "            seq.num_computed_tokens += scheduler_output.num_scheduled_tokens[req_id]\n"
     "            drafts = scheduler_output", "update_after_schedule"),
    ("ignore_eos ignored", "self.eos_ids,\n                                                seq.request.ignore_eos,",
     "self.eos_ids,\n                                                False,", "no stop rule held"),
    ("stop_token_ids ignored", STOP_ARGS, STOP_ARGS.replace(", seq.request.sampling_params.stop_token_ids)", ")"),
     "stop_token_ids"),
    ("the length rule off by one", "stop_reason(seq.output_ids, seq.request.max_new_tokens, " + STOP_ARGS, HAND_STOP,
     "past max_new_tokens"),
    ("the length rule one short", "stop_reason(seq.output_ids, seq.request.max_new_tokens, " + STOP_ARGS,
     HAND_STOP.replace("len(seq.output_ids) > seq.request.max_new_tokens",
                       "len(seq.output_ids) + 1 >= seq.request.max_new_tokens"),
     "one token before max_new_tokens"),  # (was told about EOS and ignore_eos)
    ("token times not recorded", "                seq.token_times.append(now)\n", "", "token_times"),
    ("blocks trimmed before the guesses are taken back", TAKE_BACK + "                self.kv_manager.trim(seq)  # blocks",
     "                self.kv_manager.trim(seq)\n" + TAKE_BACK + "                pass  # blocks", "trim(seq) ran before"),
    ("the step's tokens popped from the worker's output", "            for token in tokens:\n",
     "            while tokens:\n                token = tokens.pop(0)\n", "changed the step's output"),
    ("the engine's own update called", "        finished = []\n",
     "        return super().update_from_output(scheduler_output, output, now)\n",
     "calls the engine's Scheduler.update_from_output (through super().update_from_output)"),
    ("a finished request not returned", "                finished.append(seq)\n", "", "missing from the list"),
    ("the finished status not set", "                seq.status = RequestStatus.FINISHED\n", "", "RequestStatus.FINISHED"),
    ("a request that finished while its step ran looked up with [], not .get",  # (passed: no step was in flight)
     "            seq = self.requests.get(req_id)\n            if seq is None or tokens is None:",
     "            seq = self.requests[req_id]\n            if tokens is None:", "self.requests.get(req_id)"),
    ("first_token_time set on every token", "                if seq.first_token_time is None:\n"
     "                    seq.first_token_time = now\n", "                seq.first_token_time = now\n",
     "first_token_time is wrong"),
    ("request ids returned, not the sequences", "                finished.append(seq)\n",
     "                finished.append(seq.request_id)\n", "returned request ids"),
    ("a stop inside accepted guesses does not drop the guesses after it",
     "                if seq.finish_reason:  # a stop inside", "                if False:  # a stop inside",
     "appended after the one that stopped"),
]


def waiting_first():
    """The solution with its two loops swapped: admissions planned before the running requests."""
    a, b = SOLUTION.index("        for seq in list(self.running)"), SOLUTION.index("        for seq in [s for s in self")
    c = SOLUTION.index("        output = self.make_output")
    return scheduler_from(SOLUTION[:a] + SOLUTION[b:c] + SOLUTION[a:b] + SOLUTION[c:])


def calling(reference):
    """The solution, but its running loop handed to the engine's own code."""
    if reference == "super().schedule":
        return scheduler_from(SOLUTION[:SOLUTION.index("        plan = ")] + "        return super().schedule(now)\n")
    if reference == "schedule_running":
        return with_mistake("        for seq in list(self.running):",
                            "        budget = self.schedule_running(plan, budget)\n        for seq in []:")
    return with_mistake(RETRY, "while not self.allocate_or_preempt(seq, n, plan)[0]:")


# What a learner writes after reading one stage's text only: it must pass that stage (and the ones before).
STAGE1 = '''
class MyScheduler(Scheduler):
    def schedule(self, now):
        plan = StepPlan()
        for seq in list(self.running):
            n = seq.num_tokens - seq.num_computed_tokens
            self.kv_manager.allocate_slots(seq, n)
            plan.add(seq, n)
        for seq in [s for s in self.waiting if s.arrival_time <= now]:
            if len(self.running) >= self.max_batch_size:
                break
            n = seq.num_tokens - seq.num_computed_tokens
            self.kv_manager.allocate_slots(seq, n)
            self.admit(seq, plan)
            plan.add(seq, n)
        output = self.make_output(plan)
        self.update_after_schedule(output)
        return output
'''
STAGE2 = '''
class MyScheduler(Scheduler):
    def schedule(self, now):
        plan = StepPlan()
        budget = math.inf if self.token_budget is None else self.token_budget
        for seq in list(self.running):
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.kv_manager.allocate_slots(seq, n)
            plan.add(seq, n)
            budget -= n
        for seq in [s for s in self.waiting if s.arrival_time <= now]:
            if len(self.running) >= self.max_batch_size or budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            self.kv_manager.allocate_slots(seq, n)
            self.admit(seq, plan)
            plan.add(seq, n)
            budget -= n
        output = self.make_output(plan)
        self.update_after_schedule(output)
        return output
'''


@pytest.mark.parametrize("stage", sorted(ex06.STAGES))
def test_the_notebooks_solutions_pass_every_stage(model, stage):
    ok, out = check(stage, scheduler_from(SOLUTION) if stage < 5 else defined(UPDATE, "MyUpdate"), model)
    assert ok and out.startswith("✓"), out
    assert sys.gettrace() is None  # the check's tracer is gone


@pytest.mark.parametrize("src, stages", [(STAGE1, (1,)), (STAGE2, (1, 2))], ids=["stage 1's text", "stage 2's text"])
def test_a_scheduler_written_from_a_stages_text_passes_it(model, src, stages):
    for stage in stages:
        ok, out = check(stage, scheduler_from(src), model)
        assert ok, out


@pytest.mark.parametrize("name, old, new, stage, words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_typical_mistake_fails_its_stage_with_a_hint(model, name, old, new, stage, words):
    ok, out = check(stage, with_mistake(old, new), model)
    assert not ok and out.startswith("✗") and words in out, out
    assert not any(f"'{rid}'" in out or f" {rid} " in out for rid in ex06.ID8), out  # never names a request
    if stage < 3:  # stages 1 and 2 know no preemption, and stage 1 no budget
        assert "preempt" not in out and "victim" not in out, out
    if stage == 1:
        assert "budget" not in out, out
    if stage in (2, 3):  # the stage that teaches the idea is the first to catch it
        for earlier in range(1, stage):
            assert check(earlier, with_mistake(old, new), model)[0], (name, earlier)


@pytest.mark.parametrize("name, old, new, words", UPDATE_MISTAKES, ids=[m[0] for m in UPDATE_MISTAKES])
def test_each_typical_update_mistake_fails_stage_5_with_a_hint(model, name, old, new, words):
    ok, out = check(5, with_mistake(old, new, UPDATE, "MyUpdate"), model)
    assert not ok and out.startswith("✗") and words in out, out
    assert not any(f"'{rid}'" in out for rid in ex06.ID8), out


def test_preempting_on_an_empty_grant_names_what_a_refusal_is(model):
    """``not allocate_slots(...)`` takes [] (room given, no new block needed) for a refusal and preempts: the hint
    says which value refuses (it said only that nobody had been refused)."""
    wrong = with_mistake(RETRY, "while seq in self.running and not self.kv_manager.allocate_slots(seq, n):")
    ok, out = check(1, wrong, model)
    assert not ok and "allocate_slots refuses with None only; [] is room given that needs no new block" in out, out


def test_there_are_thirty_wrong_schedulers_and_every_stage_has_its_own():
    stages = [m[3] for m in MISTAKES]
    assert len(MISTAKES) + 4 >= 30 and all(stages.count(s) >= 5 for s in (1, 2, 3, 4)), stages
    assert len(UPDATE_MISTAKES) >= 10


@pytest.mark.parametrize("make, stage, words", [
    (waiting_first, 1, "running requests come first"),
    (lambda: calling("super().schedule"), 1, "calls the engine's Scheduler.schedule (through super().schedule)"),
    (lambda: calling("schedule_running"), 1, "calls the engine's Scheduler.schedule_running"),
    (lambda: calling("allocate_or_preempt"), 1, "calls the engine's Scheduler.allocate_or_preempt"),
], ids=["waiting first", "calls super().schedule", "calls schedule_running", "calls allocate_or_preempt"])
def test_waiting_first_and_calling_the_reference_fail(model, make, stage, words):
    ok, out = check(stage, make(), model)
    assert not ok and words in out, out
    assert "victim" not in out and "preempt(" not in out and "preempt," not in out, out  # stage 1's words only


def test_the_update_stage_uses_the_engines_schedule_whatever_the_class_plans(model):
    class Both(scheduler_from(SOLUTION), defined(UPDATE, "MyUpdate")):
        pass

    assert check(5, Both, model)[0]
    ok, out = check(5, scheduler_from(SOLUTION), model)  # a schedule only: its update is the engine's
    assert not ok and "not done yet" in out and "update_from_output" in out


class Raises(Scheduler):
    def schedule(self, now):
        return 1 / 0


class ReturnsAList(Scheduler):
    def schedule(self, now):
        return []


class NeverReturns(Scheduler):
    def schedule(self, now):
        while True:
            _ = len(self.running)


class PlansNothing(Scheduler):
    def schedule(self, now):
        return self.make_output(StepPlan())


class BuildsItsOwnMessage(Scheduler):
    def schedule(self, now):
        return SchedulerOutput()


class BadInit(Scheduler):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("oops")

    def schedule(self, now):
        return SchedulerOutput()


class NoSchedule(Scheduler):
    pass


class UpdateRaises(Scheduler):
    def update_from_output(self, plan, output, now):
        raise KeyError("x")


@pytest.mark.parametrize("stage, answer, words", [
    (1, None, "not done yet"), (1, ..., "not done yet"), (1, NoSchedule, "not done yet"), (1, Scheduler, "not done yet"),
    (1, lambda now: None, "pass your scheduler class"), (1, int, "pass your scheduler class"),
    (1, Raises, "ZeroDivisionError"), (1, ReturnsAList, "the SchedulerOutput that self.make_output(plan) builds"),
    (1, BuildsItsOwnMessage, "did not return the message made from its plan"),
    (1, NeverReturns, "did not return"), (1, PlansNothing, "planned nothing"),
    (1, BadInit, "could not build your scheduler"), (5, NoSchedule, "not done yet"), (5, UpdateRaises, "KeyError"),
])
def test_anything_a_learner_passes_gets_a_hint_never_a_traceback(model, stage, answer, words):
    ok, out = check(stage, answer, model)
    assert ok is False and out.startswith("✗") and words in out, out
    assert sys.gettrace() is None


def test_the_student_stubs_say_not_done_yet(model):
    ok, out = check(1, scheduler_from(stub(SOLUTION)), model)
    assert not ok and "not done yet" in out
    ok, out = check(5, defined(stub(UPDATE), "MyUpdate"), model)
    assert not ok and "not done yet" in out


def test_the_model_defaults_to_bierce_and_the_arguments_may_come_in_either_order(model):
    assert check(2, scheduler_from(SOLUTION), None)[0]
    ok, out = check(scheduler_from(SOLUTION), 3, model)
    assert ok, out


def test_a_stage_that_does_not_exist_is_refused(model):
    for stage in (0, 6, "1", None, True):
        ok, out = check(stage, scheduler_from(SOLUTION), model)
        assert not ok and "stage must be one of" in out


def test_the_workloads_expose_what_they_are_built_for(model):
    refs = {s: [ex06.reference_run(model, *ex06.stops_for(model, w)) for w in ws] for s, ws in ex06.STAGES.items()}
    assert all(r.mistake is None for rs in refs.values() for r in rs)
    gaps = [b.start_time - a.start_time for a, b in zip(refs[1][1].records, refs[1][1].records[1:])]
    assert max(gaps) > 1  # an idle gap: nothing had arrived
    for r in refs[2]:  # long prompts are chunked
        assert any(s.kind == "prefill" and s.sampled is None for rec in r.records for s in rec.seqs)
    assert all(any(rec.preempted for rec in r.records) for r in refs[3])  # tiny pools preempt
    cached = refs[3][3].engine.kv_usage()
    assert cached["prefix_hits"] > 0  # prefix caching: newcomers start past cached blocks
    assert any(rec.preempted for r in refs[4] for rec in r.records)
    assert not any(rec.preempted and rec.admitted for r in refs[4] for rec in r.records)  # V1: no preempt-to-admit
    reasons = [c.finish_reason for r in refs[5] for c in r.engine.completions.values()]
    assert {"eos", "stop", "length"} <= set(reasons), reasons  # every stop rule fires, on any model
    ignored = [c for r, w in zip(refs[5], ex06.STAGES[5]) for c in r.engine.completions.values()
               if c.finish_reason != "eos" and set(c.output_ids[:-1]) & set(r.engine.scheduler.eos_ids)]
    assert ignored  # a request that ignores EOS says it and goes on
    spec = refs[5][1].engine.spec_stats
    assert 0 < spec["accepted"] < spec["drafted"]  # guesses accepted and rejected
    assert any(s.sampled is None for rec in refs[5][0].records for s in rec.seqs)  # chunks that stop short
    assert any(rec.preempted for rec in refs[5][2].records)
    with pytest.raises(ValueError, match="could never fit|pool has only"):
        ex06.NEVER_FITS.engine(model).add_request(ex06.NEVER_FITS.requests(97)[0])


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_solutions_pass_on_other_architectures(arch):
    other = tiny_model(arch)
    for stage in (3, 5):
        ok, out = check(stage, scheduler_from(SOLUTION) if stage < 5 else defined(UPDATE, "MyUpdate"), other)
        assert ok, out


def test_run_is_bounded_by_its_step_limit(model):
    result = run(model, ex06.STAGES[1][0], scheduler_from(SOLUTION), max_steps=3)
    assert "unfinished after 3 steps" in str(result.mistake) and len(result.records) == 3


def test_the_checks_are_deterministic(model):
    first = [check(s, scheduler_from(SOLUTION), model)[1] for s in (1, 2, 3, 4)]
    again = [check(s, with_mistake(VICTIM, "victim = self.running[0]"), model)[1] for s in (1, 2, 3, 4)]
    assert first == [check(s, scheduler_from(SOLUTION), model)[1] for s in (1, 2, 3, 4)]
    assert again == [check(s, with_mistake(VICTIM, "victim = self.running[0]"), model)[1] for s in (1, 2, 3, 4)]


# -- the pictures and helpers the notebook uses ------------------------------------------------------

def test_schedules_are_compared_and_drawn(model):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = ex06.STAGES[3][2]
    v1, v0 = run(model, w), run(model, dataclasses.replace(w, admission="whole_prompt"))
    assert first_difference(v1.records, v1.records) is None
    split = first_difference(v1.records, v0.records)
    assert split is not None and plan_of(v1.records[split]) != plan_of(v0.records[split])
    assert all(plan_of(a) == plan_of(b) for a, b in zip(v1.records[:split], v0.records[:split]))
    fig = plot_schedules({"V1": v1.records, "V0": v0.records}, w.max_batch_size)
    assert fig._suptitle.get_text()
    for ax in fig.axes:
        if ax.get_label() != "<colorbar>":
            assert ax.get_title() and ax.get_xlabel() and ax.get_ylabel()
    assert f"step {split}" in fig.axes[1].get_xlabel()
    plt.close("all")
    with pytest.raises(ValueError, match="at least one step"):
        plot_schedules({"empty": []})


PROMPTS = [[3 + (11 * i + 7 * j + 5) % 94 for j in range(n)] for i, n in enumerate([9, 3, 12, 3, 6, 1, 9])]


def test_preemption_events_and_recomputed_tokens(model):
    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=14)
    eng.run([Request(p, 14, ignore_eos=True, request_id=f"r{i}") for i, p in enumerate(PROMPTS)])
    events = lat.preemption_events(eng.records)
    preempted = [rid for _, kind, rid, _ in events if kind == "preempted"]
    assert preempted and preempted == [rid for r in eng.records for rid in r.preempted]
    assert sorted(rid for _, kind, rid, _ in events if kind == "readmitted") == sorted(preempted)
    tokens, seconds = lat.recomputed_tokens(eng.records)
    assert tokens >= sum(len(eng.sequences[rid].prompt_ids) for rid in preempted) and seconds > 0


def test_latency_figures_have_titles_and_axis_labels(model):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eng = Engine(model, max_batch_size=4, kv="paged", block_size=4, num_blocks=14, preemption="swap")
    done = eng.run([Request(p, 14, ignore_eos=True, request_id=f"r{i}") for i, p in enumerate(PROMPTS)])
    axes = [lat.plot_request_anatomy(done[0]), lat.plot_itl_timeline(done),
            lat.plot_budget_tradeoff([{"budget": None, "worst_itl": 0.3, "ttft": 0.3},
                                      {"budget": 64, "worst_itl": 0.03, "ttft": 0.5}]),
            lat.plot_lanes({"fcfs": {"urgent": (0.3, 0.5)}, "priority": {"urgent": (0.05, 0.1)}})]
    axes += list(lat.plot_preemptions(eng.records, 4).axes)
    assert any(k == "swapped in" for _, k, _, _ in lat.preemption_events(eng.records))
    for ax in axes:
        if ax.get_label() == "<colorbar>":
            continue
        assert ax.get_title() and ax.get_xlabel() and (ax.get_ylabel() or ax.get_yticks().size), ax
    plt.close("all")
    with pytest.raises(ValueError, match="paged engine"):
        lat.plot_preemptions([], 4)
