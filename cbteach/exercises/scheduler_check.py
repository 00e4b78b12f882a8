"""Run a learner's scheduler inside the real engine and watch it: notebook 06's checks and the tournament.

A :class:`Workload` runs on a step clock (the same on every machine), the learner's class subclassed once more
by :func:`watched`, which checks every rule of :mod:`.rules` where it can be broken: ``rules_="exercise"``
vLLM V1's as notebook 06 teaches them, ``"safety"`` only what keeps any engine correct. Its waiting queue,
running list and KV manager are watched too (changed while walked? this step's grants and frees).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..core.clock import VirtualClock
from ..core.request import Request
from ..core.sampling import SamplingParams
from ..engine.engine import Engine
from ..engine.scheduler import Scheduler
from . import raised, rules, update_rules
from .rules import SchedulerMistake, hint


@dataclass(frozen=True)
class Workload:
    """Requests and an engine built to expose a mistake; tuples hold a value per request, in arrival order."""

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
    admission: str = "per_chunk"  # vLLM V1's rule as read at 00024d3; "whole_prompt" is V0's (and close to current V1's)
    ignore_eos: bool | tuple = True  # True: forced lengths, the memory pressure does not depend on the model
    shared_prefix: int = 0  # the first tokens every prompt has in common (prefix caching)
    prefix_caching: bool = False
    speculative: bool = False  # speculative decoding, drafts by a SometimesWrongDraft of the model
    stop_token_ids: tuple = ()  # per request: a tuple of ids that end it (finish_reason "stop")

    def requests(self, vocab_size: int) -> list[Request]:
        span = max(1, min(vocab_size, 97) - 3)  # ids 3.. kept clear of special tokens
        common = [3 + (7 * j + 2) % span for j in range(self.shared_prefix)]
        out = []
        for i, (rid, n) in enumerate(zip(self.ids, self.prompt_lens)):
            own = [3 + (11 * i + 7 * j + 5) % span for j in range(n)]
            prompt = (common[:max(0, n - 1)] + own)[:n]  # at least its last token its own
            stop = self.stop_token_ids[i] if self.stop_token_ids else ()
            ignore = self.ignore_eos[i] if isinstance(self.ignore_eos, tuple) else self.ignore_eos
            out.append(Request(prompt, self.max_new_tokens[i], request_id=rid,
                               arrival_time=self.arrivals[i] if self.arrivals else 0.0,
                               priority=self.priorities[i] if self.priorities else 0, ignore_eos=ignore,
                               sampling_params=SamplingParams(stop_token_ids=stop)))
        return out

    def engine(self, model, scheduler_cls=None) -> Engine:
        return Engine(model, None, max_batch_size=self.max_batch_size, kv="paged", block_size=self.block_size,
                      num_blocks=self.num_blocks, token_budget=self.token_budget, policy=self.policy,
                      admission=self.admission, prefix_caching=self.prefix_caching,
                      speculative=SometimesWrongDraft(model) if self.speculative else None,
                      scheduler_cls=scheduler_cls, clock=VirtualClock(step_time=1.0))


class SometimesWrongDraft(torch.nn.Module):
    """A draft model for checks: the model itself, its guesses wrong from a position that moves with every
    call -- so on any model some are accepted, some rejected, and a stop can fall inside accepted ones."""

    def __init__(self, target):
        super().__init__()
        self.target, self.config, self.calls = target, target.config, 0

    def get_input_embeddings(self):
        return self.target.get_input_embeddings()

    def generate(self, ids, max_new_tokens: int, **kwargs):
        out = self.target.generate(ids, max_new_tokens=max_new_tokens, **kwargs).clone()
        wrong = self.calls % (max_new_tokens + 1)  # max_new_tokens: every guess right
        self.calls += 1
        if ids.shape[1] + wrong < out.shape[1]:
            out[0, ids.shape[1] + wrong] = (out[0, ids.shape[1] + wrong] + 1) % self.config.vocab_size
        return out


@dataclass
class Run:
    """One workload run: the engine, its records, and the mistake that stopped it (None: it finished)."""

    engine: Engine | None
    records: list
    mistake: SchedulerMistake | None = None


def run(model, workload: Workload, scheduler_cls=None, max_steps: int = 2000, stage: int | None = None,
        eos_ids=None) -> Run:
    """Run ``workload`` with ``scheduler_cls`` (None: the engine's own), stopping at ``eos_ids`` (None: the model's
    EOS), until every request is done, for at most ``max_steps`` steps; an idle step moves the clock on."""
    try:
        eng = workload.engine(model, scheduler_cls)
    except Exception as err:  # noqa: BLE001 -- the learner's __init__
        return Run(None, [], SchedulerMistake(f"the engine could not build your scheduler: {raised(err)}"))
    if eos_ids is not None:
        eng.scheduler.eos_ids = frozenset(eos_ids)
    for r in workload.requests(model.config.vocab_size):
        eng.add_request(r)
    result = Run(eng, [])
    try:
        while eng.has_unfinished():
            if len(result.records) >= max_steps:
                raise SchedulerMistake(hint("unfinished", stage).format(max_steps))
            rec = eng.step()
            if not rec.idle:  # a forward pass, or a step that only preempted
                result.records.append(rec)
                continue
            nxt = eng.scheduler.next_event_time(eng.now())
            if nxt is None:
                raise SchedulerMistake(hint("idle", stage))
            eng.clock.advance(nxt - eng.now())
    except SchedulerMistake as err:
        result.mistake = err
    except Exception as err:  # noqa: BLE001 -- the learner's code, raised inside the engine
        result.mistake = SchedulerMistake(f"the run stopped with {raised(err)}")
    return result


def leftovers(eng: Engine, expected: dict | None = None) -> str | None:
    """What must hold once a run is over, or its hint: every request's tokens ``expected`` (``model.generate``'s;
    None: not checked), every KV block back."""
    if expected is not None and any(getattr(eng.completions.get(rid), "output_ids", None) != tokens
                                    for rid, tokens in expected.items()):
        return ("a request's tokens differ from model.generate's: a scheduler chooses who runs when, never what a "
                "request computes")
    if eng.kv_usage()["num_used_blocks"]:
        return "KV blocks are still in use after every request finished: a request that left the batch kept its blocks"
    return None


# -- the watchers ------------------------------------------------------------------------------------

MAX_CALLS = 100_000  # calls on the watched objects in one schedule(): far beyond any step that ends
_calls = [None]  # calls so far in the schedule() running now (None: none is running)


def tick() -> None:
    """One more call on a watched object in this ``schedule``; past :data:`MAX_CALLS`, it never ends."""
    if _calls[0] is None:
        return
    _calls[0] += 1
    if _calls[0] > MAX_CALLS:
        raise SchedulerMistake("schedule() did not return: a loop that never ends? (a retry loop must change "
                               "something each time round -- preempt someone -- or stop)")


class QueueWatch:
    """The policy's waiting queue, unchanged, but it knows when it is changed while being walked."""

    def __init__(self, queue, strict: bool = True):
        self.queue, self.version, self.strict = queue, 0, strict  # strict: the exercise's rule, not only safety

    def __getattr__(self, name):
        if name in ("add", "remove", "readd_preempted"):  # the queue is about to change
            self.version += 1
        return getattr(self.queue, name)

    def __len__(self):
        tick()
        return len(self.queue)

    def __contains__(self, seq):
        tick()
        return seq in self.queue

    def __iter__(self):
        version = self.version
        for seq in list(self.queue):
            if self.strict and self.version != version:  # a plain list iterator would now skip a request
                raise SchedulerMistake(hint("walked_waiting", None))
            yield seq


