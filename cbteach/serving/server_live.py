"""The live view's data: one small summary per engine step, of every engine core, pushed to every open page.

The notebooks draw the running batch after the fact, from step records. The server draws it while it
happens: every step message an engine core sends (:class:`~.core_messages.StepOutputs`) is turned
into a summary -- which core, when (``core_t``: on the core's clock, when it sent the message;
``t``: on the API server's, when it arrived, comparable between cores) and for how long
(``duration``, the step inside the engine), the message's ``bytes``, who ran in which batch slot, prefill or decode,
how many tokens, who was admitted, finished or preempted, how many wait, how many KV blocks are in
use -- on the API
server's event loop, which fans it out to the pages listening on ``GET /live/events`` (server-sent
events) and keeps the last :data:`HISTORY` in memory for ``GET /live/steps`` (what notebook 11 reads).

A slow page must never slow the server: each listener has a bounded queue and loses old steps when
it falls behind (the view is a picture, not a log), and at most ``max_listeners`` pages may listen
at once -- one more is refused (503) instead of making every stream pay for it.
"""
from __future__ import annotations

import asyncio
import collections
import time

HISTORY = 2000  # steps kept for /live/steps and for a page that opens mid-run
LISTENER_QUEUE = 1000
MAX_LISTENERS = 16


class LiveHub:
    """Step summaries from the output processor to asyncio listeners (all on the event loop)."""

    def __init__(self, max_batch_size: int, num_cores: int = 1, history: int = HISTORY,
                 max_listeners: int = MAX_LISTENERS):
        self.max_batch_size = max_batch_size  # the slots the page draws, per core
        self.num_cores = num_cores
        self.history: collections.deque = collections.deque(maxlen=history)
        self.listeners: set = set()
        self.max_listeners = max_listeners
        self.closed = False
        self.seq = 0  # summaries published so far: a page asks for those after the last it saw
        self.t0 = time.perf_counter()

    def publish(self, m, nbytes: int = 0) -> None:
        """Summarise one step message of a core and hand it to every listener."""
        if not m.outputs and not m.preempted:
            return
        done = {f.request_id for f in m.finished}
        s = m.stats
        summary = {
            "n": self.seq, "core": m.core, "step": m.step, "core_t": round(m.t, 5),
            "t": round(time.perf_counter() - self.t0, 5),
            "duration": round(m.duration, 6), "bytes": nbytes,
            "seqs": [[o.request_id, o.slot, o.kind, o.num_scheduled_tokens, len(o.new_token_ids)] for o in m.outputs],
            "admitted": list(m.admitted), "finished": sorted(done), "preempted": list(m.preempted),
            "waiting": s.num_waiting, "kv_used": s.kv_used, "kv_total": s.kv_total,
        }
        self.seq += 1
        self.history.append(summary)
        if self.closed:
            return
        for q in self.listeners:
            if q.full():
                q.get_nowait()  # drop the oldest: the page catches up
            q.put_nowait(summary)

    def subscribe(self) -> asyncio.Queue | None:
        """A queue of summaries for one page, or None when ``max_listeners`` already listen."""
        if len(self.listeners) >= self.max_listeners:
            return None
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
        return [s for s in self.history if s["n"] > since]
