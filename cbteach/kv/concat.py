"""The concatenating KV cache: every sequence owns its keys and values, copied together each step.

This is the simplest correct way to run a packed batch with a KV cache, and the most expensive.
Each sequence keeps, per layer, a ``[1, num_kv_heads, num_tokens, head_dim]`` tensor of keys and
one of values. Every step:

1. **gather** -- concatenate the in-flight sequences' caches along time into one packed cache
   (``[A cached | B cached | ...]``) and hand it to the model as its past keys and values
   (a transformers ``DynamicCache``, passed as ``past_key_values`` -- called ``cache`` in recent
   transformers);
2. the model appends this step's new keys and values after them (``[... | A new | B new]``) and
   attends through the block-diagonal mask from :mod:`cbteach.attention.packing`, passed as a 4-D
   ``attention_mask`` (so the model's attention must honour one: ``eager`` or ``sdpa``);
3. **scatter** -- cut the new keys and values out of the packed cache and append each piece to
   its sequence's own cache.

Every one of those is a copy of every sequence's whole history, every step, in every layer --
even though only one new token per sequence was computed. Counting all of them, with ``C``
cached and ``N`` new tokens' worth of K/V in a step:

* our gather writes ``C`` (one ``torch.cat``);
* ``DynamicCache.update`` on the fresh cache concatenates our gathered tensor onto an empty one:
  ``C`` again;
* the model's own ``update`` appends the new K/V: ``C + N``;
* our scatter rebuilds each sequence's cache with its new tokens: ``C + N``.

That is ``4C + 2N`` bytes moved per step, reported as :attr:`KVTraffic.bytes_copied` (measured on
the real tensors, and checked against a count of the copy operations in the tests). The paged
cache (:mod:`cbteach.kv.paged`) moves only the ``N`` new tokens' K/V.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..attention import metadata as attn_metadata
from ..attention.packing import additive_mask, block_diagonal_causal_mask

MASK_HONOURING = ("eager", "sdpa")  # attention implementations that obey a 4-D attention_mask


@dataclass
class KVTraffic:
    """K/V bytes one step moved, by what moved them.

    ``bytes_copied`` -- history copied by the cache between steps (concat's gather and scatter);
    ``bytes_read`` -- what attention read from a paged pool through the block tables;
    ``bytes_written`` -- this step's new K/V stored in a paged pool; ``seconds`` -- time spent copying.
    """

    bytes_copied: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0


def layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one layer of a transformers ``DynamicCache``."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]  # transformers < 4.56


class UnboundedKVManager:
    """The concatenating cache's manager: memory grows with the sequences, so room is never refused.

    It keeps no bookkeeping of its own; ``on_free(seq)`` and ``on_trim(seq)`` are the cache's
    callbacks that drop a sequence's K/V (all of it, or the rejected speculative guesses).
    """

    copy_on_write = True  # a fork shares the parent's tensors, which no step changes in place

    def __init__(self, on_free=None, on_trim=None, on_fork=None):
        self.on_free, self.on_trim, self.on_fork = on_free, on_trim, on_fork

    def fork(self, parent, child) -> None:
        if self.on_fork is not None:
            self.on_fork(parent, child)

    def take_pending_copies(self) -> list:
        return []

    def num_allocatable_tokens(self, seq) -> float:
        return math.inf

    num_admittable_tokens = num_allocatable_tokens

    def num_freeable_tokens(self, seqs) -> float:
        return math.inf

    def allocate_slots(self, seq, num_new_tokens: int, new_computed_blocks=(), num_lookahead_tokens: int = 0):
        return []

    def free(self, seq) -> None:
        if self.on_free is not None:
            self.on_free(seq)

    def trim(self, seq) -> None:
        if self.on_trim is not None:
            self.on_trim(seq)

    def check_fits(self, num_tokens: int, request_id) -> None:
        pass

    def get_computed_blocks(self, seq) -> tuple[list, int]:
        return [], 0

    def on_admitted(self, seq) -> None:
        pass

    def on_computed(self, seq) -> None:
        pass

    def usage(self) -> dict:
        return {}


class ConcatKVCache:
    """Per-sequence caches, gathered into one ``DynamicCache`` before each step and scattered after.

    Memory grows with the sequences, so its KV manager (:class:`UnboundedKVManager`)
    never refuses room; it tells this cache when a sequence's K/V can go. The step's own state (the
    packed ``DynamicCache`` between the forward pass and the scatter) travels in the step's metadata.
    """

    kind = "concat"
    attn_implementation = None  # the model's own attention, with our 4-D mask

    def __init__(self, num_layers: int, cache_kwarg: str = "past_key_values", attn_implementation: str = "sdpa",
                 dtype: torch.dtype = torch.float32):
        if attn_implementation not in MASK_HONOURING:
            raise ValueError(
                f"kv='concat' needs an attention implementation that honours a 4-D attention mask "
                f"({' or '.join(MASK_HONOURING)}); this model uses {attn_implementation!r}, which would attend "
                "across the packed sequences. Call model.set_attn_implementation('sdpa') first, or use kv='paged'")
        self.num_layers = num_layers
        self.dtype = dtype  # of the additive mask: the model's
        self.cache_kwarg = cache_kwarg  # forward()'s name for it: "cache" in recent transformers 5.x
        self.seq_kv: dict[object, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # request id -> per-layer K, V
        self.last_traffic = KVTraffic()
        self.manager = UnboundedKVManager(on_free=self._drop, on_trim=self._trim, on_fork=self._fork)

    def build_metadata(self, token_ids, num_computed, num_scheduled, device, block_tables=None, num_blocks=None,
                       request_ids=()):
        """The step's metadata; ``request_ids`` say whose caches to gather (no blocks here)."""
        meta = attn_metadata.build(token_ids, num_computed, num_scheduled, device)
        meta.request_ids = list(request_ids)
        return meta

    def forward_kwargs(self, meta) -> dict:
        """Gather the in-flight caches and build the mask; returns extra kwargs for the forward pass."""
        t0 = time.perf_counter()
        traffic = KVTraffic()
        cache = DynamicCache()
        for layer in range(self.num_layers):
            parts = [self.seq_kv[rid][layer] for rid, c in zip(meta.request_ids, meta.num_computed_tokens) if c > 0]
            if parts:
                k = torch.cat([p[0] for p in parts], dim=2)  # our gather: C
                v = torch.cat([p[1] for p in parts], dim=2)
                cache.update(k, v, layer)  # DynamicCache concatenates onto an empty tensor: C again
                traffic.bytes_copied += 2 * (k.nbytes + v.nbytes)
        traffic.seconds = time.perf_counter() - t0
        self.last_traffic, meta.past_key_values = traffic, cache
        device = meta.input_ids.device
        mask = block_diagonal_causal_mask(meta.num_computed_tokens, meta.num_scheduled_tokens, device=device)
        return {self.cache_kwarg: cache, "attention_mask": additive_mask(mask, self.dtype), "use_cache": True}

    def after_forward(self, meta) -> KVTraffic:
        """Scatter this step's new keys and values back to each sequence's own cache."""
        t0 = time.perf_counter()
        cache, meta.past_key_values = meta.past_key_values, None  # freed after the step
        total_cached = sum(meta.num_computed_tokens)
        for layer in range(self.num_layers):
            k_all, v_all = layer_kv(cache, layer)
            self.last_traffic.bytes_copied += k_all.nbytes + v_all.nbytes  # the model's update: C + N
            new_k = k_all[:, :, total_cached:].split(meta.num_scheduled_tokens, dim=2)
            new_v = v_all[:, :, total_cached:].split(meta.num_scheduled_tokens, dim=2)
            for rid, k, v in zip(meta.request_ids, new_k, new_v):
                layers = self.seq_kv.setdefault(rid, [None] * self.num_layers)
                if layers[layer] is None:
                    k, v = k.clone(), v.clone()  # own the memory: the packed cache is freed after the step
                else:
                    k = torch.cat([layers[layer][0], k], dim=2)
                    v = torch.cat([layers[layer][1], v], dim=2)
                layers[layer] = (k, v)
                self.last_traffic.bytes_copied += k.nbytes + v.nbytes  # our scatter: C + N in all
        # The rows whose new K/V (last layer: NaN reaches it from any layer below) are not finite -- their own
        # failure, or a neighbour's NaN come through the packed attention's masked keys (0 * NaN = NaN).
        bad = (~(torch.isfinite(k_all[0, :, total_cached:]).all(-1).all(0)
                 & torch.isfinite(v_all[0, :, total_cached:]).all(-1).all(0))).tolist()
        starts = list(itertools.accumulate(meta.num_scheduled_tokens, initial=0))
        meta.non_finite_rows = [i for i, n in enumerate(meta.num_scheduled_tokens) if any(bad[starts[i]:starts[i] + n])]
        self.last_traffic.seconds += time.perf_counter() - t0
        return self.last_traffic

    def check_fits(self, num_tokens: int, request_id) -> None:
        self.manager.check_fits(num_tokens, request_id)

    def close(self) -> None:
        """Let go of every sequence's K/V (:meth:`cbteach.Engine.close`)."""
        self.seq_kv.clear()

    def _fork(self, parent, child) -> None:
        """A sibling sample starts on the parent's K/V: the same tensors (never changed in place: each
        step's scatter makes new ones), so nothing is copied."""
        self.seq_kv[child.request_id] = list(self.seq_kv[parent.request_id])

    def _drop(self, seq) -> None:
        self.seq_kv.pop(seq.request_id, None)

    def _trim(self, seq) -> None:
        """Drop K/V past ``seq``'s computed tokens (rejected speculative guesses)."""
        self.truncate(seq.request_id, seq.num_computed_tokens)

    def truncate(self, request_id, n: int) -> None:
        """Keep the first ``n`` tokens' K/V of ``request_id`` (a row run again alone: see the worker's recovery)."""
        layers = self.seq_kv.get(request_id) or []
        for i, kv in enumerate(layers):
            if kv is not None:
                layers[i] = (kv[0][:, :, :n], kv[1][:, :, :n]) if n else None

    def usage(self) -> dict:
        """Sequences and tokens held right now."""
        return {"num_sequences": len(self.seq_kv),
                "num_tokens": sum(layers[0][0].shape[2] for layers in self.seq_kv.values() if layers[0] is not None)}
