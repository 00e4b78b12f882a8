"""One engine, one thread: the worker that steps the engine while HTTP handlers come and go.

The engine is not thread-safe, and it does not need to be: continuous batching is a *loop* --
schedule, run one forward pass, hand out the new tokens, repeat -- and between two iterations the
running batch may change. So one background thread owns the engine and does nothing else; the HTTP
side talks to it through a thread-safe inbox (``add`` and ``abort`` commands) and gets its events
back through a callback that must not block (the server passes ``loop.call_soon_threadsafe``).
A message that arrives while the batch runs is added before the *next* step, and joins the batch
then -- the request no longer waits for a batch to finish (Orca, Yu et al., OSDI'22).

What the worker adds around the engine, as a serving front end must (vLLM's ``OutputProcessor``
and detokenizer do the same):

* **Incremental text.** Each event carries the text the new tokens add; a byte-level tokenizer can
  split a character over two tokens, so an increment ending in half a character waits for the rest.
* **Stop strings.** The engine stops on ids (EOS, a length); ``stop`` is text, so it is checked on
  the decoded text after every step. When one appears, the answer is cut before it and the request
  is aborted in the engine at once: its KV blocks go back to the pool.
* **Aborts.** A client that hangs up sends ``abort``; the request leaves the batch before the next
  step and its blocks are freed.

Events a job receives, in order: ``("accepted", num_prompt_tokens)`` or ``("error", message)``;
then ``("delta", text, token_ids)`` per step that produced tokens; then once
``("finish", reason, num_output_tokens)`` with ``reason`` one of ``eos``, ``length``, ``stop``,
``abort``, ``error``.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

from ..core.request import Request
from ..core.sampling import SamplingParams

log = logging.getLogger("cbteach.serve")
IDLE_POLL_S = 0.25  # how often an idle worker looks at its stop flag
_ids = itertools.count()


@dataclass(eq=False)
class Job:
    """One choice of one HTTP request, as the worker tracks it."""

    prompt: object  # text or token ids
    max_tokens: int
    sampling: SamplingParams
    emit: Callable  # called from the worker thread with one event tuple; must not block
    stop: tuple = ()
    ignore_eos: bool = False
    request_id: str = field(default_factory=lambda: f"cmpl-{next(_ids)}")
    created: float = field(default_factory=time.perf_counter)  # when the HTTP request was read
    # the worker's state
    num_prompt_tokens: int = 0
    output_ids: list = field(default_factory=list)
    shown: str = ""  # text handed out so far
    first_token_at: float | None = None
    last_token_at: float | None = None
    done: bool = False


class EngineWorker:
    """Steps ``engine`` on a background thread; ``submit`` and ``abort`` may be called from any thread.

    ``metrics`` (a :class:`~cbteach.serving.server_metrics.ServerMetrics`) hears of every accepted request,
    token, step and finish; ``observers`` (the live view) are called after every step with
    ``(worker, record)``. Both run on the worker thread, so they must be quick.
    """

    def __init__(self, engine, *, metrics=None, observers=()):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.metrics = metrics
        self.observers = list(observers)
        self.jobs: dict[str, Job] = {}  # in flight, by request id (worker thread only)
        self.num_in_flight = 0  # read from other threads: a plain int, updated by the worker
        self._inbox: queue.Queue = queue.Queue()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cbteach-engine", daemon=True)

    # -- any thread --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; it is validated and added to the engine before the next step."""
        if self._stopping.is_set():
            job.emit(("error", "the server is shutting down"))
            return
        self._inbox.put(("add", job))

    def abort(self, request_id: str) -> None:
        """Ask for ``request_id`` to leave the batch before the next step (unknown or finished ids are ignored)."""
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        """Abort every request in flight before the next step (shutdown after the drain timeout)."""
        self._inbox.put(("abort_all", None))

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is still in flight and end the thread (bounded by ``timeout``)."""
        self._stopping.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- the worker thread -------------------------------------------------------------------
    def _run(self) -> None:
        import torch

        if self.engine.model.device.type == "cpu":
            torch.set_num_threads(1)  # as the notebooks do: small models, and the HTTP side needs a core too
        while not self._stopping.is_set():
            if self._drain(block=not self.jobs) and self.metrics is not None:
                self.metrics.refresh(self)  # an abort or an admission shows in /metrics at once
            if not self.jobs:
                continue
            try:
                record = self.engine.step()
            except Exception:  # a bug, not bad input (that was refused in _add): fail loudly, keep serving
                log.error("engine step failed:\n%s", traceback.format_exc())
                for job in list(self.jobs.values()):
                    self._finish(job, "error")
                continue
            self._handle(record)
        for job in list(self.jobs.values()):
            self._finish(job, "abort")

    def _drain(self, block: bool) -> bool:
        """Carry out the queued commands (waiting up to IDLE_POLL_S for one when ``block``); True if any."""
        try:
            cmd = self._inbox.get(timeout=IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            kind, arg = cmd
            if kind == "add":
                self._add(arg)
            elif kind == "abort" and arg in self.jobs:
                self._finish(self.jobs[arg], "abort")
            elif kind == "abort_all":
                for job in list(self.jobs.values()):
                    self._finish(job, "abort")
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _add(self, job: Job) -> None:
        try:
            ids = job.prompt if not isinstance(job.prompt, str) else self.tokenizer(job.prompt)["input_ids"]
            self.engine.add_request(Request(list(ids), job.max_tokens, request_id=job.request_id,
                                            sampling_params=job.sampling, ignore_eos=job.ignore_eos))
        except ValueError as err:  # the engine's own validation: vocabulary, positions, KV pool size
            job.emit(("error", str(err)))
            return
        job.num_prompt_tokens = len(ids)
        self.jobs[job.request_id] = job
        self.num_in_flight = len(self.jobs)
        if self.metrics is not None:
            self.metrics.accepted(job)
        job.emit(("accepted", job.num_prompt_tokens))

    def _handle(self, record) -> None:
        now = time.perf_counter()
        for s in record.seqs:
            job = self.jobs.get(s.request_id)
            if job is None or not s.new_token_ids:
                continue
            if self.metrics is not None:
                self.metrics.tokens(job, len(s.new_token_ids), now)
            if job.first_token_at is None:
                job.first_token_at = now
            job.output_ids.extend(s.new_token_ids)
            text, cut = self._text(job)
            final = s.finish_reason is not None or cut
            delta = self._increment(job, text, final)
            job.emit(("delta", delta, list(s.new_token_ids)))
            job.last_token_at = now
            if cut:
                self._finish(job, "stop")
            elif s.finish_reason is not None:
                self._finish(job, s.finish_reason, in_engine=False)
        if self.metrics is not None:
            self.metrics.step(self, record)
        for observe in self.observers:
            observe(self, record)

    def _text(self, job: Job) -> tuple[str, bool]:
        """The answer's text so far, cut before the first stop string (and whether one was found)."""
        text = self.tokenizer.decode(job.output_ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in job.stop) if i >= 0]
        return (text[:min(cuts)], True) if cuts else (text, False)

    @staticmethod
    def _increment(job: Job, text: str, final: bool) -> str:
        """What ``text`` adds to what was shown; held back while it could still be the start of a stop string
        or ends in half a character."""
        hold = 0 if final else max((len(s) - 1 for s in job.stop), default=0)
        if not final and text.endswith("\ufffd"):
            return ""
        visible = text[:len(text) - hold] if hold else text
        if not visible.startswith(job.shown) or len(visible) <= len(job.shown):
            return ""
        delta, job.shown = visible[len(job.shown):], visible
        return delta

    def _finish(self, job: Job, reason: str, in_engine: bool = True) -> None:
        """End ``job``: aborted in the engine if it is still there (blocks freed now), its last event sent."""
        if job.done:
            return
        job.done = True
        self.jobs.pop(job.request_id, None)
        self.num_in_flight = len(self.jobs)
        if in_engine and not self.engine.sequences[job.request_id].status.is_finished:
            self.engine.abort(job.request_id)
        job.emit(("finish", reason, len(job.output_ids)))
        if self.metrics is not None:
            self.metrics.finished(job, reason, time.perf_counter())
