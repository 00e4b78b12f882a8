"""Run a learner's scheduler inside the real engine and watch it: the harness behind notebook 06's checks.

The learner subclasses :class:`~cbteach.engine.scheduler.Scheduler` and writes ``schedule(now)``.
This module plugs that class into an :class:`~cbteach.engine.engine.Engine` (``scheduler_cls=``) and
runs it beside the engine's own scheduler on the same :class:`Workload`, so that the two runs can
be compared step by step (``engine.records``). Three things make that comparison fair and safe:

* **a step clock** (:class:`~cbteach.core.clock.VirtualClock` with ``step_time=1``): time moves one unit per forward step, so a request that
  "arrives at 3.5" arrives after the same step on every machine, in both runs;
* **a watched subclass** (:func:`watched`): the learner's class is subclassed once more, so the
  moment a rule is broken -- a request admitted before it arrived, in a step that preempted, past
  the batch limit, out of the policy's order; a victim that is not the policy's; a plan that feeds
  more than the budget or tokens without KV room -- it stops with a :class:`SchedulerMistake` that
  names the misconception, where it happened (not after the damage spreads);
* **a tracer** around each ``schedule`` call (``sys.settrace``): it notices when the learner's code
  runs the engine's own scheduling (``super().schedule``, ``schedule_running``, ...), and stops a
  ``schedule`` that never returns after :data:`MAX_EVENTS` traced events.

The schedules are compared with :func:`cbteach.viz.schedule.first_difference` (the notebook draws them).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from ..engine.engine import Engine
from ..core.clock import VirtualClock
from ..core.request import Request
from ..engine.scheduler import Scheduler
from ..core.scheduler_output import SchedulerOutput

MAX_EVENTS = 200_000  # traced calls and lines in one schedule() call: far beyond any honest step
REFERENCE = {f.__code__: name for name, f in [
    ("super().schedule", Scheduler.schedule), ("schedule_running", Scheduler.schedule_running),
    ("schedule_swapped", Scheduler.schedule_swapped), ("schedule_waiting", Scheduler.schedule_waiting),
    ("allocate_or_preempt", Scheduler.allocate_or_preempt)]}


IDLE = ("a step planned nothing although a request that had arrived could have run: a request that has not arrived "
        "yet is skipped, not waited for; a long prompt is fed in chunks, not kept waiting to fit whole")


class SchedulerMistake(Exception):
    """The learner's scheduler broke a rule; the message is the hint (a misconception, never a value)."""


class NotDone(SchedulerMistake):
    """``schedule`` is still the stub (it returned None, or the class does not define it)."""


@dataclass(frozen=True)
class Workload:
    """Requests and an engine built to expose a mistake. Lists are per request, in arrival order."""

    name: str
    ids: tuple
    prompt_lens: tuple
    max_new_tokens: tuple
    max_batch_size: int
    arrivals: tuple = ()  # step-clock times; empty: everyone at 0
    priorities: tuple = ()  # empty: all 0
    token_budget: int | None = None
    num_blocks: int | None = None  # None: room for every slot's full length (no memory limit)
    block_size: int = 4
    policy: str = "fcfs"
    admission: str = "per_chunk"  # vLLM V1's rule; "whole_prompt" is V0's
    ignore_eos: bool = True  # forced lengths: the workload's memory pressure does not depend on the model

    def requests(self, vocab_size: int) -> list[Request]:
        span = max(1, min(vocab_size, 97) - 3)  # ids 3.. kept clear of special tokens
        return [Request([3 + (11 * i + 7 * j + 5) % span for j in range(n)], self.max_new_tokens[i], request_id=rid,
                        arrival_time=self.arrivals[i] if self.arrivals else 0.0,
                        priority=self.priorities[i] if self.priorities else 0, ignore_eos=self.ignore_eos)
                for i, (rid, n) in enumerate(zip(self.ids, self.prompt_lens))]

    def engine(self, model, scheduler_cls=None) -> Engine:
        blocks = {} if self.num_blocks is None else {"num_blocks": self.num_blocks}
        return Engine(model, None, max_batch_size=self.max_batch_size, kv="paged", block_size=self.block_size,
                      token_budget=self.token_budget, policy=self.policy, admission=self.admission,
                      scheduler_cls=scheduler_cls,
                      clock=VirtualClock(step_time=1.0), **blocks)


