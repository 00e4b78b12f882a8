"""``GET /metrics``: the server's state and latencies in Prometheus' text format, with vLLM's names.

A production server is watched, not asked: Prometheus scrapes ``/metrics`` every few seconds and a
dashboard draws the batch filling up. The names are vLLM's (``vllm/v1/metrics/loggers.py``) under a
``cbteach:`` prefix, so a vLLM dashboard reads this server after a search-and-replace:

* gauges -- ``num_requests_running`` (in the batch), ``num_requests_waiting`` (queued, preempted or
  swapped out), ``kv_cache_usage_perc`` (used KV blocks / all blocks, 0 to 1);
* counters -- ``prompt_tokens_total``, ``generation_tokens_total``, ``num_preemptions_total``,
  ``request_success_total{finished_reason=...}`` (``stop``, ``length``, ``abort``, ``error``);
* histograms -- ``time_to_first_token_seconds`` (from the moment the HTTP request was read: queueing
  and prefill), ``inter_token_latency_seconds`` (one gap per request per step that gave it tokens),
  ``e2e_request_latency_seconds``.

The worker thread updates everything (it owns the engine; the gauges are refreshed after every step
and after every command it takes, so an abort shows at once); the HTTP thread only renders, under a
lock.
"""
from __future__ import annotations

import threading

PREFIX = "cbteach:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
OUT_OF_BATCH = ("waiting", "preempted", "swapped")  # RequestStatus values of a request not in the running batch


class Histogram:
    """Cumulative buckets, a sum and a count: what Prometheus needs to estimate percentiles."""

    def __init__(self, buckets):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out = [f'{name}_bucket{{{labels},le="{edge}"}} {n}' for edge, n in zip(self.buckets, self.counts)]
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {self.count}')
        return out + [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]


class ServerMetrics:
    """Everything ``/metrics`` shows, for one served model."""

    def __init__(self, model_name: str):
        self.labels = f'model_name="{model_name}"'
        self.lock = threading.Lock()
        self.running = self.waiting = 0
        self.kv_usage = 0.0
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0, "num_preemptions_total": 0}
        self.finished_by_reason = dict.fromkeys(FINISH_REASONS, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    # -- called by the worker thread ---------------------------------------------------------------
    def accepted(self, job) -> None:
        with self.lock:
            self.counters["prompt_tokens_total"] += job.num_prompt_tokens

    def tokens(self, job, n: int, now: float) -> None:
        with self.lock:
            self.counters["generation_tokens_total"] += n
            if job.first_token_at is None:
                self.ttft.observe(now - job.created)
            else:
                self.itl.observe(now - job.last_token_at)

    def step(self, worker, record) -> None:
        with self.lock:
            self.counters["num_preemptions_total"] += len(record.preempted)
        self.refresh(worker)

    def finished(self, job, reason: str, now: float) -> None:
        reason = {"eos": "stop"}.get(reason, reason)  # the engine's "eos" is OpenAI's (and vLLM's) "stop"
        with self.lock:
            self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
            self.e2e.observe(now - job.created)

    def refresh(self, worker) -> None:
        """The gauges, read from the engine (on the worker thread: the engine is not thread-safe)."""
        engine = worker.engine
        statuses = [engine.sequences[rid].status.value for rid in worker.jobs]
        waiting = sum(s in OUT_OF_BATCH for s in statuses)
        usage = engine.kv_usage()
        kv = usage["num_used_blocks"] / usage["num_blocks"] if usage.get("num_blocks") else 0.0
        with self.lock:
            self.running, self.waiting, self.kv_usage = len(statuses) - waiting, waiting, kv

    # -- called by the HTTP side -------------------------------------------------------------------
    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        p, lab = PREFIX, self.labels
        with self.lock:
            out = []
            for name, kind, doc, value in (
                    ("num_requests_running", "gauge", "Requests in the running batch.", self.running),
                    ("num_requests_waiting", "gauge", "Requests queued, preempted or swapped out.", self.waiting),
                    ("kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full).", self.kv_usage)):
                out += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} {kind}", f"{p}{name}{{{lab}}} {value}"]
            for name, value in self.counters.items():
                out += [f"# HELP {p}{name} {name.replace('_', ' ')}.", f"# TYPE {p}{name} counter",
                        f"{p}{name}{{{lab}}} {value}"]
            name = f"{p}request_success_total"
            out += [f"# HELP {name} Finished requests, by finish reason.", f"# TYPE {name} counter"]
            out += [f'{name}{{{lab},finished_reason="{r}"}} {n}' for r, n in self.finished_by_reason.items()]
            for name, doc, hist in (("time_to_first_token_seconds", "Time to first token.", self.ttft),
                                    ("inter_token_latency_seconds", "Inter-token latency.", self.itl),
                                    ("e2e_request_latency_seconds", "End-to-end request latency.", self.e2e)):
                out += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} histogram"] + hist.lines(p + name, lab)
        return "\n".join(out) + "\n"


def parse(text: str) -> dict:
    """A scrape as ``{"name{labels}": value}`` (comments dropped): enough for tests and notebooks."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
