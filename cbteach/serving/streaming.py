"""Streaming: hand each token to the caller the moment its step ends.

A chat server does not wait for a whole answer: it sends every token as it is generated.
:meth:`cbteach.Engine.stream` runs the engine step by step and yields one :class:`StreamEvent`
per new token (several per step for a speculative decode). ``text`` is the *increment* -- what the
token adds to the decoded answer. A byte-level tokenizer can split one character over two tokens;
then the increment is held back until the character is whole, so the increments always add up to
the completion's text.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StreamEvent:
    """One generated token, as :meth:`Engine.stream` hands it out the moment its step ends."""

    request_id: object
    token_id: int
    text: str | None  # the decoded increment (None without a tokenizer)
    finish_reason: str | None  # None until the request's last token
    time: float  # engine clock


def stream_events(engine, requests=()):
    """The generator behind :meth:`cbteach.Engine.stream` (``requests`` are already queued)."""
    shown: dict = {}  # request id -> text handed out so far
    while engine.has_unfinished():
        record = engine.step()
        for s in record.seqs:
            seq = engine.sequences[s.request_id]
            base = len(seq.output_ids) - len(s.new_token_ids)
            for j, token in enumerate(s.new_token_ids):  # one event per token, several after speculation
                reason = s.finish_reason if j == len(s.new_token_ids) - 1 else None
                yield StreamEvent(s.request_id, token, _increment(engine.tokenizer, seq, base + j + 1, shown, reason),
                                  reason, engine.now())
        if not record.seqs:
            engine._wait_for_arrival()


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
