"""Streaming: hand each token to the caller the moment its step ends.

A chat server does not wait for a whole answer: it sends every token as it is generated.
:meth:`cbteach.Engine.stream` runs the engine step by step and yields one :class:`StreamEvent`
per new token (several per step for a speculative decode). ``text`` is the *increment* -- what the
token adds to the decoded answer. A byte-level tokenizer can split one character over two tokens;
then the increment is held back until the character is whole, so the increments always add up to
the completion's text.

Every request the stream covers ends with exactly one event whose ``finish_reason`` is set: its last
token's, or -- for a request aborted while streaming -- an event with no token and
``finish_reason="aborted"`` (vLLM's streams end an aborted request the same way). A consumer that
stops listening (closes the generator, or drops it) aborts the requests it passed to the stream that
are not finished: like a client that hangs up, it frees their KV blocks.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamEvent:
    """One generated token, as :meth:`Engine.stream` hands it out the moment its step ends."""

    request_id: object
    token_id: int | None  # None only in the last event of an aborted request
    text: str | None  # the decoded increment (None without a tokenizer)
    finish_reason: str | None  # None until the request's last event
    time: float  # engine clock


def stream_events(engine, requests=()):
    """The generator behind :meth:`cbteach.Engine.stream` (``requests`` are already queued)."""
    shown: dict = {}  # request id -> text handed out so far
    done = len(engine.completions)  # completions are kept in the order requests finish: look only at new ones
    try:
        while engine.has_unfinished():
            record = engine.step()
            for s in record.seqs:
                seq = engine.sequences[s.request_id]
                base = len(seq.output_ids) - len(s.new_token_ids)
                for j, token in enumerate(s.new_token_ids):  # one event per token, several after speculation
                    reason = s.finish_reason if j == len(s.new_token_ids) - 1 else None
                    text = _increment(engine.tokenizer, seq, base + j + 1, shown, reason)
                    yield StreamEvent(s.request_id, token, text, reason, engine.now())
            done = yield from _aborted(engine, done)  # aborted by the consumer between two events
            if not record.seqs:
                engine._wait_for_arrival()
        yield from _aborted(engine, done)
    except GeneratorExit:  # the consumer stopped listening: its requests stop too, and give their blocks back
        for r in requests:
            if not engine.sequences[r.request_id].status.is_finished:
                engine.abort(r.request_id)
        raise


def _aborted(engine, done: int):
    """One closing event for each request aborted since ``done`` completions; returns the new count."""
    if len(engine.completions) == done:  # the common case: nothing finished since
        return done
    finished = list(engine.completions.values())[done:]
    for c in finished:
        if c.finish_reason == "aborted":
            yield StreamEvent(c.request_id, None, None if engine.tokenizer is None else "", "aborted", engine.now())
    return done + len(finished)


def _increment(tokenizer, seq, upto: int, shown: dict, finish_reason) -> str | None:
    """The new text the output's first ``upto`` tokens add (held back while it ends in half a character)."""
    if tokenizer is None:
        return None
    full = tokenizer.decode(seq.output_ids[:upto], skip_special_tokens=True)
    before = shown.get(seq.request_id, "")
    if (full.endswith("\ufffd") and not finish_reason) or not full.startswith(before):
        return ""
    shown[seq.request_id] = full
    return full[len(before):]
