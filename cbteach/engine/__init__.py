"""The engine: what drives a step, above the KV cache and the core's data.

* :mod:`~cbteach.engine.policies` -- waiting queues: admission order and preemption victims;
* :mod:`~cbteach.engine.scheduler` -- ``schedule()`` and ``update_from_output()``;
* :mod:`~cbteach.engine.engine_core` -- the step: schedule, the executor runs it, update;
* :mod:`~cbteach.engine.engine` -- the three calls of a step, and the public API around them;
* :mod:`~cbteach.engine.streaming` -- one event per generated token;
* :mod:`~cbteach.engine.static` -- static batching, the baseline;
* :mod:`~cbteach.engine.speculative` -- guesses proposed, verified in the packed step.

It imports :mod:`cbteach.core`, :mod:`cbteach.kv`, :mod:`cbteach.attention` and -- for the worker's
side of a step -- :mod:`cbteach.executor`; nothing here imports serving, benchmarks or pictures (see
:mod:`cbteach.core` for the layers).
"""
