"""The live view's data: one small summary per engine step, pushed to every open page.

The notebooks draw the running batch after the fact, from step records. The server draws it while it
happens: after every step the worker thread hands the step's record to :meth:`LiveHub.observe`, which
turns it into a summary -- who ran in which batch slot, prefill or decode, how many tokens, who was
admitted, finished or preempted, how many wait, how many KV blocks are in use -- and passes it to the
event loop, which fans it out to the pages listening on ``GET /live/events`` (server-sent events) and
keeps the last :data:`HISTORY` in memory for ``GET /live/steps`` (what notebook 11 reads).

A slow page must never slow the engine: each listener has a bounded queue and loses old steps when it
falls behind (the view is a picture, not a log).
"""
from __future__ import annotations

import asyncio
import collections
import time

HISTORY = 2000  # steps kept for /live/steps and for a page that opens mid-run
LISTENER_QUEUE = 1000


class LiveHub:
    """Step summaries from the worker thread to asyncio listeners."""

    def __init__(self, max_batch_size: int, history: int = HISTORY):
        self.max_batch_size = max_batch_size  # the slots the page draws
        self.history: collections.deque = collections.deque(maxlen=history)
        self.listeners: set = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False
        self.t0 = time.perf_counter()

    def bind(self, loop) -> None:
        """Called once the server's event loop runs."""
        self.loop = loop

    # -- worker thread -----------------------------------------------------------------------
    def observe(self, worker, record) -> None:
        """Summarise one step (worker thread) and hand it to the event loop."""
        if not record.seqs:
            return
        usage = worker.engine.kv_usage()
        metrics = worker.metrics
        summary = {
            "step": worker.engine.num_steps - 1,
            "t": round(time.perf_counter() - self.t0, 4),
            "seqs": [[s.request_id, s.slot, s.kind, s.num_scheduled_tokens, len(s.new_token_ids)]
                     for s in record.seqs],
            "admitted": list(record.admitted), "finished": list(record.finished),
            "preempted": list(record.preempted),
            "waiting": metrics.waiting if metrics is not None else record.num_waiting,
            "kv_used": usage.get("num_used_blocks"), "kv_total": usage.get("num_blocks"),
        }
        if self.loop is not None and not self.closed:
            try:
                self.loop.call_soon_threadsafe(self._publish, summary)
            except RuntimeError:  # the loop closed under us: the server is going down
                pass

    # -- event loop --------------------------------------------------------------------------
    def _publish(self, summary) -> None:
        self.history.append(summary)
        for q in list(self.listeners):
            if q.full():
                q.get_nowait()  # drop the oldest: the page catches up
            q.put_nowait(summary)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue(LISTENER_QUEUE)
        self.listeners.add(q)
        return q

    def unsubscribe(self, q) -> None:
        self.listeners.discard(q)

    def close(self) -> None:
        """End every listener's stream (shutdown: open pages must not hold the server up)."""
        self.closed = True
        for q in list(self.listeners):
            if q.full():
                q.get_nowait()
            q.put_nowait(None)

    def steps(self, since: int = -1) -> list:
        return [s for s in self.history if s["step"] > since]
