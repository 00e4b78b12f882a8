"""Tensor parallelism's settings, and everything that would stop a run, found before any process starts.

``Engine(model, tok, kv="paged", tensor_parallel_size=N)`` runs the model on N ranks
(:class:`~cbteach.executor.multiproc.MultiprocExecutor`, each rank a
:class:`~cbteach.worker.worker.Worker`). Before any process starts, :func:`check_config` refuses what
cannot run -- heads that do not divide, more ranks than heads, a backend this machine lacks, a KV
cache that is not paged, a plugged-in attention -- with a ``ValueError`` that says why.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .procs import WorkerDied
from .shard import Layout, layout_for

__all__ = ["ParallelConfig", "WorkerDied", "check_config", "parallel_config", "pick_backend"]


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
    if getattr(kv_cache, "attention", None) is not None or getattr(kv_cache, "slot_mapping", None) is not None:
        raise ValueError("a plugged-in attention or slot_mapping runs in the driver's process; tensor parallelism "
                         "runs attention on the ranks with the engine's own")
    return layout, backend
