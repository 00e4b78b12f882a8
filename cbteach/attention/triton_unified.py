"""Paged attention as one GPU kernel, in Triton: K/V read where they lie in the pool, no gather.

:mod:`cbteach.attention.paged` gathers every sequence's blocks into contiguous tensors, then attends.
On a GPU that gather copies every cached K/V every step -- and a decode step is bound by those very
bytes. A real paged-attention kernel (PagedAttention, Kwon et al. SOSP'23; vLLM V1's
``vllm/v1/attention/ops/triton_unified_attention.py``) reads each block through the block table
*inside* the attention loop. This module is such a kernel, written for reading:

* **one launch per layer** for the whole packed step -- prefill chunks and decodes alike (vLLM's
  "unified" attention): queries ``[num_tokens, heads, head_dim]``, the pool's K and V
  ``[num_blocks, block_size, kv_heads, head_dim]``, the 2-D ``block_tables``, ``query_start_loc`` and
  ``seq_lens`` of the step's :class:`~cbteach.attention.metadata.AttentionMetadata`;
* **one program per (sequence, tile of its queries, query head)**: the grid is
  ``(num_seqs, max query tiles, heads)``; a program whose tile starts past its sequence's queries
  returns at once. Its KV head is ``head // (heads // kv_heads)`` (grouped-query attention);
* **the inner loop** (:func:`attend_blocks`) walks the sequence's context ``TILE_N`` keys at a time;
  each key is found through the block table -- slot ``block_table[p // block_size] * block_size +
  p % block_size``, as the slot mapping writes it -- and loaded masked to the sequence's length (a
  partly filled last block holds stale slots). Scores, the causal mask (a query at position ``p``
  sees keys ``0..p``; earlier chunks are all in the past), then FlashAttention's **online softmax**
  (Dao et al. 2022): a running max ``m`` and sum ``total``, both rescaled by ``exp(m_old - m_new)``
  whenever the max grows, and the output accumulated as ``p @ V``. The program divides and stores.

vLLM's kernel (which also tiles keys across blocks this way) differs in ways that matter for speed, not
for the numbers: a program holds a KV head with all its query heads (each K/V tile is read once per KV
head, not once per query head), and it splits long contexts over several programs (a "3-D" grid
with a reduction). The same source runs in two ways: compiled for a CUDA device, or in Triton's
**interpreter** (``TRITON_INTERPRET=1``; NumPy runs each program in turn, on CPU tensors), so the
kernel is checked on any laptop. The way is decided once per process, before Triton is imported
(:mod:`.triton_mode`: ``import cbteach`` picks the interpreter where there is no GPU).

``Engine(kv="paged", attention="triton")`` runs the engine on it; :func:`kernel_attention` builds the
same with another inner loop (notebook 05b's exercise). Requires ``pip install "cbteach[kernels]"``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def attend_blocks(q, q_pos, head, table_ptr, num_keys, seq_len, k_pool_ptr, v_pool_ptr,
                  stride_block, stride_slot, stride_head, scale,
                  GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The inner loop of one program: the queries ``q`` ``[BLOCK_Q, BLOCK_D]`` of query head ``head``, at
    positions ``q_pos``, against the sequence's keys ``0 .. num_keys - 1``, ``TILE_N`` keys at a time,
    each found through the block table. Returns the unnormalised output ``acc`` ``[BLOCK_Q, BLOCK_D]``
    and the softmax sums ``total`` ``[BLOCK_Q]`` (the program divides)."""
    kv_head = head // GROUP  # query heads g*GROUP .. g*GROUP+GROUP-1 share KV head g
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, BLOCK_D)
    m = tl.full([q.shape[0]], float("-inf"), tl.float32)  # running max of each query's scores
    total = tl.full([q.shape[0]], 0.0, tl.float32)  # running sum of exp(score - m)
    acc = tl.full(q.shape, 0.0, tl.float32)  # running sum of exp(score - m) * v
    for start in range(0, num_keys, TILE_N):
        pos = start + offs_n  # the keys' positions in the sequence
        present = pos < seq_len  # past the length, a partly filled last block holds stale slots
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=present, other=0)  # logical block -> physical
        where = (block * stride_block + (pos % BLOCK_SIZE) * stride_slot)[:, None] + kv_head * stride_head \
            + offs_d[None, :]
        kv_mask = present[:, None] & (offs_d < HEAD_DIM)[None, :]
        k = tl.load(k_pool_ptr + where, mask=kv_mask, other=0.0)  # [TILE_N, BLOCK_D], read in place
        v = tl.load(v_pool_ptr + where, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [BLOCK_Q, TILE_N]
        s = tl.where(present[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))  # causal; then max
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)  # rescales what was summed under the old max
        p = tl.exp(s - m_new[:, None])
        total = total * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m = m_new
    return acc, total


@triton.jit
def unified_attention_kernel(out_ptr, q_ptr, k_pool_ptr, v_pool_ptr, block_tables_ptr, query_start_loc_ptr,
                             seq_lens_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                             stride_block, stride_slot, stride_head, stride_table,
                             INNER: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
                             BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_D: tl.constexpr):
    """One program: sequence ``program_id(0)``, its query tile ``program_id(1)``, query head ``program_id(2)``."""
    seq, tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start  # this step's queries of the sequence
    if tile * BLOCK_Q < q_len:  # else: the tile starts past this sequence's queries, nothing to do
        seq_len = tl.load(seq_lens_ptr + seq)  # context after this step: computed + scheduled
        offs_q = tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
        offs_d = tl.arange(0, BLOCK_D)
        rows = offs_q < q_len
        cols = offs_d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + offs_q)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=rows[:, None] & cols[None, :], other=0.0)
        # Query j sits at position seq_len - q_len + j; padding rows repeat the last real one (never stored).
        q_pos = seq_len - q_len + tl.minimum(offs_q, q_len - 1)
        num_keys = tl.minimum(seq_len, seq_len - q_len + (tile + 1) * BLOCK_Q)  # causal: none after the tile's last
        acc, total = INNER(q, q_pos, head, block_tables_ptr + seq * stride_table, num_keys, seq_len,
                       k_pool_ptr, v_pool_ptr, stride_block, stride_slot, stride_head, scale,
                       GROUP, BLOCK_SIZE, TILE_N, HEAD_DIM, BLOCK_D)
        out = acc / total[:, None]
        tl.store(out_ptr + (q_start + offs_q)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rows[:, None] & cols[None, :])


