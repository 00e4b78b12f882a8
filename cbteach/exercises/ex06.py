"""Notebook 06: build the scheduling step -- a :class:`~cbteach.engine.scheduler.Scheduler` subclass whose
``schedule(now)`` decides who runs and with how many tokens -- checked in four stages.

Each stage plugs the learner's class into the real :class:`~cbteach.Engine` (``scheduler_cls=``) on
workloads built to expose the typical mistakes, runs the same workload with the engine's own
scheduler, and compares, in this order:

1. the rules, checked the moment they are broken (:mod:`cbteach.exercises.scheduler_check`): no
   call to the engine's own scheduling; a plan within the token budget, running requests first and
   in order, none skipped while budget is left, every chunk with KV room; admissions only of
   arrived requests, in the policy's order, within ``max_batch_size``, never in a step that
   preempted; the policy's victim;
2. the schedule, step by step: when each step ran, who ran with how many tokens from which position,
   who was admitted and who was preempted -- the first step that differs is diagnosed;
3. the tokens: equal to the engine's run, and on stage 1's first workload to per-prompt ``model.generate``;
4. the pool: every KV block back at the end.

Stages: 1 -- no memory limit (a pool with room for every slot); 2 -- a token budget (chunked
prefill); 3 -- a tiny pool (KV room, preemption, and a request that could never fit, which the
engine refuses at add time); 4 -- the priority policy (its order, ties and victim). Hints name
the misconception and where it showed, never the engine's choice or a value.
"""
from __future__ import annotations

import functools
import weakref

import torch

from ..engine.scheduler import Scheduler
from . import report, self_check
from ..viz.schedule import first_difference, plan_of
from .scheduler_check import IDLE, NotDone, SchedulerMistake, Workload, run, watched

W = Workload
ID8 = ("kite", "ash", "moss", "bee", "elm", "fox", "dew", "gnu")  # arrival order is not alphabetical order
STAGES = {
    1: [W("six requests, three slots, stop at EOS (compared with model.generate too)", ID8[:6], (5, 9, 3, 7, 4, 6),
          (10,) * 6, 3, ignore_eos=False),
        W("arrivals mid-run and an idle gap, two slots", ID8[:7], (4, 6, 3, 5, 2, 7, 3), (6, 3, 8, 2, 5, 4, 3), 2,
          arrivals=(0, 0, 2.5, 3.5, 4.5, 30.5, 31.5))],
    2: [W("a token budget of 8, long prompts", ID8[:5], (20, 3, 5, 30, 2), (6, 8, 5, 4, 7), 3, token_budget=8),
        W("a token budget of 5, a long prompt arrives while others decode", ID8[:6], (3, 4, 2, 23, 3, 2),
          (9, 12, 10, 3, 6, 4), 4, arrivals=(0, 0, 1.5, 4.5, 5.5, 7.5), token_budget=5)],
    3: [W("a tiny pool of 12 blocks", ID8[:6], (8, 6, 9, 3, 17, 2), (12, 12, 10, 8, 6, 8), 4, num_blocks=12),
        W("a tiny pool of 10 blocks and a token budget of 6", ID8[:7], (10, 3, 14, 5, 4, 2, 9),
          (9, 10, 6, 8, 7, 9, 5), 4, arrivals=(0, 0, 0, 1.5, 2.5, 6.5, 9.5), token_budget=6, num_blocks=10),
        W("a long prompt arrives while others decode, a tiny pool of 8 blocks, a token budget of 5", ID8[:6],
          (3, 4, 2, 23, 3, 2), (9, 12, 10, 3, 6, 4), 4, arrivals=(0, 0, 1.5, 4.5, 5.5, 7.5), token_budget=5,
          num_blocks=8)],
    4: [W("priorities with ties, two slots", ID8, (5, 3, 6, 4, 2, 5, 3, 4), (4, 6, 3, 5, 4, 3, 6, 2), 2,
          priorities=(1, 0, 1, 2, 0, 1, 0, 2), policy="priority"),
        W("priorities, arrivals mid-run, a token budget of 7", ID8[:7], (6, 3, 9, 4, 5, 3, 2), (7, 5, 4, 6, 5, 4, 3),
          3, arrivals=(0, 0, 0, 2.5, 3.5, 3.5, 8.5), priorities=(2, 2, 1, 0, 2, 0, 1), token_budget=7,
          policy="priority"),
        W("priorities with ties in a tiny pool of 11 blocks", ID8[:6], (7, 5, 6, 4, 8, 3), (10, 12, 9, 10, 6, 7), 4,
          priorities=(1, 1, 0, 1, 0, 1), num_blocks=11, policy="priority"),
        W("priorities, arrivals mid-run, a tiny pool of 7 blocks and a token budget of 5", ID8[:7], (6, 3, 4, 3, 5, 8, 5),
          (11, 11, 10, 6, 7, 7, 8), 4, arrivals=(0, 0, 0.5, 2.5, 2.5, 3.5, 3.5), priorities=(2, 1, 1, 1, 2, 0, 0),
          token_budget=5, num_blocks=7, policy="priority")],
}
NEVER_FITS = W("a request that could never fit", ("whale",), (60,), (4,), 1, num_blocks=12)
STAGE_NAMES = {1: "no memory limit", 2: "the token budget and chunked prefill", 3: "KV room and preemption",
               4: "priorities"}

