"""Past one machine, for real: what tensor parallelism needs besides the worker (notebook 13).

* :mod:`~cbteach.parallel.shard` -- Megatron-style sharding of a transformers model's own modules:
  who holds which heads and rows, the KV-head rule for grouped-query attention;
* :mod:`~cbteach.parallel.procs` -- starting and watching N worker processes, one pipe each;
* :mod:`~cbteach.parallel.tp` -- the settings, and everything that would stop a run, checked before
  any process starts.

The rank itself is a worker (:mod:`cbteach.worker.worker`), and the executor that drives N of them
is :mod:`cbteach.executor.multiproc` (or :mod:`cbteach.executor.torchrun`, when ``torchrun`` started them).
"""
from .shard import Layout, layout_for  # noqa: F401
