"""What the server tells its operator: the banner, failures, drains, periodic stats -- and never a key.

An operator reads a server's log before anything else. vLLM's shows, at start, the KV cache's size and
the concurrency it allows; then every 10 s a line of running and waiting requests, KV cache usage and
prompt and generation throughput (``vllm/v1/metrics/loggers.py``, ``LoggingStatLogger``). This
server's log, on the ``cbteach.serve`` logger (uvicorn's format):

* at start (:func:`banner_lines`): each core's KV cache in tokens and blocks, and the maximum
  concurrency at the longest request the model allows (KV tokens / that length, at most the batch
  slots); a warning when the engine cores' threads outnumber the machine's processors (they then
  compete, and throughput drops);
* ``WARNING`` (the default level): one line per request that failed -- its id, the id its engine
  core knew it by, why (:meth:`ServeLog.failed`) -- and a drain's start and end, with the requests
  it aborted (:meth:`ServeLog.drain_started`, :meth:`ServeLog.drain_ended`);
* ``INFO``: every ``--stats-interval`` seconds (:class:`StatsLogger`), one line: requests running and
  waiting, each core's KV cache usage, and the prompt and generation tokens/s since the last line --
  only while there is something to say (work in the interval, or work still there); and uvicorn's access lines,
  with any ``key=`` in a URL (the live view's ``/?key=KEY``) written as ``key=***``
  (:class:`RedactKeys`).
"""
from __future__ import annotations

import asyncio
import logging
import os
import re
import time

log = logging.getLogger("cbteach.serve")
KEY_IN_URL = re.compile(r"([?&](?:api_)?key=)[^&\s\"]*", re.IGNORECASE)


def setup(level: str) -> None:
    """``cbteach.serve`` writes to stderr at ``level``, formatted as uvicorn's own lines (set up once)."""
    log.setLevel(level.upper())
    if not any(getattr(h, "cbteach", False) for h in log.handlers):
        from uvicorn.logging import DefaultFormatter

        handler = logging.StreamHandler()
        handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
        handler.cbteach = True
        log.addHandler(handler)
        log.propagate = False
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, RedactKeys) for f in access.filters):
        access.addFilter(RedactKeys())


class RedactKeys(logging.Filter):
    """Rewrites ``key=SECRET`` in a log record's URL as ``key=***``: a key must never reach a log file."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(KEY_IN_URL.sub(r"\1***", a) if isinstance(a, str) else a for a in record.args)
        elif isinstance(record.msg, str):
            record.msg = KEY_IN_URL.sub(r"\1***", record.msg)
        return True


def processors() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def banner_lines(args, ready) -> list[str]:
    """The KV cache and concurrency of the cores (``ready``: their :class:`~.core_messages.Ready`), and the
    processors warning."""
    r = ready[0]
    out = []
    if r.kv_kind == "paged" and r.num_blocks and r.block_size:
        tokens = r.num_blocks * r.block_size
        most = min(tokens / r.max_positions, r.max_batch_size) if r.max_positions else r.max_batch_size
        out.append(f"KV cache per engine core: {tokens:,} tokens ({r.num_blocks:,} blocks of {r.block_size}); "
                   f"maximum concurrency at {r.max_positions:,} tokens per request (the model's longest): "
                   f"{most:.2f}x ({r.max_batch_size} batch slots)")
    else:
        out.append(f"KV cache per engine core: {r.kv_kind}, grown per request (no pool to size); "
                   f"{r.max_batch_size} batch slots, {r.max_positions:,} tokens per request at most")
    if args.device == "cpu":
        cores = args.data_parallel_size * args.tensor_parallel_size
        want, have = cores * args.threads, processors()
        if want > have:
            out.append(f"warning: {cores} engine-core process{'es' if cores > 1 else ''} x {args.threads} "
                       f"thread{'s' if args.threads > 1 else ''} = {want} threads on {have} processor"
                       f"{'s' if have > 1 else ''}: they will compete and throughput drops; use fewer "
                       "(--data-parallel-size, --tensor-parallel-size, --threads)")
    return out


class ServeLog:
    """The operator's lines about requests and drains (all called on the event loop)."""

    def __init__(self, frontend):
        self.fe = frontend
        self.drain_at = None
        self.aborted: list = []  # http ids the drain aborted

    def failed(self, state, reason: str, error) -> None:
        what = "its engine core died" if reason == "dead" else "failed in the engine"
        log.warning("request %s (core %d, %s) %s: %s", state.http_id or "?", state.core, state.request_id, what,
                    (error or "no detail").splitlines()[0])

    def drain_started(self, timeout: float) -> None:
        self.drain_at = time.monotonic()
        n = self.fe.num_in_flight
        log.warning("draining: no new requests; %d in flight may finish for up to %g s (--drain-timeout), then "
                    "are aborted", n, timeout)

    def drain_aborting(self, states) -> None:
        ids = sorted({st.http_id or st.request_id for st in states})
        self.aborted += ids
        if ids:
            log.warning("drain: aborting %d request%s still in flight: %s", len(ids), "s" if len(ids) > 1 else "",
                        ", ".join(ids[:20]) + (" ..." if len(ids) > 20 else ""))

    def drain_ended(self) -> None:
        if self.drain_at is None:
            return
        took = time.monotonic() - self.drain_at
        log.warning("drain done in %.1f s: %d request%s aborted%s", took, len(self.aborted),
                    "" if len(self.aborted) == 1 else "s", "" if not self.aborted else " (" + ", ".join(
                        self.aborted[:20]) + (" ..." if len(self.aborted) > 20 else "") + ")")


class StatsLogger:
    """Every ``interval`` seconds, one line at INFO (vLLM's ``LoggingStatLogger``)."""

    def __init__(self, metrics, interval: float):
        self.metrics, self.interval = metrics, interval
        self.task = None

    def start(self) -> None:
        if log.isEnabledFor(logging.INFO):
            self.task = asyncio.get_running_loop().create_task(self._run())

    def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()

    def totals(self) -> tuple:
        c = self.metrics.counters
        return c["prompt_tokens_total"], c["generation_tokens_total"]

    async def _run(self) -> None:
        last, t = self.totals(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval)
            now_totals, now = self.totals(), time.monotonic()
            self.log_once([(b - a) / max(now - t, 1e-9) for a, b in zip(last, now_totals)])
            last, t = now_totals, now

    def log_once(self, rates) -> None:
        prompt, generation = rates
        cores = self.metrics.cores
        running, waiting = sum(c["num_running"] for c in cores), sum(c["num_waiting"] for c in cores)
        if not running and not waiting and not prompt and not generation:
            return  # an idle server says nothing
        kv = ", ".join(f"{100 * c['kv_usage']:.1f}%" for c in cores)
        log.info("running %d, waiting %d, KV cache usage %s; prompt %.1f tokens/s, generation %.1f tokens/s",
                 running, waiting, kv + (" (per engine core)" if len(cores) > 1 else ""), prompt, generation)
