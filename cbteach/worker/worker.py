"""One tensor-parallel rank: its shard of the model, its KV pool, its own model runner and batch.

A worker is what vLLM V1 calls a ``Worker`` (``vllm/v1/worker/gpu_worker.py``) with its model runner:
it joins the ``torch.distributed`` process group (gloo on the CPU, NCCL on CUDA), builds the
transformers model from its config on the meta device and gives it the rank's slices of the weights
(:mod:`cbteach.parallel.shard`), allocates a paged pool for **its KV heads only**, and runs a
:class:`~cbteach.worker.model_runner.ModelRunner` over them -- the same runner one process uses.

Per step it gets the scheduler's message, exactly as the driver sent it to every rank, and runs
the whole step: it updates its own persistent batch from the message, runs its shard (one all-reduce
after attention and one after the MLP of every layer: the logits come out equal on every rank),
and **samples** -- with the requests' own seeded generators, created from the message on every rank,
and a global random stream seeded alike on every rank -- so every rank draws the same tokens and
appends them to its own batch. Nothing but the message goes to a rank; only the output rank (0)
answers, with a :class:`~cbteach.core.scheduler_output.RunnerOutput` (token ids, errors, counts). This is
V1's arrangement: each worker runs ``execute_model`` and its sampler; the executor collects one
rank's output.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..attention import paged as paged_attention
from ..core.config import CacheConfig
from ..kv.concat import KVTraffic
from ..kv.caches import paged_cache_class, pool_class
from ..parallel.procs import recv, send
from ..parallel.shard import Layout, add_all_reduce_hooks, load_shard
from .async_runner import AsyncModelRunner
from .variants import runner_cls

DRAIN = "drain"  # the message that finishes a rank's step in flight (async scheduling)


@dataclass
class WorkerSetup:
    """Everything rank ``rank`` needs to build its part (sent once, when the process starts)."""

    rank: int
    layout: Layout
    model_cls: type
    config: object  # a copy of the model's config
    tensors: dict | None  # the rank's tensors by name (shard.shard_tensors); None: shard a local model
    num_blocks: int
    block_size: int
    bucket_shapes: bool
    kv_dtype: str | None
    device: str  # "cpu" or "cuda:<local rank>"
    backend: str  # "gloo" or "nccl"
    init_method: str | None  # a rendezvous (file://...), or None: the environment's (torchrun)
    num_threads: int
    accepts_logits_to_keep: bool
    max_num_reqs: int = 8
    max_model_len: int | None = None
    seed: int = 0  # every rank's global random stream starts here: unseeded sampling agrees across ranks
    timeout_s: float = 120.0
    async_scheduling: bool = False  # keep one step in flight (cbteach.worker.async_runner)
    swaps: bool = False  # the scheduler sends V0's swaps (cbteach.worker.swap_runner)
    forks: bool = False  # parallel sampling by fork: copies on write, forked samples (cbteach.worker.fork_runner)
    spec: bool = False  # the scheduler sends speculative guesses (cbteach.worker.spec_runner)


class CommCounter:
    """The all-reduces of one step: how many, and how many bytes each rank sent into them."""

    def __init__(self, group=None):
        self.group, self.count, self.nbytes = group, 0, 0

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.group)
        self.count += 1
        self.nbytes += tensor.numel() * tensor.element_size()
        return tensor


class Worker:
    """Rank ``setup.rank``'s model shard, pool and runner; :meth:`execute_model` runs one message."""

    def __init__(self, setup: WorkerSetup):
        self.rank, self.layout, self.device = setup.rank, setup.layout, torch.device(setup.device)
        paged_attention.register()
        config = setup.config
        config._attn_implementation = paged_attention.NAME  # this rank's own copy of the config
        with torch.device("meta"):
            self.model = setup.model_cls(config)
        load_shard(self.model, setup.tensors, setup.layout, self.device)
        self.model.eval()
        self.comm = CommCounter()
        add_all_reduce_hooks(self.model, setup.layout, self.comm)
        dtype = next(self.model.parameters()).dtype
        cache = CacheConfig(kind="paged", block_size=setup.block_size, bucket_shapes=setup.bucket_shapes,
                            kv_dtype=setup.kv_dtype)
        self.kv = paged_cache_class(swaps=setup.swaps)(
            cache, num_layers=setup.layout.num_layers, num_kv_heads=setup.layout.kv_heads_per_rank,
            head_dim=setup.layout.head_dim, num_blocks=setup.num_blocks, dtype=dtype, device=self.device,
            pool_cls=pool_class(setup.kv_dtype))
        torch.manual_seed(setup.seed)
        self.runner = runner_cls(setup.swaps, setup.forks, setup.spec)(self.model, self.kv, device=self.device,
                                  accepts_logits_to_keep=setup.accepts_logits_to_keep,
                                  max_num_reqs=setup.max_num_reqs, max_model_len=setup.max_model_len)
        self.pipeline = AsyncModelRunner(self.runner) if setup.async_scheduling else None

    def memory(self) -> dict:
        """This rank's bytes: its weights (shared tensors once), its KV pool, and on CUDA what torch holds."""
        seen, weights = set(), 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
        out = {"rank": self.rank, "weight_bytes": weights, "kv_pool_bytes": self.kv.pool.nbytes,
               "kv_heads": list(self.layout.kv_heads(self.rank)), "q_heads": list(self.layout.q_heads(self.rank))}
        if self.device.type == "cuda":
            out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        return out

    def execute_model(self, msg):
        """Run one message; the output rank returns the step's :class:`RunnerOutput` (with its
        all-reduces counted), the others ``None``. Under async scheduling the output is the step
        before's (``None`` if none), all-reduces not counted: they run on the device thread, across
        two messages; :data:`DRAIN` finishes the step in flight."""
        if self.pipeline is not None:
            out = self.pipeline.drain() if msg == DRAIN else self.pipeline.execute_model(msg)
            return out if self.rank == 0 else None
        self.comm.count = self.comm.nbytes = 0
        out = self.runner.execute_model(msg)
        if self.rank != 0:
            return None
        if not msg.total_num_scheduled_tokens:  # nothing ran: the worker only forgot who finished
            return out
        world = self.layout.world_size
        out.comm = {"all_reduces": self.comm.count, "all_reduce_bytes": self.comm.nbytes,
                    "num_tokens": msg.total_num_scheduled_tokens, "world_size": world}
        if out.traffic is not None:  # every rank reads and writes its own heads' share, rank 0's times N
            out.traffic = KVTraffic(bytes_read=out.traffic.bytes_read * world,
                                    bytes_written=out.traffic.bytes_written * world)
        return out


