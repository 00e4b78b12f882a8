"""See the attention mask of a packed step: as text in a terminal, or as a heatmap.

A continuous-batching step packs several sequences into one row, so one attention call serves
them all. What keeps them apart is the mask: query token ``q`` may attend key ``k`` only if both
belong to the same sequence and ``k`` is not in ``q``'s future. This module draws that mask in
three **layouts** -- the same rule, with the keys in the order a given cache hands them over:

* ``"per-sequence"`` -- each sequence's keys in one piece, ``[A cached|A new, B cached|B new]``:
  what a variable-length kernel (FlashAttention's varlen mode) sees. Plainly block diagonal.
* ``"concat"`` -- ``[A cached, B cached, ... | A new, B new, ...]``: the concatenating cache of
  notebooks 03-04 puts every cached key first, then the step appends its new keys.
* ``"paged"`` -- each sequence's keys read **slot by slot through its block table** (PagedAttention,
  Kwon et al., SOSP'23; notebook 05): whole blocks, so the slots after a sequence's last token, and
  any blocks its table is padded with to match the longest in its attention group, are masked.

The ``#``/``.`` pattern is never worked out here: it is read from
:func:`cbteach.attention.packing.block_diagonal_causal_mask`, :func:`cbteach.attention.packing.per_sequence_causal_mask`,
the paged engine's own :func:`cbteach.attention.metadata.build` -- or, for a real step, from
:meth:`cbteach.StepRecord.mask` -- so the picture *is* the mask the engine gave the model.

Try it from a shell::

    python -m cbteach mask --cached 3,0,5 --new 1,4,1
    python -m cbteach mask --cached 3,0,5 --new 1,4,1 --layout paged --block-size 4 --png mask.png
"""
from __future__ import annotations

import torch

from .mask_view import (DEFAULT_BLOCK_SIZE, EMPTY_MESSAGE, EMPTY_SLOT_COLOR, LAYOUTS, RECORD_LAYOUTS,  # noqa: F401
                        Key, MaskView, default_block_tables, key_groups, paged_mask, query_labels, resolve)
from .style import BLOCKED_COLOR, CACHED_KEY_COLOR, NEW_KEY_COLOR, get_axes, seq_letter


def _separator(layout: str, prev: Key | None, cur: Key) -> str:
    """Text between two key columns: a space parts sequences; ``|`` parts cached keys from this
    step's (once for the concat layout, per sequence otherwise); ``:`` parts paged blocks."""
    gap = "" if prev is None else " "
    if layout == "paged":
        return gap if prev is None or prev.seq != cur.seq else (":" if cur.offset == 0 else "")
    if prev is not None and (prev.seq, prev.part) == (cur.seq, cur.part):
        return ""
    if cur.part == "new" and layout == "per-sequence":
        return "|" if prev is not None and (prev.seq, prev.part) == (cur.seq, "cached") else gap + "|"
    if cur.part == "new" and (prev is None or prev.part == "cached"):
        return gap + "| "
    return gap


def _title(view: MaskView, sep="x") -> str:
    q, k = view.mask.shape
    if view.layout == "paged":
        empty = sum(key.part == "empty" for key in view.keys)
        return (f"Paged attention mask (paged layout, block_size {view.block_size}): "
                f"{q} queries {sep} {k} slots ({k - empty} keys, {empty} empty)")
    return f"Block-diagonal causal mask ({view.layout} layout): {q} queries {sep} {k} keys"


LEGEND = {"paged": "# = may attend, . = blocked, - = empty slot (masked), : = block boundary\n"
                   "the blk line gives each block's id (- = block-table padding), pos = position mod 10",
          None: "# = may attend, . = blocked, | = cached keys | this step's keys, pos = position mod 10"}


