"""Who runs the forward pass: one process, or several sharing the model (tensor parallelism).

The engine only ever calls ``runner.execute(plan) -> RunnerOutput`` and, when it closes,
``runner.close()`` -- vLLM V1 calls the same seam an *executor* (``UniProcExecutor``,
``MultiprocExecutor``). With ``tensor_parallel_size=1`` that is the
:class:`~cbteach.engine.model_runner.ModelRunner` in this process; with more, the model's layers are
split over worker processes that each run their shard (:mod:`cbteach.parallel`), while the scheduler
and the KV manager stay here, in one place.
"""
from __future__ import annotations

from .model_runner import ModelRunner


def make_runner(model, view, info, kv_cache, config):
    """The runner for ``config``: ``view`` is the engine's own view of ``model`` (one process)."""
    if config.tensor_parallel_size == 1:
        return ModelRunner(view, info, kv_cache)
    from ..parallel.tp import TensorParallelRunner  # its workers start here: errors before any process starts

    return TensorParallelRunner(model, info, kv_cache, config)
