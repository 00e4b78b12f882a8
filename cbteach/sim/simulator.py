"""The engine's own scheduler at any scale: the model replaced by a cost model, time simulated.

Vidur's idea (Agrawal et al., MLSys'24): to ask what a serving system does on hardware you do not
have, keep the *scheduler* real and replace only the model's forward pass by a prediction of how
long it takes. Here the real :class:`~cbteach.engine.scheduler.Scheduler` and
:class:`~cbteach.kv.manager.KVCacheManager` run through the engine's three calls, exactly as
:meth:`cbteach.Engine.step` makes them::

    plan = scheduler.schedule(now)                 # who runs, how many tokens each
    now += cost(plan)                              # instead of runner.execute(plan): no weights at all
    scheduler.update_from_output(plan, out, now)   # a token for each sequence whose prompt is done

Every sampled token is a placeholder (``0``) and every request stops at its output length (as a
benchmark with ``ignore_eos`` does), so the schedule -- admissions, chunked prefills, preemptions
when the pool is full -- is the engine's. Only time is simulated.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

import numpy as np

from ..core.config import SchedulerConfig
from ..core.scheduler_output import RunnerOutput
from ..core.request import Request, Sequence
from ..engine.scheduler import Scheduler
from ..kv.manager import KVCacheManager


@dataclass(frozen=True)
class SimRequest:
    request_id: object
    arrival_time: float
    prompt_len: int
    output_len: int


MAX_SPAN_S = 1e8  # seconds a synthetic workload may span: at 1e8 a float still resolves microseconds


def synthetic_workload(num_requests: int, rate: float | None, prompt_lens=(128, 512), output_lens=(16, 512),
                       seed: int = 0, spread: str = "uniform") -> list[SimRequest]:
    """``num_requests`` requests with lengths in the given ranges (inclusive) -- ``spread="uniform"``,
    or ``"loguniform"`` for the high variance of real traffic (as many short answers as long ones
    per doubling) -- and Poisson arrivals at ``rate`` per second (``None``: all at time 0). The same
    seed draws the same unit gaps and lengths at every rate, so two runs differ by the rate alone."""
    if spread not in ("uniform", "loguniform"):
        raise ValueError(f"spread must be 'uniform' or 'loguniform', got {spread!r}")
    if not isinstance(num_requests, numbers.Integral) or isinstance(num_requests, bool) or num_requests < 1:
        raise ValueError(f"num_requests must be an integer >= 1, got {num_requests!r}")
    if rate is not None and (not isinstance(rate, numbers.Real) or isinstance(rate, bool) or not math.isfinite(rate)
                             or not rate > 0):
        raise ValueError(f"rate must be None (all at once) or a finite number > 0 of requests per second, got {rate!r}")
    for name, pair in (("prompt_lens", prompt_lens), ("output_lens", output_lens)):
        if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(
                isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in pair) or not 1 <= pair[0] <= pair[1]):
            raise ValueError(f"{name} must be a pair of token counts (lo, hi) with 1 <= lo <= hi, got {pair!r}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0, num_requests)

    def lengths(lo, hi):
        if spread == "uniform":
            return rng.integers(lo, hi + 1, num_requests)
        return np.floor(np.exp(rng.uniform(np.log(lo), np.log(hi + 1), num_requests))).astype(int)

    prompts, outputs = lengths(*prompt_lens), lengths(*output_lens)
    times = np.zeros(num_requests) if rate is None else (np.cumsum(gaps) - gaps[0]) / rate
    if times[-1] > MAX_SPAN_S:
        raise ValueError(f"rate={rate!r} requests per second spreads the workload over {times[-1]:.3g} s; past {MAX_SPAN_S:.0e} s "
                         "(three years) a simulated clock cannot add a step's milliseconds any more: raise the rate")
    return [SimRequest(i, float(t), int(p), int(o)) for i, (t, p, o) in enumerate(zip(times, prompts, outputs))]


@dataclass
class SimResult:
    """A simulated run: per request its times, per step its plan's size and cost."""

    ttft: list[float]  # per request, seconds from arrival to first token
    tpot: list[float]  # per request, mean seconds between its later tokens (nan for one-token outputs)
    e2e: list[float]  # per request, arrival to last token
    output_lens: list[int]
    step_times: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    step_seqs: list[int] = field(default_factory=list)
    step_ends: list[float] = field(default_factory=list)  # per step, the simulated time it ended
    step_sampled: list[int] = field(default_factory=list)  # per step, output tokens it sampled
    arrivals: list[float] = field(default_factory=list)  # per request (in arrival order)
    num_preemptions: int = 0
    makespan: float = 0.0
    abandoned: bool = False  # stopped early by ``give_up`` (its latencies of unfinished requests are nan)
    coverage: dict = field(default_factory=dict)  # steps beyond a calibrated device's range (cost.coverage.report())

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run."""
        return sum(self.output_lens) / self.makespan if self.makespan > 0 else 0.0

    def quantile(self, metric: str, q: float) -> float:
        """The ``q`` quantile of ``metric`` (``"ttft"``, ``"tpot"`` or ``"e2e"``) over the requests that have it."""
        if metric not in ("ttft", "tpot", "e2e"):
            raise ValueError(f"metric must be 'ttft', 'tpot' or 'e2e', got {metric!r}")
        if not 0 <= q <= 1:
            raise ValueError(f"q must be a quantile in [0, 1], got {q!r}")
        values = [v for v in getattr(self, metric) if not math.isnan(v)]
        return float(np.quantile(values, q)) if values else math.nan

    def summary(self) -> dict:
        return {"requests": len(self.ttft), "steps": len(self.step_times), "makespan_s": self.makespan,
                "throughput_tok_s": self.throughput, "ttft_p50": self.quantile("ttft", 0.5),
                "ttft_p90": self.quantile("ttft", 0.9), "tpot_p50": self.quantile("tpot", 0.5),
                "tpot_p90": self.quantile("tpot", 0.9), "preemptions": self.num_preemptions}

    def steady(self, warmup: float = 0.2, cooldown: float = 0.1) -> dict:
        """The run's steady state: the requests that arrived after the first ``warmup`` and before the
        last ``cooldown`` fraction of arrivals (the system filling up, and draining once arrivals
        stop, are not what a deployment sees all day), and over the same window of time the output
        tokens served per second and the mean number of sequences in a step (the concurrency). Served
        below offered (``offered_tokens_per_s``: the window's arrivals' output tokens per second) means
        the queue grows: no steady state at this rate, however long the run."""
        n = len(self.arrivals)
        if n < 3:
            raise ValueError("a steady state needs a run of at least 3 requests")
        lo = int(n * warmup)
        hi = max(lo + 1, int(math.ceil(n * (1 - cooldown))) - 1)
        t0, t1 = self.arrivals[lo], self.arrivals[hi]
        idx = list(range(lo, hi + 1))
        out = {"requests": n, "measured": len(idx), "window_s": t1 - t0, "warmup": warmup, "cooldown": cooldown}
        for metric in ("ttft", "tpot", "e2e"):
            values = [getattr(self, metric)[i] for i in idx if not math.isnan(getattr(self, metric)[i])]
            for q in (0.5, 0.9):
                out[f"{metric}_p{round(q * 100)}"] = float(np.quantile(values, q)) if values else math.nan
        ends = np.asarray(self.step_ends)
        inside = (ends > t0) & (ends <= t1)
        out["offered_tokens_per_s"] = (sum(self.output_lens[i] for i in idx[:-1]) / (t1 - t0) if t1 > t0
                                       else math.inf)
        if inside.sum() >= 20:
            starts = ends - np.asarray(self.step_times)
            overlap = np.clip(np.minimum(ends, t1) - np.maximum(starts, t0), 0, None)
            out["served_tokens_per_s"] = float(np.asarray(self.step_sampled)[inside].sum() / (t1 - t0))
            out["concurrency"] = float((overlap * np.asarray(self.step_seqs)).sum() / (t1 - t0))
        else:  # the arrivals came within a few steps (or all at once): the whole run is the window
            out["served_tokens_per_s"] = self.throughput
            out["concurrency"] = float(np.mean(self.step_seqs)) if self.step_seqs else 0.0
        out["queue_first"], out["queue_last"] = self.queue(t0, t0 + (t1 - t0) / 3), self.queue(t1 - (t1 - t0) / 3, t1)
        return out

    def queue(self, t0: float, t1: float, points: int = 256) -> float:
        """The time-averaged number of requests waiting for their first token (arrived, not yet started)
        between ``t0`` and ``t1``: a queue that is longer at the end of a window than at its start grows."""
        if not t1 > t0:
            return 0.0
        arrivals = np.asarray(self.arrivals)
        first = arrivals + np.nan_to_num(np.asarray(self.ttft, dtype=float), nan=np.inf)  # never started: waiting
        times = np.linspace(t0, t1, points)[:, None]
        return float(((arrivals <= times) & (first > times)).sum(axis=1).mean())


def simulate(workload: list[SimRequest], step_time, *, max_batch_size: int, num_blocks: int, block_size: int = 16,
             token_budget: int | None = None, policy="fcfs", admission: str = "per_chunk",
             max_steps: int = 2_000_000, give_up: tuple | None = None) -> SimResult:
    """Run ``workload`` through the engine's scheduler and KV manager; each step costs
    ``step_time(plan)`` seconds (a :class:`~cbteach.sim.cost.CostModel`, or any function of the plan).

    ``give_up=(ttft_target, first, last, max_late)``: stop early (``abandoned``) once more than
    ``max_late`` of the requests ``first..last`` (in arrival order) have waited longer than
    ``ttft_target`` for their first token -- the run has then missed a TTFT quantile whatever follows,
    and simulating an overloaded system to its end is the costliest part of a capacity search."""
    config = SchedulerConfig(max_batch_size=max_batch_size, token_budget=token_budget, policy=policy,
                             admission=admission)
    manager = KVCacheManager(num_blocks, block_size)
    scheduler = Scheduler(config, manager)
    seqs, ids = [], set()
    for r in workload:
        at = r.arrival_time
        if not isinstance(at, numbers.Real) or isinstance(at, bool) or not math.isfinite(at) or at < 0:
            raise ValueError(f"request {r.request_id!r}: arrival_time must be a finite number of seconds >= 0, got {at!r}")
        if r.request_id in ids:
            raise ValueError(f"request id {r.request_id!r} appears twice in the workload; ids must be unique")
        ids.add(r.request_id)
    for r in sorted(workload, key=lambda r: r.arrival_time):
        if r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"request {r.request_id!r}: prompt and output lengths must be >= 1")
        request = Request([1] * r.prompt_len, r.output_len, request_id=r.request_id, arrival_time=r.arrival_time,
                          ignore_eos=True)
        manager.check_fits(r.prompt_len + r.output_len, r.request_id)  # as Engine.add_request does
        seq = Sequence(request=request, prompt_ids=list(request.prompt), arrival_time=r.arrival_time)
        seqs.append(seq)
        scheduler.add(seq)
    result = SimResult(ttft=[], tpot=[], e2e=[], output_lens=[])
    if hasattr(step_time, "coverage"):
        step_time.coverage.reset()  # count this run's steps beyond the device's calibrated range
    now = 0.0
    for step in range(max_steps):
        if not scheduler.has_unfinished():
            break
        if give_up is not None and step % 32 == 0 and _late(seqs, now, give_up):
            result.abandoned = True
            break
        plan = scheduler.schedule(now)
        result.num_preemptions += len(plan.preempted_req_ids)
        if not plan.num_scheduled_tokens:
            if plan.preempted_req_ids:
                continue  # a step that only preempted: plan again
            nxt = scheduler.next_event_time(now)
            if nxt is None:
                raise RuntimeError("the scheduler made no progress with nothing due later; please report this")
            now = nxt
            continue
        dt = float(step_time(plan))
        if not math.isfinite(dt) or dt < 0:
            raise ValueError(f"step_time gave {dt!r} for a step of {plan.total_num_scheduled_tokens} tokens; a step's "
                             "cost must be a finite number of seconds >= 0")
        now += dt
        result.step_times.append(dt)
        result.step_tokens.append(plan.total_num_scheduled_tokens)
        result.step_seqs.append(len(plan.num_scheduled_tokens))
        starts = plan.num_computed_tokens_of()
        sampled = [[0] if starts[rid] + n >= scheduler.requests[rid].num_tokens else None
                   for rid, n in plan.num_scheduled_tokens.items()]
        result.step_ends.append(now)
        result.step_sampled.append(sum(x is not None for x in sampled))
        scheduler.update_from_output(plan, RunnerOutput(sampled=sampled, req_ids=list(plan.num_scheduled_tokens)), now)
    else:
        raise RuntimeError(f"simulation still running after {max_steps} steps")
    for seq in seqs:
        times = seq.token_times
        done = bool(times) and len(seq.output_ids) >= seq.request.max_new_tokens
        result.ttft.append(seq.first_token_time - seq.arrival_time if times else math.nan)
        result.tpot.append((times[-1] - times[0]) / (len(times) - 1) if done and len(times) > 1 else math.nan)
        result.e2e.append(times[-1] - seq.arrival_time if done else math.nan)
        result.output_lens.append(len(seq.output_ids))
        result.arrivals.append(seq.arrival_time)
    result.makespan = now - min(s.arrival_time for s in seqs) if seqs else 0.0
    if hasattr(step_time, "coverage"):
        result.coverage = step_time.coverage.report()
    return result


def _late(seqs, now: float, give_up: tuple) -> bool:
    target, first, last, max_late = give_up
    late = 0
    for seq in seqs[first:last + 1]:
        if seq.arrival_time > now - target:
            break  # arrival order: the rest have not waited that long yet
        t = seq.first_token_time if seq.token_times else now
        late += t - seq.arrival_time > target
    return late > max_late
