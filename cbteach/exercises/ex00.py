"""Notebook 00: how many bytes of KV cache does one token cost?"""
from __future__ import annotations

from ..modelinfo import describe
from . import report


def check_kv_bytes_per_token(model, answer) -> bool:
    """``answer`` should be the bytes of K and V that one token occupies across all layers."""
    info = describe(model)
    expected = info.kv_bytes_per_token
    if not isinstance(answer, (int, float)):
        return report(False, "", f"answer should be a number of bytes, got {type(answer).__name__}")
    if answer == expected:
        return report(True, f"{expected:,} bytes per token: 2 (K and V) × {info.num_layers} layers × "
                            f"{info.num_kv_heads} KV heads × {info.head_dim} dims × {info.dtype.itemsize} bytes "
                            f"({str(info.dtype).removeprefix('torch.')})", "")
    hints = []
    if answer == expected // 2:
        hints.append("you counted keys or values, not both")
    if answer * info.num_layers == expected:
        hints.append("you counted one layer; every layer has its own cache")
    q_heads = model.config.num_attention_heads
    if answer == expected // info.num_kv_heads * q_heads:
        hints.append("you used the query heads; with grouped-query attention only the KV heads are cached")
    return report(False, "", f"{answer:,} is not right ({'; '.join(hints) or 'check each factor'})")


def check_ratio(lengths, answer) -> bool:
    """``answer`` should be the longest answer length divided by the shortest."""
    expected = max(lengths) / min(lengths)
    ok = isinstance(answer, (int, float)) and abs(answer - expected) < 1e-9
    return report(ok, f"the longest answer is {expected:.1f}x the shortest",
                  f"{answer!r} is not max(lengths) / min(lengths)")
