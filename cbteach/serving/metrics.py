"""Serving metrics, defined the way vLLM's benchmarks define them, computed from completions alone.

For one request, with every time on the engine's clock:

* **TTFT** (time to first token) = ``first_token_time - arrival_time``: queueing plus prefill.
* **ITL** (inter-token latency) = every gap between two consecutive tokens of the request.
* **TPOT** (time per output token) = ``(e2e - TTFT) / (output tokens - 1)``: the mean ITL of the
  request, undefined for a one-token output.
* **E2E latency** = ``finish_time - arrival_time``.

Over a run: **throughput** in output tokens per second and requests per second (over the span
from the first arrival to the last finish), percentiles (p50, p90, p99) and means of each latency
(ITL pooled over all gaps of all requests, as vLLM does), and **goodput** -- requests per second
that met given TTFT and TPOT targets (DistServe's measure of useful throughput).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestMetrics:
    request_id: object
    ttft: float
    tpot: float | None  # None for a one-token output
    itls: list[float]
    e2e: float
    num_output_tokens: int


def request_metrics(c) -> RequestMetrics:
    """TTFT, TPOT, ITLs and E2E latency of one :class:`~cbteach.core.request.Completion`."""
    if c.first_token_time is None or not c.token_times:
        raise ValueError(f"request {c.request_id!r} produced no token: it has no latency to measure")
    ttft = c.first_token_time - c.arrival_time
    finish = c.finish_time if c.finish_time is not None else c.token_times[-1]
    e2e = finish - c.arrival_time
    n = len(c.token_times)
    tpot = (e2e - ttft) / (n - 1) if n > 1 else None
    itls = [b - a for a, b in zip(c.token_times, c.token_times[1:])]
    return RequestMetrics(c.request_id, ttft, tpot, itls, e2e, len(c.output_ids))


def _stats(name: str, values: list[float]) -> dict:
    if not values:
        return {f"{name}_mean": None, **{f"{name}_p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=float)
    return {f"{name}_mean": float(arr.mean()), **{f"{name}_p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(completions, duration: float | None = None, ttft_target: float | None = None,
              tpot_target: float | None = None) -> dict:
    """Throughput, latency percentiles and goodput of a run (times in seconds).

    ``duration`` defaults to first arrival -> last finish. Aborted requests and requests that
    produced no token count in ``num_requests`` but not in the latencies. A request is *good*
    when it meets every target given (a one-token request has no TPOT and meets any TPOT target).
    ``completions``: a list of :class:`~cbteach.Completion` (``engine.run``'s result) or the engine's
    ``completions`` dict.
    """
    if isinstance(completions, dict):  # engine.completions: request id -> Completion
        completions = completions.values()
    completions = list(completions)
    wrong = next((c for c in completions if not hasattr(c, "token_times")), None)
    if wrong is not None:
        raise ValueError(f"summarize() takes completions (what Engine.run returns), got a {type(wrong).__name__}")
    for name, value in (("duration", duration), ("ttft_target", ttft_target), ("tpot_target", tpot_target)):
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0):
            raise ValueError(f"{name} must be None or a number of seconds > 0, got {value!r}")
    done = [c for c in completions if c.finish_reason != "aborted" and c.token_times]
    per = [request_metrics(c) for c in done]
    if duration is None:
        starts = [c.arrival_time for c in completions]
        ends = [c.finish_time if c.finish_time is not None else c.token_times[-1] for c in done]
        duration = (max(ends) - min(starts)) if ends else 0.0
    out_tokens = sum(m.num_output_tokens for m in per)
    good = [m for m in per if (ttft_target is None or m.ttft <= ttft_target)
            and (tpot_target is None or m.tpot is None or m.tpot <= tpot_target)]
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: None)
    summary = {"num_requests": len(completions), "num_completed": len(done), "duration": duration,
               "output_tokens": out_tokens, "tokens_per_s": rate(out_tokens), "requests_per_s": rate(len(done)),
               "goodput": rate(len(good)), "num_good": len(good)}
    summary.update(_stats("ttft", [m.ttft for m in per]))
    summary.update(_stats("tpot", [m.tpot for m in per if m.tpot is not None]))
    summary.update(_stats("itl", [x for m in per for x in m.itls]))
    summary.update(_stats("e2e", [m.e2e for m in per]))
    return summary
