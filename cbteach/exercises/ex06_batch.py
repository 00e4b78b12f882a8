"""Notebook 06b, section 3: the learner's ``update_batch(runner, scheduler_output)`` (vLLM V1's
``GPUModelRunner._update_states``) runs in the real engine's worker on :data:`WORKLOADS`; after every call the
worker's state is compared with the message (:mod:`.batch_rules`), at the end the tokens with ``model.generate``'s.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass, field

from ..core.clock import VirtualClock
from ..core.request import Request
from ..core.sampling import SamplingParams
from ..engine.engine import Engine
from ..executor import check_update_batch_signature
from ..worker import model_runner
from . import Fail, bierce, fail, generated_all, guard, is_stub, need_function, passed, raised, self_check
from .batch_rules import HINTS, Expect, state_hint

@dataclass(frozen=True)
class Workload:
    """Requests (token-id prompts, a step clock) and the engine options that take a branch of the update."""

    name: str
    prompt_lens: tuple
    max_new_tokens: tuple
    options: dict = field(default_factory=dict)  # Engine(...) keywords
    arrivals: tuple = ()  # step-clock times; empty: everyone at 0
    shared_prefix: int = 0
    n: int = 1  # samples per prompt (seeded, temperature 0.8), compared with the engine's own run
    ignore_eos: bool = False
    aborts: tuple = ()  # (step, request id): aborted before that step runs (while it waits, here)

    def requests(self, vocab_size: int) -> list[Request]:
        span = max(1, min(vocab_size, 97) - 3)  # ids 3.. kept clear of special tokens
        common = [3 + (5 * j + 1) % span for j in range(self.shared_prefix)]
        sampling = dict(n=self.n, temperature=0.8) if self.n > 1 else {}
        return [Request((common + [3 + (13 * i + 7 * j + 2) % span for j in range(n)])[:max(n, self.shared_prefix + 1)],
                        m, request_id=f"r{i}", arrival_time=self.arrivals[i] if self.arrivals else 0.0,
                        ignore_eos=self.ignore_eos, sampling_params=SamplingParams(seed=10 + i, **sampling))
                for i, (n, m) in enumerate(zip(self.prompt_lens, self.max_new_tokens))]


W = Workload
WORKLOADS = [
    W(name="requests that finish at different steps, prompts fed in chunks of a token budget of 3, one aborted "
      "while it waits",
      prompt_lens=(9, 3, 14, 5, 4, 11), max_new_tokens=(6, 9, 4, 8, 5, 7),
      options=dict(max_batch_size=4, token_budget=3), aborts=((2, "r5"),)),
    W(name="preemption and resumption under async scheduling (rows left out of a step, resumed requests sent their "
      "tokens), a pool of 7 blocks",
      prompt_lens=(10, 3, 13, 5, 4, 2), max_new_tokens=(9, 10, 6, 8, 7, 9),
      options=dict(max_batch_size=4, num_blocks=7, token_budget=6, async_scheduling=True),
      arrivals=(0, 0, 0, 1.5, 2.5, 6.5), ignore_eos=True),
    W(name="prefix caching: prompts sharing their first 12 tokens, arriving one after another",
      prompt_lens=(15, 14, 17, 13), max_new_tokens=(6, 5, 7, 4),
      options=dict(max_batch_size=3, prefix_caching=True), arrivals=(0, 3.5, 4.5, 9.5), shared_prefix=12),
    W(name="three seeded samples of each prompt forked from it (copies on write), async scheduling",
      prompt_lens=(6, 9, 5), max_new_tokens=(7, 5, 6),
      options=dict(max_batch_size=6, parallel_sampling="fork", async_scheduling=True), n=3, ignore_eos=True),
]


def _snapshot(runner) -> dict:
    """What the worker held before a message: a copy of each request's state."""
    return {rid: dataclasses.replace(s, prompt_token_ids=list(s.prompt_token_ids), block_ids=list(s.block_ids),
                                     output_token_ids=list(s.output_token_ids)) for rid, s in runner.requests.items()}


def expected(msg, before: dict) -> dict:
    """``{request id: Expect}`` for each request ``msg`` schedules: what its row and state must hold."""
    out = {}
    for new in msg.scheduled_new_reqs:
        old = None if new.req_id in msg.finished_req_ids else before.get(new.req_id)  # (an id used again: new)
        out[new.req_id] = Expect("new" if old is None else "forked",
                                 list(new.prompt_token_ids) + list(new.output_token_ids),
                                 new.num_computed_tokens, list(new.block_ids),
                                 model_runner.new_generator(new) if old is None else old.generator, new.sampling_params)
    c = msg.scheduled_cached_reqs
    for i, rid in enumerate(c.req_ids):
        held = before[rid]
        how = "resumed" if rid in c.resumed_req_ids else "replaced" if rid in c.replaced_req_ids else "running"
        table = list(c.new_block_ids[i]) if how != "running" else held.block_ids + list(c.new_block_ids[i])
        tokens = list(c.all_token_ids[rid]) if rid in c.all_token_ids else held.token_ids
        out[rid] = Expect(how, tokens, c.num_computed_tokens[i], table, held.generator, None, held)
    return out


