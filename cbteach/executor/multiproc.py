"""N worker processes, each running every message (vLLM V1's ``MultiprocExecutor``, in miniature).

``Engine(model, tok, kv="paged", tensor_parallel_size=N)`` builds this executor. Nothing else in the
engine changes: the scheduler plans a step, the executor runs it, ``update_from_output`` turns the
result into request state. What happens in between:

1. **start** (once) -- check the configuration *before* any process starts
   (:func:`cbteach.parallel.tp.check_config`), cut the model into per-rank shards
   (:mod:`cbteach.parallel.shard`), start N worker processes (:mod:`cbteach.parallel.procs`) that join
   a ``torch.distributed`` group -- gloo on the CPU, NCCL on CUDA -- each a
   :class:`~cbteach.worker.worker.Worker` with a paged pool for its own KV heads and its own model
   runner;
2. **each step** -- the scheduler's message, and nothing else, goes to every rank (under async
   scheduling each rank keeps one step in flight and rank 0 answers with the step before's output);
   every rank applies it to its own persistent batch, runs its shard (one all-reduce after attention and one after the
   MLP of every layer), samples with the same generators and appends the same tokens. Only rank 0
   answers, with the step's :class:`~cbteach.core.scheduler_output.RunnerOutput` -- token ids, not logits;
3. **stop** -- :meth:`close` asks the workers to exit and makes sure they did. A rank that dies ends
   the engine with :class:`~cbteach.parallel.procs.WorkerDied`, never a hang.

The KV manager (who owns which block) stays with the scheduler: block ids mean the same blocks on
every rank, each rank's blocks holding its heads' K/V. Under ``torchrun`` the process of rank 0 is the
driver and worker 0 at once (:mod:`cbteach.executor.torchrun`). Per step the executor keeps the
all-reduces' count and bytes (:attr:`comm_log`, and ``out.comm`` on each output); :attr:`memory` is
every rank's weights and pool.
"""
from __future__ import annotations

import copy
import os

import torch

from ..parallel.procs import WorkerGroup
from ..parallel.shard import shard_tensors
from ..parallel.tp import check_config, parallel_config
from ..worker.worker import DRAIN, WorkerSetup, worker_main
from . import torchrun


class MultiprocExecutor:
    """Runs each message on ``tensor_parallel_size`` ranks; rank 0 answers. See the module."""

    def __init__(self, model, info, kv_cache, config, *, tensor_parallel_size=None, swaps: bool = False,
                 forks: bool = False, spec: bool = False):
        pc = parallel_config(config, tensor_parallel_size)
        self.layout, backend = check_config(model, info, kv_cache, config, pc)
        self.parallel = pc
        self.comm_log: list[dict] = []  # per step: all-reduces, bytes each rank sent, tokens
        n = pc.tensor_parallel_size
        self.async_scheduling = bool(getattr(config, "async_scheduling", False))
        if self.async_scheduling and torchrun.launched_by_torchrun(n):
            raise ValueError("async_scheduling with tensor parallelism needs the executor's own worker processes: under "
                             "torchrun rank 0 is the driver and a worker at once, and its device thread's all-reduces "
                             "would cross the driver's broadcasts; run without torchrun, or without async_scheduling")
        threads = pc.num_threads or max(1, (os.cpu_count() or 1) // n)
        scheduler = getattr(config, "scheduler", None)
        # Every rank's global random stream starts from one seed, drawn from this process's: unseeded
        # sampling draws the same tokens on every rank (and torch.manual_seed here makes a run repeatable).
        seed = int(torch.randint(0, 2**62, ()).item())

        def setup(rank: int) -> WorkerSetup:
            return WorkerSetup(rank=rank, layout=self.layout, model_cls=type(model), config=copy.deepcopy(model.config),
                               tensors=shard_tensors(model, self.layout, rank), num_blocks=kv_cache.num_blocks,
                               block_size=kv_cache.block_size, bucket_shapes=bool(kv_cache.bucket_shapes),
                               kv_dtype=getattr(kv_cache.config, "kv_dtype", None),
                               device="cpu" if info.device.type == "cpu" else f"cuda:{rank}", backend=backend,
                               init_method=None, num_threads=threads,
                               accepts_logits_to_keep=info.accepts_logits_to_keep,
                               max_num_reqs=getattr(scheduler, "max_batch_size", 8), max_model_len=info.max_positions,
                               seed=seed, timeout_s=pc.step_timeout, async_scheduling=self.async_scheduling, swaps=swaps,
                               forks=forks, spec=spec)

        if torchrun.launched_by_torchrun(n):  # this process is rank 0; torchrun started the others
            self.group = torchrun.TorchrunGroup(setup(0), step_timeout=pc.step_timeout)
        else:  # one process per rank
            self.group = WorkerGroup([setup(r) for r in range(n)], target=worker_main, start_timeout=pc.start_timeout,
                                     step_timeout=pc.step_timeout, start_method=pc.start_method)
        self.memory: list[dict] = self.group.memory  # per rank: weight and KV pool bytes, its heads

    def execute_model(self, scheduler_output, non_block: bool = False):
        """Send the message to every rank; rank 0's output -- or, under async scheduling (``non_block=True``:
        every rank keeps one step in flight, :mod:`cbteach.worker.async_runner`), rank 0's output of the
        step sent before (``None`` if none was)."""
        if non_block != self.async_scheduling:
            raise ValueError(f"this executor was built for non_block={self.async_scheduling}: "
                             f"execute_model(non_block={non_block}) cannot run here")
        out = self.group.call(scheduler_output)
        if out is not None and out.comm is not None:
            self.comm_log.append(out.comm)
        return out

    def drain(self):
        """Async scheduling: every rank finishes its step in flight; rank 0's output of it (``None`` if none)."""
        return self.group.call(DRAIN) if self.async_scheduling else None

    def describe(self) -> list[str]:
        """Who holds which heads, one line per rank."""
        return self.layout.describe()

    @property
    def last_comm(self) -> dict | None:
        return self.comm_log[-1] if self.comm_log else None

    def generator_state(self, req_id):
        raise ValueError("a request's random stream lives on every rank under tensor parallelism; handing a "
                         "request over (disaggregation) needs tensor_parallel_size=1")

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
