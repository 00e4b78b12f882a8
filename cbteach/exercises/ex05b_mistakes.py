"""Notebook 05b's kernel loop with one typical mistake, simulated in torch -- the same programs, pointers into the
flat pool and masked loads: the check names the mistake whose simulation equals the learner's answer.
"""
from __future__ import annotations

import torch

_POINTER = ("a key at position p lies in logical block p // BLOCK_SIZE -- whose pool block the block table gives "
            "-- at slot p % BLOCK_SIZE of it")
_KV_HEAD = ("a query head read the wrong KV head: here 4 query heads share 2 KV heads, consecutive query heads sharing "
            "one (GROUP = heads // kv_heads query heads per KV head)")
# name -> hint, in the order the check tries them (where scores overflow, the loop without the max and the inverted
# rescale both give NaN everywhere: the first is named there, and only it passes the steps before)
MISTAKES = {
    "swapped": "block and slot are swapped in your key pointers: " + _POINTER,
    "block_plus_one": "each key was read from the block after its own: the block index is one too far. " + _POINTER,
    "slot_no_stride": "a key's slot was added to the pointer as a count of elements: one slot further is stride_slot "
                      "elements further",
    "block_no_stride": "the pool block was added to the pointer as a count of elements: one block further is "
                       "stride_block elements further",
    "head_no_stride": "the KV head was added to the pointer as a count of elements: one head further is stride_head "
                      "elements further",
    "logical_as_physical": "your loop read logical block b as pool block b: the block table says which pool block "
                           "holds each logical block (here they lie out of order)",
    "one_block_per_tile": "a tile here spans several blocks (blocks of 3, tiles of 8 keys): each key has its own "
                          "logical block and slot, from its own position",
    "slot_from_tile": "a key's slot came from its place in the tile, not from its position in the sequence: here a "
                      "tile starts part-way into a block",
    "no_scale": "the scores were not multiplied by scale: attention's softmax is over q . k times scale",
    "scale_twice": "the scores were multiplied by scale twice: once, q . k times scale",
    "scale_divided": "the scores were divided by scale: scale is already 1 / sqrt(head_dim), multiply by it",
    "loads_unmasked": "the slots past the sequence's length hold stale K/V (here NaN), and your loop loaded them: "
                      "mask the loads (mask=..., other=0.0), not only the scores -- its keys are at positions 0 .. "
                      "seq_len - 1, seq_len itself is past the end",
    "masked_with_zero": "masked scores were set to 0, not -inf: exp(0 - m) is not 0, so a key a query may not see "
                        "still got weight",
    "no_causal": "a prefill chunk: its queries saw keys after their own positions. Query j of a chunk sits at "
                 "q_pos = seq_len - num_queries + j and may see keys 0 .. q_pos only",
    "causal_strict": "a query did not see its own key: the query at q_pos sees the keys 0 .. q_pos, itself included",
    "max_before_masking": "a key this query may not see scores far above the others, and your running max took it "
                          "in: the max must be taken over the scores that survive the masks",
    "kv_head_is_head": _KV_HEAD,
    "kv_head_modulo": _KV_HEAD + ", not every GROUP-th",
    "kv_head_times_group": _KV_HEAD + ": query head h reads KV head h // GROUP, not h * GROUP",
    "head_columns_unmasked": "a tile has BLOCK_D columns, a power of two, and a head here holds HEAD_DIM = 6 numbers: "
                             "your loads read the columns past each head's own (the next head's, or a stale slot's: "
                             "here NaN, and 0 times NaN is NaN) -- mask the columns past HEAD_DIM in the loads too, "
                             "not only the keys",
    "no_running_max": "scores here reach the hundreds, and exp of a score above about 88 overflows float32 to inf: "
                      "subtract the running max before exp (section 3)",
    "max_starts_at_zero": "your running max starts at 0, above every score of a query whose scores all lie far "
                          "below zero (here near -150): each exp(score - m) underflows float32 to 0 and the sum is "
                          "0 -- the running max must start below any score it can meet",
    "rescale_inverted": "NaN from the first tile, where m is still -inf and exp(x - m) is inf: either your rescale "
                        "factor grows when the max grows (it must shrink), or p subtracts the old max instead of the "
                        "new one (section 3)",
    "max_not_stored": "your running max is never updated: m stays -inf, every tile's rescale factor is exp(-inf) = 0, "
                      "and only the last tile counts -- keep the new max for the next tile",
    "sum_not_rescaled": "the running max grew from one tile to the next, and the running sum kept what was summed "
                        "under the old max: when m changes, the sum must be rescaled too",
    "acc_not_rescaled": "the running max grew from one tile to the next, and the output so far kept what was summed "
                        "under the old max: when m changes, acc must be rescaled too",
    "divided": "your loop divided by the sum itself, and the program divides again: return (acc, total)",
    "fp16": "close to the reference, but not within float32's rounding: part of your loop computes in float16 -- "
            "keep p, V and the accumulator in float32",
}
ROUNDING = ("close to the reference, but not within float32's rounding: part of your loop computes in lower "
            "precision (float16, bfloat16, or tl.dot's default TF32 -- pass input_precision=\"ieee\")")
