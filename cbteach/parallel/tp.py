"""The tensor-parallel model runner: the scheduler stays here, the model runs on N ranks.

``Engine(model, tok, kv="paged", tensor_parallel_size=N)`` builds this runner in place of
:class:`~cbteach.engine.model_runner.ModelRunner`. Nothing else in the engine changes: the
scheduler plans a step, this runner executes it, ``update_from_output`` turns the result into
request state. What happens in between is vLLM's multiprocessing executor in miniature:

1. **start** (once) -- check the configuration *before* any process starts (heads that do not
   divide, more ranks than heads, a backend this machine lacks, a KV cache that is not paged:
   ``ValueError``), cut the model into per-rank shards (:mod:`cbteach.parallel.shard`), start N
   worker processes (:mod:`cbteach.parallel.procs`) that join a ``torch.distributed`` group --
   gloo on the CPU, NCCL on CUDA -- each with a paged pool for its own KV heads;
2. **each step** -- the scheduler's message goes to every rank
   (:class:`~cbteach.parallel.worker.StepMessage`: the ``SchedulerOutput``, the tokens sampled since the
   last step, each request's start); every rank keeps the same persistent batch as the driver, changed
   only by those, and runs its shard,
   with one all-reduce after attention and one after the MLP of every layer; rank 0 sends back the
   logits of the rows to sample; the driver samples exactly as the single-process runner does (the
   requests' generators never leave it);
3. **stop** -- :meth:`close` asks the workers to exit and makes sure they did. A rank that dies ends
   the engine with :class:`~cbteach.parallel.procs.WorkerDied`, never a hang.

The KV manager (who owns which block) stays with the scheduler: block ids mean the same blocks on
every rank, each rank's blocks holding its heads' K/V. Under ``torchrun`` the process of rank 0 is
the driver and worker 0 at once (:mod:`cbteach.parallel.torchrun`).

Per step the runner keeps the all-reduces' count and bytes (:attr:`comm_log`, and ``out.comm`` on
each :class:`~cbteach.core.outputs.RunnerOutput`); :attr:`memory` is every rank's weights and pool.
"""
from __future__ import annotations

import copy
import itertools
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..core.outputs import RunnerOutput
from ..engine.model_runner import ModelRunner
from ..kv.concat import KVTraffic
from . import torchrun
from .procs import WorkerDied, WorkerGroup
from .shard import Layout, layout_for, shard_tensors
from .worker import StepMessage, WorkerSetup

__all__ = ["ParallelConfig", "TensorParallelRunner", "WorkerDied", "check_config"]


