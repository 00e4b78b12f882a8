"""Notebook 04: the concatenating cache's ``gather`` and ``scatter``, run inside the engine.

Both run first on labelled tensors (each key holds its sequence and position, so a misplaced one names its
mistake), then in a real ``kv="concat"`` :class:`~cbteach.Engine` in place of the cache's own; the tokens must
be greedy ``model.generate``'s.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from transformers import DynamicCache

from ..attention.packing import additive_mask, block_diagonal_causal_mask
from ..engine.engine import Engine
from ..core.request import Request
from ..kv.concat import KVTraffic, layer_kv
from . import fail, generated, need_function, passed, raised, self_check

HEADS, DIM = 2, 3


def _labelled(seq: int, start: int, n: int, kind: int) -> torch.Tensor:
    """``[1, HEADS, n, DIM]`` whose token ``t`` holds ``1000 * kind + 100 * seq + (start + t)`` everywhere."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    return (1000.0 * kind + 100.0 * seq + pos).view(1, 1, n, 1).expand(1, HEADS, n, DIM).contiguous()


def _caches(cached):
    return [None if c == 0 else (_labelled(s, 0, c, 0), _labelled(s, 0, c, 1)) for s, c in enumerate(cached)]


def _labels(t) -> list[tuple[int, int, int]]:
    """(kind, sequence, position) of every token of a labelled tensor."""
    return [(int(v) // 1000, int(v) % 1000 // 100, int(v) % 100) for v in t[0, 0, :, 0].tolist()]


def _pair(x, what):
    if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(torch.is_tensor(t) for t in x)):
        raise TypeError(f"{what} should be a (keys, values) pair of tensors, got {type(x).__name__}")
    return x


def _gather_hint(gather) -> str | None:
    cached = [3, 0, 2]
    got = gather(_caches(cached))
    if got is None:
        return "not done yet: gather returned None for a step with cached keys -- write it in the cell above"
    k, v = _pair(got, "gather's result")
    want = [(0, s, p) for s, c in enumerate(cached) for p in range(c)]
    if k.dim() != 4 or k.shape[:2] != (1, HEADS) or k.shape[3] != DIM:
        return "the packed keys have the wrong shape: sequences are joined along the token axis, the others stay"
    got_k = _labels(k)
    if got_k == [(1, s, p) for _, s, p in want]:
        return "keys and values are swapped"
    if sorted(got_k) != sorted(want):
        return "the packed keys are not the cached keys, each once: every cached key of every sequence goes in"
    if got_k != want:
        return "the packed keys are in another order than the step's sequences (the order notebook 03's mask expects)"
    if _labels(v) != [(1, s, p) for _, s, p in want]:
        return "the values are not packed like the keys"
    if gather([None, None]) is not None:
        return "when no sequence has anything cached, return None (the model then gets an empty cache)"
    return None


def _scatter_hint(scatter) -> str | None:
    cached, new = [3, 0, 2], [1, 4, 1]
    old = _caches(cached)
    k_parts = [_labelled(s, 0, c, 0) for s, c in enumerate(cached) if c]
    v_parts = [_labelled(s, 0, c, 1) for s, c in enumerate(cached) if c]
    k_parts += [_labelled(s, c, n, 0) for s, (c, n) in enumerate(zip(cached, new))]
    v_parts += [_labelled(s, c, n, 1) for s, (c, n) in enumerate(zip(cached, new))]
    got = scatter(torch.cat(k_parts, dim=2), torch.cat(v_parts, dim=2), old, list(new))
    if got is None:
        return "not done yet: scatter returned None -- write it in the cell above"
    if not isinstance(got, (list, tuple)) or len(got) != len(cached):
        return f"scatter should return one (keys, values) pair per sequence of the step, {len(cached)} here"
    for s, (c, n) in enumerate(zip(cached, new)):
        k, v = _pair(got[s], f"scatter's entry for sequence {s}")
        want = [(0, s, p) for p in range(c + n)]
        have = _labels(k) if k.dim() == 4 and k.shape[2] else []
        if have == want and _labels(v) == [(1, s, p) for p in range(c + n)]:
            continue
        if have == [(1, s, p) for p in range(c + n)]:
            return "keys and values are swapped"
        if have == want[c:]:
            return "a sequence's cache lost its history: append its new keys after its old ones, do not replace them"
        if have[:c] == want[:c] and any(kind == 0 and p < cached[seq] for kind, seq, p in have[c:]):
            return ("a sequence's new keys came from the cached part of the packed cache: in the concat layout "
                    "every sequence's cached keys come first, and all the new keys after them")
        if have[:c] == want[:c] and any(seq != s for _, seq, _ in have[c:]):
            return "a sequence got another sequence's new keys: cut the new part by each one's number of new tokens"
        if have[:c] == want[:c] and len(have) != c + n:
            return "a sequence got the wrong number of new keys: each gets exactly the tokens it fed this step"
        return "a sequence's updated cache is not its old keys followed by its new ones"
    return None


def _plug(engine, gather, scatter):
    """Make ``engine``'s concat cache call the learner's gather and scatter (this engine object only):
    its ``forward_kwargs`` and ``after_forward`` are replaced by versions that call them."""
    kv = engine.kv
    packed = {}

    def caches_of(meta, layer):
        return [kv.seq_kv[rid][layer] if c > 0 else None for rid, c in zip(meta.request_ids, meta.num_computed_tokens)]

    def forward_kwargs(meta):
        cache = DynamicCache()
        for layer in range(kv.num_layers):
            got = gather(caches_of(meta, layer))
            if got is not None:
                k, v = _pair(got, "gather's result")
                cache.update(k, v, layer)
        packed["cache"] = cache
        mask = block_diagonal_causal_mask(meta.num_computed_tokens, meta.num_scheduled_tokens,
                                          device=meta.input_ids.device)
        return {kv.cache_kwarg: cache, "attention_mask": additive_mask(mask, kv.dtype), "use_cache": True}

    def after_forward(meta):
        cache = packed.pop("cache")
        for layer in range(kv.num_layers):
            k_all, v_all = layer_kv(cache, layer)
            updated = scatter(k_all, v_all, caches_of(meta, layer), list(meta.num_scheduled_tokens))
            if not isinstance(updated, (list, tuple)) or len(updated) != len(meta.request_ids):
                raise TypeError("scatter should return one (keys, values) pair per sequence of the step")
            for rid, pair in zip(meta.request_ids, updated):
                kv.seq_kv.setdefault(rid, [None] * kv.num_layers)[layer] = tuple(_pair(pair, "scatter's entry"))
        return KVTraffic()

    kv.forward_kwargs, kv.after_forward = forward_kwargs, after_forward


class Prompt(NamedTuple):
    text: str
    max_new_tokens: int  # EOS ignored


WORKLOAD = [Prompt(text="CYNIC, n.", max_new_tokens=12), Prompt(text="EXECUTIVE, n.", max_new_tokens=5),
            Prompt(text="HAG, n.", max_new_tokens=9), Prompt(text="ABSURDITY, n.", max_new_tokens=4)]


@self_check
def check_gather_scatter(gather, scatter, model, tokenizer) -> bool:
    """``gather(caches)`` and ``scatter(packed_keys, packed_values, caches, num_scheduled)``: labelled cases
    first, then inside a real concat engine, compared with ``model.generate`` prompt by prompt."""
    need_function(gather, "gather")
    need_function(scatter, "scatter")
    for name, hint_of in (("gather", _gather_hint), ("scatter", _scatter_hint)):
        try:
            hint = hint_of(gather if name == "gather" else scatter)
        except Exception as err:  # the learner's code
            hint = f"it raised {raised(err)}"
        if hint:
            return fail(f"{name}, on a step with sequences of 3, 0 and 2 cached tokens: {hint}")
    engine = Engine(model, tokenizer, max_batch_size=2, kv="concat")
    _plug(engine, gather, scatter)
    reqs = [Request(p, n, request_id=p.split(",")[0], ignore_eos=True) for p, n in WORKLOAD]
    try:
        out = engine.run(reqs)
    except Exception as err:  # the learner's functions, called by the engine
        return fail(f"inside the engine, a step failed with {raised(err)} -- on some "
                    "step a sequence's cache did not hold exactly its tokens so far")
    fused = sum(r.is_fused for r in engine.records)
    for c, (p, n) in zip(out, WORKLOAD):
        if c.output_ids != generated(model, tokenizer(p)["input_ids"], n, stop_at_eos=False):
            return fail(f"inside the engine, {c.request_id}'s tokens are not what generate gives it "
                        "alone: a key or value reached the wrong sequence or position on some step")
    return passed(f"your gather and scatter ran inside the engine for {len(engine.records)} steps ({fused} "
                  f"fused) and every request got generate's tokens")
