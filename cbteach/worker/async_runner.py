"""The worker's side of async scheduling: one step always in flight on a "device" thread.

vLLM V1's engine core, under async scheduling, hands step N+1 to its executor before it waits for
step N's output (``step_with_batch_queue`` in ``vllm/v1/engine/core.py``); its worker prepares N+1
while N is still on the device and keeps N's sampled tokens there for N+1's decodes. Here
:class:`AsyncModelRunner` wraps a :class:`~cbteach.worker.model_runner.ModelRunner` the same way, in
every process that runs one (the engine's, or each tensor-parallel rank's). One call,
``execute_model(msg)``, does::

    prepare N+1    the message changes the batch and N+1's inputs are read from its rows, while N's
                   forward pass and sampling run on the device thread; a decode of the token N is
                   sampling is *pending* (fed as 0 for now)
    queue N+1      on the device thread, behind N: once N has sampled, the pending tokens are copied
                   from N's device tensor into N+1's input ids (V1's ``prev_sampled_token_ids``) and
                   N+1's forward pass and sampling start -- without waiting for this thread, as a GPU
                   runs the kernels queued on its stream
    wait for N     until N+1 has started (or, when N raised, has seen it and not run): N's tokens exist
                   on the device. A forward that raised is run again one request at a time (cbteach's
                   recovery), and then N+1 is prepared again (N may have left blocks unwritten that N+1
                   reads) and queued again. So is one whose logits were not finite for some row when N
                   had several: a neighbour's NaN may have reached a row (see :func:`recovery.note_rows`),
                   so N+1 does not run until N's rows are sorted out -- which the device thread learns by
                   reading N's largest logits back (a wait for N on a GPU; ours, V1 has no such rule)
    finish N       N's tokens come to the host and join the rows and the states, while N+1's forward
                   pass runs; N's output is returned

so the caller gets the output of the step *before* the one it sent (``None`` when none was in flight),
and :meth:`drain` finishes the last one. Preparing N+1 may change the batch's rows while N samples, so
a step takes what sampling reads (each row's parameters and generator) when it is prepared. Block
copies inside the pool (V0's copy on write) would race the forward pass in flight: a message that
carries some waits for N first. On the CPU the device thread is a thread: PyTorch releases the
interpreter lock inside its kernels, so host work overlaps the forward pass -- where the lock allows.
This thread waits for N+1's *start*, not for N's end, so that it does not take the lock from the
device thread between N and N+1.

On CUDA, N's tokens would come to the host on the default stream *behind* N+1's kernels, queued there
meanwhile: finishing N would wait for N+1's forward pass. So, as V1 does (``AsyncGPUModelRunnerOutput``
in ``vllm/v1/worker/gpu_model_runner.py``), the copy starts on a side stream as soon as N has sampled,
and finishing N waits on that copy's event alone (:func:`copy_beside`). On the CPU and Apple's MPS there
is one stream: the copy is made when N is finished. Not V1's yet: N+1's inputs go to the device in one
ordinary copy (:func:`~cbteach.attention.metadata.build`), which on CUDA waits for the kernels queued
before it -- N's -- where V1 copies from pinned buffers without blocking (``CpuGpuBuffer.copy_to_gpu`` in
``vllm/v1/utils.py``).
"""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..core.scheduler_output import RunnerOutput
from . import recovery
from .model_runner import DeviceSample


class Flight(NamedTuple):
    """A step handed to the device thread."""

    step: object  # the Step
    future: object  # its (forward start, forward end, holds the step after), or what it raised
    launched: float  # when it was queued (time.perf_counter)
    started: threading.Event  # set once its forward pass starts (or it will not run: the step before raised)
    rows: dict  # {request id: row} of its rows that sample a token (found here, not on the device thread)