def mask_ascii(source=None, *, cached=None, new=None, layout=None, block_size=None, block_tables=None) -> str:
    """The mask as text: rows are queries, columns keys, ``#`` = may attend, ``.`` = blocked.

    Sequences are lettered A, B, C... in packed-row order. The header gives each key column's
    sequence and its position in that sequence (last digit); ``|`` separates cached keys from the
    keys this step makes. Each row is labelled ``"B p7"``: query of sequence B at position 7. In
    the paged layout a ``blk`` line names each block and ``-`` marks slots that hold no token.
    """
    view = resolve(source, cached=cached, new=new, layout=layout, block_size=block_size, block_tables=block_tables)
    num_q, num_k = view.mask.shape
    if num_q == 0:
        return EMPTY_MESSAGE + (f" -- {sum(view.cached)} cached keys, nothing attends them" if num_k else "")
    cols, prev = [], None
    for k, key in enumerate(view.keys):
        cols += [_separator(view.layout, prev, key), (k, key)]
        prev = key
    rows = query_labels(view.cached, view.new)
    q_seq = [s for s, n in enumerate(view.new) for _ in range(n)]
    width = max(len(r) for r in rows + ["seq"])

    def line(label, cell):
        return (label.ljust(width) + "  " + "".join(c if isinstance(c, str) else cell(*c) for c in cols)).rstrip()

    def vertical(label, text_of):  # one header line per character, right-aligned like numbers
        n = max(len(text_of(key)) for key in view.keys)
        return [line(label if i == n - 1 else "", lambda k, key: text_of(key).rjust(n)[i] if text_of(key) else " ")
                for i in range(n)]

    out = [_title(view), LEGEND.get(view.layout, LEGEND[None])]
    if source is not None and getattr(source, "seqs", None):  # a real step: which request each letter is
        out.append("sequences: " + ", ".join(f"{seq_letter(i)} = request {s.request_id}"
                                             for i, s in enumerate(source.seqs)))
    out += vertical("seq", lambda key: seq_letter(key.seq))
    if view.layout == "paged":
        ids = {key.block: "-" if key.block is None else str(key.block) for key in view.keys}
        if max(len(t) for t in ids.values()) <= view.block_size:  # ids written across their block
            out.append(line("blk", lambda k, key: ids[key.block].ljust(view.block_size)[key.offset]))
        else:
            out += vertical("blk", lambda key: ids[key.block] if key.offset == 0 else "")
    out.append(line("pos", lambda k, key: "-" if key.pos is None else str(key.pos % 10)))
    m = view.mask.tolist()
    for q, label in enumerate(rows):
        out.append(line(label, lambda k, key: "#" if m[q][k] else "-" if key.part == "empty"
                        and key.seq == q_seq[q] else "."))
    return "\n".join(out)


def figsize(num_q: int, num_k: int) -> tuple[float, float]:
    """A heatmap's figure size: cells about a third of an inch, within sensible bounds."""
    return max(5.0, min(14.0, 0.35 * num_k + 2.5)), max(3.5, min(10.0, 0.35 * num_q + 2.5))


