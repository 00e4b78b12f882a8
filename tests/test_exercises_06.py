"""Notebook 06's scheduler exercise: the notebook's own solution passes every stage, and each typical
mistake -- made once, in a copy of that solution -- fails its stage with a hint that names it; the
harness survives whatever a learner passes; the pictures and latency helpers the notebook uses."""
import contextlib
import dataclasses
import io
import json
import math
import sys
from pathlib import Path

import pytest

from cbteach import Engine, Request
from cbteach.engine.scheduler import Scheduler
from cbteach.core.scheduler_output import SchedulerOutput
from cbteach.exercises import ex06
from cbteach.exercises.scheduler_check import run
from cbteach.student import stub
from cbteach.viz import latency as lat
from cbteach.viz.schedule import first_difference, plan_of, plot_schedules
from conftest import tiny_model

NOTEBOOK = Path(__file__).parent.parent / "notebooks" / "06_scheduling_and_latency.ipynb"
SOLUTION = next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                if "solution" in c.get("metadata", {}).get("tags", []))


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def scheduler_from(src):
    """The class ``MyScheduler`` that ``src`` defines, with what the notebook imported before it."""
    namespace = {"math": math}
    exec(compile(src, "scheduler", "exec"), namespace)
    return namespace.get("MyScheduler")


def with_mistake(old, new):
    assert old in SOLUTION, f"the notebook's solution no longer contains {old!r}: update this mistake"
    return scheduler_from(SOLUTION.replace(old, new))


def check(stage, cls, model):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ok = ex06.check_stage(stage, cls, model)
    return ok, out.getvalue()


RETRY = "while self.kv_manager.allocate_slots(seq, n) is None:"
VICTIM = "victim = self.waiting.pick_victim(self.running)"
ARRIVED = "for seq in [s for s in self.waiting if s.arrival_time <= now]:"
STOP_RUNNING = "if seq not in self.running:  # it was the victim itself"
ADMIT_N = "n = min(seq.num_tokens - seq.num_computed_tokens, budget)\n            if self.kv_manager"
WHOLE = "n = seq.num_tokens - seq.num_computed_tokens\n            if self.kv_manager"