def init_group(setup: WorkerSetup) -> None:
    """Join the process group: ``setup.backend`` over ``setup.init_method`` (or torchrun's environment)."""
    kwargs = {"init_method": setup.init_method} if setup.init_method else {}
    if setup.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(setup.device))
    dist.init_process_group(setup.backend, rank=setup.rank, world_size=setup.layout.world_size,
                            timeout=timedelta(seconds=setup.timeout_s), **kwargs)


def worker_main(conn) -> None:
    """A worker process (started by :class:`~cbteach.parallel.procs.WorkerGroup`): read its
    :class:`WorkerSetup` from the pipe, join the group, build its part, say ``("ready", memory)``,
    then run each message; rank 0 answers each with ``("ok", RunnerOutput)``, the others stay silent.
    It stops at ``None`` or when the driver's end of the pipe closes. Any error is sent back as
    ``("error", text)`` before it exits."""
    rank = "?"
    try:
        setup = recv(conn)
        rank = setup.rank
        torch.set_num_threads(setup.num_threads)
        init_group(setup)
        worker = Worker(setup)
        setup.tensors = None  # let go of the shipped copies (the model holds its own on the device)
        send(conn, ("ready", worker.memory()))
        while True:
            msg = recv(conn)
            if msg is None:
                break
            out = worker.execute_model(msg)
            if worker.rank == 0:  # (under async scheduling its answer may be None: no step was in flight)
                send(conn, ("ok", out))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the driver is gone: nothing to answer
    except BaseException as err:  # noqa: BLE001  (tell the driver what happened, whatever it was)
        try:
            send(conn, ("error", f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}"))
        except (OSError, EOFError):
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
