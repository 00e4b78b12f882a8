"""Notebook 09: what a disaggregated handover moves (bytes of KV cache, seconds on the link), against a real
:class:`~cbteach.serving.disagg.DisaggregatedServer`'s ``.transfers`` on several model shapes and KV dtypes.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import torch

from ..serving.disagg import DisaggregatedServer
from ..core.request import Request
from . import ask, fail, first_mistake, need_function, passed, self_check


class Shape(NamedTuple):
    layers: int
    heads: int  # query heads
    kv_heads: int
    hidden: int
    head_dim: int | None = None  # None: hidden / heads (a model may make its heads wider: Qwen3, Gemma)


class Handover(NamedTuple):
    shape: str | None  # a key of SHAPES, or None for the notebook's model
    prompt_len: int  # prompt tokens
    block_size: int
    kv_dtype: str | None
    link_bytes_per_s: float


SHAPES = {"gqa": Shape(layers=2, heads=4, kv_heads=2, hidden=64),
          "mqa": Shape(layers=3, heads=4, kv_heads=1, hidden=32),
          "mha": Shape(layers=1, heads=2, kv_heads=2, hidden=32),
          "wide heads": Shape(layers=2, heads=4, kv_heads=2, hidden=32, head_dim=12)}
CASES = [Handover(shape="gqa", prompt_len=16, block_size=16, kv_dtype=None, link_bytes_per_s=10e9),
         Handover(shape="gqa", prompt_len=17, block_size=16, kv_dtype=None, link_bytes_per_s=10e9),
         Handover(shape="mqa", prompt_len=9, block_size=8, kv_dtype=None, link_bytes_per_s=25e9),
         Handover(shape="gqa", prompt_len=5, block_size=4, kv_dtype="int8", link_bytes_per_s=1e9),
         Handover(shape="mqa", prompt_len=9, block_size=8, kv_dtype="int8", link_bytes_per_s=25e9),
         Handover(shape="mha", prompt_len=30, block_size=16, kv_dtype="int8", link_bytes_per_s=64e9),
         Handover(shape="wide heads", prompt_len=7, block_size=4, kv_dtype=None, link_bytes_per_s=10e9),
         Handover(shape="wide heads", prompt_len=7, block_size=4, kv_dtype="int8", link_bytes_per_s=10e9)]


@functools.lru_cache(maxsize=None)
def small_model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=97, hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=256,
                      eos_token_id=5, bos_token_id=1, pad_token_id=5, **({"head_dim": s.head_dim} if s.head_dim else {}))
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def measured_handover(model, prompt_len: int, block_size: int, kv_dtype=None, link_bytes_per_s: float = 10e9):
    """``(bytes, seconds)`` a real disaggregated server moved to hand one request over."""
    opts = {"kv_dtype": kv_dtype} if kv_dtype else None
    server = DisaggregatedServer(model, None, max_batch_size=1, block_size=block_size,
                                 link_bytes_per_s=link_bytes_per_s, prefill_options=opts, decode_options=opts)
    ids = [10 + i % 80 for i in range(prompt_len)]
    server.run([Request(ids, 3, request_id="r", ignore_eos=True)])
    return server.transfers["bytes"], server.transfers["seconds"]


def _bytes(cfg, n, bs, kv_dtype, *, tokens=None, kv=2, one_layer=False, all_heads=False, int8="int8", bits=1,
           head_dim_by_kv_heads=False, head_dim_from_hidden=False):
    """The bytes one handover moves -- or, with one keyword changed, what a typical mistake computes."""
    heads = cfg.num_attention_heads
    kv_heads = heads if all_heads else getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    d = cfg.hidden_size // heads if head_dim_from_hidden else d
    d = cfg.hidden_size // kv_heads if head_dim_by_kv_heads else d
    per_head = {"int8": d + 4, "no scales": d, "fp32": 4 * d, "scale2": d + 2, "scales twice": d + 8,
                "scale per token": d + 4 / kv_heads}[int8 if kv_dtype == "int8" else "fp32"]
    n_slots = tokens(n, bs) if tokens else math.ceil(n / bs) * bs
    return n_slots * kv * (1 if one_layer else cfg.num_hidden_layers) * kv_heads * per_head * bits


# Typical mistakes: (:func:`_bytes`'s keywords, several: any of them; the hint when the learner's bytes are those).
BYTES_MISTAKES = [
    ([dict(tokens=lambda n, bs: n)], "the K/V go over in whole blocks: the last one whole even if partly filled"),
    ([dict(tokens=lambda n, bs: n // bs * bs)], "the number of blocks was rounded down: the last, partly filled block "
                                                "goes over whole too"),
    ([dict(tokens=lambda n, bs: math.ceil(n / bs))], "you counted blocks, not the tokens in them: each block holds "
                                                     "block_size tokens' K/V"),
    ([dict(tokens=lambda n, bs: n + 1), dict(tokens=lambda n, bs: math.ceil((n + 1) / bs) * bs)],
     "the prefill computed the prompt's K/V only: the first new token was never fed, so it has no K/V yet"),
    ([dict(kv=1)], "half the bytes: keys *and* values are stored, for every token, in every layer -- and each "
                   "value of this float32 pool takes 4 bytes (2 is float16's)"),
    ([dict(one_layer=True)], "every layer has its own keys and values"),
    ([dict(all_heads=True), dict(head_dim_by_kv_heads=True)],
     "you counted hidden_size values per token for K (and for V): with grouped-query attention only the KV heads are "
     "cached (config.num_key_value_heads), each config.head_dim wide"),
    ([dict(head_dim_from_hidden=True)], "a head is config.head_dim wide, which need not be hidden_size / "
                                        "num_attention_heads: a model may make its heads wider (Qwen3, Gemma do)"),
    ([dict(int8="no scales")], "int8 values are 1 byte each, but every (token, head) also stores one float32 scale, "
                               "for K and for V (cbteach.kv.int8)"),
    ([dict(int8="fp32")], "with kv_dtype='int8' each value takes 1 byte (plus a float32 scale per token and head)"),
    ([dict(int8="scale2"), dict(int8="scale per token")],  # (a 2-byte scale, or one shared by K and V, is "scale2")
     "too few bytes for the scales: every (token, head) keeps a float32 scale, 4 bytes, for K and another for V"),
    ([dict(int8="scales twice")], "the scales were counted twice: each (token, head) of K keeps one float32 scale "
                                  "and each of V another -- already two, once the values of K and of V are counted"),
    ([dict(bits=8)], "count bytes, not bits"),
]


@self_check
def check_handover(handover, model, prompt_len: int | None = None) -> bool:
    """``handover(prompt_len, config, block_size, kv_dtype, link_bytes_per_s)`` -> ``(bytes, seconds)``; the
    notebook's prompt first (fp32 and int8), then :data:`CASES`."""
    need_function(handover, "handover")
    cases = [Handover(shape=None, prompt_len=prompt_len, block_size=16, kv_dtype=dtype, link_bytes_per_s=10e9)
             for dtype in (None, "int8")] if prompt_len else []
    for shape, n, bs, kv_dtype, link in cases + CASES:
        m = model if shape is None else small_model(shape)
        where = (f"prompt_len={n}, block_size={bs}, kv_dtype={kv_dtype!r}, link {link:.0e} B/s, " + (
            "the notebook's model" if shape is None else f"a small model ({shape}: " + ", ".join(
                f"{k} {v}" for k, v in SHAPES[shape]._asdict().items() if v is not None) + ")"))
        got = ask(handover, n, m.config, bs, kv_dtype, link, shown=f"handover(...) for {where}")
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return fail(f"handover did not return (bytes, seconds) for {where}: got {got!r}")
        nbytes, seconds = got
        if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in got):
            return fail(f"handover should return two numbers (bytes, seconds); got {got!r}")
        exp_bytes, exp_seconds = measured_handover(m, n, bs, kv_dtype, link)
        if seconds == exp_bytes and nbytes != exp_bytes:
            return fail(f"for {where} your second number is the bytes: handover returns (bytes, seconds), in that order")
        if nbytes != exp_bytes:
            # Which mistake gives these bytes here -- and on a prompt of 40, where some that agree here differ
            # (half the bytes and floored blocks, on a prompt of 30).
            probe = ask(handover, 40, m.config, 16, kv_dtype, link, shown=f"handover(40, ...) for {where}")
            probe = probe[0] if isinstance(probe, (tuple, list)) and len(probe) == 2 else None
            gives = lambda keywords: any(nbytes == _bytes(m.config, n, bs, kv_dtype, **k) and probe in (  # noqa: E731
                None, _bytes(m.config, 40, 16, kv_dtype, **k)) for k in keywords)
            hint = first_mistake(BYTES_MISTAKES, gives) or (
                f"not one of the typical mistakes the check knows; your count is {nbytes / exp_bytes:.4g} times the "
                "bytes the server moved -- look for the factor that is off by that much")
            return fail(f"for {where} you said {nbytes:,} bytes, {'more' if nbytes > exp_bytes else 'fewer'} than "
                        f"the server moved. Hint: {hint}")
        if not math.isclose(seconds, exp_seconds, rel_tol=1e-9, abs_tol=1e-15):
            if math.isclose(seconds, 8 * exp_seconds, rel_tol=1e-9) or math.isclose(8 * seconds, exp_seconds, rel_tol=1e-9):
                hint = "link_bytes_per_s is already in bytes per second: no factor 8"
            elif any(math.isclose(seconds, f * exp_seconds, rel_tol=1e-9) for f in (1e3, 1e6, 1e-3, 1e-9)):
                hint = ("that is the link time in another unit (a factor of a thousand or more): the answer is in "
                        "seconds, and link_bytes_per_s is bytes per second")
            elif math.isclose(seconds * exp_seconds, 1.0, rel_tol=1e-6):
                hint = "the division is upside down: seconds = bytes / (bytes per second)"
            else:
                hint = "seconds = bytes / link_bytes_per_s (the handover is modelled as bandwidth only, no latency)"
            return fail(f"the bytes are right for {where}, but {seconds!r} s is not the link time. Hint: {hint}")
    return passed(f"bytes and link time match the disaggregated server's .transfers on all {len(cases + CASES)} "
                  f"handovers (fp32 and int8 pools, {len({c.shape for c in cases + CASES})} model shapes)")
