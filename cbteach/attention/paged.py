"""Paged attention as a transformers attention function: the model code stays untouched.

Only the engine's own view of the model (:mod:`cbteach.core.model_view`) calls ``"cbteach_paged"``
(registered with ``AttentionInterface``), so ``model.generate`` works as before. Each layer hands over its
queries and this step's new K/V (RoPE applied) with the step's ``AttentionMetadata``, passed as a
forward keyword argument (``cbteach_step=``): no global state. Then: **write** the new K/V at their
``slot_mapping`` slots, **read** each sequence's context through its block table, **attend** within its
causal past -- one call per attention group (:func:`vectorised_attention`; notebook 05's loop over
sequences, :func:`~cbteach.attention.reference.reference_attention`, is tested equal). vLLM's kernel reads the blocks where they lie; a
gather then ``scaled_dot_product_attention`` computes the same numbers in stock PyTorch. transformers
builds no mask for us: we register no mask function.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import EngineRuleError

NAME = "cbteach_paged"
STEP_KWARG = "cbteach_step"  # the forward argument that carries the step's AttentionMetadata


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``query`` ``[1, heads, T, head_dim]``, ``key``/``value`` ``[1, kv_heads, T, head_dim]``: runs the step's
    attention function (``Engine(attention=fn)``'s, or :func:`default_attention`) and checks its shape."""
    meta = kwargs.pop(STEP_KWARG, None)
    if meta is None:  # (not one request's failure: no request can run on this model)
        raise EngineRuleError(f"{NAME!r} attention got no {STEP_KWARG}=: {type(module).__name__} does not pass the forward's "
                              "keyword arguments on to its attention function, so kv='paged' cannot run it: use kv='concat'")
    if attention_mask is not None:  # (transformers builds none for us: a layer's own, which block tables would drop)
        raise EngineRuleError(f"{type(module).__name__} hands its attention function a mask of its own: use kv='concat'")
    attend = meta.attention or default_attention
    out = attend(query, key, value, meta, module.layer_idx, scaling)
    if not isinstance(out, torch.Tensor) or out.shape != query.shape:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise EngineRuleError(f"the attention function returned {got}; it must return a tensor shaped like the "
                              f"queries, [1, heads, tokens, head_dim] = {tuple(query.shape)}")
    return out.transpose(1, 2).contiguous(), None


def default_attention(query, key, value, meta, layer: int, scaling=None) -> torch.Tensor:
    """Write this step's K/V at ``meta.slot_mapping``, then read and attend (:func:`vectorised_attention`).
    ``Engine(attention=fn)`` takes a function with this signature."""
    meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
    return vectorised_attention(query, layer, meta, scaling)


def vectorised_attention(query, layer: int, meta, scaling=None) -> torch.Tensor:
    """Attend every query of the packed row with one call per attention group."""
    _, H, T, D = query.shape
    rows = query[0].transpose(0, 1)  # [T, H, D]: one query per packed row (a view)
    if meta.scratch_row:
        # Row T, a zero "scratch" query, takes the padding's reads and writes: no data-dependent shapes.
        rows = torch.cat([rows, rows.new_zeros(1, H, D)])
    out = None if meta.whole_row else query.new_empty(T + 1, H, D)
    for group in meta.groups:
        G, Q = group.q_index.shape
        k, v = meta.pool.read(layer, group.block_tables)  # [G, K, kv_heads, D]
        k, v = k.transpose(1, 2).to(query.dtype), v.transpose(1, 2).to(query.dtype)  # [G, kv_heads, K, D]
        if meta.pool.may_hold_nan:  # a stale slot's NaN would spread: masked, its weight is 0, but 0 * NaN = NaN
            seen = group.mask.any(dim=2, keepdim=True).transpose(-1, -2)  # [G, 1, K, 1]: keys some query sees
            k, v = k.where(seen, 0.0), v.where(seen, 0.0)
        if group.rows is not None:  # a slice of the packed row: a view, no gather
            q = rows[group.rows[0]:group.rows[1]].view(G, Q, H, D)
        else:
            q = rows[group.q_index]  # [G, Q, H, D]
        o = _attend(q.transpose(1, 2), k, v, group.mask, scaling).transpose(1, 2)  # [G, Q, H, D]
        if out is None:  # the whole step was one dense group: its output is the step's output
            return o.reshape(T, H, D).transpose(0, 1)[None]
        if group.rows is not None:
            out[group.rows[0]:group.rows[1]] = o.reshape(-1, H, D)
        else:
            out[group.q_index.flatten()] = o.reshape(-1, H, D)
    return out[:T].transpose(0, 1)[None]  # [1, H, T, D]


def _attend(q, k, v, mask, scaling):
    """``scaled_dot_product_attention`` for ``q`` ``[G, H, Q, D]``, ``k``/``v`` ``[G, kv_heads, K, D]``. A decode
    under grouped-query attention lays the query heads sharing a KV head out as that head's queries
    (``[G, kv_heads, H // kv_heads, D]``): same numbers, less work. On a GPU it is written out instead
    (:func:`masked_softmax_attention`): the fused kernel SDPA picked on an H200 for our broadcast boolean
    masks gave wrong tokens (``benchmarks/results/gpu.json``)."""
    if written_out(q.device):
        return masked_softmax_attention(q, k, v, mask, scaling)
    G, H, Q, D = q.shape
    kv_heads = k.shape[1]
    if Q == 1 and H != kv_heads:
        o = F.scaled_dot_product_attention(q.reshape(G, kv_heads, H // kv_heads, D), k, v, attn_mask=mask,
                                           scale=scaling)
        return o.view(G, H, 1, D)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=H != kv_heads)


def written_out(device) -> bool:
    """Whether attention is computed by :func:`masked_softmax_attention` on ``device`` (any but the CPU)."""
    return device.type != "cpu"


def masked_softmax_attention(q, k, v, mask, scaling=None):
    """``softmax(q kᵀ * scale, where mask) v`` for ``q`` ``[G, H, Q, D]``, ``k``/``v`` ``[G, kv_heads, K, D]``, ``mask``
    ``[G, 1, Q, K]`` or None; query head ``h`` reads KV head ``h // (H // kv_heads)``."""
    G, H, Q, D = q.shape
    kv_heads = k.shape[1]
    scale = scaling if scaling is not None else D ** -0.5
    qg = q.reshape(G, kv_heads, H // kv_heads, Q, D)  # the query heads of each KV head together
    scores = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * scale  # [G, kv_heads, H // kv_heads, Q, K]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v[:, :, None])  # [G, kv_heads, H // kv_heads, Q, D]
    return out.reshape(G, H, Q, D)


def register() -> None:
    """Make ``"cbteach_paged"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, paged_attention_forward)
