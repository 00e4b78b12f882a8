"""Notebook 05's slot mapping and paged attention, right or (``mistake=``) as a learner who made that mistake would
compute them: the check names a wrong answer by the mistake it equals. A piece that is or calls these is refused.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

_SWAPPED = ("block and offset are swapped: a position's block (its index in the table) is position // block_size, "
            "its offset in that block position % block_size")
_BOUNDARY = ("the block index is off by one at a block boundary: position p is in block p // block_size of the table, "
             "rounded down (positions 0 .. block_size - 1 are block 0)")

# name -> hint, in the order the check tries them
SLOT_MISTAKES = {
    "contiguous": ("a sequence's blocks need not lie side by side in the pool: look each position's block up in its "
                   "own table (entry position // block_size), rather than counting on from the table's first block"),
    "swapped": _SWAPPED,
    "offset_times": _SWAPPED,
    "no_times": ("a slot is an address in the pool seen as one long row of slots: block b starts at slot "
                 "b * block_size, then comes the offset"),
    "no_offset": "every token of a block got the block's first slot: add the token's offset inside its block",
    "from_zero": ("this step's tokens come after the num_computed_tokens already in the cache: a sequence's first "
                  "new token is at position num_computed_tokens, not 0"),
    "plus_one": "positions count from 0: a sequence's first new token is at position num_computed_tokens exactly",
    "packed_index": ("positions are counted inside each sequence (from its num_computed_tokens on), not along the "
                     "packed row of the whole step"),
    "block_up": _BOUNDARY,
    "block_next": _BOUNDARY,
    "block_before": _BOUNDARY,
    "block_plus": _BOUNDARY,
    "table_zero": ("every sequence was mapped through sequence 0's block table: sequence i's tokens live in the "
                   "blocks of its own table, block_tables[i]"),
    "last_block": ("not every new token goes into the sequence's last block: a chunk can begin in a partly filled "
                   "block and run on into the next -- find each token's block from its own position"),
    **dict.fromkeys(("fixed_16", "fixed_8", "fixed_4", "fixed_2"),
                    "the block size is the argument block_size, not a number of your own: the steps here use "
                    "blocks of 1, 2, 4 and 16 tokens"),
}


def slots(block_tables, num_computed_tokens, num_scheduled_tokens, block_size, mistake=None) -> list[int]:
    """The pool slot of every scheduled token, in packed order (with ``mistake``: that mistake's)."""
    out, row = [], 0
    if mistake and mistake.startswith("fixed_"):  # a block size typed in, not the argument's
        block_size = int(mistake.removeprefix("fixed_"))
    for table, c, n in zip(block_tables, num_computed_tokens, num_scheduled_tokens):
        if mistake == "table_zero":
            table = block_tables[0]
        for j in range(n):
            p = {"from_zero": j, "plus_one": c + j + 1, "packed_index": row}.get(mistake, c + j)
            if mistake == "contiguous":  # the first block's slot, counted on from there
                out.append(table[0] * block_size + p)
                row += 1
                continue
            block = {"block_up": -(-p // block_size), "block_next": (p + 1) // block_size, "last_block": -1,
                     "block_before": (p - 1) // block_size, "block_plus": p // block_size + 1,
                     }.get(mistake, p // block_size)
            offset = 0 if mistake == "no_offset" else p % block_size
            if mistake == "swapped":
                block, offset = offset, block
            scale = 1 if mistake == "no_times" else block_size
            out.append(offset * block_size + table[block] if mistake == "offset_times"
                       else table[block] * scale + offset)
            row += 1
    return out


_CAUSAL = ("a query sees the keys up to its own position, itself included: query j of a sequence that had c "
           "tokens computed is at position c + j")
_STALE = ("a sequence owns only positions 0 .. c + n - 1 of its blocks: the rest of its last block, and the padding "
          "of its block-table row, hold stale K/V")
_OTHER_ROW = ("a sequence read its context through another sequence's block table: sequence i's are in the blocks "
              "of its own row, meta.block_tables[i]")

# name -> hint, in the order the check tries them
ATTENTION_MISTAKES = {
    "read_first": ("this step's keys and values are part of its own context: write them into the pool first, then "
                   "read the context through the block table"),
    "swapped": _SWAPPED,
    "no_times": SLOT_MISTAKES["no_times"],
    "causal_minus": _CAUSAL + " (your queries do not see their own key)",
    "causal_minus_prefill": _CAUSAL + " (your queries do not see their own key)",
    "causal_plus": _CAUSAL + " (your queries see one key past their own position)",
    "causal_zero": ("a chunk that continues a prompt starts after the c tokens already computed: its query j is at "
                    "position c + j and sees every earlier key, the cached ones too"),
    "is_causal": ("SDPA's is_causal=True lines its mask up top-left (query j sees keys 0 .. j): wrong for a chunk "
                  "after c computed tokens -- build the mask yourself"),
    "no_mask": ("a prompt or a chunk feeds several queries at once: each may see only the keys up to its own "
                "position, not the later tokens of its own chunk (a causal mask)"),
    "gqa_tile": ("grouped-query heads: the query heads that share a KV head are consecutive -- with g query heads "
                 "per KV head, heads 0 .. g-1 read KV head 0, the next g read KV head 1, ..."),
    "whole_blocks": _STALE,
    "padded_row": _STALE,
    "floor_blocks": ("a sequence's last block is usually only partly filled, and its tokens are part of the "
                     "context: read positions 0 .. c + n - 1"),
    "softmax_axis": ("the softmax went over the wrong axis: each query's weights over its keys must sum to 1 -- "
                     "normalise along the keys (the last axis of q @ k^T)"),
    "only_new": ("each query attended to this step's tokens only: its context also holds the c tokens computed in "
                 "earlier steps -- read positions 0 .. c + n - 1 through the block table"),
    "table_zero": _OTHER_ROW,
    "table_layer": _OTHER_ROW,
    "no_scale": "use the scaling the layer passes you (scaling=): not every model scales scores by 1 / sqrt(head_dim)",
    "scaled_twice": ("the scores were scaled twice: multiply the queries by scaling, or pass it to "
                     "scaled_dot_product_attention as scale=, not both"),
    "mask_inverted": ("the mask is the wrong way round: in scaled_dot_product_attention's boolean attn_mask, True "
                      "means the query may see that key and False hides it"),
    "read_layer_zero": ("the context was read from layer 0 of the pool: each layer keeps its own K/V -- read them at "
                        "the layer you are given, as you write them"),
    "mask_float": ("the mask went to scaled_dot_product_attention as numbers (0 and 1), which it adds to the scores "
                   "instead of hiding keys: pass a boolean mask (True: the query may see that key)"),
}


def attend(query, key, value, meta, layer: int, scaling=None, mistake=None) -> torch.Tensor:
    """Paged attention for one step, one sequence at a time (with ``mistake``: that mistake's): write the
    step's K/V at ``meta.slot_mapping``, read each context through its block table, attend causally."""
    pool, bs = meta.pool, meta.block_size
    write = lambda: pool.write(layer, meta.slot_mapping, key[0].transpose(0, 1), value[0].transpose(0, 1))  # noqa: E731
    if mistake != "read_first":
        write()
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    out = torch.empty_like(query)
    for i, (c, n) in enumerate(zip(meta.num_computed_tokens, meta.num_scheduled_tokens)):
        row = {"table_zero": 0, "table_layer": layer}.get(mistake, i)
        start, length, table = int(meta.query_start_loc[i]), c + n, meta.block_tables[row]
        width = {"whole_blocks": -(-length // bs) * bs, "padded_row": table.numel() * bs,
                 "floor_blocks": length // bs * bs}.get(mistake, length)
        pos = torch.arange(width, device=query.device)
        if mistake == "only_new":  # this step's own slots: positions c .. c + n - 1
            pos, width = pos[:n] + c, n
        block, offset = (pos % bs, pos // bs) if mistake == "swapped" else (pos // bs, pos % bs)
        slot = table[block] * (1 if mistake == "no_times" else bs) + offset
        k, v = pool.read_slots(0 if mistake == "read_layer_zero" else layer, slot)  # [width, kv_heads, D]
        k, v = k.transpose(0, 1).to(query.dtype), v.transpose(0, 1).to(query.dtype)  # [kv_heads, width, D]
        group = heads // kv_heads
        k, v = ((k.repeat(group, 1, 1), v.repeat(group, 1, 1)) if mistake == "gqa_tile"
                else (k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)))
        diagonal = {"causal_minus": c - 1, "causal_plus": c + 1, "causal_zero": 0, "only_new": 0,
                    "causal_minus_prefill": c - 1 if n > 1 else c}.get(mistake, c)
        mask = torch.ones(n, width, dtype=torch.bool, device=query.device).tril(diagonal=diagonal)
        if mistake == "is_causal":  # SDPA's is_causal=True where n > 1: a top-left mask; a decode unmasked
            mask = torch.ones(n, width, dtype=torch.bool, device=query.device).tril(diagonal=0) if n > 1 else None
        if (mistake == "no_mask" and n > 1) or (mistake in ("whole_blocks", "padded_row") and n == 1):
            mask = None
        scale = head_dim ** -0.5 if mistake == "no_scale" else scaling
        if mistake == "scaled_twice":  # the queries multiplied by the scale, and SDPA told it too
            scale = (scaling if scaling is not None else head_dim ** -0.5) ** 2
        if mistake == "mask_inverted" and mask is not None:
            mask = ~mask
        q = query[0, :, start:start + n]
        if mistake == "softmax_axis":  # written by hand, normalised along the queries
            scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else head_dim ** -0.5)
            scores = scores.masked_fill(~mask, float("-inf")) if mask is not None else scores
            out[0, :, start:start + n] = scores.softmax(dim=-2) @ v
            continue
        if mistake == "mask_float" and mask is not None:
            mask = mask.to(q.dtype)
        out[0, :, start:start + n] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    if mistake == "read_first":
        write()
    return out
