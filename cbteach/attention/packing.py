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
    ``query_start_loc[i]:query_start_loc[i + 1]`` of the row; it had ``num_computed_tokens[i]`` tokens in
    the cache before this step and feeds ``num_scheduled_tokens[i]`` now. The names are the ones the
    step's attention metadata uses (and vLLM's); FlashAttention calls ``query_start_loc`` ``cu_seqlens_q``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    num_computed_tokens: list[int]
    num_scheduled_tokens: list[int]

    @property
    def query_start_loc(self) -> list[int]:
        """Where each sequence's tokens start in the row, and the row's end (cumulative lengths)."""
        out = [0]
        for n in self.num_scheduled_tokens:
            out.append(out[-1] + n)
        return out

    @property
    def logits_indices(self) -> list[int]:
        """Index in the row of each sequence's last new token -- the one whose logits we sample."""
        return [end - 1 for end in self.query_start_loc[1:]]


def pack(chunks: list[list[int]], num_computed_tokens: list[int], device=None) -> PackedBatch:
    """Concatenate each sequence's new tokens into one row, with per-sequence positions.

    ``device`` is where the tensors are made: pass the model's (``model.device``), so the same
    code runs on CPU, CUDA and MPS.
    """
    if len(chunks) != len(num_computed_tokens):
        raise ValueError("pack() needs one num_computed_tokens entry per chunk")
    ids, pos = [], []
    for chunk, start in zip(chunks, num_computed_tokens):
        if not chunk:
            raise ValueError("every packed sequence must feed at least one token")
        ids.extend(chunk)
        pos.extend(range(start, start + len(chunk)))
    return PackedBatch(
        input_ids=torch.tensor([ids], dtype=torch.long, device=device),
        position_ids=torch.tensor([pos], dtype=torch.long, device=device),
        num_computed_tokens=list(num_computed_tokens),
        num_scheduled_tokens=[len(c) for c in chunks],
    )


def _check_lengths(cached, new):
    if len(cached) != len(new):
        raise ValueError(f"num_computed_tokens has {len(cached)} entries but num_scheduled_tokens has {len(new)}")
    if any(c < 0 for c in cached) or any(n < 0 for n in new):
        raise ValueError("sequence lengths must be >= 0")


def _ranges(lengths, device, starts=None):
    """``[0..n0-1, 0..n1-1, ...]`` (or counting from ``starts``) as one tensor."""
    starts = starts or [0] * len(lengths)
    parts = [torch.arange(s, s + n, device=device) for s, n in zip(starts, lengths)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _owner(lengths, device):
    """For every element of the concatenated pieces, which piece it belongs to."""
    return torch.repeat_interleave(torch.arange(len(lengths), device=device),
                                   torch.tensor(lengths, dtype=torch.long, device=device))


def block_diagonal_causal_mask(num_computed_tokens: list[int], num_scheduled_tokens: list[int],
                               device=None) -> torch.Tensor:
    """Boolean ``[queries, keys]`` mask, True = may attend, keys laid out ``[all cached | all new]``.

    Query ``j`` of sequence ``s`` (at position ``num_computed_tokens[s] + j``) sees all of ``s``'s
    cached keys and ``s``'s new keys ``0..j``. This is the layout of the concatenating cache.
    """
    cached, new = num_computed_tokens, num_scheduled_tokens
    _check_lengths(cached, new)
    q_seq, q_idx, c_seq = _owner(new, device), _ranges(new, device), _owner(cached, device)
    cached_part = q_seq[:, None] == c_seq[None, :]
    new_part = (q_seq[:, None] == q_seq[None, :]) & (q_idx[None, :] <= q_idx[:, None])
    return torch.cat([cached_part, new_part], dim=1)


def per_sequence_causal_mask(num_computed_tokens: list[int], num_scheduled_tokens: list[int],
                             device=None) -> torch.Tensor:
    """Boolean ``[queries, keys]`` mask with keys laid out ``[A's context | B's context | ...]``.

    Each sequence's context is its cached keys followed by its new keys. Query ``j`` of ``s`` sees
    keys of ``s`` at positions ``<= num_computed_tokens[s] + j``. This is what a variable-length
    attention kernel, or the paged cache reading each sequence through its block table, sees.
    """
    cached, new = num_computed_tokens, num_scheduled_tokens
    _check_lengths(cached, new)
    ctx = [c + n for c, n in zip(cached, new)]
    q_seq, q_pos = _owner(new, device), _ranges(new, device, starts=cached)
    k_seq, k_pos = _owner(ctx, device), _ranges(ctx, device)
    return (q_seq[:, None] == k_seq[None, :]) & (k_pos[None, :] <= q_pos[:, None])


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Turn a boolean ``[Q, K]`` mask into the ``[1, 1, Q, K]`` additive form transformers expects.

    Allowed entries become 0, blocked ones the most negative finite number of ``dtype`` (not
    ``-inf``, so a row can never turn into NaN), which softmax turns into an exact zero weight.
    """
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    out.masked_fill_(~mask, torch.finfo(dtype).min)
    return out[None, None]
