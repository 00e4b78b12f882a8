"""Automatic prefix caching: full KV blocks found again by the tokens they hold.

Many requests share a beginning -- a system prompt, a few-shot preamble, the history of a chat.
Their keys and values for that shared prefix are the same (K/V of a token depend only on the
tokens up to it and their positions), so they need computing once. (The same in exact arithmetic:
computed inside another batch or chunk, floating-point K/V can differ in the last bits -- the
batch-invariance caveat of notebook 01; in fp32 the course's tests see no token change.) vLLM's
automatic prefix caching does it with block hashes:

* a **full** block is named by a hash of its tokens *and of everything before it* (the hash of
  the previous block is part of the input), so equal hashes mean equal prefixes, not just equal
  blocks: ``h_i = sha256(h_{i-1}, tokens of block i)``;
* when a block is allocated for tokens that fill it, its hash is recorded (``hash -> block``; vLLM
  V1 caches a block at allocation, so requests admitted in the same step already share it);
* a new request looks up its prompt's block hashes in order and reuses every hit -- its block
  table starts with those blocks (their reference counts go up) and its ``num_computed_tokens``
  starts past them, so only the rest of the prompt is prefilled;
* a finished request's blocks go back to the free list *with their contents*: they stay findable
  until the allocator hands them out again, least recently used first, and only then is their
  hash forgotten (eviction).

At least the prompt's last token is always computed, even on a full hit: its logits give the
first output token. SGLang's RadixAttention reaches the same reuse with a radix tree over tokens
instead of a hash table.
"""
from __future__ import annotations

import hashlib
import struct


def chain_hash(parent: bytes, tokens) -> bytes:
    """A block's name: the SHA-256 digest of its parent's name and its token ids (``parent`` is
    ``b""`` for a sequence's first block). Stable across processes and runs (Python's ``hash`` is
    not), and the whole 32-byte digest is kept: a collision would silently reuse the wrong K/V, and
    while an *accidental* one is out of reach even for 64 bits, a 64-bit name can be attacked on
    purpose -- why vLLM moved to SHA-256 and keeps its full digest."""
    return hashlib.sha256(parent + struct.pack(f"<{len(tokens)}q", *tokens)).digest()


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block has none)."""
    out, parent = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        out.append(parent)
    return out


class PrefixCache:
    """``hash -> block`` for full blocks whose K/V are in the pool, with hit statistics."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, found in the cache
        self._chain: dict = {}  # request id -> (blocks hashed so far, last hash)

    def lookup(self, prompt_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of the prompt, leaving at least its last token."""
        usable = prompt_ids[:len(prompt_ids) - 1]  # the last prompt token is always computed
        blocks = []
        for h in block_hashes(usable, self.block_size):
            block = self.block_of.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def record_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.queries += num_prompt_tokens
        self.hits += num_hit_tokens

    def register(self, seq, upto: int | None = None) -> None:
        """Record the hashes of ``seq``'s blocks that are full once its first ``upto`` tokens are
        computed (default: its ``num_computed_tokens``; the KV manager passes what this step will have
        computed). Only known tokens count (never speculative guesses), and only new blocks are
        hashed: the chain's last hash is remembered per request."""
        done, parent = self._chain.get(seq.request_id, (0, b""))
        upto = seq.num_computed_tokens if upto is None else upto
        full = min(upto, seq.num_tokens, len(seq.block_table) * self.block_size) // self.block_size
        for i in range(done, full):
            parent = chain_hash(parent, seq.token_ids(i * self.block_size, (i + 1) * self.block_size))
            block = seq.block_table[i]
            if parent not in self.block_of and block not in self.hash_of:
                self.block_of[parent] = block
                self.hash_of[block] = parent
        self._chain[seq.request_id] = (max(done, full), parent)

    def forget(self, seq) -> None:
        """``seq`` gave its blocks back (finished or preempted): restart its hash chain next time."""
        self._chain.pop(seq.request_id, None)

    def evict(self, block: int) -> None:
        """``block`` is being handed out for new tokens: forget what it held."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def stats(self) -> dict:
        return {"prefix_queries": self.queries, "prefix_hits": self.hits, "prefix_hit_rate": self.hit_rate,
                "num_cached_blocks": len(self.block_of)}
