"""Ragged packing: many sequences, one unpadded row, one forward pass.

Static batching pads every sequence to the same length and runs a ``[batch, max_len]`` tensor.
Continuous batching instead *concatenates* the tokens each sequence needs this step into a single
``[1, total_tokens]`` row -- a whole prompt for a sequence being prefilled, one token for a
sequence being decoded -- and runs that. No padding, and prefill and decode share the pass.

Two things make a packed row behave like separate sequences:

* ``position_ids`` -- each token gets its position *in its own sequence*, so RoPE (Llama, Qwen2)
  or learned position embeddings (GPT-2) see what they would see if the sequence ran alone.
* a **block-diagonal causal mask** -- a query may attend a key only if both belong to the same
  sequence and the key is not in that sequence's future.

Keys come in two parts. Tokens computed in earlier steps live in the KV cache ("cached"); this
step's tokens produce new keys. :func:`block_diagonal_causal_mask` takes the layout the
concatenating KV cache uses -- every sequence's cached keys first, then every sequence's new keys
(``[A cached | B cached | A new | B new]``); :func:`per_sequence_causal_mask` takes the layout
the paged cache gathers -- each sequence's whole context in one piece (``[A all | B all]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    """One step's packed input.

    ``input_ids`` and ``position_ids`` are ``[1, total_tokens]``. Sequence ``i`` owns tokens
    ``cu_seqlens[i]:cu_seqlens[i + 1]`` of the row; it had ``num_cached[i]`` tokens in the cache
    before this step and feeds ``num_new[i]`` now.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    num_cached: list[int]
    num_new: list[int]

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.num_new:
            out.append(out[-1] + n)
        return out

    @property
    def last_token_index(self) -> list[int]:
        """Index in the row of each sequence's last new token -- the one whose logits we sample."""
        return [end - 1 for end in self.cu_seqlens[1:]]


def pack(chunks: list[list[int]], num_cached: list[int], device=None) -> PackedBatch:
    """Concatenate each sequence's new tokens into one row, with per-sequence positions."""
    if len(chunks) != len(num_cached):
        raise ValueError("pack() needs one num_cached entry per chunk")
    ids, pos = [], []
    for chunk, start in zip(chunks, num_cached):
        if not chunk:
            raise ValueError("every packed sequence must feed at least one token")
        ids.extend(chunk)
        pos.extend(range(start, start + len(chunk)))
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([pos], dtype=torch.long, device=device),
        num_cached=list(num_cached),
        num_new=[len(c) for c in chunks],
    )


def _check_lengths(num_cached, num_new):
    if len(num_cached) != len(num_new):
        raise ValueError(f"num_cached has {len(num_cached)} entries but num_new has {len(num_new)}")
    if any(c < 0 for c in num_cached) or any(n < 0 for n in num_new):
        raise ValueError("sequence lengths must be >= 0")


def block_diagonal_causal_mask(num_cached: list[int], num_new: list[int], device=None) -> torch.Tensor:
    """Boolean ``[queries, keys]`` mask, True = may attend, keys laid out ``[all cached | all new]``.

    Query ``j`` of sequence ``s`` (at position ``num_cached[s] + j``) sees all of ``s``'s cached
    keys and ``s``'s new keys ``0..j``.
    """
    _check_lengths(num_cached, num_new)
    q_seq = torch.repeat_interleave(torch.arange(len(num_new), device=device),
                                    torch.tensor(num_new, dtype=torch.long, device=device))
    q_idx = torch.cat([torch.arange(n, device=device) for n in num_new]) if num_new else q_seq
    c_seq = torch.repeat_interleave(torch.arange(len(num_cached), device=device),
                                    torch.tensor(num_cached, dtype=torch.long, device=device))
    cached_part = q_seq[:, None] == c_seq[None, :]
    new_part = (q_seq[:, None] == q_seq[None, :]) & (q_idx[None, :] <= q_idx[:, None])
    return torch.cat([cached_part, new_part], dim=1)


def per_sequence_causal_mask(num_cached: list[int], num_new: list[int], device=None) -> torch.Tensor:
    """Boolean ``[queries, keys]`` mask with keys laid out ``[A's context | B's context | ...]``.

    Each sequence's context is its cached keys followed by its new keys, ``num_cached[s] +
    num_new[s]`` long. Query ``j`` of ``s`` sees keys of ``s`` at positions ``<= num_cached[s] + j``.
    """
    _check_lengths(num_cached, num_new)
    ctx = [c + n for c, n in zip(num_cached, num_new)]
    new_t = torch.tensor(num_new, dtype=torch.long, device=device)
    ctx_t = torch.tensor(ctx, dtype=torch.long, device=device)
    seqs = torch.arange(len(num_new), device=device)
    q_seq = torch.repeat_interleave(seqs, new_t)
    q_pos = torch.cat([torch.arange(c, c + n, device=device) for c, n in zip(num_cached, num_new)]) \
        if num_new else q_seq
    k_seq = torch.repeat_interleave(seqs, ctx_t)
    k_pos = torch.cat([torch.arange(n, device=device) for n in ctx]) if ctx else k_seq
    return (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean ``[Q, K]`` mask into the ``[1, 1, Q, K]`` additive form transformers expects.

    Allowed entries become 0, blocked ones the most negative finite number of ``dtype`` (not
    ``-inf``, so a row can never turn into NaN), which softmax turns into an exact zero weight.
    """
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    out.masked_fill_(~mask, torch.finfo(dtype).min)
    return out[None, None]
