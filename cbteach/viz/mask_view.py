"""Which key is which: the three layouts of a packed step's mask, and the mask itself.

:mod:`cbteach.viz.mask` draws; this module decides what is drawn. :func:`resolve` turns a
:class:`~cbteach.StepRecord` or plain ``cached``/``new`` lengths into a :class:`MaskView` -- the
boolean mask (read from :mod:`cbteach.attention.packing` or the paged engine's own
:func:`cbteach.attention.metadata.build`, never worked out here) and one :class:`Key` per column saying
which sequence, which position, and (paged) which block and offset it comes from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..attention.metadata import build
from ..attention.packing import block_diagonal_causal_mask, per_sequence_causal_mask
from .style import seq_letter


LAYOUTS = ("concat", "per-sequence", "paged")
RECORD_LAYOUTS = {"concat": ("concat",), "paged": ("per-sequence", "paged")}  # by StepRecord.kv_kind
DEFAULT_BLOCK_SIZE = 4  # small, so a picture fits a screen; the engine's default is 16
EMPTY_SLOT_COLOR = "#cfcfcf"
EMPTY_MESSAGE = "(empty step: no queries)"


class Key(NamedTuple):
    """One key column: its sequence, where it comes from, its position (None: an empty slot)."""
    seq: int
    part: str  # "cached", "new" (made this step) or "empty" (paged: a slot with no token)
    pos: int | None
    block: int | None = None  # paged: the block id from the block table (None: table padding)
    offset: int | None = None  # paged: the slot's offset inside its block


@dataclass
class MaskView:
    """What a picture needs: the lengths, the layout, the boolean mask and its key columns."""
    cached: list[int]
    new: list[int]
    layout: str
    mask: torch.Tensor
    keys: list[Key]
    block_size: int | None = None


def _int_list(value, name: str, minimum: int = 0) -> list[int]:
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}") from None
    for x in items:
        if not isinstance(x, int) or isinstance(x, bool):
            raise ValueError(f"{name} must hold integers, got {x!r}")
        if x < minimum:
            raise ValueError(f"{name} must hold values >= {minimum}, got {x}")
    return items


def default_block_tables(cached, new, block_size: int) -> list[list[int]]:
    """Blocks handed out in order -- A gets 0, 1, ..., then B the next ones: enough for each context."""
    counts = [-(-(c + n) // block_size) for c, n in zip(cached, new)]
    return [list(range(sum(counts[:s]), sum(counts[:s + 1]))) for s in range(len(counts))]


def paged_mask(cached, new, block_size: int = DEFAULT_BLOCK_SIZE, block_tables=None):
    """``(mask, keys)`` as paged attention sees the step: per sequence, every slot of its blocks.

    The engine's :func:`cbteach.attention.metadata.build` makes the masks, one per attention group
    (decodes, prefills): keys ``0 .. blocks x block_size`` of each sequence's gathered blocks
    (tables padded to the group's longest), a query allowed positions ``<=`` its own. Here the
    groups' masks are laid side by side. (On CUDA the engine also rounds group shapes up to powers
    of two, ``bucket_shapes``; the picture leaves that out.)
    """
    cached, new = _int_list(cached, "cached"), _int_list(new, "new")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    tables = default_block_tables(cached, new, block_size) if block_tables is None else list(block_tables)
    if len(tables) != len(new):
        raise ValueError(f"block_tables has {len(tables)} entries for {len(new)} sequences: give one per sequence")
    tables = [_int_list(t, "each block table") for t in tables]
    for s, (c, n, t) in enumerate(zip(cached, new, tables)):
        if len(t) * block_size < c + n:
            raise ValueError(f"sequence {seq_letter(s)} has {c + n} tokens: its block table needs at least "
                             f"{-(-(c + n) // block_size)} blocks of {block_size}, got {len(t)}")
    live = [s for s, n in enumerate(new) if n]  # a sequence with no query this step is not attended
    rows, width = {}, {s: len(t) for s, t in enumerate(tables)}
    if live:
        meta = build([0] * sum(new), [cached[s] for s in live], [new[s] for s in live], "cpu",
                     block_tables=[tables[s] for s in live], block_size=block_size)
        starts = meta.query_start_loc.tolist()
        for g in meta.groups:
            for i, first_row in enumerate(g.q_index[:, 0].tolist()):
                s = live[starts.index(first_row)]
                rows[s], width[s] = g.mask[i, 0, :new[s]], g.block_tables.shape[1]
    keys, mask = [], torch.zeros(sum(new), sum(width.values()) * block_size, dtype=torch.bool)
    for s, table in enumerate(tables):
        if s in rows:
            mask[sum(new[:s]):sum(new[:s + 1]), len(keys):len(keys) + width[s] * block_size] = rows[s]
        for b in range(width[s]):
            for o in range(block_size):
                p = b * block_size + o
                part = "empty" if b >= len(table) or p >= cached[s] + new[s] else "cached" if p < cached[s] else "new"
                keys.append(Key(s, part, None if part == "empty" else p, table[b] if b < len(table) else None, o))
    return mask, keys


def resolve(source=None, *, cached=None, new=None, layout=None, block_size=None, block_tables=None) -> MaskView:
    """Turn the public arguments into a :class:`MaskView`.

    ``source`` is a :class:`~cbteach.StepRecord` (a concat step is drawn ``"concat"``; a paged step
    ``"per-sequence"``, or ``"paged"`` through the block tables its record kept), or ``None`` with
    plain lists ``cached`` and ``new``, one entry per sequence (layout ``"concat"`` unless given).
    ``block_size`` and ``block_tables`` are for the paged layout (default: 4, blocks in order).
    """
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if source is not None:
        if cached is not None or new is not None:
            raise ValueError("give either a StepRecord or cached=/new= lists, not both")
        if not all(hasattr(source, a) for a in ("num_computed_tokens", "num_scheduled_tokens", "kv_kind", "mask")):
            raise ValueError(f"source must be a cbteach.StepRecord, got {type(source).__name__}")
        allowed = RECORD_LAYOUTS.get(source.kv_kind, (source.kv_kind,))
        layout = layout or allowed[0]
        if layout not in allowed:
            raise ValueError(f"this record is a {source.kv_kind!r} step, drawn in layout {allowed}; "
                             f"layout={layout!r} would draw a mask the engine did not use")
        cached, new = list(source.num_computed_tokens), list(source.num_scheduled_tokens)
        if layout == "paged":
            usage = source.kv_usage or {}
            tables = [usage.get("block_tables", {}).get(s.request_id) for s in source.seqs]
            if None in tables:
                raise ValueError(f"step {source.step}'s record lacks a block table (a sequence that finished "
                                 "freed its blocks); draw it with layout='per-sequence'")
            mask, keys = paged_mask(cached, new, usage["block_size"], tables)
            return MaskView(cached, new, layout, mask, keys, usage["block_size"])
        # The record rebuilds its mask with the same packing function the engine called.
        return MaskView(cached, new, layout, source.mask(), _plain_keys(cached, new, layout))
    if cached is None or new is None:
        raise ValueError("give a StepRecord, or both cached= and new= (one length per sequence)")
    cached, new = _int_list(cached, "cached"), _int_list(new, "new")
    if len(cached) != len(new):
        raise ValueError(f"cached has {len(cached)} entries but new has {len(new)}: "
                         "give one cached and one new length per sequence")
    layout = layout or "concat"
    if layout != "paged" and (block_size is not None or block_tables is not None):
        raise ValueError(f"block_size and block_tables apply only to layout='paged', not {layout!r}")
    if layout == "paged":
        bs = DEFAULT_BLOCK_SIZE if block_size is None else block_size
        return MaskView(cached, new, layout, *paged_mask(cached, new, bs, block_tables), bs)
    make = block_diagonal_causal_mask if layout == "concat" else per_sequence_causal_mask
    return MaskView(cached, new, layout, make(cached, new), _plain_keys(cached, new, layout))


def key_groups(cached: list[int], new: list[int], layout: str) -> list[tuple[int, str, int, int]]:
    """The key axis cut into runs ``(sequence, "cached" | "new", start, stop)``, empty runs left out.

    ``layout`` is ``"concat"`` or ``"per-sequence"`` (``"paged"``, a paged record's ``kv_kind``,
    means its ``mask()``'s per-sequence order). Which entries are allowed comes from packing.
    """
    if layout in ("per-sequence", "paged"):
        parts = [(s, part, n) for s in range(len(new)) for part, n in (("cached", cached[s]), ("new", new[s]))]
    else:
        parts = [(s, "cached", c) for s, c in enumerate(cached)] + [(s, "new", n) for s, n in enumerate(new)]
    groups, start = [], 0
    for s, part, n in parts:
        if n:
            groups.append((s, part, start, start + n))
            start += n
    return groups


def _plain_keys(cached, new, layout) -> list[Key]:
    return [Key(s, part, (0 if part == "cached" else cached[s]) + k - start)
            for s, part, start, stop in key_groups(cached, new, layout) for k in range(start, stop)]


def query_labels(cached: list[int], new: list[int]) -> list[str]:
    """``"B p7"`` for each query of the packed row: its sequence's letter and its position in it."""
    return [f"{seq_letter(s)} p{c + j}" for s, (c, n) in enumerate(zip(cached, new)) for j in range(n)]
