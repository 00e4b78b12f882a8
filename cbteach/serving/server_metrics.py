"""``GET /metrics``: the server's state and latencies in Prometheus' text format, with vLLM's names.

A production server is watched, not asked: Prometheus scrapes ``/metrics`` every few seconds and a
dashboard draws the batch filling up. The names are vLLM's (``vllm/v1/metrics/loggers.py``) under a
``cbteach:`` prefix, so a vLLM dashboard reads this server after a search-and-replace. As in vLLM,
what belongs to one engine core carries its index in an ``engine`` label:

* per core, gauges -- ``num_requests_running`` (in its batch), ``num_requests_waiting`` (queued,
  preempted or swapped out), ``kv_cache_usage_perc`` (used KV blocks / all blocks, 0 to 1),
  ``engine_load_tokens`` (what routing compares: tokens it still has to compute);
* per core, counters -- ``num_preemptions_total``, and how the core and the API server talk:
  ``engine_core_steps_total``, ``engine_core_messages_{out,in}_total`` and
  ``engine_core_bytes_{out,in}_total`` (one message out per step), and where the core's time went,
  ``engine_core_{step,idle,io}_seconds_total`` (stepping; waiting for requests with nothing to do;
  encoding, sending and receiving);
* counters -- ``prompt_tokens_total``, ``generation_tokens_total``,
  ``request_success_total{finished_reason=...}`` (only ``stop`` and ``length``: an answer the client
  got whole) and ``request_failure_total{reason=...}`` (``abort``: the client left or the server
  stopped first; ``error``: it failed in the engine, or its core died);
* histograms -- ``time_to_first_token_seconds`` (from the moment the HTTP request was read: queueing
  and prefill), ``inter_token_latency_seconds`` (one gap per request per step that gave it tokens),
  ``e2e_request_latency_seconds`` (answers that finished).

Everything is updated on the API server's event loop, as each step's message arrives
(:mod:`.output_processor`), and rendered there: no locks.
"""
from __future__ import annotations

PREFIX = "cbteach:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
SUCCESS = ("stop", "length")
FAILURE = ("abort", "error")
REASON = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error", "dead": "error"}
CORE_GAUGES = (("num_requests_running", "num_running", "Requests in the core's running batch."),
               ("num_requests_waiting", "num_waiting", "Requests queued, preempted or swapped out."),
               ("kv_cache_usage_perc", "kv_usage", "Fraction of the core's KV blocks in use (1 = full)."),
               ("engine_load_tokens", "load", "Tokens the core still has to compute (what routing compares)."))
CORE_COUNTERS = (("num_preemptions_total", "num_preemptions", "Preemptions."),
                 ("engine_core_steps_total", "num_steps", "Engine steps (forward passes)."),
                 ("engine_core_messages_out_total", "num_messages_out", "Messages the core sent (one per step)."),
                 ("engine_core_bytes_out_total", "bytes_out", "Bytes of the messages the core sent."),
                 ("engine_core_messages_in_total", "num_messages_in", "Messages the core received."),
                 ("engine_core_bytes_in_total", "bytes_in", "Bytes of the messages the core received."),
                 ("engine_core_step_seconds_total", "step_s", "Seconds the core spent in Engine.step()."),
                 ("engine_core_idle_seconds_total", "idle_s", "Seconds the core waited for requests, idle."),
                 ("engine_core_io_seconds_total", "io_s", "Seconds the core spent encoding, sending, receiving."))


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
    """Everything ``/metrics`` shows, for one served model and its engine cores."""

    def __init__(self, model_name: str, num_cores: int = 1):
        self.labels = f'model_name="{model_name}"'
        self.cores = [{"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "load": 0} for _ in range(num_cores)]
        self.core_totals = [{} for _ in range(num_cores)]  # the cores' own running totals (CoreStats)
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0}
        self.success = dict.fromkeys(SUCCESS, 0)
        self.failure = dict.fromkeys(FAILURE, 0)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    # -- from the output processor, on the event loop --------------------------------------------
    def accepted(self, state) -> None:
        self.counters["prompt_tokens_total"] += len(state.prompt_ids)

    def tokens(self, state, n: int, now: float) -> None:
        self.counters["generation_tokens_total"] += n
        if state.first_token_at is None:
            self.ttft.observe(now - state.created)
        else:
            self.itl.observe(now - state.last_token_at)

    def finished(self, state, reason: str, now: float) -> None:
        reason = REASON.get(reason, "error")
        if reason in self.success:
            self.success[reason] += 1
            self.e2e.observe(now - state.created)
        else:
            self.failure[reason] += 1

    def core_stats(self, core: int, stats, load: int) -> None:
        g = self.cores[core]
        g["num_running"], g["num_waiting"], g["load"] = stats.num_running, stats.num_waiting, load
        g["kv_usage"] = stats.kv_used / stats.kv_total if stats.kv_total else 0.0
        self.core_totals[core] = {key: getattr(stats, key) for _, key, _ in CORE_COUNTERS}

    # -- the scrape -------------------------------------------------------------------------------
    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        p, lab = PREFIX, self.labels
        out = []
        for name, key, doc in CORE_GAUGES:
            out += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} gauge"]
            out += [f'{p}{name}{{{lab},engine="{i}"}} {g[key]}' for i, g in enumerate(self.cores)]
        for name, key, doc in CORE_COUNTERS:
            out += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} counter"]
            out += [f'{p}{name}{{{lab},engine="{i}"}} {t.get(key, 0)}' for i, t in enumerate(self.core_totals)]
        for name, value in self.counters.items():
            out += [f"# HELP {p}{name} {name.replace('_', ' ')}.", f"# TYPE {p}{name} counter",
                    f"{p}{name}{{{lab}}} {value}"]
        for name, label, doc, table in (("request_success_total", "finished_reason", "Answers finished whole.",
                                         self.success),
                                        ("request_failure_total", "reason", "Requests that ended without a whole "
                                         "answer (abort: the client left or the server stopped; error).",
                                         self.failure)):
            out += [f"# HELP {p}{name} {doc}", f"# TYPE {p}{name} counter"]
            out += [f'{p}{name}{{{lab},{label}="{r}"}} {n}' for r, n in table.items()]
        for name, doc, hist in (("time_to_first_token_seconds", "Time to first token.", self.ttft),
                                ("inter_token_latency_seconds", "Inter-token latency.", self.itl),
                                ("e2e_request_latency_seconds", "End-to-end latency of finished answers.", self.e2e)):
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
