"""Notebook 06: the engine's step -- ``schedule(now)`` in four stages, ``update_from_output`` in a fifth.

Each stage plugs the learner's class into the real engine on workloads built to expose the typical mistakes,
runs the engine's own scheduler beside it, and compares: the rules where they are broken (:mod:`.rules`),
the schedule step by step (the first difference diagnosed), the outputs, and every KV block back.
"""
from __future__ import annotations

import collections
import dataclasses
import weakref

from ..engine.scheduler import Scheduler
from ..viz.schedule import first_difference, plan_of
from . import bierce, fail, generated_all, guard, passed, raised, self_check
from .rules import ROOM_STAGE, NotDone, SchedulerMistake, hint
from .scheduler_check import Workload, leftovers, run, watched

ID8 = ("kite", "ash", "moss", "bee", "elm", "fox", "dew", "gnu")  # arrival order is not alphabetical order


def W(name: str, prompt_lens: tuple, **fields) -> Workload:
    """A workload of ``len(prompt_lens)`` requests named from :data:`ID8`."""
    return Workload(name, ID8[:len(prompt_lens)], prompt_lens, **fields)


STAGES = {
    1: [W("six requests, three slots, stop at EOS (compared with model.generate too)", prompt_lens=(5, 9, 3, 7, 4, 6),
          max_new_tokens=(10,) * 6, max_batch_size=3, ignore_eos=False),
        W("arrivals mid-run and an idle gap, two slots", prompt_lens=(4, 6, 3, 5, 2, 7, 3),
          max_new_tokens=(6, 3, 8, 2, 5, 4, 3), max_batch_size=2, arrivals=(0, 0, 2.5, 3.5, 4.5, 30.5, 31.5))],
    2: [W("a token budget of 8, long prompts", prompt_lens=(20, 3, 5, 30, 2), max_new_tokens=(6, 8, 5, 4, 7),
          max_batch_size=3, token_budget=8),
        W("a token budget of 5, a long prompt arrives while others decode", prompt_lens=(3, 4, 2, 23, 3, 2),
          max_new_tokens=(9, 12, 10, 3, 6, 4), max_batch_size=4, arrivals=(0, 0, 1.5, 4.5, 5.5, 7.5), token_budget=5)],
    3: [W("a tiny pool of 12 blocks", prompt_lens=(8, 6, 9, 3, 17, 2), max_new_tokens=(12, 12, 10, 8, 6, 8),
          max_batch_size=4, num_blocks=12),
        W("a tiny pool of 10 blocks and a token budget of 6", prompt_lens=(10, 3, 14, 5, 4, 2, 9),
          max_new_tokens=(9, 10, 6, 8, 7, 9, 5), max_batch_size=4, arrivals=(0, 0, 0, 1.5, 2.5, 6.5, 9.5),
          token_budget=6, num_blocks=10),
        W("a long prompt arrives while others decode, a tiny pool of 8 blocks, a token budget of 5",
          prompt_lens=(3, 4, 2, 23, 3, 2), max_new_tokens=(9, 12, 10, 3, 6, 4), max_batch_size=4,
          arrivals=(0, 0, 1.5, 4.5, 5.5, 7.5), token_budget=5, num_blocks=8),
        W("prefix caching on: prompts sharing their first 12 tokens, a pool of 8 blocks",
          prompt_lens=(15, 14, 17, 13, 16, 14), max_new_tokens=(6, 9, 5, 8, 7, 6), max_batch_size=3,
          arrivals=(0, 0, 0, 2.5, 4.5, 9.5), num_blocks=8, shared_prefix=12, prefix_caching=True)],
    4: [W("priorities with ties, two slots", prompt_lens=(5, 3, 6, 4, 2, 5, 3, 4), max_new_tokens=(4, 6, 3, 5, 4, 3, 6, 2),
          max_batch_size=2, priorities=(1, 0, 1, 2, 0, 1, 0, 2), policy="priority"),
        W("priorities, arrivals mid-run, a token budget of 7", prompt_lens=(6, 3, 9, 4, 5, 3, 2),
          max_new_tokens=(7, 5, 4, 6, 5, 4, 3), max_batch_size=3, arrivals=(0, 0, 0, 2.5, 3.5, 3.5, 8.5),
          priorities=(2, 2, 1, 0, 2, 0, 1), token_budget=7, policy="priority"),
        W("priorities with ties in a tiny pool of 11 blocks", prompt_lens=(7, 5, 6, 4, 8, 3),
          max_new_tokens=(10, 12, 9, 10, 6, 7), max_batch_size=4, priorities=(1, 1, 0, 1, 0, 1), num_blocks=11,
          policy="priority"),
        W("priorities, arrivals mid-run, a tiny pool of 7 blocks and a token budget of 5",
          prompt_lens=(6, 3, 4, 3, 5, 8, 5), max_new_tokens=(11, 11, 10, 6, 7, 7, 8), max_batch_size=4,
          arrivals=(0, 0, 0.5, 2.5, 2.5, 3.5, 3.5), priorities=(2, 1, 1, 1, 2, 0, 0), token_budget=5, num_blocks=7,
          policy="priority"),
        W("priorities, arrivals mid-run, a pool of 7 blocks, a budget of 5: a victim ahead of the asking request",
          prompt_lens=(8, 4, 2, 5, 6), max_new_tokens=(4, 10, 9, 7, 10), max_batch_size=4,
          arrivals=(0, 1.5, 2.5, 3.5, 5.5), priorities=(0, 2, 1, 1, 0), token_budget=5, num_blocks=7, policy="priority")],
    5: [W("stops: an EOS, a stop token, lengths, ignore_eos; long prompts in chunks of a budget of 6",
          prompt_lens=(9, 4, 14, 3, 11, 5), max_new_tokens=(12, 14, 10, 16, 9, 13), max_batch_size=3,
          arrivals=(0, 0, 0, 1.5, 3.5, 6.5), token_budget=6, ignore_eos=False),
        W("speculative decoding: guesses accepted and rejected, a pool of 16 blocks", prompt_lens=(8, 6, 10, 7, 5),
          max_new_tokens=(14, 12, 16, 10, 11), max_batch_size=3, arrivals=(0, 0, 0, 2.5, 5.5), num_blocks=16,
          speculative=True, ignore_eos=False),
        W("prefix caching and preemption in a pool of 7 blocks, a token budget of 7", prompt_lens=(13, 10, 15, 9, 12, 14),
          max_new_tokens=(8, 10, 7, 9, 6, 8), max_batch_size=3, arrivals=(0, 0, 1.5, 2.5, 6.5, 8.5), token_budget=7,
          num_blocks=7, shared_prefix=8, prefix_caching=True, ignore_eos=False)],
}
NEVER_FITS = Workload("a request that could never fit", ("whale",), prompt_lens=(60,), max_new_tokens=(4,),
                      max_batch_size=1, num_blocks=12)
