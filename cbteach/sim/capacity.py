"""Capacity planning on the simulator: the highest rate that meets latency targets, GPUs, and cost.

The questions a deployment asks -- *how many requests per second can one replica take within a TTFT
and TPOT target? how many GPUs for N users? what does a million tokens cost?* -- are what Vidur
built its simulator for: each answer needs many runs at many rates, cheap on a cost model and
dear on GPUs. A :class:`Deployment` is a model on ``tensor_parallel_size`` devices with the
engine's settings and a traffic shape; :func:`max_rate` searches the rate.

**Steady state only.** A run of 100 requests at a rate the replica cannot sustain still looks fine:
the queue has no time to grow before the arrivals stop. So every run here is long enough to reach
the steady state -- at least ``steady_factor`` (10) times its own concurrency (the mean number of
sequences in a step), lengthened and rerun until it is -- and its metrics come from the steady window
only (:meth:`cbteach.sim.simulator.SimResult.steady`: the first 20% of arrivals, the warm-up, and the
last 10%, the drain, are discarded). The served output tokens per second over that window, not the
offered rate, give the cost per token.

**The search** counts a rate as met when the steady window served what arrived in it (:func:`stable`)
and its quantiles are within the targets. It starts at the workload's roofline (:mod:`cbteach.sim.roofline`: no schedule can serve
more), halves the rate until a run meets both targets, then bisects between that rate and the one
above it, a fixed number of times. Every run at a rate is the same run whatever the targets (the
same requests: only the arrival gaps are scaled), so a looser target never gives a lower capacity.
Targets are quantiles over requests (p90 by default, as serving SLOs are usually stated). Every
answer is checked against the roofline (:func:`check_within_roofline`).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace

from .cost import CostModel
from .roofline import roofline_rate
from .simulator import SimResult, simulate, synthetic_workload


@dataclass(frozen=True)
class Deployment:
    """One replica: ``model`` on ``tensor_parallel_size`` x ``device``, the engine's settings, and the
    traffic (lengths; the shortest run, ``num_requests``, and the longest, ``max_requests``)."""

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
    max_requests: int = 20_000
    steady_factor: float = 10.0
    seed: int = 0

    def cost_model(self) -> CostModel:
        return CostModel(self.model, self.device, self.tensor_parallel_size, block_size=self.block_size)

    def check_lengths(self) -> None:
        """``ValueError`` if the longest prompt and output do not fit the model's positions (the engine refuses such
        a request; a simulation of it would be of nothing real)."""
        shape = self.cost_model().shape
        longest = self.prompt_lens[-1] + self.output_lens[-1]
        if longest > shape.max_positions:
            raise ValueError(f"the longest prompt + output ({self.prompt_lens[-1]} + {self.output_lens[-1]} = {longest} "
                             f"tokens) is more than {shape.name}'s {shape.max_positions} positions: shorten --prompt or "
                             "--output")

    def workload(self, rate: float | None, num_requests: int):
        """The first ``num_requests`` of one long stream of requests: a longer run extends a shorter one."""
        if not isinstance(num_requests, numbers.Integral) or isinstance(num_requests, bool) or num_requests < 1:
            raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
        if num_requests > self.max_requests:
            raise ValueError(f"num_requests {num_requests} > max_requests {self.max_requests}")
        self.check_lengths()
        pool = synthetic_workload(self.max_requests, rate, self.prompt_lens, self.output_lens, self.seed, self.spread)
        return pool[:num_requests]

    def run(self, rate: float, num_requests: int | None = None, give_up: tuple | None = None) -> SimResult:
        """The simulated run of ``num_requests`` (default: the deployment's) at ``rate`` requests per second."""
        cost = self.cost_model()
        blocks = cost.kv_capacity_tokens(self.gpu_memory_utilization, self.token_budget,
                                         self.max_batch_size) // self.block_size
        n = self.num_requests if num_requests is None else num_requests
        return simulate(self.workload(rate, n), cost, max_batch_size=self.max_batch_size,
                        num_blocks=blocks, block_size=self.block_size, token_budget=self.token_budget,
                        give_up=give_up)

    def steady_run(self, rate: float, ttft_target: float | None = None, quantile: float = 0.9,
                   min_requests: int | None = None) -> tuple[SimResult, dict]:
        """A run at ``rate`` long enough for its steady state (``steady_factor`` x its concurrency, and at
        least ``min_requests``; at most ``max_requests``), and that steady state (``steady["steady"]``:
        whether it was reached). With ``ttft_target``, a run stops as soon as its TTFT ``quantile`` in
        the steady window is sure to miss it (``steady["abandoned"]``, its TTFT quantiles ``inf``)."""
        n = min(self.max_requests, max(self.num_requests, min_requests or 0))
        while True:
            key = (self, rate, n)
            if key in _RUNS:
                result, st = _RUNS[key]
            else:
                give_up = None
                if ttft_target is not None:
                    lo, hi = _window(n)
                    give_up = (ttft_target, lo, hi, math.floor((1 - quantile) * (hi - lo)) + 1)
                result = self.run(rate, n, give_up)
                if result.abandoned:
                    st = {"requests": n, "abandoned": True, "steady": False, "ttft_p50": math.inf,
                          "ttft_p90": math.inf, "tpot_p50": math.nan, "tpot_p90": math.nan}
                    return result, st
                st = result.steady()
                st["abandoned"] = False
                _RUNS[key] = result, st
                if len(_RUNS) > 64:
                    _RUNS.pop(next(iter(_RUNS)))
            need = math.ceil(self.steady_factor * max(st["concurrency"], 1.0))
            if n >= need or n >= self.max_requests:
                st["steady"] = n >= need
                return result, st
            n = min(self.max_requests, math.ceil(1.2 * need))

    def roofline(self) -> dict:
        """The workload's roofline rate on this replica (:func:`cbteach.sim.roofline.roofline_rate`)."""
        w = self.workload(None, self.max_requests)
        return roofline_rate(self.cost_model(), [r.prompt_len for r in w], [r.output_len for r in w],
                             self.max_batch_size)

    def with_(self, **changes) -> Deployment:
        return replace(self, **changes)


_RUNS: dict = {}  # (deployment, rate, requests) -> finished runs: the same run is never simulated twice


def _window(n: int, warmup: float = 0.2, cooldown: float = 0.1) -> tuple[int, int]:
    """The steady window's first and last request (as :meth:`SimResult.steady` takes them)."""
    lo = int(n * warmup)
    return lo, max(lo + 1, int(math.ceil(n * (1 - cooldown))) - 1)


CONFIRM = 4  # a capacity must hold over a run this many times longer than the one that found it


@dataclass
class Capacity:
    """The answer of :func:`max_rate`: the rate, its confirming run's steady state, the roofline, every
    rate tried, and the stability test the answer passed (:attr:`test`)."""

    rate: float  # requests per second that meet both targets, sustained (0.0: not even the lowest rate does)
    result: SimResult | None  # the confirming run (``confirm`` x the first run's requests)
    steady: dict | None = None  # its steady state (SimResult.steady, plus "steady")
    roofline: dict | None = None
    probes: list = field(default_factory=list)  # (rate, ttft quantile, tpot quantile, met, requests)
    first: dict | None = None  # the steady state of the first (shorter) run at ``rate``
    confirm: float = CONFIRM

    @property
    def served_tokens_per_s(self) -> float:
        return self.steady["served_tokens_per_s"] if self.steady else 0.0

    @property
    def test(self) -> str:
        """The stability test, in words, with the run lengths it used."""
        if not self.steady:
            return "no rate met the targets"
        return (f"a run of {self.first['requests']:,} requests, then one of {self.steady['requests']:,} "
                f"({self.confirm:g}x as many): each meets both targets in its steady window, serves what arrives "
                f"(within {STABLE_SERVED:.0%}) and its queue does not grow across the window (waiting requests, "
                f"last third vs first third: {self.steady['queue_last']:.1f} vs {self.steady['queue_first']:.1f})")

    def __repr__(self) -> str:
        return f"Capacity(rate={self.rate:.3g} req/s, {len(self.probes)} simulated runs)"


def meets(run, ttft_target: float, tpot_target: float, quantile: float = 0.9) -> bool:
    """Whether a run's (a :class:`SimResult`, or its steady state) TTFT and TPOT quantiles are within
    the targets (seconds)."""
    if not (ttft_target > 0 and tpot_target > 0):  # (NaN compares False with everything: it met nothing, silently)
        raise ValueError(f"the targets must be numbers of seconds > 0, got ttft={ttft_target!r}, tpot={tpot_target!r}")
    if isinstance(run, dict):
        key = f"p{round(quantile * 100)}"
        ttft, tpot = run[f"ttft_{key}"], run[f"tpot_{key}"]
    else:
        ttft, tpot = run.quantile("ttft", quantile), run.quantile("tpot", quantile)
    return ttft <= ttft_target and (math.isnan(tpot) or tpot <= tpot_target)


STABLE_SERVED = 0.1  # served at least 90% of the output tokens offered in the window
STABLE_QUEUE = (1.5, 1.0)  # last third's mean queue <= 1.5 x the first third's + 1 request


def stable(steady: dict, tolerance: float = STABLE_SERVED) -> bool:
    """Whether a run's steady window served what arrived in it (within ``tolerance``) and its queue did
    not grow across the window (the mean number of requests waiting for a first token in its last third
    at most :data:`STABLE_QUEUE` of the first third's): if either fails, a longer run waits longer."""
    factor, extra = STABLE_QUEUE
    served = steady["served_tokens_per_s"] >= (1 - tolerance) * steady["offered_tokens_per_s"]
    return served and steady.get("queue_last", 0.0) <= factor * steady.get("queue_first", 0.0) + extra


def _check_targets(ttft_target, tpot_target, quantile):
    for name, v in (("the TTFT target (--ttft)", ttft_target), ("the TPOT target (--tpot)", tpot_target)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 or not math.isfinite(v):
            raise ValueError(f"{name} must be a number of seconds > 0, got {v!r}")
    if quantile not in (0.5, 0.9):
        raise ValueError(f"the quantile (--quantile) must be 0.5 or 0.9 (the steady state reports p50 and p90), "
                         f"got {quantile!r}")


def check_within_roofline(deployment: Deployment, rate: float, served_tokens_per_s: float | None = None) -> dict:
    """Refuse (``ValueError``) a rate, or a served token rate, above the deployment's roofline."""
    roof = deployment.roofline()
    if rate > roof["rate"] * (1 + 1e-9):
        raise ValueError(f"{rate:.3g} requests/s offers more than the device can do: its {roof['bound']} roofline "
                         f"allows {roof['rate']:.3g} requests/s of this workload (compute {roof['compute']:.3g}, "
                         f"bandwidth {roof['bandwidth']:.3g}) -- a transient, not a capacity")
    if served_tokens_per_s is not None and served_tokens_per_s > roof["output_tokens_per_s"] * (1 + 1e-9):
        raise ValueError(f"{served_tokens_per_s:.4g} output tokens/s is above the roofline's "
                         f"{roof['output_tokens_per_s']:.4g}")
    return roof


def max_rate(deployment: Deployment, ttft_target: float, tpot_target: float, quantile: float = 0.9,
             min_rate: float = 1 / 64, bisections: int = 4, progress=None, confirm: float = CONFIRM) -> Capacity:
    """The highest request rate (per second) that ``deployment`` sustains within both targets: a rate
    counts when its steady-state run meets them and is :func:`stable`, and then a run ``confirm`` times
    as long does too (a rate at the edge of instability passes a short run and fails a long one).
    ``progress(rate)`` (optional) is called before every simulated run."""
    _check_targets(ttft_target, tpot_target, quantile)
    if not confirm >= 1:
        raise ValueError(f"confirm must be >= 1 (the confirming run's length, in first runs), got {confirm!r}")
    roof = deployment.roofline()
    probes, runs = [], {}
    key = f"p{round(quantile * 100)}"

    def passes(rate, min_requests=None):
        if progress is not None:
            progress(rate)
        result, st = deployment.steady_run(rate, ttft_target, quantile, min_requests)
        met = not st["abandoned"] and stable(st) and meets(st, ttft_target, tpot_target, quantile)
        probes.append((rate, st[f"ttft_{key}"], st[f"tpot_{key}"], met, st["requests"]))
        return met, result, st

    def ok(rate):
        met, _, first = passes(rate)
        if met:
            met, result, st = passes(rate, math.ceil(confirm * first["requests"]))
            runs[rate] = (result, st, first)
        return met

    hi, lo = roof["rate"], None
    rate = hi / 2
    while rate >= min_rate:
        if ok(rate):
            lo = rate
            break
        hi, rate = rate, rate / 2
    if lo is None:
        return Capacity(0.0, None, None, roof, probes, confirm=confirm)
    for _ in range(bisections):  # geometric midpoints: the same rates for every target
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    result, st, first = runs[lo]
    check_within_roofline(deployment, lo, st["served_tokens_per_s"])
    return Capacity(lo, result, st, roof, probes, first=first, confirm=confirm)


def gpus_for_users(users: int, requests_per_user: float, capacity_rate: float, tensor_parallel_size: int = 1) -> int:
    """Devices for ``users`` who each send ``requests_per_user`` requests per second, when one replica
    (``tensor_parallel_size`` devices) meets the targets up to ``capacity_rate``: whole replicas,
    data-parallel (each serves its share of the users), at least one."""
    if not isinstance(users, int) or isinstance(users, bool) or users < 0:
        raise ValueError(f"the number of users (--users) must be a whole number >= 0, got {users!r}")
    if not requests_per_user > 0:
        raise ValueError(f"the rate per user (--rate-per-user) must be > 0, got {requests_per_user!r}")
    if not capacity_rate > 0:
        raise ValueError("this replica meets the targets at no rate: loosen them, or use a bigger replica")
    if not isinstance(tensor_parallel_size, int) or isinstance(tensor_parallel_size, bool) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size (devices per replica) must be an integer >= 1, got {tensor_parallel_size!r}")
    return max(1, math.ceil(users * requests_per_user / capacity_rate - 1e-9)) * tensor_parallel_size


def cost_per_million_tokens(deployment: Deployment, capacity, price_per_device_hour: float | None = None) -> float:
    """Dollars per million output tokens for a replica at ``capacity`` (a :class:`Capacity`, or a rate
    in requests/s, simulated to its steady state): the replica's price per hour over the output tokens
    it *serves* in an hour -- measured in the steady state, never the offered rate x the mean length."""
    price = deployment.cost_model().device.price_per_hour if price_per_device_hour is None else price_per_device_hour
    if not (isinstance(price, (int, float)) and not isinstance(price, bool) and math.isfinite(price) and price >= 0):
        raise ValueError(f"the price per device-hour must be a finite number >= 0 (dollars), got {price!r}")
    if isinstance(capacity, Capacity):
        served = capacity.served_tokens_per_s
    else:
        if not capacity > 0:
            raise ValueError("rate must be > 0 requests per second")
        served = deployment.steady_run(capacity)[1]["served_tokens_per_s"]
    if not served > 0:
        raise ValueError("the replica served no tokens at this rate")
    check_within_roofline(deployment, 0.0, served)
    return price * deployment.tensor_parallel_size / (served * 3600) * 1e6
