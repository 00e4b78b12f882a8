"""Who runs the worker's side of a step: one worker in this process, or N worker processes.

The engine core only calls ``executor.execute_model(scheduler_output) -> RunnerOutput`` and, when it
closes, ``executor.close()`` -- vLLM V1's seam between its engine core and its workers
(``vllm/v1/executor/``: ``UniProcExecutor``, ``MultiprocExecutor``). Under async scheduling it calls
``execute_model(scheduler_output, non_block=True)``, which launches the step and returns the output of
the step launched before it, and ``drain()`` (:mod:`cbteach.engine.async_scheduling`; the workers'
side: :mod:`cbteach.worker.async_runner`) -- in one process or on every tensor-parallel rank. So V1's
three places are three folders here: the scheduler in :mod:`cbteach.engine` (the engine core), the executor here, and the
worker -- model runner, persistent batch, sampler -- in :mod:`cbteach.worker`, lowest of the three.

* :class:`~cbteach.executor.uniproc.UniProcExecutor` -- ``tensor_parallel_size=1``: one
  :class:`~cbteach.worker.model_runner.ModelRunner`, in this process;
* :class:`~cbteach.executor.multiproc.MultiprocExecutor` -- ``tensor_parallel_size=N``: N worker
  processes (:mod:`cbteach.worker.worker`), each holding a shard of the model and running every
  message; the scheduler and the KV manager stay here, in one place;
* :mod:`~cbteach.executor.torchrun` -- the same ranks, started by ``torchrun``.
"""
from __future__ import annotations

import inspect

from ..worker.async_runner import AsyncModelRunner
from ..worker.variants import runner_cls
from .uniproc import UniProcExecutor

__all__ = ["check_update_batch_signature", "make_executor", "UniProcExecutor"]


def make_executor(model, view, info, kv_cache, config, update_batch=None, swaps: bool = False, forks: bool = False,
                  spec: bool = False):
    """The executor for ``config``: ``view`` is the engine's own view of ``model`` (one process);
    ``update_batch`` a learner's own message-to-batch function (notebook 06b), one process only;
    ``swaps``: the scheduler sends V0's swaps (:mod:`cbteach.worker.swap_runner` carries them out);
    ``forks``: parallel sampling by fork (:mod:`cbteach.worker.fork_runner`); ``spec``: the scheduler sends
    speculative guesses (:mod:`cbteach.worker.spec_runner`)."""
    if update_batch is not None:
        check_update_batch_signature(update_batch)
    if config.tensor_parallel_size == 1:
        runner = runner_cls(swaps, forks, spec)(view, kv_cache, device=info.device, accepts_logits_to_keep=info.accepts_logits_to_keep,
                            max_num_reqs=config.scheduler.max_batch_size, max_model_len=info.max_positions,
                            update_batch=update_batch)
        return UniProcExecutor(runner, AsyncModelRunner(runner) if config.async_scheduling else None)
    if update_batch is not None:
        raise ValueError("a plugged-in update_batch runs in this process; with tensor_parallel_size > 1 every rank "
                         "runs the engine's own: use tensor_parallel_size=1 to run yours")
    from .multiproc import MultiprocExecutor  # its workers start here: errors before any process starts

    return MultiprocExecutor(model, info, kv_cache, config, swaps=swaps, forks=forks, spec=spec)


def check_update_batch_signature(update_batch) -> None:
    """A plugged-in ``update_batch`` is called as ``update_batch(runner, scheduler_output)``: ``ValueError`` now,
    where it could not be, rather than a ``TypeError`` on the first step."""
    if not callable(update_batch):
        raise ValueError(f"update_batch must be a function update_batch(runner, scheduler_output), got "
                         f"{type(update_batch).__name__}")
    try:
        inspect.signature(update_batch).bind(None, None)
    except TypeError:
        raise ValueError(f"update_batch is called as update_batch(runner, scheduler_output), and "
                         f"{getattr(update_batch, '__name__', update_batch)!r} cannot take those two arguments") from None
    except ValueError:  # no signature to read (a builtin): it is called as it is
        pass