STAGE_NAMES = {1: "no memory limit", 2: "the token budget and chunked prefill", 3: "KV room and preemption",
               4: "priorities", 5: "update_from_output"}

_references: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(workload, eos): Run}


def stops_for(model, w: Workload) -> tuple[Workload, frozenset | None]:
    """``w`` made to stop at EOS whatever the model: EOS is the token the model says most on ``w`` (greedy), every
    second request ignores it, one gets a stop token. Returns the workload and the EOS ids (None: the model's)."""
    if w.ignore_eos:
        return w, None
    probe = reference_run(model, dataclasses.replace(w, ignore_eos=True))
    said = [probe.engine.completions[rid].output_ids for rid in w.ids]
    ignore = tuple(i % 2 == 1 for i in range(len(w.ids)))
    heard_by_ignorers = {t for out, ig in zip(said, ignore) if ig for t in out}
    counts = collections.Counter(t for out, ig in zip(said, ignore) if not ig for t in out[1:])
    eos = max(counts, key=lambda t: (t in heard_by_ignorers, counts[t]))  # said, and ignored by someone
    stops = []
    for out, ig in zip(said, ignore):
        other = [t for t in out[2:] if t != eos]
        stops.append((other[0],) if other and ig and not any(stops) else ())
    return dataclasses.replace(w, stop_token_ids=tuple(stops), ignore_eos=ignore), frozenset({eos})


