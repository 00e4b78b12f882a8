"""The concatenating KV cache: every sequence owns its keys and values, copied together each step.

This is the simplest correct way to run a packed batch with a KV cache, and the most expensive.
Each sequence keeps, per layer, a ``[1, num_kv_heads, num_tokens, head_dim]`` tensor of keys and
one of values. Every step:

1. **gather** -- concatenate the in-flight sequences' caches along time into one packed cache
   (``[A cached | B cached | ...]``) and hand it to the model as its past keys and values
   (the ``past_key_values`` argument, called ``cache`` in recent transformers);
2. the model appends this step's new keys and values after them (``[... | A new | B new]``) and
   attends through the block-diagonal mask from :mod:`cbteach.packing`;
3. **scatter** -- cut the new keys and values out of the packed cache and append each piece to
   its sequence's own cache.

Steps 1 and 3 copy every sequence's whole history, every step, in every layer -- the copy grows
with the history even though only one new token per sequence was computed. :attr:`last_copy`
reports the bytes and seconds this costs. The paged cache (:mod:`cbteach.kv_paged`) removes it.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .packing import PackedBatch, additive_mask, block_diagonal_causal_mask


@dataclass
class CopyStats:
    """What one step's gather and scatter cost."""

    bytes_gathered: int = 0
    bytes_scattered: int = 0
    seconds: float = 0.0

    @property
    def bytes_copied(self) -> int:
        return self.bytes_gathered + self.bytes_scattered


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer of a transformers ``DynamicCache``."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.56


class ConcatKVCache:
    """Per-sequence caches, gathered into one ``DynamicCache`` before each step and scattered after."""

    kind = "concat"

    def __init__(self, num_layers: int, cache_kwarg: str = "past_key_values"):
        self.num_layers = num_layers
        self.cache_kwarg = cache_kwarg  # forward()'s name for it: "cache" in recent transformers 5.x
        self.kv: dict[object, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.last_copy = CopyStats()

    def prepare(self, seqs, batch: PackedBatch, dtype: torch.dtype) -> dict:
        """Gather the in-flight caches and build the mask; returns extra kwargs for the forward pass."""
        t0 = time.perf_counter()
        stats = CopyStats()
        cache = DynamicCache()
        for layer in range(self.num_layers):
            parts = [self.kv[s.request_id][layer] for s, c in zip(seqs, batch.num_cached) if c > 0]
            if parts:
                k = torch.cat([p[0] for p in parts], dim=2)
                v = torch.cat([p[1] for p in parts], dim=2)
                stats.bytes_gathered += k.nbytes + v.nbytes
                cache.update(k, v, layer)
        stats.seconds = time.perf_counter() - t0
        self.last_copy = stats
        self._packed = cache
        mask = block_diagonal_causal_mask(batch.num_cached, batch.num_new, device=batch.input_ids.device)
        return {self.cache_kwarg: cache, "attention_mask": additive_mask(mask, dtype)}

    def after_forward(self, seqs, batch: PackedBatch) -> None:
        """Scatter this step's new keys and values back to each sequence's own cache."""
        t0 = time.perf_counter()
        cache, self._packed = self._packed, None
        total_cached = sum(batch.num_cached)
        for layer in range(self.num_layers):
            k_all, v_all = layer_kv(cache, layer)
            new_k = k_all[:, :, total_cached:].split(batch.num_new, dim=2)
            new_v = v_all[:, :, total_cached:].split(batch.num_new, dim=2)
            for seq, k, v in zip(seqs, new_k, new_v):
                layers = self.kv.setdefault(seq.request_id, [None] * self.num_layers)
                if layers[layer] is None:
                    k, v = k.clone(), v.clone()  # own the memory: the packed cache is freed after the step
                else:
                    k = torch.cat([layers[layer][0], k], dim=2)
                    v = torch.cat([layers[layer][1], v], dim=2)
                layers[layer] = (k, v)
                self.last_copy.bytes_scattered += k.nbytes + v.nbytes
        self.last_copy.seconds += time.perf_counter() - t0

    def free(self, seq) -> None:
        self.kv.pop(seq.request_id, None)

    def num_cached_tokens(self, seq) -> int:
        layers = self.kv.get(seq.request_id)
        return 0 if not layers or layers[0] is None else layers[0][0].shape[2]

    # This cache grows without bound (until the machine runs out of memory), so there is
    # nothing to reserve and nothing to refuse; the paged cache gives these real work.
    def can_allocate(self, seq, num_new_tokens: int) -> bool:
        return True

    def allocate(self, seq, num_new_tokens: int) -> None:
        pass

    def check_fits(self, num_tokens: int, request_id) -> None:
        pass

    def forward_context(self, seqs, batch):
        return contextlib.nullcontext()

    def usage(self) -> dict:
        """Sequences and tokens held right now."""
        return {"num_sequences": len(self.kv),
                "num_tokens": sum(l[0][0].shape[2] for l in self.kv.values() if l[0] is not None)}
