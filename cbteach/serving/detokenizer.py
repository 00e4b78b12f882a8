"""Incremental detokenization: the text each step's new tokens add, without re-decoding the answer.

A stream must send text, and the engine gives token ids. Decoding the whole answer after every
step and sending the difference is correct but quadratic: a 2,000-token answer decodes 2 million
tokens. vLLM's detokenizer (``vllm/transformers_utils/detokenizer_utils.py``,
``detokenize_incrementally``) decodes a short window instead. It keeps two offsets into the
answer's ids: text up to ``read_offset`` was already sent; ``prefix_offset`` a few tokens before
it starts the window. After new ids arrive it decodes ``ids[prefix_offset:read_offset]`` and
``ids[prefix_offset:]``; the new text is the second minus the first. Decoding from a few tokens
back, not from ``read_offset`` itself, lets the tokenizer see the context that decides spacing
(SentencePiece's leading "▁", merges around a space). A window whose text ends in U+FFFD is half a
character -- a byte-level tokenizer can split a UTF-8 character over two tokens -- and waits for
the next token.

**Stop strings.** ``stop`` is text, so it is checked here, where the text is (the engine stops on
ids). The tail that could still be the start of a stop string is held back; when one appears the
answer is cut before it and :attr:`stopped` is set -- the caller then aborts the request in the
engine at once, and its KV blocks go back to the pool.

**Stop token ids** end the answer in the engine too; as in vLLM, the stop token's own text is not sent
(``include_stop_str_in_output=False``): the text ends where the token would begin.

At the end, :meth:`finish` decodes the whole answer once and sends whatever the windows have not
(held-back text, or a tokenizer whose windows disagree with a full decode), so the streamed pieces
always add up to ``tokenizer.decode(ids, skip_special_tokens=True)`` cut at the first stop string.
"""
from __future__ import annotations

INITIAL_WINDOW = 5  # tokens of context before the first new one (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)


def fast_decode(tokenizer):
    """``decode(ids)`` as ``tokenizer.decode(ids, skip_special_tokens=True)`` gives it: straight from the Rust
    tokenizer when the Python wrapper would add nothing (no clean-up of spaces), else through the wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """The text of one answer, a step at a time: ``add(new_ids) -> text to send``, then ``finish()``."""

    def __init__(self, tokenizer, stop: tuple = (), stop_token_ids: tuple = ()):
        self.tokenizer = tokenizer
        self.decode = fast_decode(tokenizer)
        self.stop = tuple(stop)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.hold = max((len(s) - 1 for s in self.stop), default=0)  # chars that may start a stop string
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (from the windows)
        self.sent = 0  # characters of ``text`` handed out
        self.stopped = False
        self.num_decoded_tokens = 0  # tokens put through decode(), for the tests' linearity check

    def _decode(self, ids) -> str:
        self.num_decoded_tokens += len(ids)
        return self.decode(ids)

    def add(self, new_ids) -> str:
        """Take one step's new token ids; return the text that may be sent now ("" while it waits)."""
        if self.stopped:
            return ""
        cut = next((i for i, t in enumerate(new_ids) if t in self.stop_token_ids), None)
        if cut is not None:  # the answer ends before this token: send the rest of its text, and stop
            self.ids.extend(new_ids[:cut])
            piece = self.finish()
            self.stopped = True
            return piece
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window = self._decode(self.ids[self.prefix_offset:])
        if window.endswith("\ufffd") or len(window) <= len(prefix):
            return ""  # half a character, or nothing printable yet: wait for more tokens
        self.text += window[len(prefix):]
        self.prefix_offset, self.read_offset = max(0, len(self.ids) - INITIAL_WINDOW), len(self.ids)
        return self._release(final=False)

    def _release(self, final: bool) -> str:
        start = max(0, self.sent - self.hold - 1)  # a stop string can only begin in text not yet searched
        cuts = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if cuts:
            self.text, self.stopped, final = self.text[:min(cuts)], True, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent:end], end
        return piece

    def finish(self) -> str:
        """The answer is over: everything not sent yet (held-back text), checked against one full decode."""
        if not self.stopped:
            full = self._decode(self.ids)
            if full.startswith(self.text[:self.sent]):  # the windows agreed with a full decode
                self.text = full
        return self._release(final=True)

    @property
    def full_text(self) -> str:
        """The answer's text as sent once :meth:`finish` has run."""
        return self.text[:self.sent]