def reference_run(model, workload: Workload, eos_ids=None):
    """The engine's own scheduler on ``workload`` (cached per model: every stage compares with it)."""
    runs = _references.setdefault(model, {})
    key = (workload, eos_ids)
    if key not in runs:
        runs[key] = run(model, workload, eos_ids=eos_ids)
    return runs[key]


def diagnose(ref, mine, stage=None, preempted_before=None) -> str:
    """Name the misconception behind the first step where ``mine``'s schedule differs from ``ref``'s.
    The steps before it were identical, so both schedulers saw the same state. ``preempted_before``: the
    prompt length of each request preempted in an earlier step."""
    t_ref, plan_ref, adm_ref, pre_ref = plan_of(ref)
    t, plan, adm, pre = plan_of(mine)
    room, budget = stage is None or stage >= ROOM_STAGE, stage is None or stage >= 2
    if t != t_ref:
        return hint("idle", stage) if t > t_ref else "a step ran before anything could: only requests that have " \
                                                      "arrived may run"
    if pre_ref and not pre:
        return hint("skipped_refused", stage)
    if pre and not pre_ref:
        return ("a request was preempted although no request had been refused room (allocate_slots refuses with "
                "None only; [] is room given that needs no new block)")
    got, want = {r: n for r, _, n in plan}, {r: n for r, _, n in plan_ref}
    if pre and set(got) > set(want):
        return ("after the request asking for room was itself the victim, later running requests were still "
                "planned: when that happens the running loop ends (vLLM V1)")
    left_out = [r for r in want if r not in adm_ref and r not in got]
    if pre and left_out and all(got[r] == want.get(r) for r in got):
        return ("after a preemption, a running request further down the list was left out: one preempted a moment "
                "ago is skipped and the loop goes on -- it ends only when the request asking for room was the victim")
    if any(got.get(r, 0) < n for r, n in want.items() if r not in adm_ref):
        if budget and adm and not pre and any(r not in got for r in want if r not in adm_ref):
            return ("a running request got fewer tokens than it lacked (none) while a newcomer was admitted: running "
                    "requests come first, and a prefill that does not fit is cut to the budget that is left")
        if pre:
            return ("after a preemption, a request got fewer tokens than the budget allowed: a victim already planned "
                    "in this step gives its tokens back to the budget (preempt returns how many)")
        running = [r for r in want if r not in adm_ref and r in got]
        if running and all(got[r] == 1 for r in running) and any(want[r] > 1 for r in running):
            return ("a running request was given one token although it lacks more: a running request may still be "
                    "prefilling its prompt in chunks, and it gets what it lacks (num_tokens - num_computed_tokens)"
                    + (", cut to the budget" if budget else ""))
        return ("a running request got fewer tokens than it lacked (or none)" + (" while budget was left" if budget
                else "") + ": check the arithmetic on what a request lacks" + (" and on the budget" if budget else "")
                + " -- an off-by-one?")
    starts, starts_ref = {r: c for r, c, _ in plan}, {r: c for r, c, _ in plan_ref}
    if room and any(starts_ref[r] > 0 and starts.get(r) != starts_ref[r] for r in adm_ref if r in starts_ref):
        return ("a newcomer did not start past the blocks of its prompt already computed: with prefix caching, "
                "get_computed_blocks finds them, its chunk is what it lacks past them, and it starts there")
    if len(adm) < len(adm_ref):
        causes = ["an off-by-one on the batch limit" + (" or the budget" if budget else ""),
                  "a stop at a request not arrived yet"]
        tail = ", or wait for room for a whole prompt instead of the chunk it feeds now?" if room else "?"
        free = "a slot, budget and KV room for its chunk were" if room else "a slot and budget were" if budget \
            else "a slot was"
        return (f"a request that had arrived was left waiting although {free} free: did admissions stop too early ("
                + ", ".join(causes) + ")" + tail)
    if any(got.get(r, 0) != n for r, n in want.items()):
        return "an admitted request's chunk is not what it lacks" + (", cut to the budget that is left" if budget else "")
    back = preempted_before or {}
    if any(r not in adm_ref and r in back and starts[r] + got[r] == back[r] for r in adm):
        return ("a request preempted earlier was admitted with a chunk that ends where its prompt ends: it comes back "
                "with the tokens it had generated, so what it lacks is num_tokens - num_computed_tokens, outputs "
                "included -- and its room must fit that")
    return "the step's plan differs from the engine's scheduler's on the same state: compare your loop with the rules"


