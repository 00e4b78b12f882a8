"""Tensor parallelism under ``torchrun``: the same ranks, started by torch's launcher instead.

``torchrun --nproc-per-node 2 script.py`` starts the script twice with ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` set. The scheduler still lives in one place -- the process of
rank 0, which is the driver *and* worker 0 -- and the other ranks only serve::

    model = load_model("bierce")
    if serve_rank(model):  # ranks 1..N-1 work here until rank 0 closes its engine
        raise SystemExit
    with Engine(model, tok, kv="paged", tensor_parallel_size=int(os.environ["WORLD_SIZE"])) as eng:
        ...                # rank 0 only

Each step rank 0 broadcasts the scheduler's message over a gloo group (``broadcast_object_list``; a
CPU group even when the model's all-reduces use NCCL, as vLLM keeps one) and every rank runs it and
samples for itself; nothing comes back (rank 0's own worker gives the output). A rank that dies
makes the launcher stop the others, and rank 0's next collective fails:
:class:`~cbteach.parallel.procs.WorkerDied`. ``benchmarks/tp/torchrun_check.py`` runs this end to end.
(V1's executor for torchrun, ``ExecutorWithExternalLauncher`` in ``vllm/v1/executor/uniproc_executor.py``,
works differently: every rank runs its own engine and scheduler, and deterministic scheduling keeps
them in step; here one scheduler, on rank 0, broadcasts its message.)
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist

from ..parallel.procs import WorkerDied
from ..parallel.shard import layout_for, shard_tensors
from ..worker.worker import Worker, WorkerSetup, init_group


def launched_by_torchrun(world_size: int) -> bool:
    """True in a process torchrun started for a group of exactly ``world_size`` ranks."""
    return "TORCHELASTIC_RUN_ID" in os.environ and os.environ.get("WORLD_SIZE") == str(world_size)


class TorchrunGroup:
    """Rank 0's side: this process is worker 0; the plan reaches the others by broadcast."""

    def __init__(self, setup: WorkerSetup, step_timeout: float = 120.0):
        if int(os.environ.get("RANK", "0")) != 0:
            raise ValueError("under torchrun only rank 0 builds the engine; the other ranks call serve_rank(model)")
        setup.init_method = None  # torchrun's environment is the rendezvous
        init_group(setup)
        self.control = dist.new_group(backend="gloo") if setup.backend != "gloo" else None
        dist.broadcast_object_list([_public(setup)], src=0, group=self.control)  # the others build their part
        self.worker = Worker(setup)
        self.memory = self._gather(self.worker.memory())
        self._open = True

    def _gather(self, mine) -> list:
        out = [None] * dist.get_world_size()
        dist.gather_object(mine, out, dst=0, group=self.control)
        return out

    def call(self, msg):
        """Broadcast the message; run it here too, as worker 0; this worker's output."""
        if not self._open:
            raise WorkerDied("the tensor-parallel group was closed")
        try:
            dist.broadcast_object_list([msg], src=0, group=self.control)
            return self.worker.execute_model(msg)
        except (RuntimeError, OSError) as err:
            self._open = False
            raise WorkerDied(f"tensor parallelism stopped: a collective failed ({err})") from err

    def close(self) -> None:
        if self._open:
            self._open = False
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
            finally:
                dist.destroy_process_group()


def _public(setup: WorkerSetup) -> dict:
    """What the other ranks need from rank 0 (they shard their own copy of the model)."""
    return {k: getattr(setup, k) for k in ("num_blocks", "block_size", "bucket_shapes", "kv_dtype", "backend",
                                           "num_threads", "accepts_logits_to_keep", "max_num_reqs", "max_model_len",
                                           "seed", "timeout_s", "swaps", "forks", "spec")}


def serve_rank(model) -> bool:
    """On ranks 1..N-1 of a torchrun group: join, build this rank's shard of ``model``, run every message
    rank 0 broadcasts until it closes its engine; returns True. On rank 0 (or outside torchrun):
    returns False at once -- build the engine there."""
    rank = int(os.environ.get("RANK", "0"))
    if "TORCHELASTIC_RUN_ID" not in os.environ or rank == 0:
        return False
    world = int(os.environ["WORLD_SIZE"])
    device = next(model.parameters()).device
    backend = "nccl" if device.type == "cuda" else "gloo"
    layout = layout_for(model, world)
    setup = WorkerSetup(rank=rank, layout=layout, model_cls=type(model), config=copy.deepcopy(model.config),
                        tensors=shard_tensors(model, layout, rank), num_blocks=1, block_size=1, bucket_shapes=False,
                        kv_dtype=None, device="cpu" if device.type == "cpu" else f"cuda:{os.environ.get('LOCAL_RANK', rank)}",
                        backend=backend, init_method=None, num_threads=1, accepts_logits_to_keep=True)
    init_group(setup)
    control = dist.new_group(backend="gloo") if backend != "gloo" else None
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    for key, value in box[0].items():
        setattr(setup, key, value)
    torch.set_num_threads(setup.num_threads)
    worker = Worker(setup)
    dist.gather_object(worker.memory(), None, dst=0, group=control)
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0] is None:
            break
        worker.execute_model(box[0])
    dist.destroy_process_group()
    return True
