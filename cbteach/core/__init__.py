"""The engine core: what runs a step, and nothing else.

* :mod:`~cbteach.core.request` -- requests in, completions out, a sequence's live state;
* :mod:`~cbteach.core.sampling` -- choosing a token and deciding when a request stops;
* :mod:`~cbteach.core.config` -- the engine's options, validated once;
* :mod:`~cbteach.core.policies` -- waiting queues: admission order and preemption victims;
* :mod:`~cbteach.core.scheduler` -- ``schedule()`` and ``update_from_output()``;
* :mod:`~cbteach.core.model_runner` -- ``execute()``: pack, run the model once, sample;
* :mod:`~cbteach.core.engine` -- the three calls of a step, and the public API around them;
* :mod:`~cbteach.core.static` -- static batching, the baseline;
* :mod:`~cbteach.core.records` and :mod:`~cbteach.core.speculative`.

The KV caches (:mod:`cbteach.kv`) and attention (:mod:`cbteach.attention`) sit beside it; the tools
around it (serving, benchmarks, visualisers, exercises, the command line) only use its public API.
"""
