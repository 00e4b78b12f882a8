"""The bottom of the stack: the data every other layer passes around, and nothing that drives it.

* :mod:`~cbteach.core.request` -- requests in, completions out, a sequence's live state;
* :mod:`~cbteach.core.sampling` -- choosing a token and deciding when a request stops;
* :mod:`~cbteach.core.config` -- the engine's options, validated once;
* :mod:`~cbteach.core.scheduler_output` -- one step's plan, from the scheduler to the model runner;
* :mod:`~cbteach.core.records` -- what happened in a step;
* :mod:`~cbteach.core.clock` -- the engine's clock: wall time, or simulated seconds;
* :mod:`~cbteach.core.modelinfo` and :mod:`~cbteach.core.model_view` -- what a model's config says,
  and the engine's own view of the model.

The layers read bottom-up, as the data flows (vLLM V1 keeps the same order: ``v1/request.py``,
then ``v1/core/`` for the KV cache manager and scheduler, then ``v1/engine/`` and ``v1/worker/``):

1. :mod:`cbteach.attention`, :mod:`cbteach.perf`, :mod:`cbteach.models` -- masks, packing, paged
   attention; roofline arithmetic; loading a model;
2. :mod:`cbteach.core` -- this package;
3. :mod:`cbteach.kv` -- the KV cache: manager, pool, paged and concatenating caches;
4. :mod:`cbteach.engine` -- the scheduler, the model runner and the engine that steps them;
5. :mod:`cbteach.serving` -- streams of requests: the HTTP server, workloads, metrics;
6. :mod:`cbteach.bench`, :mod:`cbteach.viz` -- measurements and pictures;
7. :mod:`cbteach.exercises` and the command line -- what the notebooks call.

A module imports only from its own floor or below (``tests/test_layering.py`` checks).
"""