INTERPRETED = type(tl.zeros).__name__ == "InterpretedFunction"  # the way Triton was imported (triton_mode)


def _as_kernel_function(fn):
    """``fn`` as a function a kernel can call in this process's Triton: a ``@triton.jit`` function as it
    is; a plain function (or one decorated before the process's mode was set) decorated now."""
    raw = fn
    while callable(getattr(raw, "fn", None)):  # a JITFunction or an InterpretedFunction keeps the function as .fn
        raw = raw.fn
    if not callable(raw):
        raise ValueError(f"the inner loop must be a function decorated with @triton.jit, got {type(fn).__name__}")
    return fn if type(fn) is type(unified_attention_kernel) and fn.fn is raw else triton.jit(raw)


def check_device(device, dtype=None) -> None:
    """Refuse tensors this process's Triton cannot run on: compiled, CUDA only; interpreted, the CPU
    (CUDA tensors too, copied to the host for each launch) and no bfloat16, which NumPy lacks."""
    kind = torch.device(device).type if device is not None else None
    if kind not in (("cpu", "cuda") if INTERPRETED else ("cuda",)):
        raise ValueError(f"the Triton kernel cannot run on {kind}: this process runs Triton " + (
            "in its interpreter, on CPU tensors" if INTERPRETED else
            "compiled, on CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 before Triton is imported"))
    if INTERPRETED and dtype == torch.bfloat16:
        raise ValueError("Triton's interpreter computes with NumPy, which has no bfloat16: run the model in "
                         "float32 or float16 for the kernel on a CPU (or on a CUDA GPU)")


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def unified_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, meta, scaling=None,
                      inner=None, tile_n: int | None = None) -> torch.Tensor:
    """Attend the packed step's ``query`` (``[1, heads, T, head_dim]``, as transformers passes it) over the
    pool's ``k_pool``/``v_pool`` (one layer, ``[num_blocks, block_size, kv_heads, head_dim]``) through
    ``meta.block_tables``, in one launch. ``inner``: the inner loop (default :func:`attend_blocks`);
    ``tile_n``: keys per turn of its loop (a power of two; default: chosen for the device)."""
    _, H, T, D = query.shape
    kv_heads = k_pool.shape[2]
    if H % kv_heads or k_pool.shape[3] != D or k_pool.stride(3) != 1 or k_pool.stride() != v_pool.stride():
        raise ValueError(f"queries [1, {H}, T, {D}] and a pool {tuple(k_pool.shape)} do not fit: the heads must be a "
                         "multiple of the KV heads, head_dim equal, K and V laid out alike")
    check_device(query.device, query.dtype)
    B, longest = len(meta.num_scheduled_tokens), max(meta.num_scheduled_tokens)
    longest_context = max(c + n for c, n in zip(meta.num_computed_tokens, meta.num_scheduled_tokens))
    chosen = tile_n
    if INTERPRETED:  # NumPy pays per operation, not per element: big tiles, few loop turns
        block_q, tile_n, block_d = min(16, _pow2(longest)), min(256, _pow2(longest_context)), _pow2(D)
    else:  # tl.dot wants every side >= 16 on a GPU
        block_q, tile_n, block_d = 16, 32, max(16, _pow2(D))
    if chosen is not None:
        if chosen < (1 if INTERPRETED else 16) or chosen & (chosen - 1):
            raise ValueError(f"tile_n must be a power of two{'' if INTERPRETED else ' >= 16 on a GPU'}, got {chosen}")
        tile_n = chosen
    out = torch.empty_like(query)
    q, o = query[0].transpose(0, 1), out[0].transpose(0, 1)  # [T, H, D] views: no copy
    tables = meta.block_tables
    grid = (B, -(-longest // block_q), H)  # (sequence, tile of its queries, query head)
    unified_attention_kernel[grid](o, q, k_pool, v_pool, tables, meta.query_start_loc, meta.seq_lens,
                 D ** -0.5 if scaling is None else float(scaling),
                 q.stride(0), q.stride(1), o.stride(0), o.stride(1),
                 k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), tables.stride(0),
                 INNER=_as_kernel_function(inner or attend_blocks), GROUP=H // kv_heads, BLOCK_Q=block_q,
                 BLOCK_SIZE=meta.block_size, TILE_N=tile_n, HEAD_DIM=D, BLOCK_D=block_d)
    return out


def kernel_attention(inner=None):
    """An attention function for the engine's plug point (``Engine(kv="paged", attention=...)``): write
    this step's K/V at ``meta.slot_mapping``, then :func:`unified_attention` reads them from the pool."""
    def attention(query, key, value, meta, layer, scaling=None):
        meta.pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))
        return unified_attention(query, meta.pool.k[layer], meta.pool.v[layer], meta, scaling, inner)

    attention.__name__ = f"triton_{getattr(inner, '__name__', 'attend_blocks')}"
    return attention