class RunningWatch(list):
    """The running list, unchanged, but it knows when a loop over it skips a request: removing one at or
    before the loop's position shifts the rest left, and a plain list iterator steps over the next."""

    def __init__(self, items=(), strict: bool = True):
        super().__init__(items)
        self.cursors: list = []  # [position, skipped] of each live loop
        self.strict = strict  # the exercise's rule (no request skipped), not only the count

    def __len__(self):
        tick()
        return super().__len__()

    def __contains__(self, seq):
        tick()
        return super().__contains__(seq)

    def __iter__(self):
        cursor = [0, False]
        self.cursors.append(cursor)
        try:
            while True:
                if cursor[1] and self.strict:
                    raise SchedulerMistake(hint("walked_running", None))
                if cursor[0] >= len(self):
                    return
                cursor[0] += 1
                yield self[cursor[0] - 1]
        finally:
            self.cursors.remove(cursor)

    def remove(self, seq):
        i = next(j for j in range(len(self)) if self[j] is seq)
        super().pop(i)
        for cursor in self.cursors:  # the request that moved into a visited position is never visited
            cursor[1] = cursor[1] or (i < cursor[0] and cursor[0] - 1 < len(self))


class KVWatch:
    """The KV manager, unchanged, but it remembers this step's grants and what each free saw."""

    def __init__(self, manager):
        self.manager = manager
        self.begin_step()

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def begin_step(self):
        self.granted, self.refused, self.frees, self.trims = {}, set(), {}, set()

    def allocate_slots(self, seq, num_new_tokens, *args, **kwargs):
        tick()
        cached = kwargs.get("new_computed_blocks", args[0] if args else ())
        start = seq.num_computed_tokens + len(cached) * self.manager.block_size  # an admission's cached prefix
        got = self.manager.allocate_slots(seq, num_new_tokens, *args, **kwargs)
        if got is None:
            self.refused.add(id(seq))
        else:
            self.granted[id(seq)] = (start, num_new_tokens)
        return got

    def free(self, seq):
        self.frees[id(seq)] = (len(seq.output_ids), seq.finish_reason)
        return self.manager.free(seq)

    def trim(self, seq):
        self.trims.add(id(seq))
        return self.manager.trim(seq)


