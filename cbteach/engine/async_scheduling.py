"""Async scheduling: plan step N+1 while step N's forward pass runs (vLLM V1's ``async_scheduling``).

In the synchronous engine the CPU and the model take turns: schedule, *then* forward, *then*
update, *then* schedule again -- the model idles while the host plans and books. On a GPU the host
work is a fixed cost per step (a few milliseconds in Python) that a fast forward pass makes large;
vLLM V1 hides it by overlapping it with the forward pass. Here the forward pass and the sampling run
in a worker thread (PyTorch releases the interpreter lock inside its kernels), and one
:meth:`AsyncStepper.step` does::

    plan N+1      (host; step N's forward and sampling are running)
    wait for N    its sampled tokens are ready -- on the device
    launch N+1    the worker applies plan N+1 to its batch; N+1's decodes read N's tokens straight
                  from the device tensor (the worker's ``prev``: V1's ``prev_sampled_token_ids``)
    finish N      copy N's tokens to the host, into the worker's batch and out to the scheduler
    update N      (host; step N+1's forward is running all the while)

Two consequences, both as in vLLM V1. The scheduler plans N+1 before N's tokens exist: a sequence
that will get a token from N has a **placeholder** for it (``Sequence.num_placeholders``), so N+1
schedules its decode of that token. And a sequence that stops at N (EOS) may already be in N+1: its
N+1 work is wasted and its N+1 output dropped (one step of one sequence's compute). A request
preempted while its step is in flight keeps the token that step gives it -- as the synchronous
engine, which appends it before it preempts; a prompt whose samples were to fork from it (V0's
fork) hands them their first tokens, and with its blocks gone they compute the prompt again.
Tokens are the same as the synchronous engine's.

What is the same as vLLM V1 (``vllm/v1/core/sched/async_scheduler.py``, ``vllm/v1/engine/core.py``,
``vllm/v1/worker/gpu_model_runner.py``): placeholders on the scheduler's side, and the worker feeding
the last step's tokens from the device. What is not: V1's ``step_with_batch_queue`` launches N+1
before it waits on N; here the worker applies plan N+1 and prepares its inputs only after N's forward
and sampling have finished, so the model idles while the host does that. V1 copies N's tokens to the
host on a side CUDA stream and waits on an event; here ``finish`` copies them on the default stream
after N+1 is queued (on a GPU that copy would wait for N+1's forward). V1's worker runs in its own
process (or thread); here one thread runs the forward pass and the sampling, and this stepper drives
the runner directly rather than through the executor. The limits are cbteach's, not V1's: ``kv="paged"``, no
speculative decoding (V1 runs it, with placeholder guesses its worker fills in), no swap preemption
(V0's), one process (V1 runs async scheduling with its multiprocess executor and tensor parallelism).

When step N fails, the worker runs N's requests again one at a time from its own batch -- which plan
N+1 has not touched yet: it is applied only when N+1 launches -- so nobody is failed with the request
the model failed on; a request planned in N+1 on blocks N never wrote computes them itself.

Each step's record keeps when the host and the model worked (``StepRecord.timings``): notebook 09
draws both timelines from them.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor


def check_async_options(config, executor) -> None:
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
    runner = getattr(executor, "runner", None)
    if not all(callable(getattr(runner, m, None)) for m in ("prepare_inputs", "forward", "sample", "finish")):
        raise ValueError("async_scheduling needs a model runner in this process here (tensor_parallel_size=1; V1 also "
                         "runs it with tensor parallelism)")


class AsyncStepper:
    """The engine's step loop with one forward pass always in flight (see the module)."""

    def __init__(self, engine):
        check_async_options(engine.config, engine.executor)
        self.engine = engine
        self.runner = engine.executor.runner
        self.runner.feed_from_device = True  # the next step reads this step's tokens on the device
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbteach-forward")  # the "device"
        self.flight = None  # the step in flight: plan, record, the worker's step, future, who gets a token

    @property
    def in_flight(self) -> bool:
        return self.flight is not None

    def step(self):
        """Plan the next step while the one in flight runs, wait for that one, launch the next, finish and
        update from the one that ran; returns its record (or, with nothing to run, an idle record)."""
        e = self.engine
        if self.flight is None:  # the first step, or after idling: launch one, then go on as usual
            planned = self._schedule()
            if not planned.plan.num_scheduled_tokens:
                self._tell_worker(planned.plan)
                return e.end_record(planned.record)
            self._launch(planned, self._mark_placeholders(planned))
        done = self.flight
        planned = self._schedule()  # while done's forward runs
        expecting = self._mark_placeholders(planned)
        recovered = self._wait(done)  # its tokens are on the device: the next step reads them there
        self.flight = None
        if planned.plan.num_scheduled_tokens:
            self._launch(planned, expecting)
        else:
            self._tell_worker(planned.plan)
        output = recovered if recovered is not None else self.runner.finish(done["step"])  # while N+1's forward runs
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
            recovered = self._wait(done)
            self.apply_output(done, recovered if recovered is not None else self.runner.finish(done["step"]))
            self.engine.end_record(done["planned"].record)

    def drain_if_scheduled(self, request_ids) -> None:
        """Drain the step in flight if it schedules any of ``request_ids`` (before those ids can be reused)."""
        if self.flight is not None and any(r in self.flight["planned"].plan.num_scheduled_tokens for r in request_ids):
            self.drain()

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

    def _tell_worker(self, plan) -> None:
        if not plan.is_empty:  # nothing to run, but the worker forgets who finished
            self.runner.update_states(plan)

    def _launch(self, planned, expecting) -> None:
        """Apply the plan to the worker's batch -- only now, after the step before finished: a failure
        there is recovered from the batch as that step saw it -- and start its forward pass."""
        runner = self.runner
        runner.update_states(planned.plan)
        step = runner.prepare_inputs(planned.plan)
        t_launch = time.perf_counter()
        future = self.worker.submit(self._forward, step)
        time.sleep(0)  # give up the interpreter lock: the worker starts the forward now, not when we next wait
        self.flight = {"planned": planned, "step": step, "future": future, "expecting": expecting,
                       "launch": t_launch}

    def _forward(self, step):
        t0 = time.perf_counter()
        self.runner.forward(step)
        t1 = time.perf_counter()
        self.runner.sample(step)
        return t0, t1

    def _wait(self, flight):
        """Wait for ``flight``'s forward pass and sampling; ``None`` -- or, if the forward raised, the
        output of each row run alone (as the synchronous runner does)."""
        e, record = self.engine, flight["planned"].record
        try:
            t0, t1 = flight["future"].result()
        except Exception as err:  # noqa: BLE001  (isolate: find whose tokens failed)
            record.timings["forward"] = (flight["launch"], time.perf_counter())
            return self.runner.recover(flight["step"], err)
        record.timings["forward"] = (t0, t1)
        e.advance_clock(flight["planned"].plan, t1 - t0)
        return None

    def apply_output(self, flight, output) -> None:
        t0 = time.perf_counter()
        for s in flight["expecting"]:
            s.num_placeholders -= 1
        self.engine.apply_output(flight["planned"], output)
        flight["planned"].record.timings["update"] = (t0, time.perf_counter())