def plugged(fn, seen: list):
    """``fn`` as the runner calls it, checked after every call (``seen``: the messages so far)."""
    @functools.wraps(fn)
    def update_batch(runner, scheduler_output):
        before, rows = _snapshot(runner), list(runner.input_batch.req_ids)
        try:
            fn(runner, scheduler_output)
        except Exception as err:  # noqa: BLE001 -- the learner's code
            if isinstance(err, KeyError) and err.args and err.args[0] in scheduler_output.finished_req_ids \
                    and err.args[0] not in before:
                raise Fail(HINTS["never_held"].format(who=repr(err.args[0]))) from None
            more = (" -- remove_request changes batch.req_id_to_index (and popping changes runner.requests): walk "
                    "a copy, a list made before the loop" if isinstance(err, RuntimeError)
                    and "changed size during iteration" in str(err) else "")
            raise Fail(f"your update_batch stopped with {raised(err)}{more}") from None
        said = state_hint(runner, scheduler_output, before, expected(scheduler_output, before), rows)
        if said is not None:
            raise Fail(said)
        seen.append(scheduler_output)
    return update_batch


def run_workload(model, w: Workload, fn=None) -> tuple[Engine, list, Fail | None]:
    """``w`` through an engine with ``fn`` as its worker's update (None: its own): the engine, the messages, and
    the first mistake (a :class:`Fail`, or None)."""
    seen: list = []
    eng = Engine(model, None, kv="paged", block_size=4, clock=VirtualClock(step_time=1.0),
                 update_batch=None if fn is None else plugged(fn, seen), **w.options)
    said = None
    try:
        if w.aborts:  # stepped here, to abort on time (such a workload has no arrival times)
            for r in w.requests(model.config.vocab_size):
                eng.add_request(r)
            while eng.has_requests():
                for rid in [rid for at, rid in w.aborts if at == eng.num_steps]:
                    eng.abort(rid)
                eng.step()
        else:
            eng.run(w.requests(model.config.vocab_size))
    except Fail as err:
        said = err
    finally:
        with contextlib.suppress(Exception):  # a run stopped half-way by a wrong batch
            eng.close()
    return eng, seen, said


def _outputs(eng) -> dict:
    return {rid: [s.output_ids for s in c.samples] if c.samples else c.output_ids for rid, c in eng.completions.items()}


@self_check
def check_update_batch(update_batch, model=None) -> bool:
    """``update_batch(runner, scheduler_output)`` as the worker's update on :data:`WORKLOADS`, on ``model``
    (None: bierce); see the module."""
    if is_stub(update_batch):
        return fail("not done yet: write update_batch(runner, scheduler_output), then run this check")
    need_function(update_batch, "update_batch")
    refused = guard.refusal("update_batch", update_batch)
    if refused:
        return fail(refused)
    try:
        check_update_batch_signature(update_batch)  # (the engine's own check, made when an engine is built with it)
    except ValueError as err:
        return fail(str(err))
    model = bierce() if model is None else model
    for w in WORKLOADS:
        eng, seen, said = run_workload(model, w, update_batch)
        where = f"on the workload '{w.name}'"
        if said is not None:
            return fail(f"{where}, message {len(seen)}: {said}")
        aborted = {rid for _, rid in w.aborts}
        want = (_outputs(run_workload(model, w)[0]) if w.n > 1 else
                generated_all(model, [r for r in w.requests(model.config.vocab_size) if r.request_id not in aborted]))
        if {rid: ids for rid, ids in _outputs(eng).items() if rid not in aborted} != want:
            return fail(f"{where}: the batch was right after every message, but the tokens differ from " +
                        ("the engine's own run" if w.n > 1 else "model.generate's") + " -- does your code change the "
                        "rows' tokens or generators after it has built them?")
    return passed(f"on all {len(WORKLOADS)} workloads your update_batch left the worker's batch as every "
                  "message said -- finished requests forgotten, rows of the scheduled requests only, blocks "
                  "appended or replaced, prefix hits and forked samples kept -- and every token came out as "
                  "model.generate's (the seeded samples: as the engine's own run)")
