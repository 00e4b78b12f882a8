"""Prompts to token ids, in the API server: checked, tokenized off the event loop, refused early.

In vLLM V1 the engine core never sees text: the API server's ``InputProcessor``
(``vllm/v1/engine/input_processor.py``; tokenizing is moving to its renderer) tokenizes and validates
every request, and hands the core token ids. This module is that step for cbteach's server:

* **refuse before tokenizing what cannot fit.** No token of a vocabulary covers more than
  :attr:`PromptChecker.max_chars_per_token` characters of text, so a text prompt of ``C``
  characters has at least ``C / max_chars_per_token`` tokens. If even that many cannot fit in the
  model's positions beside ``max_tokens``, the request is refused at once -- a 900 KB prompt costs
  a division, not a tokenization (and never a stall of the streams in flight);
* **tokenize off the event loop.** A long text is tokenized in a worker thread (the Rust tokenizer
  lets go of the interpreter lock while it works), so the loop keeps writing other streams;
* **check the ids** as the engine would -- inside the vocabulary, prompt plus ``max_tokens`` within
  the model's positions -- so a bad request is a 400 before it reaches a core. The core still runs
  the engine's own checks (the KV pool's size, for one) and may refuse it too.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from .openai_protocol import bad

INLINE_CHARS = 2000  # shorter texts are tokenized on the event loop itself: a thread hop costs more


def load_tokenizer(name: str):
    """The tokenizer of ``serve --model NAME`` (the embedded bierce's, or a hub id's / folder's)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    from ..models import BIERCE_DIR, EMBEDDED

    source = BIERCE_DIR if name in EMBEDDED else name
    local = name in EMBEDDED or Path(name).is_dir()
    try:
        return AutoTokenizer.from_pretrained(source, local_files_only=local)
    except OSError:
        return AutoTokenizer.from_pretrained(source, local_files_only=True)


def max_chars_per_token(tokenizer) -> int:
    """The most characters of text one token of this vocabulary stands for (doubled when the tokenizer
    normalizes text first: a normalizer may fold two characters into one)."""
    vocab = tokenizer.get_vocab()
    longest = max((len(tokenizer.convert_tokens_to_string([t])) for t in vocab), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is not None and backend.normalizer is not None
    return max(1, longest) * (2 if normalizes else 1)


class PromptChecker:
    """Turns a request's prompts into checked token ids for a model of ``max_positions`` and ``vocab_size``."""

    def __init__(self, tokenizer, max_positions: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_positions = max_positions
        self.vocab_size = vocab_size
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cbteach-tokenize")
        self.num_tokenized = 0  # texts tokenized (the tests check that a hopeless one never is)

    def check_text_length(self, text: str, max_tokens: int) -> None:
        room = self.max_positions - max_tokens
        if len(text) > room * self.max_chars_per_token:
            least = -(-len(text) // self.max_chars_per_token)
            raise bad(f"the prompt has {len(text):,} character{'s' if len(text) != 1 else ''}: at least {least:,} "
                      f"token{'s' if least != 1 else ''} (no token covers more than {self.max_chars_per_token} characters), but the model's "
                      f"{self.max_positions} positions leave room for {max(room, 0)} beside max_tokens={max_tokens}",
                      "prompt", "context_length_exceeded")

    def tokenize(self, text: str) -> list[int]:
        self.num_tokenized += 1
        return list(self.tokenizer(text, verbose=False)["input_ids"])  # (no warning for a long one: it is refused)

    async def to_ids(self, prompt, max_tokens: int) -> list[int]:
        """The prompt (text or token ids) as checked token ids; :class:`~.openai_protocol.APIError` if not."""
        if isinstance(prompt, str):
            self.check_text_length(prompt, max_tokens)
            if len(prompt) <= INLINE_CHARS:
                ids = self.tokenize(prompt)
            else:
                ids = await asyncio.get_running_loop().run_in_executor(self.pool, self.tokenize, prompt)
            if not ids:
                raise bad("the prompt has no tokens", "prompt")
        else:
            ids = list(prompt)
            top = max(ids)
            if top >= self.vocab_size:
                raise bad(f"prompt token id {top} is outside the model's vocabulary of {self.vocab_size} ids "
                          f"(0 to {self.vocab_size - 1})", "prompt")
        if len(ids) + max_tokens > self.max_positions:
            raise bad(f"the prompt has {len(ids)} tokens and max_tokens={max_tokens}: {len(ids) + max_tokens} "
                      f"positions, more than the model's {self.max_positions}", "prompt", "context_length_exceeded")
        return ids

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