# (the mistake, what it replaces in the solution, with what, the stage that must fail, words of its hint)
MISTAKES = [
    ("no tie-break: the victim is the most urgent max, the oldest among equals", VICTIM,
     "victim = max(self.running, key=lambda s: s.request.priority)", 3, "victim is not the policy's"),
    ("no tie-break, equal priorities: the victim taken among equals by max", VICTIM,
     "victim = max(self.running, key=lambda s: s.request.priority)", 4, "victim is not the policy's"),
    ("a tie of priority and arrival broken by max (the oldest), not by the policy", VICTIM,
     "victim = max(self.running, key=lambda r: (r.request.priority, r.arrival_time))", 4, "victim is not the policy's"),
    ("equal priorities ordered by request id", ARRIVED,
     "for seq in sorted([s for s in self.waiting if s.arrival_time <= now], key=lambda s: (s.request.priority, "
     "s.request_id)):", 4, "out of the policy's order"),
    ("last in, first out", ARRIVED, "for seq in reversed([s for s in self.waiting if s.arrival_time <= now]):", 1,
     "out of the policy's order"),
    ("budget off by one, under", "budget)  # a decode's", "budget - 1)  # a decode's", 2, "fewer tokens"),
    ("budget off by one, over", "            budget -= n\n        return out", "            budget -= n - 1\n"
     "        return out", 2, "exceeds the token budget"),
    ("budget spent when below zero, not at zero", "or budget <= 0:", "or budget < 0:", 2, "no tokens"),
    ("forgotten preemption: returns without room", RETRY, "if self.kv_manager.allocate_slots(seq, n) is None:\n"
     "                return out\n            while False:", 3, "refused KV room and nobody was preempted"),
    ("forgotten preemption: skips the request", RETRY, "if self.kv_manager.allocate_slots(seq, n) is None:\n"
     "                continue\n            while False:", 3, "refused KV room and nobody was preempted"),
    ("the refusal ignored", RETRY, "self.kv_manager.allocate_slots(seq, n)\n            while False:", 3,
     "without KV room"),
    ("the wrong victim: the oldest", VICTIM, "victim = self.running[0]", 3, "victim is not the policy's"),
    ("the wrong victim: never the asker", VICTIM,
     "victim = self.waiting.pick_victim([s for s in self.running if s is not seq] or [seq])", 3,
     "victim is not the policy's"),
    ("a planned victim's tokens not given back", "budget += self.preempt(victim, out)", "self.preempt(victim, out)", 4,
     "gives its tokens back"),
    ("the preempted asker still planned", STOP_RUNNING, "if False:  # it was the victim itself", 3, "not running"),
    ("the running loop goes on after the asker was its own victim", "                break\n            out.add",
     "                continue\n            out.add", 4, "loop ends"),
    ("admitting in a step that preempted", "if out.preempted or len(", "if len(", 3, "admitted in a step that preempted"),
    ("admitting past max_batch_size", "len(self.running) >= self.max_batch_size", "len(self.running) > self.max_batch_size",
     1, "past max_batch_size"),
    ("batch limit off by one, under", "len(self.running) >= self.max_batch_size",
     "len(self.running) >= self.max_batch_size - 1", 1, "left waiting"),
    ("a later request overtakes one that did not fit", "break  # nobody overtakes", "continue  # nobody overtakes", 3,
     "overtook an earlier one that did not fit"),
    ("arrival_time ignored", "[s for s in self.waiting if s.arrival_time <= now]", "list(self.waiting)", 1,
     "before it arrived"),
    ("admissions stop at the first request not yet arrived", ARRIVED,
     "for seq in list(self.waiting):\n            if seq.arrival_time > now:\n                break", 4,
     "skipped, not waited for"),
    ("a long prompt admitted whole, not chunked", ADMIT_N, WHOLE, 2, "exceeds the token budget"),
    ("a long prompt kept waiting until it fits the budget whole", ADMIT_N,
     WHOLE.replace("if self", "if n > budget:\n                break\n            if self"), 2, "fit whole"),
    ("a running prefill not chunked", "budget)  # a decode's", "math.inf)  # a decode's", 2, "exceeds the token budget"),
    ("only decodes run", "or seq not in self.running:  # budget spent",
     "or seq not in self.running or not seq.output_ids:  # budget spent", 2, "fewer tokens"),
    ("V0's whole-prompt admission", ADMIT_N, ADMIT_N.replace(
        "if self.kv_manager", "if self.kv_manager.num_admittable_tokens(seq) < seq.num_tokens:\n                break\n"
        "            if self.kv_manager"), 3, "whole prompt"),
]


def waiting_first():
    """The solution with its two loops swapped: admissions planned before the running requests."""
    a, b = SOLUTION.index("        for seq in list(self.running)"), SOLUTION.index("        for seq in [s for s in self")
    c = SOLUTION.index("        return out")
    return scheduler_from(SOLUTION[:a] + SOLUTION[b:c] + SOLUTION[a:b] + SOLUTION[c:])


def calling(reference):
    """The solution, but its running loop handed to the engine's own code."""
    if reference == "super().schedule":
        return scheduler_from(SOLUTION[:SOLUTION.index("        out = ")] + "        return super().schedule(now)\n")
    if reference == "schedule_running":
        return with_mistake("        for seq in list(self.running):",
                            "        budget = self.schedule_running(out, budget)\n        for seq in []:")
    return with_mistake(RETRY, "while not self.allocate_or_preempt(seq, n, out)[0]:")


@pytest.mark.parametrize("stage", sorted(ex06.STAGES))
def test_the_notebooks_solution_passes_every_stage(model, stage):
    ok, out = check(stage, scheduler_from(SOLUTION), model)
    assert ok and out.startswith("✓"), out
    assert sys.gettrace() is None  # the check's tracer is gone


