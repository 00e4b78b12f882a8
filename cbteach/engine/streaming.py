"""Streaming: hand each token to the caller the moment its step ends.

A chat server does not wait for a whole answer: it sends every token as it is generated.
:meth:`cbteach.Engine.stream` runs the engine step by step and yields one :class:`StreamEvent`
per new token (several per step for a speculative decode). ``text`` is the *increment* -- what the
token adds to the decoded answer. A byte-level tokenizer can split one character over two tokens;
then the increment is held back until the character is whole, so the increments always add up to
the completion's text.

Every request the stream covers ends with exactly one event whose ``finish_reason`` is set: its last
token's, or -- for a request aborted while streaming -- an event with no token and
``finish_reason="aborted"`` (vLLM's streams end an aborted request too, with ``"abort"``), or ``"error"`` for
one that failed alone (its ``Completion.error`` says why). A consumer that
stops listening (closes the generator, or drops it) aborts the requests it passed to the stream that
are not finished: like a client that hangs up, it frees their KV blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

# Ends that come with no token of their own: the last token (if any) was an ordinary one.
ENDED_WITHOUT_TOKEN = ("aborted", "error")


@dataclass
class StreamEvent:
    """One generated token, as :meth:`Engine.stream` hands it out the moment its step ends."""

    request_id: object
    token_id: int | None  # None only in the last event of an aborted request
    text: str | None  # the decoded increment (None without a tokenizer)
    finish_reason: str | None  # None until the request's last event
    time: float  # engine clock


def stream_events(engine, requests=()):
    """The generator behind :meth:`cbteach.Engine.stream` (``requests`` are already queued).

    The events are read from the requests' own state (their outputs and status), not from the step
    records of the steps this generator ran: so a stream that was suspended while something else
    drove the engine -- another stream, :meth:`~cbteach.Engine.run` -- catches up with every token
    and closing event it missed, and a request aborted before the first ``next()`` still gets its
    closing event.
    """
    covered = _Covered(engine, [engine.sequences[sid] for r in requests for sid in engine.sample_ids(r.request_id)])
    return EventStream(engine, covered)


class EventStream:
    """The iterator :meth:`~cbteach.Engine.stream` returns: a generator of events that also ends its
    requests when the consumer hangs up before reading anything (a generator that never started runs
    no code when it is closed or dropped, so this wrapper does it)."""

    def __init__(self, engine, covered):
        self._engine, self._covered = engine, covered
        self._events = _events(engine, covered)
        self._started = False

    def __iter__(self):
        return self

    def __next__(self) -> StreamEvent:
        self._started = True
        return next(self._events)

    def close(self) -> None:
        """Stop listening: the requests this stream covers that are not finished are aborted."""
        if not self._started:
            self._started = True
            _abort_unfinished(self._engine, self._covered)
        self._events.close()

    def __del__(self):  # dropped by the consumer: it hung up
        try:
            self.close()
        except Exception:  # noqa: BLE001  (never raise from a finaliser; the engine may be gone already)
            pass


class _Covered:
    """The sequences a stream reports on: its own requests' (each sample of an ``n > 1`` request has its
    own id, ``(request_id, i)``), and any added with ``add_request`` while it streams (not those another
    ``run()`` or ``stream()`` brought: they report on their own). Kept as the sequences themselves, not
    their ids: a finished request may be released and its id taken by a new one while the stream is
    suspended, and the stream must go on reporting on the request it covered."""

    def __init__(self, engine, own: list):
        self.engine = engine
        self.seqs = list(own)
        self.known = dict(engine.sequences)  # request id -> the sequence it named when last looked at
        self.emitted: dict = {id(s): 0 for s in own}  # (by identity; self.seqs keeps them) -> tokens handed out
        self.closed: set = set()

    def refresh(self) -> None:
        """Pick up requests added to the engine one by one since the last look."""
        for rid, seq in list(self.engine.sequences.items()):
            if self.known.get(rid) is not seq:
                self.known[rid] = seq
                if id(seq) not in self.emitted and not seq.claimed:
                    self.seqs.append(seq)
                    self.emitted[id(seq)] = 0

    def open(self) -> list:
        return [s for s in self.seqs if id(s) not in self.closed]


def _abort_unfinished(engine, covered: _Covered) -> None:
    """The consumer hung up: its requests stop too, and give their blocks back (an unfinished sequence is
    still the engine's: only a finished one can be released and its id reused)."""
    for seq in covered.open():
        if not seq.status.is_finished:
            engine.abort(seq.request_id)


def _events(engine, covered: _Covered):
    shown: dict = {}  # request id -> text handed out so far
    try:
        while True:
            covered.refresh()
            yield from _catch_up(engine, covered, shown)
            covered.refresh()  # the consumer may have added a request while it held the last event
            if not covered.open():
                return
            if not engine.has_unfinished():  # someone else finished them: the next catch-up closes them
                continue
            if engine.step().idle:
                engine.wait_for_arrival()
    except GeneratorExit:  # the consumer stopped listening
        _abort_unfinished(engine, covered)
        raise


def _catch_up(engine, covered: _Covered, shown: dict):
    """Every token each covered request produced since its last event, then its closing event."""
    for seq in covered.open():
        rid = seq.request_id
        done, out = seq.status.is_finished, seq.output_ids[:]  # as they are now: the consumer may drive on
        for j in range(covered.emitted[id(seq)], len(out)):
            last = done and seq.finish_reason not in ENDED_WITHOUT_TOKEN and j == len(out) - 1
            reason = seq.finish_reason if last else None
            try:
                text = _increment(engine.tokenizer, seq, j + 1, shown, reason)
            except Exception as err:  # noqa: BLE001  (its tokenizer failed on its ids: it alone ends, as in run())
                yield _failed(engine, covered, seq, f"the tokenizer could not decode this request's tokens: "
                                                    f"{type(err).__name__}: {err}")
                break
            covered.emitted[id(seq)] = j + 1
            yield StreamEvent(rid, out[j], text, reason, seq.token_times[j])
        else:
            if done:
                covered.closed.add(id(seq))
                if seq.finish_reason in ENDED_WITHOUT_TOKEN or not out:  # no last token carries it: a closing event
                    yield StreamEvent(rid, None, None if engine.tokenizer is None else "", seq.finish_reason,
                                      engine.now())


def _failed(engine, covered: _Covered, seq, error: str) -> StreamEvent:
    """``seq`` fails alone: ended with ``error`` (its blocks given back) unless it had finished, and closed."""
    if not seq.status.is_finished:
        engine.abort(seq.request_id, error=error)
    covered.closed.add(id(seq))
    return StreamEvent(seq.request_id, None, "", "error", engine.now())


def _increment(tokenizer, seq, upto: int, shown: dict, finish_reason) -> str | None:
    """The new text the output's first ``upto`` tokens add (held back while it ends in half a character)."""
    if tokenizer is None:
        return None
    full = tokenizer.decode(seq.output_ids[:upto], skip_special_tokens=True)
    before = shown.get(id(seq), "")
    if (full.endswith("\ufffd") and not finish_reason) or not full.startswith(before):
        return ""
    shown[id(seq)] = full
    return full[len(before):]
