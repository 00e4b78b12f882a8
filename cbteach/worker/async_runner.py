"""The worker's side of async scheduling: one step always in flight on a "device" thread.

vLLM V1's engine core, under async scheduling, hands step N+1 to its executor before it waits for
step N's output (``step_with_batch_queue`` in ``vllm/v1/engine/core.py``); the worker runs the
messages in order and keeps the last step's sampled tokens on the device for the next one. Here
:class:`AsyncModelRunner` wraps a :class:`~cbteach.worker.model_runner.ModelRunner` the same way,
in every process that runs one (the engine's, or each tensor-parallel rank's). One call,
``execute_model(msg)``, does::

    wait for N     its forward pass and sampling (on the device thread) are done; a forward that
                   raised is run again one request at a time (cbteach's recovery)
    launch N+1     the message changes the batch, the inputs are read from its rows -- a decode of a
                   token N sampled reads it from N's device tensor -- and the forward pass and the
                   sampling start on the device thread
    finish N       N's tokens come to the host and join the rows and the states, while N+1's forward
                   pass runs; N's output is returned

so the caller gets the output of the step *before* the one it sent (``None`` when none was in flight),
and :meth:`drain` finishes the last one. On the CPU the device thread is a thread: PyTorch releases
the interpreter lock inside its kernels, so host work overlaps the forward pass.

Not V1's order yet: V1's worker prepares N+1 (``_update_states``, ``_prepare_inputs``) while N is
still on the device; here N+1 is applied and prepared after N's forward and sampling have finished,
and the model idles meanwhile. And V1 copies N's tokens on a side CUDA stream and waits on an
event; here ``finish`` copies them on the default stream (on a GPU it would wait for N+1's forward).
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from ..core.outputs import RunnerOutput


class AsyncModelRunner:
    """``runner``, with the step it was last sent still running while the caller plans the next (see the module)."""

    def __init__(self, runner):
        self.runner = runner
        runner.feed = self._feed  # the next step reads this step's tokens on the device
        self.device = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbteach-forward")
        self.flight = None  # the step on the device: (Step, future, launch time)
        self.prev = None  # the last step's sampled tokens on the device, and {request id: index} (V1's prev_sampled_token_ids)

    def execute_model(self, msg) -> RunnerOutput | None:
        """Apply ``msg``, launch its step (if it schedules any tokens); the output of the step in flight
        before it, or ``None``."""
        done = self._wait()
        self.runner.update_states(msg)
        if msg.total_num_scheduled_tokens:
            step = self.runner.prepare_inputs(msg)
            self.flight = (step, self.device.submit(self._forward, step), time.perf_counter())
            time.sleep(0)  # give up the interpreter lock: the device thread starts now, not at our next wait
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
    def _forward(self, step):
        t0 = time.perf_counter()
        self.runner.forward(step)
        t1 = time.perf_counter()
        self.runner.sample(step)
        self.prev = (step.sampled.tokens, {rid: i for i, rid in enumerate(step.req_ids) if step.samples[i]})
        return t0, t1

    def _feed(self, step) -> None:
        """A step prepared before the last one's tokens reached the host feeds them from the device."""
        fed = [(at, self.prev[1][rid]) for at, rid, _ in step.pending if self.prev is not None and rid in self.prev[1]]
        if fed:
            at, src = torch.tensor(fed, device=step.meta.input_ids.device).T
            step.meta.input_ids[0, at] = self.prev[0][src]

    def _wait(self):
        """Wait for the step in flight; a function that finishes it (its tokens to the host), or ``None``."""
        if self.flight is None:
            return None
        (step, future, launched), self.flight = self.flight, None
        try:
            t0, t1 = future.result()
        except Exception as err:  # noqa: BLE001  (isolate: find whose tokens failed)
            output = self.runner.recover(step, err)  # (errors that stop the engine re-raise from here)
            output.forward_span = (launched, time.perf_counter())
            tokens = [(s or [0])[-1] for s in output.sampled]  # the next step reads them as if one pass had sampled them
            self.prev = (torch.tensor(tokens, device=self.runner.device), {rid: i for i, rid in enumerate(step.req_ids)})
            return lambda: output

        def finish() -> RunnerOutput:
            output = self.runner.finish(step)
            output.forward_span = (t0, t1)
            return output
        return finish
