"""The bottom of the stack: the data every other layer passes around, and nothing that drives it.

* :mod:`~cbteach.core.request` -- requests in, completions out, a sequence's live state;
* :mod:`~cbteach.core.sampling` -- choosing a token and deciding when a request stops;
* :mod:`~cbteach.core.config` -- the engine's options, validated once;
* :mod:`~cbteach.core.scheduler_output` -- a step's two messages: the plan to the worker, its answer back;
* :mod:`~cbteach.core.records` -- what happened in a step;
* :mod:`~cbteach.core.clock` -- the engine's clock: wall time, or simulated seconds;
* :mod:`~cbteach.core.modelinfo` and :mod:`~cbteach.core.model_view` -- what a model's config says,
  and the engine's own view of the model.

The layers read bottom-up, as the data flows (vLLM V1 keeps its worker below its engine core the
same way: ``v1/worker/`` imports only the message types of ``v1/core/sched/output.py``, never the
scheduler, and ``v1/executor/`` connects them):

1. :mod:`cbteach.attention`, :mod:`cbteach.perf`, :mod:`cbteach.models` -- masks, packing, paged
   attention; roofline arithmetic; loading a model;
2. :mod:`cbteach.core` -- this package;
3. :mod:`cbteach.kv` -- the KV cache: manager, pool, paged and concatenating caches;
4. :mod:`cbteach.parallel` -- shards, process groups and pipes for tensor parallelism;
5. :mod:`cbteach.worker` -- the model runner, its persistent batch and sampler, a tensor-parallel rank;
6. :mod:`cbteach.executor` -- one worker in this process, or N worker processes;
7. :mod:`cbteach.engine` -- the scheduler and the engine core that steps it;
8. :mod:`cbteach.serving`, :mod:`cbteach.sim` -- the HTTP server, workloads, metrics; the simulator;
9. :mod:`cbteach.bench`, :mod:`cbteach.viz` -- measurements and pictures;
10. :mod:`cbteach.exercises` and the command line -- what the notebooks call.

A module imports only from its own floor or below (``tests/test_layering.py`` checks).
"""