def watched(cls: type, stage: int | None = None, rules_: str = "exercise") -> type:
    """A subclass of the learner's ``cls`` that checks every rule where it can be broken
    (``rules_``: ``"exercise"`` or ``"safety"``, see the module)."""
    exercise = rules_ == "exercise"
    own_update = cls.update_from_output is not Scheduler.update_from_output
    words = functools.partial(hint, stage=stage)  # a rule's hint, in the stage's words

    class Watched(cls):
        check_now = 0.0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.waiting, self.running = QueueWatch(self.waiting, exercise), RunningWatch(self.running, exercise)
            self.kv_manager = KVWatch(self.kv_manager)

        def schedule(self, now):
            self.check_now = now
            self.kv_manager.begin_step()
            self.made = None
            before = list(self.running)
            _calls[0] = 0
            try:
                out = super().schedule(now)
            finally:
                _calls[0] = None
            rules.check_plan(self, out, self.made, before, stage, exercise)
            self.outputs_before = [len(s.output_ids) for s in self.made.plan.seqs]
            return out

        def make_output(self, plan):
            out = super().make_output(plan)
            self.made = rules.Made(plan, out, [s.num_computed_tokens for s in plan.seqs])
            return out

        def admit(self, seq, plan):
            rules.enforce(rules.admission_rules(self, seq, plan, exercise), words)
            return super().admit(seq, plan)

        def preempt(self, seq, plan):
            rules.enforce(rules.preemption_rules(self, seq, exercise), words)
            return super().preempt(seq, plan)

        def update_from_output(self, scheduler_output, output, now):
            self.kv_manager.begin_step()
            self.check_sampled = [None if t is None else list(t) for t in output.sampled]  # (the worker's: read only)
            try:
                finished = super().update_from_output(scheduler_output, output, now)
            except TypeError as err:  # the commonest way to trip over a chunk that got no token
                if own_update and any(t is None for t in output.sampled):
                    raise SchedulerMistake(f"{update_rules.UPDATE_HINTS['none_token']} ({err})") from None
                raise
            if own_update:
                update_rules.check_update(self, self.made, output, finished)
            return finished

    Watched.__name__ = Watched.__qualname__ = cls.__name__
    return Watched

