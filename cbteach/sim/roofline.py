"""The most a replica can serve, whatever the scheduler: the roofline of a whole workload.

Every request costs a fixed amount of work, however it is scheduled: its prompt's and its output's
tokens each pass through every layer (``2 x parameters`` FLOPs per token, plus attention's
``4 x heads x head_dim`` per query-key pair and the LM head per sampled token), and each decode step
reads every weight once for at most ``max_batch_size`` sequences, and each output token reads its
whole context's K/V. So at ``rate`` requests per second a replica of ``tp`` devices must sustain

* ``rate x FLOPs per request`` <= ``tp x peak FLOP/s`` (the compute roofline), and
* ``rate x bytes per request`` <= ``peak bytes/s`` per device (the bandwidth roofline), with the
  weights' bytes shared by at most ``max_batch_size`` output tokens per step.

Both use the datasheet **peaks**, not the achieved fractions, so no schedule can beat them: a
capacity above :func:`roofline_rate` is a transient (a run too short to fill the system), never a
capacity. :func:`cbteach.sim.capacity.max_rate` checks every answer against it.
"""
from __future__ import annotations

import numpy as np

from .cost import CostModel


def request_work(cost: CostModel, prompt_lens, output_lens, max_batch_size: int) -> dict:
    """Mean FLOPs per request (all devices together) and bytes one device must read per request."""
    s, tp = cost.shape, cost.tp
    p = np.asarray(prompt_lens, dtype=float)
    o = np.asarray(output_lens, dtype=float)
    pairs = p * (p + 1) / 2 + (o - 1) * p + (o - 1) * o / 2  # causal prefill, then decodes at growing context
    dense = 2 * s.num_layers * s.layer_params * (p + o - 1) + 2 * s.hidden_size * s.vocab_size * o
    flops = dense + 4 * s.num_layers * s.num_heads * s.head_dim * pairs
    kv = cost.kv_bytes_per_token_per_device
    context_read = (o - 1) * p + (o - 1) * o / 2 + p  # decode steps read their context; the prompt is written
    weights = cost.weight_bytes_per_device * (o - 1) / max_batch_size  # each step's weights shared by <= batch
    return {"flops": float(flops.mean()), "bytes_per_device": float((weights + kv * context_read).mean()),
            "output_tokens": float(o.mean()), "tp": tp}


def roofline_rate(cost: CostModel, prompt_lens, output_lens, max_batch_size: int) -> dict:
    """The highest request rate the device's peaks allow for requests of these lengths: ``compute``,
    ``bandwidth``, and ``rate`` (the smaller), in requests per second; ``output_tokens_per_s`` at it."""
    w = request_work(cost, prompt_lens, output_lens, max_batch_size)
    d = cost.device
    compute = cost.tp * d.peak_flops / w["flops"]
    bandwidth = d.mem_bandwidth / w["bytes_per_device"] if w["bytes_per_device"] > 0 else float("inf")
    rate = min(compute, bandwidth)
    return {"compute": compute, "bandwidth": bandwidth, "rate": rate, "bound": "compute" if compute <= bandwidth
            else "bandwidth", "output_tokens_per_s": rate * w["output_tokens"]}