def _compare_outputs(mine, ref, where: str) -> str | None:
    """The hint for the first way ``mine``'s completions differ from ``ref``'s (None: they agree)."""
    for rid, c_ref in ref.engine.completions.items():
        c = mine.engine.completions.get(rid)
        if c is None:
            return f"{where}: a request never completed -- update_from_output returns the sequences that finished"
        if c.output_ids != c_ref.output_ids:
            return f"{where}: the schedules matched but the tokens differ -- does your code change the requests' tokens?"
        if c.finish_reason != c_ref.finish_reason:
            return f"{where}: a request finished with the wrong finish_reason"
        if (c.first_token_time, c.token_times) != (c_ref.first_token_time, c_ref.token_times):
            return f"{where}: a request's token times differ: each token's time is `now` of the step that appended it"
    return None


def _check_workload(cls, model, w: Workload, stage: int, with_generate: bool) -> str | None:
    """None if ``cls`` runs ``w`` exactly as the engine does, else the hint."""
    w, eos = stops_for(model, w) if stage == 5 else (w, None)
    ref = reference_run(model, w, eos)
    if ref.mistake is not None:  # the engine's own scheduler must pass its own check
        raise RuntimeError(f"the engine's scheduler failed workload {w.name!r}: {ref.mistake}")
    mine = run(model, w, watched(cls, stage), max_steps=3 * len(ref.records) + 20, stage=stage, eos_ids=eos)
    where = f"on the workload '{w.name}'"
    diff = first_difference(ref.records, mine.records)
    if isinstance(mine.mistake, NotDone):
        return str(mine.mistake)
    if diff is not None and diff < len(mine.records) and diff < len(ref.records):
        back = {rid: len(ref.engine.sequences[rid].prompt_ids) for rec in ref.records[:diff] for rid in rec.preempted}
        return f"{where}, step {diff}: {diagnose(ref.records[diff], mine.records[diff], stage, back)}"
    if mine.mistake is not None:
        return f"{where}, step {len(mine.records)}: {mine.mistake}"
    if diff is not None:
        return f"{where}: your run took a different number of steps than the engine's with its scheduler"
    differ = _compare_outputs(mine, ref, where)
    if differ is not None:
        return differ
    left = leftovers(mine.engine, generated_all(model, w.requests(model.config.vocab_size)) if with_generate else None)
    return left and f"{where}: {left}"


def _never_fits(model) -> bool:
    """The engine refuses, at add time, a request that could never fit even alone in the pool."""
    try:
        NEVER_FITS.engine(model).add_request(NEVER_FITS.requests(model.config.vocab_size)[0])
    except ValueError:
        return True
    return False


