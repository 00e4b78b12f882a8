"""Pictures of the paged KV cache: the block pool, who owns each block, and how full it is.

The paged cache (:mod:`cbteach.kv.paged`) preallocates ``num_blocks`` blocks of ``block_size``
token slots. A sequence owns a list of blocks -- its *block table* -- that need not be adjacent,
and gets a new block only when its last one is full. :func:`draw_pool` draws the pool as a grid,
one cell per block, coloured by the owning request (free blocks white). Inside a used block the
solid part is the slots that hold tokens, the pale rest is room reserved but unused: only a
sequence's *last* block can be partly empty, which is why paging wastes so little.

The input is ``PagedKVCache.usage()`` -- and every paged engine step keeps one in
``StepRecord.kv_usage``, so :func:`pool_slider` can replay how the pool filled and emptied, and
:func:`draw_memory_map` can draw a whole run at once: slot address against step, so the holes
a contiguous allocator leaves between regions (external fragmentation) are there to see.
"""
from __future__ import annotations

import math

from matplotlib.colors import to_rgb

from .style import get_axes, palette_color, record_request_colors, step_records, text_color_on, tint

_REQUIRED = ("num_blocks", "block_size", "block_tables")
_GAP = 0.06  # space between cells, in cell widths


def stored_tokens(records, index: int) -> dict:
    """Tokens each live sequence has in the KV cache after step ``index`` (request id -> count),
    as the pool reported them (``seq_num_tokens`` of ``PagedKVCache.usage()``)."""
    records = _paged_records(records)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(records):
        raise ValueError(f"step index must be in 0..{len(records) - 1}, got {index!r}")
    return dict(records[index].kv_usage["seq_num_tokens"])


def _columns(num_blocks: int) -> int:
    """Grid width: a power of two near the square root (8 at least, 32 at most), so ids read easily."""
    if num_blocks <= 8:
        return max(num_blocks, 1)
    return min(32, max(8, 2 ** math.ceil(math.log2(math.sqrt(num_blocks)))))


def _fill(usage, tokens) -> dict:
    """Block id -> tokens it holds, for requests whose token count matches their block table."""
    bs, fill = usage["block_size"], {}
    tables = usage["block_tables"]
    if tokens is None:
        return fill
    for rid, table in tables.items():
        n = tokens.get(rid)
        if n is None or math.ceil(n / bs) != len(table):  # inconsistent: show ownership only
            continue
        for i, block in enumerate(table):
            fill[block] = min(bs, n - i * bs)
    return fill


def draw_pool(usage: dict, *, ax=None, colors: dict | None = None, tokens: dict | None = None,
              title: str | None = None):
    """Draw a paged-cache pool (``PagedKVCache.usage()``) as a grid of blocks; return the axes.

    ``colors`` maps request id -> colour (default: in block-table order); ``tokens`` maps request
    id -> tokens stored (default: the usage's own ``seq_num_tokens``) and turns on the per-block fill levels.
    Each block cell is a patch with ``gid = "block <id>"``; free blocks are white.
    """
    from matplotlib.patches import Rectangle

    if not isinstance(usage, dict) or any(k not in usage for k in _REQUIRED):
        raise ValueError(f"usage must be the dict PagedKVCache.usage() returns (keys {_REQUIRED}); "
                         "a concat-cache run has no pool to draw -- use Engine(..., kv='paged')")
    n, bs, tables = usage["num_blocks"], usage["block_size"], usage["block_tables"]
    if colors is None:
        colors = {rid: palette_color(i) for i, rid in enumerate(tables)}
    owner = {}
    for rid, table in tables.items():
        for block in table:
            if not 0 <= block < n:
                raise ValueError(f"request {rid!r} owns block {block}, outside the pool's 0..{n - 1}")
            owner.setdefault(block, rid)  # a block shared by several (prefix caching) shows its first owner
    if tokens is None:
        tokens = usage.get("seq_num_tokens")  # what PagedKVCache.usage() reports per sequence
    fill = _fill(usage, tokens)
    cols = _columns(n)
    rows = math.ceil(n / cols)
    fig, ax = get_axes(ax, figsize=(min(14.0, 0.55 * cols + 5.5), min(12.0, 0.55 * rows + 1.8)))
    show_text = n <= 128  # ids and fill counts only while cells are big enough to read
    for block in range(n):
        r, c = divmod(block, cols)
        x, y, w = c + _GAP, r + _GAP, 1 - 2 * _GAP
        rid = owner.get(block)
        base = colors.get(rid, "#888888") if rid is not None else None
        ax.add_patch(Rectangle((x, y), w, w, facecolor="white" if base is None else tint(base, 0.65),
                               edgecolor="#999999" if base is None else base, linewidth=1.0, gid=f"block {block}"))
        if block in fill:  # solid part = token slots in use, filled left to right
            ax.add_patch(Rectangle((x, y), w * fill[block] / bs, w, facecolor=base, linewidth=0, gid="fill"))
        if base is not None and bs <= 32 and show_text:  # faint dividers: the block's token slots
            ax.vlines([x + w * k / bs for k in range(1, bs)], y, y + w, colors="white", linewidth=0.5)
        if show_text:
            full = block in fill and fill[block] == bs
            # top right: the pale (unfilled) side of a partly filled block, so the id stays readable
            ax.text(x + w - 0.05, y + 0.06, str(block), ha="right", va="top", fontsize=6,
                    color=text_color_on(base) if full else "#555555")
            if block in fill:
                ax.text(c + 0.5, r + 0.6, f"{fill[block]}/{bs}", ha="center", va="center", fontsize=7,
                        color=text_color_on(base) if full else "black")
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)  # block 0 top left, ids increase left to right, then down
    ax.set_aspect("equal")
    ax.set_xticks([c + 0.5 for c in range(cols)], [f"+{c}" for c in range(cols)], fontsize=7)
    ax.set_yticks([r + 0.5 for r in range(rows)], [str(r * cols) for r in range(rows)], fontsize=7)
    ax.set_xlabel("block id = row start + column")
    ax.set_ylabel("row start (block id)")
    used = usage.get("num_used_blocks", len(owner))
    util = usage.get("utilisation")
    ax.set_title(title or (f"KV block pool: {used} used, {n - used} free of {n} blocks ({bs} tokens each)"
                           + (f"\n{usage.get('num_tokens', '?')} tokens stored, "
                              f"utilisation {util:.0%} of used slots" if util is not None else "")), fontsize=10)
    _block_tables(ax, tables, colors, tokens, bool(fill))
    return ax