@dataclass
class Run:
    """One workload run: the engine, its records, and the mistake that stopped it (None: it finished)."""

    engine: Engine | None
    records: list
    mistake: SchedulerMistake | None = None


def run(model, workload: Workload, scheduler_cls=None, max_steps: int = 2000) -> Run:
    """Run ``workload`` with ``scheduler_cls`` (None: the engine's own scheduler) for at most
    ``max_steps`` forward steps. Idle steps (nothing scheduled) move the clock to the next arrival."""
    try:
        eng = workload.engine(model, scheduler_cls)
    except Exception as err:  # noqa: BLE001 -- the learner's __init__
        return Run(None, [], SchedulerMistake(f"the engine could not build your scheduler: {type(err).__name__}: {err}"))
    for r in workload.requests(model.config.vocab_size):
        eng.add_request(r)
    records = []
    try:
        while eng.has_unfinished():
            if len(records) >= max_steps:
                raise SchedulerMistake(f"requests were still unfinished after {max_steps} steps: are the same "
                                       "requests preempted over and over, or is one never given its tokens?")
            rec = eng.step()
            if not rec.idle:  # a forward pass, or a step that only preempted
                records.append(rec)
                continue
            nxt = eng.scheduler.next_event_time(eng.now())
            if nxt is None:
                raise SchedulerMistake(IDLE)
            eng.clock.t = nxt
    except SchedulerMistake as err:
        return Run(eng, records, err)
    except Exception as err:  # noqa: BLE001 -- the learner's code, raised inside the engine
        return Run(eng, records, SchedulerMistake(f"the run stopped with {type(err).__name__}: {err}"))
    return Run(eng, records)


class _Tracer:
    """``sys.settrace`` for one ``schedule`` call: which engine scheduling code ran, and a bound on events."""

    def __init__(self):
        self.called, self.events, self.saved = None, 0, None

    def __call__(self, frame, event, arg):
        self.events += 1
        if self.events > MAX_EVENTS:
            raise SchedulerMistake("schedule() did not return: a loop that never ends? (a retry loop must change "
                                   "something each time round -- preempt someone -- or stop)")
        if event == "call" and frame.f_code in REFERENCE and self.called is None:
            self.called = REFERENCE[frame.f_code]
        return self

    def __enter__(self):
        self.saved = sys.gettrace()
        sys.settrace(self)
        return self

    def __exit__(self, *exc):
        sys.settrace(self.saved)


CALLED_REFERENCE = ("your schedule() ran the engine's own scheduling ({}): the exercise is to write the step "
                    "yourself, from allocate_slots, pick_victim, preempt, admit and SchedulerOutput.add")


def watched(cls: type) -> type:
    """A subclass of the learner's ``cls`` that checks every rule where it can be broken."""

    class Watched(cls):
        check_now = 0.0

        def schedule(self, now):
            self.check_now = now
            with _Tracer() as tracer:
                out = super().schedule(now)
            if tracer.called:
                raise SchedulerMistake(CALLED_REFERENCE.format(tracer.called))
            if out is None:
                raise NotDone("not done yet: schedule() returned None -- it must build and return the step's "
                              "SchedulerOutput")
            if not isinstance(out, SchedulerOutput):
                raise SchedulerMistake(f"schedule() returned a {type(out).__name__}; it must return a SchedulerOutput")
            check_plan(self, out)
            return out

        def admit(self, seq, out):
            check_admission(self, seq, out)
            return super().admit(seq, out)

        def preempt(self, seq, out):
            if seq not in self.running:
                raise SchedulerMistake("preempt() was given a request that is not running: only a running request "
                                       "holds KV blocks to give back")
            if seq is not self.waiting.pick_victim(self.running):
                raise SchedulerMistake("the victim is not the policy's: when room is refused, the request to preempt "
                                       "is the one self.waiting.pick_victim(self.running) names, whoever asked")
            return super().preempt(seq, out)

    Watched.__name__ = Watched.__qualname__ = cls.__name__
    return Watched


