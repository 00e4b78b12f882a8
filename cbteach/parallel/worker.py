"""One tensor-parallel rank: its shard of the model, its shard of the KV pool, one forward per plan.

A worker is what vLLM calls a ``Worker`` with its ``ModelRunner``: it joins the
``torch.distributed`` process group (gloo on the CPU, NCCL on CUDA), builds the transformers model
from its config on the meta device and gives it the rank's slices of the weights
(:mod:`cbteach.parallel.shard`), and allocates a paged pool for **its KV heads only**. Then, per
step, it receives the plan as a :class:`StepMessage` -- the scheduler's message, where each sequence
starts, which rows' logits are wanted -- builds the same attention metadata the single-process
engine builds, and runs the forward pass. Like the driver's runner, every rank keeps a persistent
batch (:class:`~cbteach.engine.input_batch.InputBatch`) changed only by the scheduler's message --
the same :class:`~cbteach.core.scheduler_output.SchedulerOutput` the driver applies -- and by the
tokens the driver sampled: token ids and block tables are read from there, not sent each step. Every row-parallel
module's output is summed across ranks by an all-reduce (counted here: calls and bytes). The
logits are then equal on every rank; rank 0's go back to the driver, which samples.
"""
from __future__ import annotations

import pickle
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ..attention import metadata as attn_metadata
from ..attention import paged as paged_attention
from ..engine.input_batch import InputBatch, ScheduledRow
from ..kv.int8 import Int8BlockKVPool, Int8KVPool
from ..kv.pool import PagedKVPool
from .shard import Layout, add_all_reduce_hooks, load_shard

POOLS = {None: PagedKVPool, "int8": Int8KVPool, "int8_block": Int8BlockKVPool}


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
    timeout_s: float = 120.0


@dataclass
class StepMessage:
    """One forward pass as every rank needs it: plain data, no request objects. ``appended``: the tokens
    the driver sampled since the last pass (each rank's batch appends them); ``update``: the step's
    :class:`~cbteach.core.scheduler_output.SchedulerOutput`, sent with its first pass only (a step the
    driver reruns one request at a time sends none); ``rows``: ``(request id, start, tokens fed, guesses)``
    per packed request -- the starts as the driver runs them (it may recompute unwritten blocks)."""

    rows: list[tuple]
    logit_rows: list[int]  # packed rows whose logits the driver samples from
    update: object = None
    appended: dict = field(default_factory=dict)


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
    """Rank ``setup.rank``'s model shard and pool; :meth:`step` runs one plan."""

    def __init__(self, setup: WorkerSetup, local_model=None):
        self.rank, self.layout, self.device = setup.rank, setup.layout, torch.device(setup.device)
        self.block_size, self.bucket_shapes = setup.block_size, setup.bucket_shapes
        self.accepts_logits_to_keep = setup.accepts_logits_to_keep
        paged_attention.register()
        config = setup.config
        config._attn_implementation = paged_attention.NAME  # this rank's own copy of the config
        with torch.device("meta"):
            self.model = setup.model_cls(config)
        load_shard(self.model, setup.tensors, setup.layout, self.device)
        self.model.eval()
        self.comm = CommCounter()
        self.batch = InputBatch(setup.block_size)  # this rank's copy of the driver's persistent batch
        add_all_reduce_hooks(self.model, setup.layout, self.comm)
        dtype = next(self.model.parameters()).dtype
        self.pool = POOLS[setup.kv_dtype](num_layers=setup.layout.num_layers, num_blocks=setup.num_blocks,
                                          block_size=setup.block_size, num_kv_heads=setup.layout.kv_heads_per_rank,
                                          head_dim=setup.layout.head_dim, dtype=dtype, device=self.device)

    def memory(self) -> dict:
        """This rank's bytes: its weights (shared tensors once), its KV pool, and on CUDA what torch holds."""
        seen, weights = set(), 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                weights += t.numel() * t.element_size()
        out = {"rank": self.rank, "weight_bytes": weights, "kv_pool_bytes": self.pool.nbytes,
               "kv_heads": list(self.layout.kv_heads(self.rank)), "q_heads": list(self.layout.q_heads(self.rank))}
        if self.device.type == "cuda":
            out["cuda_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        return out

    @torch.inference_mode()
    def step(self, msg: StepMessage) -> dict:
        """Run one pass; returns the step's counts (and, on rank 0, the wanted rows' logits)."""
        for rid, tokens in msg.appended.items():
            self.batch.append(rid, tokens)
        if msg.update is not None:
            self.batch.update(msg.update)
            self.pool.copy_blocks([tuple(p) for p in msg.update.block_copies])
        states = [self.batch.requests[rid] for rid, _, _, _ in msg.rows]
        token_ids = [t for (_, start, n, drafts), state in zip(msg.rows, states)
                     for t in self.batch.chunk(ScheduledRow(state=state, start=start, num_tokens=n,
                                                            draft_ids=list(drafts)))]
        meta = attn_metadata.build(token_ids, [r[1] for r in msg.rows], [r[2] for r in msg.rows], self.device,
                                   block_tables=[s.block_ids for s in states], block_size=self.block_size,
                                   bucket_shapes=self.bucket_shapes)
        meta.pool = self.pool
        rows = torch.tensor(msg.logit_rows, dtype=torch.long, device=self.device)
        kwargs = {paged_attention.STEP_KWARG: meta, "use_cache": False}
        if self.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = rows
        self.comm.count = self.comm.nbytes = 0
        t0 = time.perf_counter()
        out = self.model(input_ids=meta.input_ids, position_ids=meta.positions, **kwargs)
        logits = out.logits[0] if self.accepts_logits_to_keep else out.logits[0, rows]
        reply = {"rank": self.rank, "all_reduces": self.comm.count, "all_reduce_bytes": self.comm.nbytes,
                 "kv_bytes_read": round(sum(g.block_tables.numel() for g in meta.groups) * self.block_size
                                        * self.pool.bytes_per_token),
                 "kv_bytes_written": round(meta.num_tokens * self.pool.bytes_per_token)}
        if self.rank == 0:
            reply["logits"] = logits.float().cpu()  # synchronises with the device: the step is done
        reply["forward_time"] = time.perf_counter() - t0
        return reply


def init_group(setup: WorkerSetup) -> None:
    """Join the process group: ``setup.backend`` over ``setup.init_method`` (or torchrun's environment)."""
    kwargs = {"init_method": setup.init_method} if setup.init_method else {}
    if setup.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(setup.device))
    dist.init_process_group(setup.backend, rank=setup.rank, world_size=setup.layout.world_size,
                            timeout=timedelta(seconds=setup.timeout_s), **kwargs)


def send(conn, obj) -> None:
    conn.send_bytes(pickle.dumps(obj))  # a plain copy: no shared-memory handles to outlive a step


def recv(conn):
    return pickle.loads(conn.recv_bytes())


def worker_main(conn) -> None:
    """A worker process (started by :class:`~cbteach.parallel.procs.WorkerGroup`): read its
    :class:`WorkerSetup` from the pipe, join the group, build the shard, say ``("ready", memory)``,
    then answer each :class:`StepMessage` with ``("ok", reply)`` until ``None`` (stop) or the
    driver's end of the pipe closes. Any error is sent back as ``("error", text)`` before it exits."""
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
            send(conn, ("ok", worker.step(msg)))
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
