"""Notebook 04: the concatenating cache's ``gather`` and ``scatter``, first on labelled tensors (each key holds its
sequence and position, so a misplaced one names its mistake), then inside a real ``kv="concat"``
:class:`~cbteach.Engine` in place of the cache's own, whose tokens must be greedy ``model.generate``'s.
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


def _pairs(got):
    """What ``scatter`` returned, a generator of ``(keys, values)`` pairs made a list (anything else as it is)."""
    if hasattr(got, "__iter__") and not isinstance(got, (list, tuple, str, bytes, dict)) and not torch.is_tensor(got):
        return list(got)
    return got


def _labelled(seq: int, start: int, n: int, kind: int) -> torch.Tensor:
    """``[1, HEADS, n, DIM]`` whose token ``t`` holds ``1000 * kind + 100 * seq + (start + t)`` everywhere."""
    pos = torch.arange(start, start + n, dtype=torch.float32)
    return (1000.0 * kind + 100.0 * seq + pos).view(1, 1, n, 1).expand(1, HEADS, n, DIM).contiguous()


def _caches(cached):
    return [None if c == 0 else (_labelled(s, 0, c, 0), _labelled(s, 0, c, 1)) for s, c in enumerate(cached)]


def _labels(t) -> list[tuple[int, int, int]]:
    """(kind, sequence, position) of every token of a labelled tensor."""
    return [(int(v) // 1000, int(v) % 1000 // 100, int(v) % 100) for v in t[0, 0, :, 0].tolist()]


class _NotAPair(Exception):
    """A result that is not a (keys, values) pair: the check's finding, not something the learner's code raised."""


def _pair(x, what):
    if not (isinstance(x, (tuple, list)) and len(x) == 2 and all(torch.is_tensor(t) for t in x)):
        raise _NotAPair(f"{what} should be a (keys, values) pair of tensors, got {type(x).__name__}")
    return x


def _gather_hint(gather) -> str | None:
    cached = [3, 0, 2]
    got = gather(_caches(cached))
    if got is None and gather(_caches([3, 1, 2])) is not None:
        return ("gather returned None for a step where one sequence has nothing cached yet: None means that no "
                "sequence has anything cached")
    if got is None:
        return "not done yet: gather returned None for a step with cached keys -- write it in the cell above"
    k, v = _pair(got, "gather's result")
    want = [(0, s, p) for s, c in enumerate(cached) for p in range(c)]
    if k.dim() != 4 or k.shape[:2] != (1, HEADS) or k.shape[3] != DIM:
        return "the packed keys have the wrong shape: sequences are joined along the token axis, the others stay"
    hints = [(_labels(k) == [(1, s, p) for _, s, p in want], "keys and values are swapped"),
             (sorted(_labels(k)) != sorted(want), "the packed keys are not every cached key of every sequence, once"),
             (_labels(k) != want, "the packed keys are in another order than the step's sequences (03's mask)"),
             (v.shape != k.shape or _labels(v) != [(1, s, p) for _, s, p in want],
              "the values are not packed like the keys")]
    hint = next((hint for wrong, hint in hints if wrong), None)
    if hint is None and gather([None, None]) is not None:
        return "when no sequence has anything cached, return None (the model then gets an empty cache)"
    return hint


def _scatter_hint(scatter) -> str | None:
    cached, new = [3, 0, 2], [1, 4, 1]
    packed = [torch.cat([_labelled(s, 0, c, kind) for s, c in enumerate(cached) if c]  # the cached keys, then the new
                        + [_labelled(s, c, n, kind) for s, (c, n) in enumerate(zip(cached, new))], dim=2)
              for kind in (0, 1)]
    got = _pairs(scatter(*packed, _caches(cached), list(new)))
    if got is None:
        return "not done yet: scatter returned None -- write it in the cell above"
    if not isinstance(got, (list, tuple)) or len(got) != len(cached):
        return f"scatter should return one (keys, values) pair per sequence of the step, {len(cached)} here"
    for s, (c, n) in enumerate(zip(cached, new)):
        k, v = _pair(got[s], f"scatter's entry for sequence {s}")
        want, have = [(0, s, p) for p in range(c + n)], _labels(k) if k.dim() == 4 and k.shape[2] else []
        if have == want and _labels(v) == [(1, s, p) for p in range(c + n)]:
            continue
        kept = have[:c] == want[:c]  # its old keys are there
        values = _labels(v) if v.dim() == 4 and v.shape[2] else []
        hints = [(have == [(1, s, p) for p in range(c + n)], "keys and values are swapped"),
                 (have == want and any(kind == 0 for kind, _, _ in values),
                  "a sequence's values came from the packed keys: its new values are cut from packed_values"),
                 (have == want, "the keys are right, but the values are not placed like them"),
                 (have == want[c:], "a sequence's cache lost its history: append its new keys after its old ones"),
                 (kept and any(kind == 0 and p < cached[seq] for kind, seq, p in have[c:]),
                  "a sequence's new keys came from the cached part of the packed cache: in the concat layout every "
                  "sequence's cached keys come first, and all the new keys after them"),
                 (kept and any(seq != s for _, seq, _ in have[c:]),
                  "a sequence got another sequence's new keys: cut the new part by each one's number of new tokens"),
                 (kept and len(have) != c + n, "a sequence got the wrong number of new keys: the tokens it fed")]
        return next((hint for wrong, hint in hints if wrong), "a sequence's cache is not its old keys, then its new")
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
            updated = _pairs(scatter(k_all, v_all, caches_of(meta, layer), list(meta.num_scheduled_tokens)))
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
    for name, fn, hint_of in (("gather", gather, _gather_hint), ("scatter", scatter, _scatter_hint)):
        try:
            hint = hint_of(fn)
        except _NotAPair as err:
            hint = str(err)
        except Exception as err:  # the learner's code
            hint = f"it raised {raised(err)}"
            if isinstance(err, TypeError) and "NoneType" in str(err):
                hint += " -- the second sequence has nothing cached yet: its entry in caches is None, not a pair"
            elif isinstance(err, RuntimeError) and "Sizes of tensors must match" in str(err):
                hint += (" -- a cache's keys are [1, heads, tokens, head_dim] and the sequences' lengths differ: "
                         "they are joined along the token axis")
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