class AsyncModelRunner:
    """``runner``, with the step it was last sent still running while the caller plans the next (see the module)."""

    def __init__(self, runner):
        self.runner = runner
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbteach-forward")
        self.flight: Flight | None = None  # the step on the device
        self.prev = None  # the last step's sampled tokens on the device, and {request id: index} (V1's prev_sampled_token_ids)
        self.recovered = False  # the last step waited for failed and was run again a request at a time
        self.broken = False  # a step on the device raised: the one queued behind it does not run
        self.held = False  # ... or its logits were not finite for a row of several: nor does it
        self.copy_stream = torch.cuda.Stream(runner.device) if runner.device.type == "cuda" else None

    def execute_model(self, msg) -> RunnerOutput | None:
        """Apply ``msg`` and prepare its step while the step in flight runs, queue it behind that one (if it
        schedules any tokens), then wait for that one; the output of the step in flight before, or ``None``."""
        done = self._wait() if self.runner.changes_pool_first(msg) else None  # (not beside a forward pass)
        self.runner.update_states(msg)
        step, pending = self._prepare(msg) if msg.total_num_scheduled_tokens else (None, None)
        queued = self._launch(step, pending) if step is not None else None
        if done is None:
            done = self._wait(behind=queued)
            if self.recovered and queued is not None:  # N failed for someone and N+1 did not run: blocks
                step, pending = self._prepare(msg, first=step)  # N was to fill may be read by N+1 -- again
                queued = self._launch(step, pending)
        self.flight = queued
        return done() if done is not None else None

    def drain(self) -> RunnerOutput | None:
        """Finish the step in flight, launching nothing; its output, or ``None``."""
        done = self._wait()
        return done() if done is not None else None

    def close(self) -> None:
        self.drain()
        self.device.shutdown(wait=True)
        self.runner.close()

    def generator_state(self, req_id) -> bytes | None:
        return self.runner.generator_state(req_id)

    # -- internals ---------------------------------------------------------------------------
    def _launch(self, step, pending) -> Flight:
        """Queue ``step`` on the device thread, behind the step in flight (if any); its flight."""
        started, rows = threading.Event(), sampled_rows(step)
        future = self.device.submit(self._forward, step, pending, started, rows)
        return Flight(step, future, time.perf_counter(), started, rows)

    def _forward(self, step, pending, started, rows):
        """On the device thread: feed ``step`` the tokens of the step before, run and sample it; keep its
        sampled tokens, and ``rows`` (whose they are), for the step after. Returns its forward pass's span
        and whether it holds the step after (read from here: by the time this thread is waited for, the
        step after may have set ``self.held`` for itself)."""
        try:
            if self.broken or self.held:  # the step before raised or may have spread a NaN: this one is
                return None               # prepared again after that one's rows are sorted out
            self.feed(step, pending)
            started.set()
            t0 = time.perf_counter()
            self.runner.forward(step)
            t1 = time.perf_counter()
            self.runner.sample(step)
            self.held = held = len(step.rows) > 1 and not bool(step.sampled.finite.all())
            if self.copy_stream is not None:
                step.sampled = copy_beside(step.sampled, self.copy_stream)
        except BaseException:
            self.broken = True
            raise
        finally:
            started.set()
        self.prev = (step.sampled.tokens, rows)
        return t0, t1, held

    def _prepare(self, msg, first=None) -> tuple:
        """The step's inputs (prepared again after ``first``, if given), and where its *pending* tokens
        come from: fed positions past what the host knows -- the token the step before samples for the
        request, or, if that step failed for it, none. Each is fed as 0 until :meth:`feed`; returns
        ``(step, pending)``, ``pending`` two tensors of ``k``: packed positions, and the rows of the step
        before's sampled tokens that go there (``None``: none) -- found here, while that step runs."""
        step = self.runner.prepare_inputs(msg) if first is None else self.runner.prepare_again(msg, first)
        known = self.runner.input_batch.num_tokens[step.rows]
        if not np.any(np.add(step.starts, step.counts) > known):
            return step, None
        pending, at = [], 0
        for rid, start, count, end in zip(step.req_ids, step.starts, step.counts, known.tolist()):
            pending += [(at + p - start, rid) for p in range(max(start, end), start + count)]
            at += count
        device = step.meta.input_ids.device
        where = [a for a, _ in pending]
        step.input_ids[where] = 0
        step.meta.input_ids[0, torch.tensor(where, device=device)] = 0
        # The rows of the tokens the step before samples: the step in flight's, or after it was waited
        # for (and maybe run again a request at a time), those it left in self.prev.
        rows = self.flight.rows if self.flight is not None else self.prev[1] if self.prev else {}
        fed = [(a, rows[rid]) for a, rid in pending if rid in rows]
        return step, (tuple(torch.tensor(x, device=device) for x in zip(*fed)) if fed else None)

    def feed(self, step, pending) -> None:
        """A step's pending tokens -- sampled by the step before, not on the host yet -- read from the device
        (``pending``: from :meth:`_prepare`)."""
        if pending is not None:
            at, src = pending
            step.meta.input_ids[0, at] = self.prev[0][src]

    def _wait(self, behind: Flight | None = None):
        """Wait for the step in flight -- if ``behind`` (the step queued after it), until that one has
        started; a function that finishes the step (its tokens to the host), or ``None``."""
        self.recovered = False
        if self.flight is None:
            return None
        (step, future, launched, _, _), self.flight = self.flight, None
        if behind is not None:
            behind.started.wait()  # (it has started, so this one has sampled; or it saw this one raise)
        try:
            t0, t1, held = future.result()
        except Exception as err:  # noqa: BLE001  (isolate: find whose tokens failed)
            if behind is not None:
                behind.future.result()  # (it saw the failure and did not run)
            self.broken = False
            output = recovery.recover(self.runner, step, err)  # (errors that stop the engine re-raise from here)
            output.forward_span = (launched, time.perf_counter())
            self._recovered(output, step)
            return lambda: output

        def finish() -> RunnerOutput:
            output = self.runner.finish(step)
            output.forward_span = (t0, t1)
            return output
        if not held:  # (this step's own: ``self.held`` may be the step behind's by now)
            return finish
        self.held = False  # (the step behind saw it and did not run)
        if behind is not None:
            behind.future.result()  # (it saw the hold and did not run)
        output = finish()  # rows hit by a neighbour's NaN run again alone, now no step has read their tokens
        self._recovered(output, step)
        return lambda: output

    def _recovered(self, output: RunnerOutput, step) -> None:
        """``step``'s rows were run again: the step after it reads their tokens from ``output``, on the host."""
        tokens = [(s or [0])[-1] for s in output.sampled]  # the next step reads them as if one pass had sampled them
        self.prev = (torch.tensor(tokens, device=self.runner.device), {rid: i for i, rid in enumerate(step.req_ids)})
        self.recovered = True