def _block_tables(ax, tables, colors, tokens, has_fill, max_rows: int = 18):
    """The block tables as coloured text to the right of the grid, one line every 13 points."""
    lines = [("block tables" if tables else "block tables: (none)", "black", "bold")]
    for i, (rid, table) in enumerate(tables.items()):
        if i == max_rows:
            lines.append((f"... and {len(tables) - max_rows} more", "black", "normal"))
            break
        shown = ", ".join(map(str, table[:10])) + (f", ... (+{len(table) - 10})" if len(table) > 10 else "")
        count = f"  {tokens[rid]} tok" if tokens and rid in tokens else ""
        lines.append((f"{rid}: [{shown}]{count}", colors.get(rid, "#888888"), "normal"))
    if tables and not has_fill:
        lines.append(("(fill levels: pass tokens=stored_tokens(...))", "#777777", "normal"))
    for i, (text, color, weight) in enumerate(lines):
        # offsets in points, not axes fractions: the lines keep their spacing however short the grid is
        ax.annotate(text, xy=(1.03, 1.0), xycoords="axes fraction", xytext=(0, -13 * i), textcoords="offset points",
                    ha="left", va="top", fontsize=9 if i == 0 else 8, color=color, fontweight=weight,
                    annotation_clip=False)


def _paged_records(records) -> list:
    records = step_records(records)
    if any(r.kv_usage is None for r in records):
        raise ValueError("these records carry no pool state (kv_usage is None): they come from a concat-cache "
                         "engine; run Engine(..., kv='paged') to see the block pool")
    return records


def draw_pool_step(records, index: int, *, colors: dict | None = None):
    """The pool after step ``index`` of a paged run, with fill levels and the step's events; returns the figure."""
    records = _paged_records(records)
    tokens = stored_tokens(records, index)  # also checks the index
    rec = records[index]
    ax = draw_pool(rec.kv_usage, colors=colors or record_request_colors(records), tokens=tokens)
    events = [f"{name} {', '.join(map(str, ids))}" for name, ids in
              (("admitted", rec.admitted), ("finished (blocks freed)", rec.finished),
               ("preempted (blocks freed)", rec.preempted)) if ids]
    ax.figure.suptitle(f"After step {rec.step}: " + (" · ".join(events) or "no admissions or departures"),
                       fontsize=10)
    ax.figure.tight_layout()
    return ax.figure


def memory_map(records, colors: dict | None = None):
    """An RGB image ``[slots, steps, 3]`` of a paged run's pool: a slot is its owner's colour when it
    holds a token, a pale shade of it when it is set aside but empty, white when it is free."""
    import numpy as np

    records = _paged_records(records)
    colors = colors or record_request_colors(records)
    bs, n = records[0].kv_usage["block_size"], records[0].kv_usage["num_blocks"]
    img = np.ones((n * bs, len(records), 3))
    for x, rec in enumerate(records):
        stored = rec.kv_usage["seq_num_tokens"]
        for rid, table in rec.kv_usage["block_tables"].items():
            base = colors.get(rid, "#888888")
            for i, block in enumerate(table):
                full = min(bs, max(0, stored.get(rid, 0) - i * bs))  # slots of this block holding tokens
                img[block * bs:block * bs + full, x] = to_rgb(base)
                img[block * bs + full:(block + 1) * bs, x] = tint(base, 0.7)
    return img


def draw_memory_map(records, *, ax=None, colors: dict | None = None, title: str | None = None, marks=()):
    """Draw a paged run's KV memory over time (:func:`memory_map`): slot address up, step across.
    ``marks``: steps to flag with a red triangle on the map's top edge (say what they mean in the title)."""
    records = _paged_records(records)
    img = memory_map(records, colors)
    fig, ax = get_axes(ax, figsize=(7, 4))
    ax.imshow(img, aspect="auto", origin="lower", interpolation="nearest",
              extent=(records[0].step - 0.5, records[-1].step + 0.5, 0, img.shape[0]))
    if len(marks):
        ax.plot(list(marks), [img.shape[0]] * len(marks), "v", color="red", markersize=5, clip_on=False)
    ax.set_xlabel("engine step")
    ax.set_ylabel("KV slot address")
    ax.set_title(title or "KV memory over a run (solid: tokens, pale: set aside, white: free)", fontsize=10)
    return ax


def pool_slider(records, *, interval_ms: int = 1200):
    """A notebook widget: a ``step`` slider (and play button) replaying the pool of a paged run."""
    from .stepper import player

    records = _paged_records(records)
    colors = record_request_colors(records)  # one colour per request for the whole replay
    return player(len(records), lambda i: draw_pool_step(records, i, colors=colors), interval_ms=interval_ms)
