"""The worker: everything on the model's side of the scheduler's message (vLLM V1's ``vllm/v1/worker/``).

* :mod:`~cbteach.worker.input_batch` -- the persistent batch: a row per scheduled request, in
  preallocated arrays, the rows' block tables one tensor;
* :mod:`~cbteach.worker.model_runner` -- a step: the message changes the batch (V1's ``_update_states``),
  inputs from the rows, the model once, tokens on the device, then on the host;
* :mod:`~cbteach.worker.worker` -- a tensor-parallel rank: its shard, its pool, its own runner.

Beside them, each variant's runner (:mod:`~cbteach.worker.variants` mixes in the ones an engine needs):
speculative guesses (``spec_runner``), V0's swaps and forks (``swap_runner``, ``fork_runner``), async
scheduling's order (``async_runner``), and a failed step's rows run alone (``recovery``).

The worker sits below the engine: it imports the core's data, the KV cache and attention, never the
scheduler. The engine reaches it only through an executor (:mod:`cbteach.executor`).
"""