_references: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {workload name: Run}


def reference_run(model, workload: W):
    """The engine's own scheduler on ``workload`` (cached per model: every stage compares with it)."""
    runs = _references.setdefault(model, {})
    if workload.name not in runs:
        runs[workload.name] = run(model, workload)
    return runs[workload.name]


def generate_outputs(model, workload: W) -> dict:
    """Per-prompt greedy ``model.generate``: the ground truth for a workload that stops at EOS."""
    outs = {}
    for r in workload.requests(model.config.vocab_size):
        ids = torch.tensor([r.prompt], device=model.device)
        eos = model.generation_config.eos_token_id
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=r.max_new_tokens,
                             pad_token_id=eos if isinstance(eos, int) else None)
        outs[r.request_id] = out[0, ids.shape[1]:].tolist()
    return outs


def diagnose(ref, mine) -> str:
    """Name the misconception behind the first step where ``mine``'s schedule differs from ``ref``'s.
    The steps before it were identical, so both schedulers saw the same state."""
    t_ref, plan_ref, adm_ref, pre_ref = plan_of(ref)
    t, plan, adm, pre = plan_of(mine)
    if t != t_ref:
        return IDLE if t > t_ref else "a step ran before anything could: only requests that have arrived may run"
    if pre_ref and not pre:
        return ("the KV manager refused room and nobody was preempted: when allocate_slots returns None, preempt "
                "the policy's victim and ask again")
    if pre and not pre_ref:
        return "a request was preempted although no request had been refused room"
    got, want = {r: n for r, _, n in plan}, {r: n for r, _, n in plan_ref}
    if pre and set(got) > set(want):
        return ("after the request asking for room was itself the victim, later running requests were still "
                "planned: when that happens the running loop ends (vLLM V1)")
    if any(got.get(r, 0) < n for r, n in want.items() if r not in adm_ref):
        if pre:
            return ("after a preemption, a request got fewer tokens than the budget allowed: a victim already planned "
                    "in this step gives its tokens back to the budget (preempt returns how many)")
        return ("a running request got fewer tokens than it lacked (or none) while budget was left: check the "
                "arithmetic on the budget and on what a request lacks -- an off-by-one?")
    if len(adm) < len(adm_ref):
        return ("a request that had arrived was left waiting although a slot, budget and KV room for its chunk were "
                "free: did admissions stop too early (an off-by-one on the batch limit or the budget, a stop at a "
                "request not arrived yet), or wait for room for a whole prompt instead of the chunk it feeds now?")
    if any(got.get(r, 0) != n for r, n in want.items()):
        return "an admitted request's chunk is not what it lacks, cut to the budget that is left"
    return "the step's plan differs from the engine's scheduler's on the same state: compare your loop with the rules"