def sampled_rows(step) -> dict:
    """``{request id: row}`` of the rows of ``step`` that sample a token."""
    return {rid: i for i, (rid, s) in enumerate(zip(step.req_ids, step.samples)) if s}


@dataclass
class CopiedSample(DeviceSample):
    """A step's sampled tokens (still on the device, for the next step's feed) with their copy to the host
    under way on a side stream: reading them waits for that copy only."""

    host: tuple = ()  # (tokens, top) in host memory (pinned), written by the copy
    ready: object = None  # a torch.cuda.Event recorded on the side stream after the copy

    def to_host(self) -> tuple[list, list]:
        self.ready.synchronize()
        tokens, top = self.host
        return tokens.tolist(), [math.isfinite(x) for x in top.tolist()]


def copy_beside(sampled: DeviceSample, stream) -> CopiedSample:
    """Start ``sampled``'s device -> host copy on ``stream`` (a ``torch.cuda.Stream``), after what the
    current stream has queued so far: the sampling, not what is queued after it."""
    stream.wait_stream(torch.cuda.current_stream(sampled.tokens.device))
    with torch.cuda.stream(stream):
        host = (sampled.tokens.to("cpu", non_blocking=True), sampled.top.to("cpu", non_blocking=True))
        ready = torch.cuda.Event(blocking=True)
        ready.record(stream)
    # (The device tensors stay referenced here until the copy is read: their memory cannot be reused before.)
    return CopiedSample(tokens=sampled.tokens, top=sampled.top, errors=sampled.errors, host=host, ready=ready)
