"""Async scheduling: plan step N+1 while step N's forward pass runs (vLLM V1's ``async_scheduling``).

In the synchronous engine the CPU and the model take turns: schedule, *then* forward, *then*
update, *then* schedule again -- the model idles while the host plans and books. On a GPU the host
work is a fixed cost per step (a few milliseconds in Python) that a fast forward pass makes large;
vLLM V1 hides it by overlapping it with the forward pass. One :meth:`AsyncStepper.step` does::

    plan N+1      (host; step N's forward and sampling are running on the worker's device thread)
    send N+1      ``executor.execute_model(plan, non_block=True)``: the worker applies plan N+1 to
                  its batch, prepares N+1's inputs and queues N+1 behind N on its device thread, where
                  it starts once N has sampled -- its decodes read N's tokens straight from the device
                  tensor (V1's ``prev_sampled_token_ids``); then N's tokens come to the host and N's
                  output is returned (:mod:`cbteach.worker.async_runner`)
    update N      (host; step N+1's forward is running all the while)

The executor carries it, as in V1 (``step_with_batch_queue`` in ``vllm/v1/engine/core.py`` hands N+1
to the executor before it waits on N): one process, or every tensor-parallel rank keeping its own step
in flight, rank 0 answering.

Two consequences, both as in vLLM V1. The scheduler plans N+1 before N's tokens exist: a sequence
that will get a token from N has a **placeholder** for it (``Sequence.num_placeholders``), so N+1
schedules its decode of that token. And a sequence that stops at N (EOS) may already be in N+1: its
N+1 work is wasted and its N+1 output dropped (one step of one sequence's compute). A request
preempted while its step is in flight keeps the token that step gives it -- as the synchronous
engine, which appends it before it preempts; a prompt whose samples were to fork from it (V0's
fork) hands them their first tokens, and with its blocks gone they compute the prompt again.
Tokens are the same as the synchronous engine's.

What is the same as vLLM V1 (``vllm/v1/core/sched/async_scheduler.py``, ``vllm/v1/engine/core.py``,
``vllm/v1/worker/gpu_model_runner.py``): placeholders on the scheduler's side; N+1 handed to the
executor before N's output is waited on; the worker preparing N+1 while N is on the device and feeding
N's tokens from the device; on CUDA, N's tokens copied to the host on a side stream
(:mod:`cbteach.worker.async_runner`). The limits are
cbteach's, not V1's: ``kv="paged"``, no speculative decoding (V1 runs it, with placeholder guesses
its worker fills in), no swap preemption (V0's), and not under ``torchrun``.

When step N fails, the worker runs N's requests again one at a time, each from its own state and N's
inputs (plan N+1 may have changed the batch's rows already), so nobody is failed with the request the
model failed on; then it prepares N+1 again, and a request planned in N+1 on blocks N never wrote
computes them itself.

Each step's record keeps when the host and the model worked (``StepRecord.timings``): notebook 09
draws both timelines from them.
"""
from __future__ import annotations

import time


def check_async_options(config) -> None:
    """Refuse what async scheduling cannot run exactly (before anything starts)."""
    if config.cache.kind != "paged":
        raise ValueError("async_scheduling needs kv='paged' (the concatenating cache copies every sequence's K/V "
                         "around the forward pass, which can then not overlap the next step's planning)")
    if config.speculative is not None:
        raise ValueError("async_scheduling and speculative decoding do not go together here (V1 runs them together, "
                         "with placeholder guesses its worker fills in; cbteach drafts on the host from known tokens)")
    if config.scheduler.preemption == "swap":
        raise ValueError("async_scheduling preempts by recompute only (swap is V0's; its host copies would race the "
                         "forward pass in flight)")


class AsyncStepper:
    """The engine's step loop with one step always in flight in the executor (see the module)."""

    def __init__(self, engine):
        check_async_options(engine.config)
        self.engine = engine
        self.executor = engine.executor
        self.flight = None  # the step in flight: (PlannedStep, sequences that get a token from it)

    @property
    def in_flight(self) -> bool:
        return self.flight is not None

    def step(self):
        """Plan the next step while the one in flight runs, send it, and update from the one that ran;
        returns that one's record (or, with nothing in flight and nothing to run, an idle record)."""
        e = self.engine
        if self.flight is None:  # the first step, or after idling: launch one, then go on as usual
            planned = self._schedule()
            self._send(planned)
            if self.flight is None:
                return e.end_record(planned.record)
        done = self.flight
        planned = self._schedule()  # while done's forward runs
        output = self._send(planned)  # done's output; planned is in flight now (if it runs anything)
        self.apply_output(done, output)
        finished = e.end_record(done[0].record)
        if self.flight is None and planned.plan.preempted_req_ids:
            e.end_record(planned.record)  # a step that only preempted goes into the history too
        return finished

    def drain(self) -> None:
        """Finish the step in flight and update from it, launching nothing (before an abort or close)."""
        if self.flight is not None:
            done, self.flight = self.flight, None
            self.apply_output(done, self.executor.drain())
            self.engine.end_record(done[0].record)

    def drain_if_scheduled(self, request_ids) -> None:
        """Drain the step in flight if it schedules any of ``request_ids`` (before those ids can be reused)."""
        if self.flight is not None and any(r in self.flight[0].plan.num_scheduled_tokens for r in request_ids):
            self.drain()

    def close(self) -> None:
        self.drain()

    # -- internals ---------------------------------------------------------------------------
    def _schedule(self):
        e = self.engine
        start, t0 = e.now(), time.perf_counter()
        planned = e.begin_step(e.scheduler.schedule(start), start)
        planned.record.timings["schedule"] = (t0, time.perf_counter())
        return planned

    def _send(self, planned):
        """Hand ``planned`` to the executor (it launches it if it runs anything, else the worker only
        reads the message); the output of the step that was in flight, or ``None``."""
        expecting = self._mark_placeholders(planned) if planned.plan.num_scheduled_tokens else []
        output = self.executor.execute_model(planned.plan, non_block=True) \
            if planned.plan.num_scheduled_tokens or not planned.plan.is_empty or self.flight is not None else None
        self.flight = (planned, expecting) if planned.plan.num_scheduled_tokens else None
        return output

    def _mark_placeholders(self, planned) -> list:
        """Sequences that will get a token from this step (they reach the end of their known tokens):
        the next plan may schedule that token before it exists."""
        starts = planned.plan.num_computed_tokens_of()
        expecting = [s for s, n in zip(planned.seqs, planned.plan.num_scheduled_tokens.values())
                     if starts[s.request_id] + n >= s.num_tokens_with_placeholders]
        for s in expecting:
            s.num_placeholders += 1
        return expecting

    def apply_output(self, flight, output) -> None:
        planned, expecting = flight
        t0 = time.perf_counter()
        if output.forward_span is not None:
            planned.record.timings["forward"] = output.forward_span
        self.engine.advance_clock(planned.plan, output.forward_time)
        for s in expecting:
            s.num_placeholders -= 1
        self.engine.apply_output(planned, output)
        planned.record.timings["update"] = (t0, time.perf_counter())