def _check_workload(cls, model, w: W, with_generate: bool) -> str | None:
    """None if ``cls`` schedules ``w`` exactly as the engine does, else the hint."""
    ref = reference_run(model, w)
    if ref.mistake is not None:  # the engine's own scheduler must pass its own check
        raise RuntimeError(f"the engine's scheduler failed workload {w.name!r}: {ref.mistake}")
    mine = run(model, w, watched(cls), max_steps=3 * len(ref.records) + 20)
    where = f"on the workload '{w.name}'"
    diff = first_difference(ref.records, mine.records)
    if isinstance(mine.mistake, NotDone):
        return str(mine.mistake)
    if diff is not None and diff < len(mine.records) and diff < len(ref.records):
        return f"{where}, step {diff}: {diagnose(ref.records[diff], mine.records[diff])}"
    if mine.mistake is not None:
        return f"{where}, step {len(mine.records)}: {mine.mistake}"
    if diff is not None:
        return f"{where}: your run took a different number of steps than the engine's with its scheduler"
    outputs = {rid: c.output_ids for rid, c in mine.engine.completions.items()}
    if outputs != {rid: c.output_ids for rid, c in ref.engine.completions.items()}:
        return f"{where}: the schedules matched but the tokens differ -- does your code change the requests' tokens?"
    if with_generate and outputs != generate_outputs(model, w):
        return f"{where}: the tokens differ from model.generate's -- does your code change the requests' tokens?"
    if mine.engine.kv_usage()["num_used_blocks"]:
        return f"{where}: KV blocks are still in use after every request finished"
    return None


def _never_fits(model) -> bool:
    """The engine refuses, at add time, a request that could never fit even alone in the pool."""
    try:
        NEVER_FITS.engine(model).add_request(NEVER_FITS.requests(model.config.vocab_size)[0])
    except ValueError:
        return True
    return False


@functools.lru_cache(maxsize=1)
def _bierce():
    from ..models import load_model

    return load_model()[0]


@self_check
def check_stage(stage, scheduler_cls, model=None) -> bool:
    """Stage ``stage`` (1-4, see :data:`STAGES`) of the scheduler exercise, for ``scheduler_cls`` (a
    subclass of :class:`~cbteach.engine.scheduler.Scheduler` that overrides ``schedule``) on ``model``
    (any causal LM the engine runs; None: the course's bierce). ``check_stage(MyScheduler, 1)`` works too."""
    if isinstance(scheduler_cls, int) and not isinstance(stage, int):
        stage, scheduler_cls = scheduler_cls, stage
    if isinstance(stage, bool) or stage not in STAGES:
        return report(False, "", f"stage must be one of {sorted(STAGES)}, got {stage!r}")
    if scheduler_cls is None or scheduler_cls is Ellipsis:
        return report(False, "", "not done yet: write your scheduler class, then run this check")
    if not (isinstance(scheduler_cls, type) and issubclass(scheduler_cls, Scheduler)):
        return report(False, "", f"pass your scheduler class itself, a subclass of cbteach.engine.scheduler.Scheduler "
                                 f"(got {type(scheduler_cls).__name__})")
    if scheduler_cls.schedule is Scheduler.schedule:
        return report(False, "", "not done yet: your class does not define schedule(self, now)")
    model = _bierce() if model is None else model
    for i, w in enumerate(STAGES[stage]):
        try:
            hint = _check_workload(scheduler_cls, model, w, with_generate=stage == 1 and i == 0)
        except SchedulerMistake as err:
            hint = str(err)
        if hint is not None:
            return report(False, "", f"stage {stage} ({STAGE_NAMES[stage]}): {hint}")
    extra = ""
    if stage == 3 and _never_fits(model):
        extra = "; a request that could never fit was refused by the engine at add time (ValueError), never queued"
    return report(True, f"stage {stage} ({STAGE_NAMES[stage]}): on all {len(STAGES[stage])} workloads your scheduler "
                        f"planned every step as the engine's does -- same requests, tokens, admissions and "
                        f"preemptions -- with the same outputs and no KV block left behind{extra}", "")
