"""Past one machine, for real: tensor parallelism on ``torch.distributed`` (notebook 13).

* :mod:`~cbteach.parallel.shard` -- Megatron-style sharding of a transformers model's own modules:
  who holds which heads and rows, the KV-head rule for grouped-query attention;
* :mod:`~cbteach.parallel.worker` -- one rank: its shard, its KV pool, one forward per plan;
* :mod:`~cbteach.parallel.procs` -- starting and watching N worker processes (vLLM's
  multiprocessing executor);
* :mod:`~cbteach.parallel.tp` -- :class:`TensorParallelRunner`, the engine's runner for
  ``tensor_parallel_size > 1``;
* :mod:`~cbteach.parallel.torchrun` -- the same ranks started by ``torchrun``.
"""
from .shard import Layout, layout_for  # noqa: F401