def mask_heatmap(source=None, *, cached=None, new=None, layout=None, block_size=None, block_tables=None, ax=None):
    """Draw the mask as a heatmap on ``ax`` (a new figure if None) and return the axes.

    Allowed entries are shaded by where the key comes from -- light for keys read from the KV
    cache, dark for keys made this step -- blocked entries are white, empty paged slots grey.
    Grey lines mark sequence boundaries, dashed lines the cached/new boundary, dotted lines blocks.
    """
    from matplotlib.colors import ListedColormap

    view = resolve(source, cached=cached, new=new, layout=layout, block_size=block_size, block_tables=block_tables)
    mask, keys, paged = view.mask, view.keys, view.layout == "paged"
    num_q, num_k = mask.shape
    fig, ax = get_axes(ax, figsize=figsize(num_q, num_k))
    ax.set_title(_title(view, "×"), fontsize=10)
    where = {"concat": "concat layout: all cached | all new", "per-sequence": "per-sequence layout: each "
             "sequence's cached | new", "paged": "paged layout: slots read through each block table"}
    ax.set_xlabel(f"key ({where[view.layout]})" + ("\n(ticks: sequence, block id)" if paged else ""))
    ax.set_ylabel("query (packed-row token)")
    if num_q == 0:
        ax.text(0.5, 0.5, EMPTY_MESSAGE, ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return ax

    code = torch.tensor([{"cached": 1, "new": 2, "empty": 0}[key.part] for key in keys])
    shade = mask.to(torch.int64) * code[None]  # 1 = cached key allowed, 2 = new key allowed, 0 = blocked
    q_seq = torch.tensor([s for s, n in enumerate(view.new) for _ in range(n)])
    k_seq, empty = torch.tensor([key.seq for key in keys]), torch.tensor([key.part == "empty" for key in keys])
    shade[(q_seq[:, None] == k_seq[None, :]) & empty[None, :]] = 3  # a sequence's own empty slots
    ax.imshow(shade.numpy(), cmap=ListedColormap([BLOCKED_COLOR, CACHED_KEY_COLOR, NEW_KEY_COLOR, EMPTY_SLOT_COLOR]),
              vmin=0, vmax=3, interpolation="nearest",
              aspect="equal" if max(num_k / num_q, num_q / num_k) <= 4 else "auto")
    if num_q * num_k <= 2500:  # cell edges make single entries countable on small masks
        ax.set_xticks([x - 0.5 for x in range(num_k + 1)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(num_q + 1)], minor=True)
        ax.grid(which="minor", color="#dddddd", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
        ax.xaxis.remove_overlapping_locs = ax.yaxis.remove_overlapping_locs = False

    runs = []  # (first column, last column + 1, label) of each tick's span
    for k, (a, b) in enumerate(zip([None] + keys, keys)):
        sep = _separator(view.layout, a, b)
        if k and sep.strip(" ") in ("|", "| "):
            ax.axvline(k - 0.5, color="black", linewidth=1.4, linestyle="--")
        elif k and sep == ":":
            ax.axvline(k - 0.5, color="#888888", linewidth=0.8, linestyle=":")
        elif k and sep:
            ax.axvline(k - 0.5, color="#555555", linewidth=1.0)
        if k == 0 or sep or (not paged and (a.seq, a.part) != (b.seq, b.part)):
            blk = "" if not paged else "\npad" if b.block is None else f"\n{b.block}"
            runs.append([k, k + 1, seq_letter(b.seq) + blk])
        else:
            runs[-1][1] = k + 1
    bounds = [sum(view.new[: s + 1]) for s in range(len(view.new))]
    for b in bounds[:-1]:
        if 0 < b < num_q:
            ax.axhline(b - 0.5, color="#555555", linewidth=1.0)
    if paged and len(runs) > 24:  # too many blocks to name: one tick per sequence
        merged = {}
        for a, b, label in runs:
            merged.setdefault(label.split("\n")[0], [a, b])[1] = b
        runs = [(a, b, letter) for letter, (a, b) in merged.items()]
    ax.set_xticks([(a + b - 1) / 2 for a, b, _ in runs], [label for *_, label in runs],
                  fontsize=7 if paged else None)
    if num_q <= 40:  # one label per query while they stay readable, else one per sequence
        ax.set_yticks(range(num_q), query_labels(view.cached, view.new), fontsize=8)
    else:
        starts = [0] + bounds[:-1]
        ax.set_yticks([(a + b - 1) / 2 for a, b in zip(starts, bounds) if b > a],
                      [seq_letter(s) for s, (a, b) in enumerate(zip(starts, bounds)) if b > a])
    mask_legend(ax, "attend: key made this step", below_points=60 if paged else 36, empty=paged)
    return ax


def mask_legend(ax, new_key_label: str, below_points: float, empty: bool = False) -> None:
    """The mask pictures' legend (cached key, this step's key, blocked; ``empty``: the paged empty
    slot), a fixed distance below the axes -- clear of tick labels and the x label at any size."""
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    handles = [Patch(color=CACHED_KEY_COLOR, label="attend: cached key"),
               Patch(color=NEW_KEY_COLOR, label=new_key_label),
               Patch(facecolor=BLOCKED_COLOR, edgecolor="#999999", label="blocked")]
    if empty:
        handles.append(Patch(color=EMPTY_SLOT_COLOR, label="empty slot (masked)"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=len(handles), fontsize=7,
              frameon=False, bbox_transform=offset_copy(ax.transAxes, fig=ax.figure, y=-below_points, units="points"))
