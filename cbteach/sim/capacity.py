"""Capacity planning on the simulator: the highest rate that meets latency targets, GPUs, and cost.

The questions a deployment asks -- *how many requests per second can one replica take within a TTFT
and TPOT target? how many GPUs for N users? what does a million tokens cost?* -- are what Vidur
built its simulator for: each answer needs many runs at many rates, cheap on a cost model and
dear on GPUs. A :class:`Deployment` is a model on ``tensor_parallel_size`` devices with the
engine's settings and a traffic shape; :func:`max_rate` searches the rate.

**The search** doubles the rate from ``min_rate`` until a run misses a target, then bisects between
the last rate that met both and the first that missed, a fixed number of times. Every run draws the
same requests at every rate (the same seed; only the arrival gaps are scaled), and the search
visits the same rates whatever the targets, so a looser target never gives a lower capacity.
Targets are quantiles over requests (p90 by default, as serving SLOs are usually stated).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .cost import CostModel
from .simulator import SimResult, simulate, synthetic_workload


@dataclass(frozen=True)
class Deployment:
    """One replica: ``model`` on ``tensor_parallel_size`` x ``device``, the engine's settings, and the
    traffic (lengths and how many requests a run simulates)."""

    model: object = "llama-3-8b"
    device: object = "a100-80gb"
    tensor_parallel_size: int = 1
    max_batch_size: int = 256
    token_budget: int | None = 2048
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    prompt_lens: tuple = (128, 1024)
    output_lens: tuple = (32, 512)
    spread: str = "uniform"
    num_requests: int = 200
    seed: int = 0

    def cost_model(self) -> CostModel:
        return CostModel(self.model, self.device, self.tensor_parallel_size)

    def run(self, rate: float) -> SimResult:
        """The simulated run at ``rate`` requests per second."""
        cost = self.cost_model()
        blocks = cost.kv_capacity_tokens(self.gpu_memory_utilization) // self.block_size
        workload = synthetic_workload(self.num_requests, rate, self.prompt_lens, self.output_lens, self.seed,
                                      self.spread)
        return simulate(workload, cost, max_batch_size=self.max_batch_size, num_blocks=blocks,
                        block_size=self.block_size, token_budget=self.token_budget)

    def with_(self, **changes) -> Deployment:
        return replace(self, **changes)


@dataclass
class Capacity:
    """The answer of :func:`max_rate`: the rate, the run at that rate, and every rate tried."""

    rate: float  # requests per second that meet both targets (0.0: not even the lowest rate does)
    result: SimResult | None
    probes: list = field(default_factory=list)  # (rate, ttft quantile, tpot quantile, met)

    def __repr__(self) -> str:
        return f"Capacity(rate={self.rate:.3g} req/s, {len(self.probes)} simulated runs)"


def meets(result: SimResult, ttft_target: float, tpot_target: float, quantile: float = 0.9) -> bool:
    """Whether a run's TTFT and TPOT quantiles are within the targets (seconds)."""
    tpot = result.quantile("tpot", quantile)
    return result.quantile("ttft", quantile) <= ttft_target and (math.isnan(tpot) or tpot <= tpot_target)


def _check_targets(ttft_target, tpot_target, quantile):
    for name, v in (("ttft_target", ttft_target), ("tpot_target", tpot_target)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
    if not 0 < quantile <= 1:
        raise ValueError(f"quantile must be in (0, 1], got {quantile!r}")


def max_rate(deployment: Deployment, ttft_target: float, tpot_target: float, quantile: float = 0.9,
             min_rate: float = 0.0625, max_rate_limit: float = 4096.0, bisections: int = 8) -> Capacity:
    """The highest request rate (per second) at which ``deployment`` meets both targets."""
    _check_targets(ttft_target, tpot_target, quantile)
    probes = []

    def ok(rate):
        result = deployment.run(rate)
        met = meets(result, ttft_target, tpot_target, quantile)
        probes.append((rate, result.quantile("ttft", quantile), result.quantile("tpot", quantile), met))
        return met, result

    met, result = ok(min_rate)
    if not met:
        return Capacity(0.0, None, probes)
    lo, best, hi = min_rate, result, None
    while lo * 2 <= max_rate_limit:
        met, result = ok(lo * 2)
        if not met:
            hi = lo * 2
            break
        lo, best = lo * 2, result
    if hi is None:  # never missed: the limit is the answer
        return Capacity(lo, best, probes)
    for _ in range(bisections):  # geometric midpoints: the same rates for every target
        mid = math.sqrt(lo * hi)
        met, result = ok(mid)
        if met:
            lo, best = mid, result
        else:
            hi = mid
    return Capacity(lo, best, probes)


def output_tokens_per_second(deployment: Deployment, rate: float) -> float:
    """Output tokens a replica serves per second at ``rate`` (the workload's mean output length x rate)."""
    w = synthetic_workload(deployment.num_requests, None, deployment.prompt_lens, deployment.output_lens,
                           deployment.seed, deployment.spread)
    return rate * float(np.mean([r.output_len for r in w]))


def gpus_for_users(users: int, requests_per_user: float, capacity_rate: float, tensor_parallel_size: int = 1) -> int:
    """Devices for ``users`` who each send ``requests_per_user`` requests per second, when one replica
    (``tensor_parallel_size`` devices) meets the targets up to ``capacity_rate``: whole replicas,
    data-parallel (each serves its share of the users), at least one."""
    if not isinstance(users, int) or isinstance(users, bool) or users < 0:
        raise ValueError(f"users must be an int >= 0, got {users!r}")
    if not requests_per_user > 0:
        raise ValueError(f"requests_per_user must be > 0, got {requests_per_user!r}")
    if not capacity_rate > 0:
        raise ValueError("this replica meets the targets at no rate: loosen them, or use a bigger replica")
    return max(1, math.ceil(users * requests_per_user / capacity_rate - 1e-9)) * tensor_parallel_size


def cost_per_million_tokens(deployment: Deployment, rate: float, price_per_device_hour: float | None = None) -> float:
    """Dollars per million output tokens for a replica run at ``rate`` (its capacity, say): the
    replica's price per hour over the output tokens it serves in an hour."""
    price = deployment.cost_model().device.price_per_hour if price_per_device_hour is None else price_per_device_hour
    if not rate > 0:
        raise ValueError("rate must be > 0 requests per second")
    per_hour = output_tokens_per_second(deployment, rate) * 3600
    return price * deployment.tensor_parallel_size / per_hour * 1e6
