"""Continuous vs static batching at GPU scale, and where the gap comes from.

Anyscale's measurement (Daniel et al., 2023, "How continuous batching enables 23x throughput in LLM
inference"): OPT-13B on an A100, traffic with high variance in output length. A static batcher
loses three ways, and this module takes them apart by switching them off one at a time:

1. **memory** -- it reserves room for the *longest possible* sequence in every slot (prompt cap +
   ``max_new_tokens``), so the pool holds few slots; a paged pool stores only real tokens;
2. **padding** -- every prompt is padded to the batch's longest, and a sequence that finished keeps
   being computed (as padding) until the batch's longest one ends;
3. **waiting** -- a request that arrives, or a slot that frees, waits for the whole batch to end;
   an iteration-level scheduler (Orca) refills the slot on the next step.

:func:`compare_batching` runs four simulated servers on one workload -- static as it is; static with
the paged pool's batch size; that without padding; and continuous batching (the engine's own
scheduler, :mod:`cbteach.sim.simulator`) -- and reports each one's throughput and the factor each
change contributes (their product is the whole gap).
"""
from __future__ import annotations

import math

import numpy as np

from .cost import CostModel
from .simulator import SimRequest, SimResult, simulate


def simulate_static(workload: list[SimRequest], cost: CostModel, batch_size: int, pad: bool = True) -> SimResult:
    """Static batching: the next batch is up to ``batch_size`` requests that have arrived when the last
    batch ended; it runs until its longest output is done. ``pad``: prompts padded to the longest and
    finished sequences computed on (``generate`` on a padded batch); without it, only real tokens."""
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    queue = sorted(workload, key=lambda r: r.arrival_time)
    n = len(queue)
    ttft, tpot, e2e = [math.nan] * n, [math.nan] * n, [math.nan] * n
    result = SimResult(ttft=ttft, tpot=tpot, e2e=e2e, output_lens=[r.output_len for r in queue])
    now, i = 0.0, 0
    while i < n:
        now = max(now, queue[i].arrival_time)
        j = i
        while j < n and j - i < batch_size and queue[j].arrival_time <= now:
            j += 1
        batch = queue[i:j]
        p_max, o_max = max(r.prompt_len for r in batch), max(r.output_len for r in batch)
        prompts = [p_max] * len(batch) if pad else [r.prompt_len for r in batch]
        now = _step(result, cost, now, [0] * len(batch), prompts)
        first = now
        for k in range(1, o_max):
            live = [r for r in batch if pad or r.output_len > k]
            now = _step(result, cost, now, [p + k - 1 for p, r in zip(prompts, batch) if r in live], [1] * len(live))
            for idx, r in enumerate(batch, start=i):
                if r.output_len == k + 1:
                    e2e[idx], tpot[idx] = now - r.arrival_time, (now - first) / k
        for idx, r in enumerate(batch, start=i):
            ttft[idx] = first - r.arrival_time
            if r.output_len == 1:
                e2e[idx] = first - r.arrival_time
        i = j
    result.makespan = now - queue[0].arrival_time if queue else 0.0
    return result


def _step(result: SimResult, cost: CostModel, now: float, computed: list[int], scheduled: list[int]) -> float:
    dt = cost.step_time(computed, scheduled)
    result.step_times.append(dt)
    result.step_tokens.append(sum(scheduled))
    result.step_seqs.append(len(scheduled))
    return now + dt


def compare_batching(model="opt-13b", device="a100-40gb", workload=None, *, max_prompt: int = 512,
                     max_new_tokens: int = 1536, max_batch_size: int = 256, block_size: int = 16,
                     token_budget: int | None = 4096) -> dict:
    """Throughput of static and continuous batching on ``workload`` (default: 400 requests at once,
    prompts 64-512 tokens, outputs log-uniform 16-1536 -- high variance), and the factors of the gap."""
    from .simulator import synthetic_workload

    cost = CostModel(model, device)
    if workload is not None and not len(workload):
        raise ValueError("workload is empty: give requests, or None for the default (400 at once)")
    if workload is None:
        workload = synthetic_workload(400, None, (64, max_prompt), (16, max_new_tokens), seed=0, spread="loguniform")
    capacity = cost.kv_capacity_tokens()
    mean_len = float(np.mean([r.prompt_len + r.output_len for r in workload]))
    b_static = max(1, min(max_batch_size, capacity // (max_prompt + max_new_tokens)))  # worst case per slot
    b_paged = max(1, min(max_batch_size, int(capacity // mean_len)))  # real tokens only
    runs = {
        "static": simulate_static(workload, cost, b_static, pad=True),
        "static + paged memory": simulate_static(workload, cost, b_paged, pad=True),
        "static + paged memory, no padding": simulate_static(workload, cost, b_paged, pad=False),
        "continuous": simulate(workload, cost, max_batch_size=max_batch_size, num_blocks=capacity // block_size,
                               block_size=block_size, token_budget=token_budget),
    }
    names = list(runs)
    thr = {k: r.throughput for k, r in runs.items()}
    factors = {"memory": thr[names[1]] / thr[names[0]], "padding": thr[names[2]] / thr[names[1]],
               "waiting": thr[names[3]] / thr[names[2]]}
    return {"model": cost.shape.name, "device": cost.device.name, "kv_capacity_tokens": capacity,
            "batch_size_static": b_static, "batch_size_paged": b_paged, "throughput": thr, "factors": factors,
            "total": thr[names[3]] / thr[names[0]], "runs": runs}
