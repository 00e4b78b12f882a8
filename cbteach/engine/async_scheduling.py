"""Async scheduling: plan step N+1 while step N's forward pass runs (vLLM V1's ``async_scheduling``).

In the synchronous engine the CPU and the model take turns: schedule, *then* forward, *then*
update, *then* schedule again -- the model idles while the host plans and books. On a GPU the host
work is a fixed cost per step (a few milliseconds in Python) that a fast forward pass makes large;
vLLM V1 hides it by overlapping it with the forward pass. Here the forward runs in a worker thread
(PyTorch releases the interpreter lock inside its kernels), and one :meth:`AsyncStepper.step` does::

    plan N+1      (host; step N's forward is running)
    wait for N    then sample N's tokens (host)
    launch N+1    its inputs need N's sampled tokens: the decodes of N+1 feed them
    update N      (host; step N+1's forward is running)

Two consequences, both as in vLLM V1. The scheduler plans N+1 before N's tokens exist: a sequence
that will get a token from N has a **placeholder** for it (``Sequence.num_placeholders``), so N+1
schedules its decode of that token. And a sequence that stops at N (EOS) may already be in N+1: its
N+1 work is wasted and its N+1 output dropped (one step of one sequence's compute). A request
preempted while its step is in flight keeps the token that step gives it -- as the synchronous
engine, which appends it before it preempts. Tokens are the same as the synchronous engine's.

What is the same as vLLM V1 (``vllm/v1/core/sched/async_scheduler.py``, ``vllm/v1/engine/core.py``):
the scheduler plans step N+1 before N's tokens exist, counting a placeholder for each
(``num_output_placeholders`` there), and the runner -- which keeps its own batch and appended step N's
tokens itself (:mod:`cbteach.engine.input_batch`) -- feeds them to N+1. What is not: V1 keeps the
sampled tokens on the device and prepares N+1's inputs without waiting for the host (its GPU runner's
``prev_sampled_token_ids``); here sampling happens on the host between the two forward passes, so
only planning and the update are hidden. The limits are cbteach's, not V1's: ``kv="paged"``, no
speculative decoding (V1 runs it, with placeholder guesses the worker fills in), no swap preemption
(V0's), one process (V1 runs async scheduling with its multiprocess executor and tensor parallelism).

When step N fails, the runner runs N's requests again one at a time from its own batch -- which plan
N+1 has not touched yet: it is applied only when N+1 launches -- so nobody is failed with the request
the model failed on; a request planned in N+1 on blocks N never wrote computes them itself.

Each step's record keeps when the host and the model worked (``StepRecord.timings``): notebook 09
draws both timelines from them.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor


def check_async_options(config, runner) -> None:
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
    if not all(callable(getattr(runner, m, None)) for m in ("prepare", "forward", "finish")):
        raise ValueError("async_scheduling needs a model runner in this process here (tensor_parallel_size=1; V1 also "
                         "runs it with tensor parallelism)")


class AsyncStepper:
    """The engine's step loop with one forward pass always in flight (see the module)."""

    def __init__(self, engine):
        check_async_options(engine.config, engine.runner)
        self.engine = engine
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbteach-forward")  # the "device"
        self.flight = None  # the step in flight: plan, record, prepared inputs, future, who gets a token

    @property
    def in_flight(self) -> bool:
        return self.flight is not None

    def step(self):
        """Plan the next step while the one in flight runs, finish that one, launch the next, update from
        the finished one; returns the finished step's record (or, with nothing to run, an idle record)."""
        e = self.engine
        if self.flight is None:  # the first step, or after idling: launch one, then go on as usual
            planned = self._schedule()
            if not planned.plan.num_scheduled_tokens:
                self._forget_finished(planned.plan)
                return e.end_record(planned.record)
            self._launch(planned, self._mark_placeholders(planned))
        done = self.flight
        planned = self._schedule()  # while done's forward runs
        expecting = self._mark_placeholders(planned)
        output = self._wait(done)  # its sampled tokens join the runner's batch: the next step feeds them
        self.flight = None
        if planned.plan.num_scheduled_tokens:
            self._launch(planned, expecting)
        else:
            self._forget_finished(planned.plan)
        self.apply_output(done, output)
        finished = e.end_record(done["planned"].record)
        if not planned.plan.num_scheduled_tokens and planned.plan.preempted_req_ids:
            e.end_record(planned.record)  # a step that only preempted goes into the history too
        return finished

    def _schedule(self):
        e = self.engine
        start, t0 = e.now(), time.perf_counter()
        planned = e.begin_step(e.scheduler.schedule(start), start)
        planned.record.timings["schedule"] = (t0, time.perf_counter())
        return planned

    def drain(self) -> None:
        """Finish the step in flight and update from it, launching nothing (before an abort or close)."""
        if self.flight is not None:
            done, self.flight = self.flight, None
            self.apply_output(done, self._wait(done))
            self.engine.end_record(done["planned"].record)

    def close(self) -> None:
        self.drain()
        self.worker.shutdown(wait=True)

    # -- internals ---------------------------------------------------------------------------
    def _mark_placeholders(self, planned) -> list:
        """Sequences that will get a token from this step (they reach the end of their known tokens):
        the next plan may schedule that token before it exists."""
        starts = planned.plan.num_computed_tokens_of()
        expecting = [s for s, n in zip(planned.seqs, planned.plan.num_scheduled_tokens.values())
                     if starts[s.request_id] + n >= s.num_tokens + s.num_placeholders]
        for s in expecting:
            s.num_placeholders += 1
        return expecting

    def _forget_finished(self, plan) -> None:
        if plan.finished_req_ids:  # nothing to run, but the runner forgets who finished
            self.engine.runner.update_states(plan)

    def _launch(self, planned, expecting) -> None:
        """Apply the plan to the runner's batch -- only now, after the step before finished: a failure
        there is recovered from the batch as that step saw it -- and start its forward pass."""
        runner = self.engine.runner
        prepared = runner.prepare(runner.update_states(planned.plan))
        t_launch = time.perf_counter()
        future = self.worker.submit(self._forward, prepared)
        time.sleep(0)  # give up the interpreter lock: the worker starts the forward now, not when we next wait
        self.flight = {"planned": planned, "prepared": prepared, "future": future, "expecting": expecting,
                       "launch": t_launch}

    def _forward(self, prepared):
        t0 = time.perf_counter()
        self.engine.runner.forward(prepared)
        return t0, time.perf_counter()

    def _wait(self, flight):
        """Step ``flight``'s output: its forward's result, sampled (or, if the forward raised, each
        row run alone, as the synchronous runner does)."""
        e, record = self.engine, flight["planned"].record
        try:
            t0, t1 = flight["future"].result()
        except Exception as err:  # noqa: BLE001  (isolate: find whose tokens failed)
            record.timings["forward"] = (flight["launch"], time.perf_counter())
            return e.runner.recover(flight["prepared"]["rows"], err)
        record.timings["forward"] = (t0, t1)
        e.advance_clock(flight["planned"].plan, t1 - t0)
        return e.runner.finish(flight["prepared"])

    def apply_output(self, flight, output) -> None:
        t0 = time.perf_counter()
        for s in flight["expecting"]:
            s.num_placeholders -= 1
        self.engine.apply_output(flight["planned"], output)
        flight["planned"].record.timings["update"] = (t0, time.perf_counter())