# What the interpreter's error says -> the mistake that makes it (a loop that stops, so no simulation to compare)
STOPPED = {
    "Expected pointer argument to have shape": "what your loop returns does not have the shapes the program stores: "
    "(acc, total), acc [BLOCK_Q, BLOCK_D] first, then total [BLOCK_Q] with one sum per query -- the two swapped, or "
    "a sum or max over the wrong axis?",
    "must have equal reduction dimensions": "tl.dot(a, b) multiplies [M, K] by [K, N]: the scores are q [BLOCK_Q, "
    "BLOCK_D] times the keys transposed, [BLOCK_D, TILE_N]",
}
NAN = ("your output has NaN (or inf) where the reference has none: exp of a large number, inf - inf, 0 * inf? Look "
       "at the first tile, where m is still -inf, and at what the masks put in the scores")


def _load(flat, addr, mask):
    """A masked load from a flat tensor (``other=0``); None if an address it reads lies outside."""
    if bool(((addr < 0) | (addr >= flat.numel()))[mask].any()):
        return None
    zero = torch.zeros((), dtype=flat.dtype, device=flat.device)
    return torch.where(mask, flat[addr.clamp(0, flat.numel() - 1)], zero)


def loop(query, pool, meta, tile_n: int, mistake: str | None = None, block_q: int | None = None):
    """The launcher's output ``[1, heads, T, head_dim]`` with ``mistake`` in its inner loop (None: right),
    or None where the mistaken loop reads outside the tensors. ``block_q``: queries per program (default:
    the interpreter's choice, :func:`cbteach.attention.triton_unified.unified_attention`)."""
    _, H, T, D = query.shape
    k_pool, v_pool = pool.k[0], pool.v[0]
    B, kv_heads = k_pool.shape[1], k_pool.shape[2]
    sb, ss, sh = k_pool.stride()[:3]
    kflat, vflat, tables = k_pool.reshape(-1), v_pool.reshape(-1), meta.block_tables.contiguous()
    tflat, group, scale = tables.reshape(-1), H // kv_heads, D ** -0.5
    seqs = list(zip(meta.num_computed_tokens, meta.num_scheduled_tokens))
    block_q_given = block_q is not None  # (a GPU's programs: tiles of 16 or more)
    block_q = block_q or min(16, 1 << max(0, max(n for _, n in seqs) - 1).bit_length())  # a power of two
    dev, out = query.device, torch.empty_like(query)
    for i, (c, n) in enumerate(seqs):
        seq_len, start_q = c + n, int(meta.query_start_loc[i])
        for tile in range(-(-n // block_q)):
            rows = torch.arange(tile * block_q, min(n, (tile + 1) * block_q), device=dev)
            q_pos = seq_len - n + rows
            num_keys = min(seq_len, seq_len - n + (tile + 1) * block_q)
            for h in range(H):
                kv_head = {"kv_head_is_head": h, "kv_head_modulo": h % group, "kv_head_times_group": h * group
                           }.get(mistake, h // group)
                q = query[0, h, start_q + rows]
                if mistake == "head_columns_unmasked":  # the tile's BLOCK_D columns, the query's padding 0
                    q = torch.nn.functional.pad(q, (0, max(16 if block_q_given else 1, 1 << (D - 1).bit_length()) - D))
                got = _inner(q, q_pos, kv_head, i * tables.stride(0), num_keys, seq_len,
                             tflat, kflat, vflat, (sb, ss, sh), B, tile_n, scale, mistake)
                if got is None:
                    return None
                out[0, h, start_q + rows] = got[:, :D]
    return out


def _inner(q, q_pos, kv_head, table_at, num_keys, seq_len, tflat, kflat, vflat, strides, B, tile_n, scale, mistake):
    sb, ss, sh = strides
    dev, D = q.device, q.shape[1]
    offs_n, offs_d = torch.arange(tile_n, device=dev), torch.arange(D, device=dev)
    m = torch.full((q.shape[0],), 0.0 if mistake == "max_starts_at_zero" else float("-inf"), device=dev)
    total = torch.zeros(q.shape[0], device=dev)
    acc = torch.zeros(q.shape, device=dev)
    for start in range(0, num_keys, tile_n):
        pos = start + offs_n
        present = pos < seq_len
        loaded = torch.ones_like(present) if mistake == "loads_unmasked" else present
        index = {"block_plus_one": pos // B + 1, "one_block_per_tile": torch.full_like(pos, start // B),
                 "swapped": pos % B}.get(mistake, pos // B)
        slot = {"swapped": pos // B, "one_block_per_tile": offs_n, "slot_from_tile": offs_n % B}.get(mistake, pos % B)
        block = index if mistake == "logical_as_physical" else _load(tflat, table_at + index, loaded)
        if block is None:
            return None
        where = (block * (1 if mistake == "block_no_stride" else sb) + slot * (1 if mistake == "slot_no_stride" else ss)
                 + kv_head * (1 if mistake == "head_no_stride" else sh))[:, None] + offs_d[None, :]
        mask = loaded[:, None].expand(-1, D)
        k, v = _load(kflat, where, mask), _load(vflat, where, mask)
        if k is None or v is None:
            return None
        s = (q @ k.T) * {"no_scale": 1.0, "scale_twice": scale * scale, "scale_divided": 1 / scale}.get(mistake, scale)
        causal = {"no_causal": torch.ones_like(q_pos[:, None] >= pos[None, :]),
                  "causal_strict": pos[None, :] < q_pos[:, None]}.get(mistake, pos[None, :] <= q_pos[:, None])
        keep = present[None, :] & causal
        unmasked = s
        s = torch.where(keep, s, torch.tensor(0.0 if mistake == "masked_with_zero" else float("-inf"), device=dev))
        if mistake == "no_running_max":
            p = torch.exp(s)
            total, acc = total + p.sum(1), acc + p @ v
            continue
        m_new = torch.maximum(m, (unmasked if mistake == "max_before_masking" else s).max(1).values)
        alpha = torch.exp(m_new - m) if mistake == "rescale_inverted" else torch.exp(m - m_new)
        p = torch.exp(s - m_new[:, None])
        total = (total if mistake == "sum_not_rescaled" else total * alpha) + p.sum(1)
        pv = p.half().float() @ v.half().float() if mistake == "fp16" else p @ v
        acc = (acc if mistake == "acc_not_rescaled" else acc * alpha[:, None]) + pv
        m = m if mistake == "max_not_stored" else m_new
    out = acc / total[:, None]
    return out / total[:, None] if mistake == "divided" else out
