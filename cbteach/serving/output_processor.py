"""The API server's side of every step: token ids from the engine core in, text for each request out.

vLLM V1's ``OutputProcessor`` (``vllm/v1/engine/output_processor.py``) runs in the API process, on
its event loop: for every message of per-step outputs from the engine core it finds each request's
state, detokenizes the new ids incrementally (:mod:`.detokenizer`), checks stop strings, updates the
metrics and wakes the HTTP handler of that request. One message per step means one wake-up of the
loop per step, not one per sequence; and the handler of a stream that fell behind finds several
events waiting and writes them in one send.

A :class:`RequestState` is one choice of one HTTP request as the API server tracks it. Its
handler reads ``(choice index, event)`` pairs from ``state.queue``; a choice's events come in order::

    ("accepted", num_prompt_tokens) | ("rejected", why)
    ("delta", text, token_ids)                      per step that gave it tokens
    ("finish", reason, num_output_tokens, error)    once

where ``reason`` is the engine's (``eos``, ``stop``, ``length``, ``error``), ``abort`` (its client
left, or the server is shutting down) or ``dead`` (its engine core died).
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from .detokenizer import IncrementalDetokenizer


@dataclass(eq=False)
class RequestState:
    """One choice of one HTTP request, from the moment it is routed to a core until it finishes."""

    request_id: str  # the id the engine core knows it by
    prompt_ids: list
    max_tokens: int
    detok: IncrementalDetokenizer
    queue: asyncio.Queue  # its HTTP handler's; shared by the choices of one request
    index: int = 0  # which choice of its HTTP request
    core: int = -1
    created: float = field(default_factory=time.perf_counter)  # when its HTTP request was read
    num_output_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    charged: int = 0  # tokens counted in its core's load (routing)
    done: bool = False
    http_id: str = ""  # the id its client sees (cmpl-..., chatcmpl-...): what the operator's log names

    def push(self, event) -> None:
        self.queue.put_nowait((self.index, event))

    @property
    def remaining_tokens(self) -> int:
        """What the core may still compute for it: its prompt (until its first token) and its outputs."""
        return (len(self.prompt_ids) if self.first_token_at is None else 0) + self.max_tokens - self.num_output_tokens


class OutputProcessor:
    """Request states by core-side id, and what each step message does to them."""

    def __init__(self, metrics=None, hub=None):
        self.states: dict[str, RequestState] = {}
        self.metrics, self.hub = metrics, hub
        self.load: list[int] = []  # tokens each core still has to compute, as far as the API server knows
        self.abort_in_core = None  # set by the client: sends an Abort to a request's core
        self.on_failed = None  # called as on_failed(state, reason, error) when a request fails (the log's line)
        self.process_s = 0.0  # seconds spent handling step messages (the API server's share of a step)
        self.num_messages = 0

    def add(self, state: RequestState, core: int) -> None:
        state.core = core
        self.states[state.request_id] = state
        self._charge(state)

    def _charge(self, state: RequestState) -> None:
        new = 0 if state.done else state.remaining_tokens
        self.load[state.core] += new - state.charged
        state.charged = new

    # -- one message from a core ----------------------------------------------------------------
    def process(self, m, nbytes: int = 0) -> None:
        """Apply one :class:`~.core_messages.StepOutputs` (``nbytes``: its size on the wire)."""
        t = time.perf_counter()
        self.num_messages += 1
        states = self.states
        for rid in m.accepted:
            st = states.get(rid)
            if st is not None:
                st.push(("accepted", len(st.prompt_ids)))
                if self.metrics is not None:
                    self.metrics.accepted(st)
        for rid, why in m.rejected:
            st = states.pop(rid, None)
            if st is not None:
                st.done = True
                self._charge(st)
                st.push(("rejected", why))
        for o in m.outputs:
            st = states.get(o.request_id)
            if st is None or not o.new_token_ids:
                continue
            try:
                self._tokens(st, o.new_token_ids, t)
            except Exception as err:  # noqa: BLE001  (its tokenizer failed on its ids: that request alone ends)
                self.abort_in_core(st)
                self.end(st, "error", f"the tokenizer could not decode this request's tokens: {type(err).__name__}: {err}")
                continue
            if st.detok.stopped:  # a stop string: the engine does not know, so tell it to drop the request
                self.abort_in_core(st)
                self.end(st, "stop")
        for f in m.finished:
            st = states.get(f.request_id)
            if st is not None:
                self.end(st, f.finish_reason, f.error)
        if self.metrics is not None:
            self.metrics.core_stats(m.core, m.stats, self.load[m.core])
        if self.hub is not None and m.step >= 0:
            self.hub.publish(m, nbytes)
        self.process_s += time.perf_counter() - t

    def _tokens(self, st: RequestState, ids, now: float) -> None:
        ids, text = _until_stop(st.detok, ids)
        if self.metrics is not None:
            self.metrics.tokens(st, len(ids), now)
        if st.first_token_at is None:
            st.first_token_at = now
        st.last_token_at = now
        st.num_output_tokens += len(ids)
        st.push(("delta", text, list(ids)))
        self._charge(st)

    def end(self, st: RequestState, reason: str, error: str | None = None) -> None:
        """``st`` is over: the text held back is sent (unless it failed), then its one closing event."""
        if st.done:
            return
        st.done = True
        self.states.pop(st.request_id, None)
        self._charge(st)
        if reason not in ("error", "dead"):
            try:
                tail = st.detok.finish()
            except Exception as err:  # noqa: BLE001  (as above: this request's text failed, not the server)
                reason, error, tail = "error", f"the tokenizer could not decode this request's tokens: {err}", ""
            if tail:
                st.push(("delta", tail, []))
        st.push(("finish", reason, st.num_output_tokens, error))
        if reason in ("error", "dead") and self.on_failed is not None:
            self.on_failed(st, reason, error)
        if self.metrics is not None:
            self.metrics.finished(st, reason, time.perf_counter())

    def fail_all(self, reason: str, error: str, core: int | None = None) -> None:
        """End every request in flight (on ``core``, or everywhere) with ``reason``: a dead core, shutdown."""
        for st in list(self.states.values()):
            if core is None or st.core == core:
                self.end(st, reason, error)


def _until_stop(detok: IncrementalDetokenizer, ids) -> tuple[list, str]:
    """A step's new ids, and the text they add -- up to the token that completes a stop string. A speculative
    step brings several tokens; the answer ends at that token, as it does when they come one a step."""
    if len(ids) == 1 or not detok.stop:
        return list(ids), detok.add(ids)
    text = ""
    for k, token in enumerate(ids):
        text += detok.add([token])
        if detok.stopped:
            return list(ids[:k + 1]), text
    return list(ids), text
