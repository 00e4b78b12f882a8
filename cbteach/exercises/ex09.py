"""Notebook 09: what a disaggregated handover moves -- bytes of KV cache and seconds on the link -- compared
with a real :class:`~cbteach.serving.disagg.DisaggregatedServer`'s ``.transfers`` on several model shapes and
KV dtypes. Hints name the factor that is off.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple

import torch

from ..serving.disagg import DisaggregatedServer
from ..core.request import Request
from . import fail, need_function, passed, self_check

class Shape(NamedTuple):
    """A small model's shape; head_dim = hidden / heads."""

    layers: int
    heads: int  # query heads
    kv_heads: int
    hidden: int


class Handover(NamedTuple):
    """One handover to check: the model, the prompt, the pool and the link."""

    shape: str | None  # a key of SHAPES, or None for the notebook's model
    prompt_len: int  # prompt tokens
    block_size: int
    kv_dtype: str | None
    link_bytes_per_s: float


SHAPES = {"gqa": Shape(layers=2, heads=4, kv_heads=2, hidden=64),
          "mqa": Shape(layers=3, heads=4, kv_heads=1, hidden=32),
          "mha": Shape(layers=1, heads=2, kv_heads=2, hidden=32)}
CASES = [Handover(shape="gqa", prompt_len=16, block_size=16, kv_dtype=None, link_bytes_per_s=10e9),
         Handover(shape="gqa", prompt_len=17, block_size=16, kv_dtype=None, link_bytes_per_s=10e9),
         Handover(shape="mqa", prompt_len=9, block_size=8, kv_dtype=None, link_bytes_per_s=25e9),
         Handover(shape="gqa", prompt_len=5, block_size=4, kv_dtype="int8", link_bytes_per_s=1e9),
         Handover(shape="mqa", prompt_len=9, block_size=8, kv_dtype="int8", link_bytes_per_s=25e9),
         Handover(shape="mha", prompt_len=30, block_size=16, kv_dtype="int8", link_bytes_per_s=64e9)]


@functools.lru_cache(maxsize=None)
def small_model(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[shape]
    cfg = LlamaConfig(vocab_size=97, hidden_size=s.hidden, intermediate_size=2 * s.hidden, num_hidden_layers=s.layers,
                      num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, max_position_embeddings=256,
                      eos_token_id=5, bos_token_id=1, pad_token_id=5)
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


def _bytes_hint(got, prompt_len, config, bs, kv_dtype) -> str:
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    slots = lambda n: math.ceil(n / bs) * bs  # noqa: E731  n tokens take whole blocks
    per_token = 2 * layers * kv_heads * (d + 4 if kv_dtype == "int8" else 4 * d)
    expected = slots(prompt_len) * per_token
    if got == prompt_len * per_token:
        return f"the K/V go over in whole blocks: the last one travels whole even if partly filled (block_size {bs})"
    if got in (slots(prompt_len + 1) * per_token, (prompt_len + 1) * per_token):
        return ("the prefill engine computed the prompt's K/V only: the first new token was sampled but never "
                "fed through the model, so it has no K/V yet")
    if got * 2 == expected:
        return "keys *and* values are stored, for every token" + (
            " (and every layer has its own)" if layers == 2 else "") + (
            "; fp32 takes 4 bytes per value" if kv_dtype != "int8" else "")
    if got * layers == expected and layers > 1:
        return "every layer has its own keys and values"
    if kv_heads != heads and got * kv_heads == expected * heads:
        return "with grouped-query attention only the KV heads are cached (config.num_key_value_heads)"
    if kv_dtype == "int8":
        if got == slots(prompt_len) * 2 * layers * kv_heads * d:
            return ("int8 values are 1 byte each, but every (token, head) also stores one float32 scale, for K "
                    "and for V (cbteach.kv.int8)")
        if got == slots(prompt_len) * 2 * layers * kv_heads * 4 * d:
            return "with kv_dtype='int8' each value takes 1 byte (plus a float32 scale per token and head)"
    if got == 8 * expected:
        return "count bytes, not bits"
    return ("bytes = whole blocks of the prompt × block_size × bytes per token, and bytes per token = "
            "2 (K, V) × layers × KV heads × bytes per head")


@self_check
def check_handover(handover, model, prompt_len: int | None = None) -> bool:
    """``handover(prompt_len, config, block_size, kv_dtype, link_bytes_per_s)`` -> ``(bytes, seconds)``; the
    notebook's prompt first (fp32 and int8), then :data:`CASES`."""
    need_function(handover, "handover")
    cases = [Handover(shape=None, prompt_len=prompt_len, block_size=16, kv_dtype=dtype, link_bytes_per_s=10e9)
             for dtype in (None, "int8")] if prompt_len else []
    cases += CASES
    for shape, n, bs, kv_dtype, link in cases:  # see Handover
        m = model if shape is None else small_model(shape)
        where = (f"prompt_len={n}, block_size={bs}, kv_dtype={kv_dtype!r}, link {link:.0e} B/s, "
                 + ("the notebook's model" if shape is None else f"a small model ({shape}: layers, heads, kv "
                                                                  f"heads, hidden = {tuple(SHAPES[shape])})"))
        try:
            got = handover(n, m.config, bs, kv_dtype, link)
            if got is None:
                return fail("not done yet: handover returned None -- write it in the cell above")
            nbytes, seconds = got
        except Exception as err:  # the learner's code, or a result that is not a pair
            return fail(f"handover(...) failed or did not return (bytes, seconds) for {where}: "
                        f"{type(err).__name__}: {err}")
        if not all(isinstance(x, numbers.Real) and not isinstance(x, bool) for x in (nbytes, seconds)):
            return fail(f"handover should return two numbers (bytes, seconds); got {got!r}")
        exp_bytes, exp_seconds = measured_handover(m, n, bs, kv_dtype, link)
        if nbytes != exp_bytes:
            more = "more" if nbytes > exp_bytes else "fewer"
            return fail(f"for {where} you said {nbytes:,} bytes, {more} than the server moved. "
                        f"Hint: {_bytes_hint(nbytes, n, m.config, bs, kv_dtype)}")
        if not math.isclose(seconds, exp_seconds, rel_tol=1e-9, abs_tol=1e-15):
            if math.isclose(seconds, 8 * exp_seconds, rel_tol=1e-9):
                hint = "link_bytes_per_s is already in bytes per second: no factor 8"
            elif math.isclose(seconds * exp_seconds, 1.0, rel_tol=1e-6):
                hint = "the division is upside down: seconds = bytes / (bytes per second)"
            else:
                hint = "seconds = bytes / link_bytes_per_s (the handover is modelled as bandwidth only, no latency)"
            return fail(f"the bytes are right for {where}, but {seconds!r} s is not the link time. Hint: {hint}")
    shapes = len({c.shape for c in cases})
    return passed(f"bytes and link time match the disaggregated server's .transfers on all {len(cases)} "
                  f"handovers (fp32 and int8 pools, {shapes} model shapes)")
