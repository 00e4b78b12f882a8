"""Performance arithmetic and honest measurement for the notebooks.

* :mod:`~cbteach.perf.roofline` -- FLOPs and bytes of a prefill or decode step for a model's
  shape, arithmetic intensity, the roofline (Williams, Waterman and Patterson, 2009), published
  accelerator specs, and this machine's peak FLOP/s and bandwidth measured;
* :mod:`~cbteach.perf.claims` -- one printed line per comparison the prose makes, saying whether
  it held where the notebook ran (``claim: ... -- holds``), and :func:`~cbteach.perf.claims.timeit`,
  medians of repeats after a warm-up.
"""
from .claims import CLAIM_LINE, claim, failed_claims, timeit
from .roofline import (A100, DEVICES, H100, LLAMA2_7B, T4, Device, ModelShape, StepCost, decode_step, kv_capacity_batch,
                       measure_bandwidth, measure_flops, measure_device, prefill_step, ridge_batch)

__all__ = ["claim", "failed_claims", "CLAIM_LINE", "timeit", "ModelShape", "StepCost", "Device", "DEVICES", "T4",
           "A100", "H100", "LLAMA2_7B", "decode_step", "prefill_step", "ridge_batch", "kv_capacity_batch",
           "measure_flops", "measure_bandwidth", "measure_device"]
