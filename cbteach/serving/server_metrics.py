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
(:mod:`.output_processor`). The exposition is ``prometheus_client``'s (what vLLM uses): its gauges,
counters and histograms in one registry per server, ``ServerMetrics.registry`` -- an operator who
wants more registers it there and ``/metrics`` shows it. (A counter also shows a ``_created``
series, the library's; the cores' own totals come through a custom collector, :class:`CoreTotals`.)
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


class CoreTotals:
    """A collector of the cores' own running totals: each core counts, the API server only relays its last
    report (a ``prometheus_client`` custom collector: the library's way to expose counts kept elsewhere)."""

    def __init__(self, model_name: str, totals: list):
        self.model_name, self.totals = model_name, totals

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for name, key, doc in CORE_COUNTERS:
            family = CounterMetricFamily(PREFIX + name.removesuffix("_total"), doc, labels=("model_name", "engine"))
            for i, t in enumerate(self.totals):
                family.add_metric((self.model_name, str(i)), t.get(key, 0))
            yield family


class ServerMetrics:
    """Everything ``/metrics`` shows, for one served model and its engine cores, in one ``prometheus_client``
    registry (``.registry``): an operator's own metrics registered there are scraped with these."""

    def __init__(self, model_name: str, num_cores: int = 1, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        # Python-side mirrors: what the stats log line reads (and tests), without a scrape
        self.cores = [{"num_running": 0, "num_waiting": 0, "kv_usage": 0.0, "load": 0} for _ in range(num_cores)]
        self.core_totals = [{} for _ in range(num_cores)]  # the cores' own running totals (CoreStats)
        self.counters = {"prompt_tokens_total": 0, "generation_tokens_total": 0}
        per_core, reg = ("model_name", "engine"), self.registry
        self._gauges = {key: Gauge(PREFIX + name, doc, per_core, registry=reg) for name, key, doc in CORE_GAUGES}
        for g in self._gauges.values():
            for i in range(num_cores):
                g.labels(model_name, str(i)).set(0)
        self.registry.register(CoreTotals(model_name, self.core_totals))
        self._tokens = {name: Counter(PREFIX + name, doc, ("model_name",), registry=reg).labels(model_name)
                        for name, doc in (("prompt_tokens_total", "Prompt tokens of the requests accepted."),
                                          ("generation_tokens_total", "Tokens generated."))}
        success = Counter(PREFIX + "request_success_total", "Answers finished whole.", ("model_name", "finished_reason"),
                          registry=reg)
        failure = Counter(PREFIX + "request_failure_total", "Requests that ended without a whole answer (abort: "
                          "the client left or the server stopped; error).", ("model_name", "reason"), registry=reg)
        self.success = {r: success.labels(model_name, r) for r in SUCCESS}
        self.failure = {r: failure.labels(model_name, r) for r in FAILURE}
        self.ttft, self.itl, self.e2e = (
            Histogram(PREFIX + name, doc, ("model_name",), buckets=buckets, registry=reg).labels(model_name)
            for name, doc, buckets in (("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS),
                                       ("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS),
                                       ("e2e_request_latency_seconds", "End-to-end latency of finished answers.",
                                        E2E_BUCKETS)))

    # -- from the output processor, on the event loop --------------------------------------------
    def accepted(self, state) -> None:
        self.counters["prompt_tokens_total"] += len(state.prompt_ids)
        self._tokens["prompt_tokens_total"].inc(len(state.prompt_ids))

    def tokens(self, state, n: int, now: float) -> None:
        self.counters["generation_tokens_total"] += n
        self._tokens["generation_tokens_total"].inc(n)
        if state.first_token_at is None:
            self.ttft.observe(now - state.created)
        else:
            self.itl.observe(now - state.last_token_at)

    def finished(self, state, reason: str, now: float) -> None:
        reason = REASON.get(reason, "error")
        if reason in self.success:
            self.success[reason].inc()
            self.e2e.observe(now - state.created)
        else:
            self.failure[reason].inc()

    def core_stats(self, core: int, stats, load: int) -> None:
        g = self.cores[core]
        g["num_running"], g["num_waiting"], g["load"] = stats.num_running, stats.num_waiting, load
        g["kv_usage"] = stats.kv_used / stats.kv_total if stats.kv_total else 0.0
        for key, gauge in self._gauges.items():
            gauge.labels(self.model_name, str(core)).set(g[key])
        self.core_totals[core].update({key: getattr(stats, key) for _, key, _ in CORE_COUNTERS})

    # -- the scrape -------------------------------------------------------------------------------
    def render(self) -> str:
        """The Prometheus text exposition format (version 0.0.4), written by ``prometheus_client``."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()


def parse(text: str) -> dict:
    """A scrape as ``{"name{labels}": value}`` (comments dropped): enough for tests and notebooks. The labels
    are written ``model_name`` first, then the others in the order the scrape gives them (``prometheus_client``
    sorts them by name), so a key reads ``cbteach:num_requests_running{model_name="m",engine="0"}``."""
    import re

    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            name, brace, labels = key.partition("{")
            if brace:
                pairs = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', labels)
                pairs.sort(key=lambda kv: kv[0] != "model_name")  # (a stable sort: the rest keep their order)
                key = name + "{" + ",".join(f'{k}="{v}"' for k, v in pairs) + "}"
            out[key] = float(value)
    return out