@pytest.mark.parametrize("name, old, new, stage, words", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_each_typical_mistake_fails_its_stage_with_a_hint(model, name, old, new, stage, words):
    ok, out = check(stage, with_mistake(old, new), model)
    assert not ok and out.startswith("✗") and words in out, out
    assert not any(f"'{rid}'" in out or f" {rid} " in out for rid in ex06.ID8), out  # never names a request


@pytest.mark.parametrize("make, stage, words", [
    (waiting_first, 1, "running requests come first"),
    (lambda: calling("super().schedule"), 1, "engine's own scheduling (super().schedule)"),
    (lambda: calling("schedule_running"), 1, "engine's own scheduling (schedule_running)"),
    (lambda: calling("allocate_or_preempt"), 1, "engine's own scheduling (allocate_or_preempt)"),
], ids=["waiting first", "calls super().schedule", "calls schedule_running", "calls allocate_or_preempt"])
def test_waiting_first_and_calling_the_reference_fail(model, make, stage, words):
    ok, out = check(stage, make(), model)
    assert not ok and words in out, out


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
        return SchedulerOutput()


class BadInit(Scheduler):
    def __init__(self, *args, **kwargs):
        raise RuntimeError("oops")

    def schedule(self, now):
        return SchedulerOutput()


class NoSchedule(Scheduler):
    pass


@pytest.mark.parametrize("answer, words", [
    (None, "not done yet"), (..., "not done yet"), (NoSchedule, "not done yet"), (Scheduler, "not done yet"),
    (lambda now: None, "pass your scheduler class"), (int, "pass your scheduler class"),
    (Raises, "ZeroDivisionError"), (ReturnsAList, "must return a SchedulerOutput"), (NeverReturns, "did not return"),
    (PlansNothing, "planned nothing"), (BadInit, "could not build your scheduler"),
])
def test_anything_a_learner_passes_gets_a_hint_never_a_traceback(model, answer, words):
    ok, out = check(1, answer, model)
    assert ok is False and out.startswith("✗") and words in out, out
    assert sys.gettrace() is None


def test_the_student_stub_says_not_done_yet(model):
    ok, out = check(1, scheduler_from(stub(SOLUTION)), model)
    assert not ok and "not done yet" in out


def test_the_model_defaults_to_bierce_and_the_arguments_may_come_in_either_order(model):
    assert check(2, scheduler_from(SOLUTION), None)[0]
    ok, out = check(scheduler_from(SOLUTION), 3, model)
    assert ok, out


def test_a_stage_that_does_not_exist_is_refused(model):
    for stage in (0, 5, "1", None, True):
        ok, out = check(stage, scheduler_from(SOLUTION), model)
        assert not ok and "stage must be one of" in out


def test_the_workloads_expose_what_they_are_built_for(model):
    refs = {s: [ex06.reference_run(model, w) for w in ws] for s, ws in ex06.STAGES.items()}
    assert all(r.mistake is None for rs in refs.values() for r in rs)
    gaps = [b.start_time - a.start_time for a, b in zip(refs[1][1].records, refs[1][1].records[1:])]
    assert max(gaps) > 1  # an idle gap: nothing had arrived
    for r in refs[2]:  # long prompts are chunked
        assert any(s.kind == "prefill" and s.sampled is None for rec in r.records for s in rec.seqs)
    assert all(any(rec.preempted for rec in r.records) for r in refs[3])  # tiny pools preempt
    assert any(rec.preempted for r in refs[4] for rec in r.records)
    # V0's admission-time priority preemption never fires, so a V1 scheduler can match the engine
    assert not any(rec.preempted and rec.admitted for r in refs[4] for rec in r.records)
    with pytest.raises(ValueError, match="could never fit|pool has only"):
        ex06.NEVER_FITS.engine(model).add_request(ex06.NEVER_FITS.requests(97)[0])


def test_run_is_bounded_by_its_step_limit(model):
    result = run(model, ex06.STAGES[1][0], scheduler_from(SOLUTION), max_steps=3)
    assert "unfinished after 3 steps" in str(result.mistake) and len(result.records) == 3


def test_the_checks_are_deterministic(model):
    first = [check(s, scheduler_from(SOLUTION), model)[1] for s in ex06.STAGES]
    again = [check(s, with_mistake(VICTIM, "victim = self.running[0]"), model)[1] for s in ex06.STAGES]
    assert first == [check(s, scheduler_from(SOLUTION), model)[1] for s in ex06.STAGES]
    assert again == [check(s, with_mistake(VICTIM, "victim = self.running[0]"), model)[1] for s in ex06.STAGES]


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