def check_admission(sched, seq, out) -> None:
    """The admission rules, checked at the moment ``sched.admit(seq, out)`` is called."""
    if out.preempted:
        raise SchedulerMistake("admitted in a step that preempted: when this step had to preempt, room is short -- "
                               "a newcomer admitted now would only be preempted again (vLLM V1 admits nobody)")
    if seq.arrival_time > sched.check_now:
        raise SchedulerMistake("a request was admitted before it arrived: only requests whose arrival_time is at "
                               "or before `now` may be admitted")
    if len(sched.running) >= sched.max_batch_size:
        raise SchedulerMistake("admitted past max_batch_size: every slot of the batch was already taken")
    if seq not in sched.waiting:
        raise SchedulerMistake("admit() was given a request that is not waiting")
    first = next(s for s in sched.waiting if s.arrival_time <= sched.check_now)
    if first is not seq:
        left = math.inf if sched.token_budget is None else sched.token_budget - out.total_num_scheduled_tokens
        need = min(first.num_tokens - first.num_computed_tokens, left)
        if sched.kv_manager.num_admittable_tokens(first) < need:
            raise SchedulerMistake("a waiting request overtook an earlier one that did not fit: the first request "
                                   "(in the policy's order) that is refused room ends the admissions of the step")
        raise SchedulerMistake("admitted out of the policy's order: walk self.waiting in its own order (it is "
                               "the policy), skipping only requests that have not arrived yet")


def check_plan(sched, out: SchedulerOutput) -> None:
    """What must hold of any plan ``schedule`` returns, whatever the reference would have done."""
    seqs, counts = list(out.seqs), list(out.num_scheduled_tokens)
    if len(set(map(id, seqs))) != len(seqs):
        if any(seqs.count(s) > 1 for s in out.admitted):
            raise SchedulerMistake("a request admitted in this step was planned a second time, as a running one: "
                                   "running requests come first, admissions after them get what is left")
        raise SchedulerMistake("a request was added to the plan twice in one step")
    for seq, n in zip(seqs, counts):
        if n < 1:
            raise SchedulerMistake("a request was planned for no tokens: plan only what feeds at least one token")
        if seq not in sched.running:
            raise SchedulerMistake("the plan holds a request that is not running (preempted in this step, or never "
                                   "admitted): a request you preempt leaves the plan, and the loop stops there")
        if n > seq.num_tokens + len(seq.draft_ids) - seq.num_computed_tokens:
            raise SchedulerMistake("a request was given more tokens than it lacks (num_tokens - num_computed_tokens)")
        if len(seq.block_table) * sched.kv_manager.block_size < seq.num_computed_tokens + n:
            raise SchedulerMistake("tokens were planned without KV room: every planned chunk needs allocate_slots to "
                                   "have given it room -- None means refused: preempt the victim and ask again")
    if sched.token_budget is not None and sum(counts) > sched.token_budget:
        raise SchedulerMistake("the chunk exceeds the token budget: the step's plan feeds more tokens than "
                               "token_budget; cut a prefill to the budget that is left (chunked prefill)")
    admitted = [s for s in seqs if any(s is a for a in out.admitted)]
    running = [s for s in seqs if not any(s is a for a in out.admitted)]
    if seqs != running + admitted:
        raise SchedulerMistake("a waiting request was planned before a running one: running requests come first, "
                               "admissions get what is left")
    if running != [s for s in sched.running if any(s is r for r in running)]:
        raise SchedulerMistake("running requests were not planned in the running list's order (self.running)")
    left = math.inf if sched.token_budget is None else sched.token_budget - sum(counts)
    skipped = [s for s in sched.running if not any(s is r for r in seqs)]
    if skipped and left > 0 and not out.preempted:
        seq = skipped[0]
        need = seq.num_computed_tokens + min(seq.num_tokens - seq.num_computed_tokens, left)
        if len(seq.block_table) * sched.kv_manager.block_size < need:
            raise SchedulerMistake("a running request was refused KV room and nobody was preempted: when "
                                   "allocate_slots returns None, preempt the policy's victim and ask again")
        raise SchedulerMistake("a running request was skipped while budget was left: every running request gets "
                               "what it lacks, cut to the budget, before anyone is admitted")