def _refuse(stage, cls) -> str | None:
    """Why ``cls`` cannot be checked at ``stage`` (None: it can)."""
    if isinstance(stage, bool) or stage not in STAGES:
        return f"stage must be one of {sorted(STAGES)}, got {stage!r}"
    if cls is None or cls is Ellipsis:
        return "not done yet: write your scheduler class, then run this check"
    if not (isinstance(cls, type) and issubclass(cls, Scheduler)):
        return f"pass your scheduler class itself, a subclass of cbteach.engine.scheduler.Scheduler (got " \
               f"{type(cls).__name__})"
    # a method not written (still the engine's) is "not done yet" (the guard)
    return guard.refusal("scheduler", cls, ("update_from_output",) if stage == 5 else ("schedule",))


@self_check
def _gone_hint(scheduler_cls, model) -> str | None:
    """Under async scheduling a step's output can name a request that finished while it ran -- V1's
    ``update_from_output`` skips it (``vllm/v1/core/sched/scheduler.py``: "The request is already finished ...
    in pipeline parallelism or async scheduling"): the update, handed such an output, must not trip over it."""
    from ..core.scheduler_output import RunnerOutput, SchedulerOutput

    eng = STAGES[5][0].engine(model, scheduler_cls)
    try:
        eng.scheduler.update_from_output(SchedulerOutput(num_scheduled_tokens={"gone": 1}, total_num_scheduled_tokens=1),
                                         RunnerOutput(sampled=[[3]], req_ids=["gone"]), 0.0)
    except KeyError:
        return ("a step's output named a request that finished while that step ran (async scheduling) and your update "
                "raised KeyError: look each request up with self.requests.get(req_id) and skip None")
    except Exception as err:  # noqa: BLE001  (the learner's code)
        return f"a step's output named a request that finished while that step ran, and your update raised {raised(err)}"
    finally:
        eng.close()
    return None


def check_stage(stage, scheduler_cls, model=None, *, prefix_caching: bool = True) -> bool:
    """Stage ``stage`` (1-5, :data:`STAGES`) for ``scheduler_cls`` on ``model`` (None: bierce); stage 5 checks
    ``update_from_output`` under the engine's own ``schedule``. ``prefix_caching=False`` leaves those workloads out."""
    if isinstance(scheduler_cls, int) and not isinstance(stage, int):
        stage, scheduler_cls = scheduler_cls, stage
    refused = _refuse(stage, scheduler_cls)
    if refused:
        return fail(refused)
    if stage == 5:  # the update alone: the engine's own schedule plans every step
        scheduler_cls = type(scheduler_cls.__name__, (scheduler_cls,), {"schedule": Scheduler.schedule})
    model = bierce() if model is None else model
    workloads = [w for w in STAGES[stage] if prefix_caching or not w.prefix_caching]
    for i, w in enumerate(workloads):
        try:
            hint_ = _check_workload(scheduler_cls, model, w, stage, with_generate=stage == 1 and i == 0)
        except SchedulerMistake as err:
            hint_ = str(err)
        if hint_ is not None:
            return fail(f"stage {stage} ({STAGE_NAMES[stage]}): {hint_}")
    if stage == 5:
        gone = _gone_hint(scheduler_cls, model)
        if gone:
            return fail(f"stage 5 ({STAGE_NAMES[5]}): {gone}")
    extra = ""
    if stage == 3 and _never_fits(model):
        extra = "; a request that could never fit was refused by the engine at add time (ValueError), never queued"
    what = ("your update appended, stopped and freed as the engine's does -- same steps, tokens, finish reasons and "
            "token times" if stage == 5 else "your scheduler planned every step as the engine's does -- same "
            "requests, tokens, admissions and preemptions -- with the same outputs")
    return passed(f"stage {stage} ({STAGE_NAMES[stage]}): on all {len(workloads)} workloads {what}, "
                  f"and no KV block left behind{extra}")