@dataclass(frozen=True)
class ParallelConfig:
    """How to run tensor-parallel: ``tensor_parallel_size`` ranks, a ``backend`` (``None``: gloo on the
    CPU, NCCL on CUDA), and the seconds a step (or the start) may take before the engine gives up."""

    tensor_parallel_size: int = 2
    backend: str | None = None
    step_timeout: float = 120.0
    start_timeout: float = 300.0
    num_threads: int | None = None  # torch threads per rank (None: this machine's cores / ranks)
    start_method: str = "spawn"  # or "forkserver" (faster repeated starts; its server stays until exit)

    def __post_init__(self):
        n = self.tensor_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"backend must be None (gloo on the CPU, NCCL on CUDA), 'gloo' or 'nccl', got "
                             f"{self.backend!r}")
        if self.start_method not in ("spawn", "forkserver"):
            raise ValueError(f"start_method must be 'spawn' or 'forkserver', got {self.start_method!r}")
        for name in ("step_timeout", "start_timeout"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0")


def parallel_config(config, tensor_parallel_size=None) -> ParallelConfig:
    """A :class:`ParallelConfig` from the engine's :class:`~cbteach.core.config.EngineConfig` (its
    ``tensor_parallel_size``) or the keyword, or ``config`` itself when it is one."""
    if isinstance(config, ParallelConfig):
        return config
    n = tensor_parallel_size if tensor_parallel_size is not None else getattr(config, "tensor_parallel_size", None)
    if n is None:
        raise ValueError("say how many ranks: tensor_parallel_size=N (or pass a ParallelConfig)")
    return ParallelConfig(tensor_parallel_size=n, backend=getattr(config, "distributed_backend", None))


def pick_backend(device: torch.device, backend: str | None) -> str:
    """gloo for a CPU model, NCCL for a CUDA one -- or ``ValueError`` saying why neither can run."""
    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed: tensor parallelism cannot run here")
    want = backend or ("nccl" if device.type == "cuda" else "gloo")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallelism runs on CPU (gloo) or CUDA (NCCL); the model is on {device.type}")
    if want == "nccl" and device.type != "cuda":
        raise ValueError("backend 'nccl' needs a CUDA model; on the CPU use 'gloo' (the default there)")
    if want == "gloo" and device.type == "cuda":
        raise ValueError("use backend 'nccl' (the default on CUDA) for a CUDA model; gloo is for CPU tensors here")
    if want == "nccl" and not dist.is_nccl_available():
        raise ValueError("backend 'nccl' is not available in this torch build")
    if want == "gloo" and not dist.is_gloo_available():
        raise ValueError("backend 'gloo' is not available in this torch build")
    return want


def check_config(model, info, kv_cache, config, pc: ParallelConfig) -> tuple[Layout, str]:
    """Everything that would stop a tensor-parallel run, found before any process starts."""
    layout = layout_for(model, pc.tensor_parallel_size)
    backend = pick_backend(info.device, pc.backend)
    world = os.environ.get("WORLD_SIZE")
    if "TORCHELASTIC_RUN_ID" in os.environ and world != str(pc.tensor_parallel_size):
        raise ValueError(f"under torchrun the engine's ranks are torchrun's: tensor_parallel_size must be WORLD_SIZE "
                         f"({world}), got {pc.tensor_parallel_size}")
    if info.device.type == "cuda" and torch.cuda.device_count() < pc.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={pc.tensor_parallel_size} needs that many GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    if getattr(kv_cache, "kind", None) != "paged":
        raise ValueError("tensor parallelism needs kv='paged': each rank keeps its KV heads in its own paged pool, "
                         "addressed by the scheduler's block tables")
    scheduler = getattr(config, "scheduler", None)
    if getattr(scheduler, "preemption", "recompute") == "swap":
        raise ValueError("preemption='swap' copies blocks from the driver's pool, which tensor parallelism leaves "
                         "empty (the ranks hold the K/V); use preemption='recompute'")
    if getattr(kv_cache, "attention", None) is not None or getattr(kv_cache, "slot_mapping", None) is not None:
        raise ValueError("a plugged-in attention or slot_mapping runs in the driver's process; tensor parallelism "
                         "runs attention on the ranks with the engine's own")
    return layout, backend


class TensorParallelRunner(ModelRunner):
    """Runs each plan on ``tensor_parallel_size`` ranks; samples here. See the module docstring."""

    def __init__(self, model, info, kv_cache, config, *, tensor_parallel_size=None):
        pc = parallel_config(config, tensor_parallel_size)
        self.layout, backend = check_config(model, info, kv_cache, config, pc)
        super().__init__(model, info, kv_cache)
        self.parallel = pc
        self.comm_log: list[dict] = []  # per step: all-reduces, bytes each rank sent, tokens
        self.last_logits = None
        self._update = None  # the step's message, sent to every rank with its first pass
        self._appended: dict = {}  # tokens sampled since the last pass, which every rank's batch appends
        n = pc.tensor_parallel_size
        threads = pc.num_threads or max(1, (os.cpu_count() or 1) // n)

        def setup(rank: int) -> WorkerSetup:
            return WorkerSetup(rank=rank, layout=self.layout, model_cls=type(model), config=copy.deepcopy(model.config),
                               tensors=shard_tensors(model, self.layout, rank), num_blocks=kv_cache.num_blocks,
                               block_size=kv_cache.block_size, bucket_shapes=bool(kv_cache.bucket_shapes),
                               kv_dtype=getattr(kv_cache.config, "kv_dtype", None),
                               device="cpu" if info.device.type == "cpu" else f"cuda:{rank}", backend=backend,
                               init_method=None, num_threads=threads,
                               accepts_logits_to_keep=info.accepts_logits_to_keep, timeout_s=pc.step_timeout)

        if torchrun.launched_by_torchrun(n):  # this process is rank 0; torchrun started the others
            self.group = torchrun.TorchrunGroup(setup(0), step_timeout=pc.step_timeout)
        else:  # vLLM's multiprocessing executor: one process per rank
            self.group = WorkerGroup([setup(r) for r in range(n)], start_timeout=pc.start_timeout,
                                     step_timeout=pc.step_timeout, start_method=pc.start_method)
        self.memory: list[dict] = self.group.memory  # per rank: weight and KV pool bytes, its heads

    def describe(self) -> list[str]:
        """Who holds which heads, one line per rank."""
        return self.layout.describe()

    @property
    def last_comm(self) -> dict | None:
        return self.comm_log[-1] if self.comm_log else None

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def update_states(self, msg):
        """As one process; the message itself goes to every rank with the step's first pass, and each
        applies it to its own batch (copy-on-write copies included: each rank holds its heads' K/V)."""
        rows = self.input_batch.update(msg)
        self._update = msg
        return rows

    def _run(self, rows) -> RunnerOutput:
        batch = self.input_batch
        for row in rows:
            batch.redo_from(row)
        chunks = [batch.chunk(r) for r in rows]
        counts = [r.num_tokens for r in rows]
        num_logits = [len(r.draft_ids) + 1 for r in rows]  # the last 1 + guesses rows of a speculating row
        first_row = [0, *itertools.accumulate(num_logits)]
        logit_rows = [i for e, k in zip(itertools.accumulate(counts), num_logits) for i in range(e - k, e)]
        msg = StepMessage(rows=[(r.req_id, r.start, r.num_tokens, r.draft_ids) for r in rows], logit_rows=logit_rows,
                          update=self._update, appended=self._appended)
        self._update, self._appended = None, {}
        t0 = time.perf_counter()
        answers = self.group.call(msg)
        forward_time = time.perf_counter() - t0
        comm = {"all_reduces": answers[0]["all_reduces"], "all_reduce_bytes": answers[0]["all_reduce_bytes"],
                "num_tokens": sum(counts), "world_size": len(answers)}
        self.comm_log.append(comm)
        traffic = KVTraffic(bytes_read=sum(a["kv_bytes_read"] for a in answers),
                            bytes_written=sum(a["kv_bytes_written"] for a in answers))
        logits = answers[0]["logits"].to(self.info.device)
        self.last_logits = logits  # the sampled rows' logits (equal on every rank after the all-reduces)
        out = self.finish({"rows": rows, "chunks": chunks, "logits": logits, "first_row": first_row,
                           "forward_time": forward_time, "traffic": traffic, "comm": comm})
        for i, (rid, tokens, forks) in enumerate(zip(out.req_ids, out.sampled, out.fork_tokens)):
            if tokens and out.error(i) is None:  # what every rank's batch appends before the next pass
                self._appended.setdefault(rid, []).extend(tokens)
            for sample_id, token in (forks or {}).items():
                self._appended.setdefault(sample_id, []).append(token)
        return out
