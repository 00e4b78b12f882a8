"""See the attention mask of a packed step: as text in a terminal, or as a heatmap.

A continuous-batching step packs several sequences into one row, so one attention call serves
them all. What keeps them apart is the mask: query token ``q`` may attend key ``k`` only if both
belong to the same sequence and ``k`` is not in ``q``'s future. This module draws that mask.

The ``#``/``.`` pattern is never worked out here: it is read from
:func:`cbteach.packing.block_diagonal_causal_mask` (the ``"concat"`` key layout,
``[A cached, B cached, ... | A new, B new, ...]``) or :func:`cbteach.packing.per_sequence_causal_mask`
(the ``"paged"`` layout, ``[A cached|A new, B cached|B new, ...]``) -- or, for a real step, from
:meth:`cbteach.StepRecord.mask` -- so the picture *is* the mask the engine gave the model.

Try it from a shell::

    python -m cbteach mask --cached 3,0,5 --new 1,4,1
    python -m cbteach mask --cached 3,0,5 --new 1,4,1 --layout paged --png mask.png
"""
from __future__ import annotations

import argparse

import torch

from ..packing import block_diagonal_causal_mask, per_sequence_causal_mask
from .style import BLOCKED_COLOR, CACHED_KEY_COLOR, NEW_KEY_COLOR, get_axes, seq_letter

LAYOUTS = ("concat", "paged")
EMPTY_MESSAGE = "(empty step: no queries)"


def _int_list(value, name: str) -> list[int]:
    """Validate one list of per-sequence lengths."""
    try:
        items = list(value)
    except TypeError:
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}") from None
    for x in items:
        if not isinstance(x, int) or isinstance(x, bool):
            raise ValueError(f"{name} must hold integers, got {x!r}")
        if x < 0:
            raise ValueError(f"{name} must hold lengths >= 0, got {x}")
    return items


def resolve(source=None, *, cached=None, new=None, layout=None):
    """Turn the public arguments into ``(cached, new, layout, mask)``.

    ``source`` is a :class:`~cbteach.StepRecord` (its layout is its ``kv_kind``), or ``None`` with
    plain lists ``cached`` and ``new``, one entry per sequence (layout ``"concat"`` unless given).
    """
    if source is not None:
        if cached is not None or new is not None:
            raise ValueError("give either a StepRecord or cached=/new= lists, not both")
        if not all(hasattr(source, a) for a in ("num_computed_tokens", "num_scheduled_tokens", "kv_kind", "mask")):
            raise ValueError(f"source must be a cbteach.StepRecord, got {type(source).__name__}")
        if layout is not None and layout != source.kv_kind:
            raise ValueError(f"this record's keys use the {source.kv_kind!r} layout; "
                             f"layout={layout!r} would draw a mask the engine did not use")
        # The record rebuilds its mask with the same packing function the engine called.
        return list(source.num_computed_tokens), list(source.num_scheduled_tokens), source.kv_kind, source.mask()
    if cached is None or new is None:
        raise ValueError("give a StepRecord, or both cached= and new= (one length per sequence)")
    cached, new = _int_list(cached, "cached"), _int_list(new, "new")
    if len(cached) != len(new):
        raise ValueError(f"cached has {len(cached)} entries but new has {len(new)}: "
                         "give one cached and one new length per sequence")
    layout = "concat" if layout is None else layout
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    make = per_sequence_causal_mask if layout == "paged" else block_diagonal_causal_mask
    return cached, new, layout, make(cached, new)


def key_groups(cached: list[int], new: list[int], layout: str) -> list[tuple[int, str, int, int]]:
    """The key axis cut into runs ``(sequence, "cached" | "new", start, stop)``, empty runs left out.

    This is the *order* of keys each cache hands to attention -- the one thing the picture must
    know to name its columns. (Which entries are allowed still comes from the packing functions.)
    """
    if layout == "paged":
        parts = [(s, part, n) for s in range(len(new)) for part, n in (("cached", cached[s]), ("new", new[s]))]
    else:
        parts = [(s, "cached", c) for s, c in enumerate(cached)] + [(s, "new", n) for s, n in enumerate(new)]
    groups, start = [], 0
    for s, part, n in parts:
        if n:
            groups.append((s, part, start, start + n))
            start += n
    return groups


def query_labels(cached: list[int], new: list[int]) -> list[str]:
    """``"B p7"`` for each query of the packed row: its sequence's letter and its position in it."""
    return [f"{seq_letter(s)} p{c + j}" for s, (c, n) in enumerate(zip(cached, new)) for j in range(n)]


def _columns(cached, new, layout):
    """Key columns for the text picture: ``(key index, sequence, position)``, with separator strings.

    A space parts two sequences' keys; ``|`` parts cached keys from this step's keys -- once for
    the whole row in the concat layout, once per sequence in the paged layout.
    """
    cols, prev = [], None
    for s, part, start, stop in key_groups(cached, new, layout):
        gap = " " if prev else ""
        if part == "new" and layout == "paged":
            cols.append("|" if prev and prev[:2] == (s, "cached") else gap + "|")
        elif part == "new" and (prev is None or prev[1] == "cached"):
            cols.append(gap + "| ")  # the concat layout's single cached | new boundary
        else:
            cols.append(gap)
        first_pos = 0 if part == "cached" else cached[s]
        cols += [(k, s, first_pos + k - start) for k in range(start, stop)]
        prev = (s, part)
    return cols


def _title(layout, num_q, num_k, sep="x"):
    return f"Block-diagonal causal mask ({layout} layout): {num_q} queries {sep} {num_k} keys"


def mask_ascii(source=None, *, cached=None, new=None, layout=None) -> str:
    """The mask as text: rows are queries, columns keys, ``#`` = may attend, ``.`` = blocked.

    Sequences are lettered A, B, C... in packed-row order. The header gives each key column's
    sequence and its position in that sequence (last digit); ``|`` separates cached keys from the
    keys this step makes. Each row is labelled ``"B p7"``: query of sequence B at position 7.
    """
    cached, new, layout, mask = resolve(source, cached=cached, new=new, layout=layout)
    num_q, num_k = mask.shape
    if num_q == 0:
        return EMPTY_MESSAGE + (f" -- {num_k} cached keys, nothing attends them" if num_k else "")
    cols = _columns(cached, new, layout)
    rows = query_labels(cached, new)
    width = max(len(r) for r in rows + ["seq"])
    letter_len = max(len(seq_letter(c[1])) for c in cols if not isinstance(c, str))

    def line(label, cell):
        return label.ljust(width) + "  " + "".join(c if isinstance(c, str) else cell(c) for c in cols)

    out = [_title(layout, num_q, num_k),
           "# = may attend, . = blocked, | = cached keys | this step's keys, pos = position mod 10"]
    if source is not None and getattr(source, "seqs", None):
        # A real step: say which request each letter stands for.
        out.append("sequences: " + ", ".join(f"{seq_letter(i)} = request {s.request_id}"
                                             for i, s in enumerate(source.seqs)))
    # Multi-letter names (after Z) take one header line per letter, right-aligned like numbers.
    for i in range(letter_len):
        out.append(line("seq" if i == letter_len - 1 else "", lambda c: seq_letter(c[1]).rjust(letter_len)[i]))
    out.append(line("pos", lambda c: str(c[2] % 10)))
    m = mask.tolist()
    for q, label in enumerate(rows):
        out.append(line(label, lambda c: "#" if m[q][c[0]] else "."))
    return "\n".join(out)


def mask_heatmap(source=None, *, cached=None, new=None, layout=None, ax=None):
    """Draw the mask as a heatmap on ``ax`` (a new figure if None) and return the axes.

    Allowed entries are shaded by where the key comes from -- light for keys read from the KV
    cache, dark for keys made this step -- blocked entries are white. Grey lines mark sequence
    boundaries, the dashed line the cached/new boundary of the concat layout.
    """
    from matplotlib.colors import ListedColormap

    cached, new, layout, mask = resolve(source, cached=cached, new=new, layout=layout)
    num_q, num_k = mask.shape
    fig, ax = get_axes(ax, figsize=(max(4.0, min(12.0, 0.35 * num_k + 2)), max(3.0, min(9.0, 0.35 * num_q + 2))))
    ax.set_title(_title(layout, num_q, num_k, "×"), fontsize=10)
    where = "all cached | all new" if layout == "concat" else "each sequence: cached | new"
    ax.set_xlabel(f"key ({layout} layout: {where})")
    ax.set_ylabel("query (packed-row token)")
    if num_q == 0:
        ax.text(0.5, 0.5, EMPTY_MESSAGE, ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return ax

    groups = key_groups(cached, new, layout)
    shade = mask.to(torch.int64).numpy().copy()  # 1 = allowed; cached keys stay 1, new keys become 2
    for _, part, start, stop in groups:
        shade[:, start:stop] *= 1 if part == "cached" else 2
    ax.imshow(shade, cmap=ListedColormap([BLOCKED_COLOR, CACHED_KEY_COLOR, NEW_KEY_COLOR]), vmin=0, vmax=2,
              interpolation="nearest", aspect="equal" if max(num_k / num_q, num_q / num_k) <= 4 else "auto")
    # Cell edges make single entries countable on small masks.
    if num_q * num_k <= 2500:
        ax.set_xticks([x - 0.5 for x in range(num_k + 1)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(num_q + 1)], minor=True)
        ax.grid(which="minor", color="#dddddd", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
        # A sequence's centre tick can sit on a cell edge; keep that edge's grid line anyway.
        ax.xaxis.remove_overlapping_locs = ax.yaxis.remove_overlapping_locs = False

    # Sequence boundaries: between key runs of different sequences, and between query groups.
    for (s0, p0, _, stop), (s1, p1, _, _) in zip(groups, groups[1:]):
        cut = p0 == "cached" and p1 == "new" and (layout == "concat" or s0 == s1)
        ax.axvline(stop - 0.5, color="black" if cut else "#555555", linewidth=1.4 if cut else 1.0,
                   linestyle="--" if cut else "-")
    bounds = [sum(new[: s + 1]) for s in range(len(new))]
    for b in bounds[:-1]:
        if 0 < b < num_q:
            ax.axhline(b - 0.5, color="#555555", linewidth=1.0)

    ax.set_xticks([(a + b - 1) / 2 for _, _, a, b in groups],
                  [seq_letter(s) for s, _, _, _ in groups])
    if num_q <= 40:  # one label per query while they stay readable, else one per sequence
        ax.set_yticks(range(num_q), query_labels(cached, new), fontsize=8)
    else:
        starts = [0] + bounds[:-1]
        ax.set_yticks([(a + b - 1) / 2 for a, b in zip(starts, bounds) if b > a],
                      [seq_letter(s) for s, (a, b) in enumerate(zip(starts, bounds)) if b > a])
    mask_legend(ax, "attend: key made this step", below_points=36)
    return ax


def mask_legend(ax, new_key_label: str, below_points: float) -> None:
    """The mask pictures' legend (cached key, this step's key, blocked), a fixed distance below the
    axes -- clear of tick labels and the x label at any figure size."""
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    ax.legend(handles=[Patch(color=CACHED_KEY_COLOR, label="attend: cached key"),
                       Patch(color=NEW_KEY_COLOR, label=new_key_label),
                       Patch(facecolor=BLOCKED_COLOR, edgecolor="#999999", label="blocked")],
              loc="upper center", bbox_to_anchor=(0.5, 0), ncol=3, fontsize=7, frameon=False,
              bbox_transform=offset_copy(ax.transAxes, fig=ax.figure, y=-below_points, units="points"))


def _parse_lengths(text: str) -> list[int]:
    """argparse type for ``"3,0,5"`` (an empty string is an empty list: a step with no sequences)."""
    text = text.strip()
    if not text:
        return []
    out = []
    for item in text.split(","):
        try:
            value = int(item.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not an integer; "
                                             "give comma-separated token counts like 3,0,5") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{value} is negative; token counts must be >= 0")
        out.append(value)
    return out


def cli(argv=None) -> int:
    """``python -m cbteach mask``: print a packed step's mask, optionally save the heatmap as PNG."""
    parser = argparse.ArgumentParser(
        prog="python -m cbteach mask",
        description="Print the attention mask of one packed step: one query row per new token, "
                    "one column per key, # = may attend, . = blocked.")
    parser.add_argument("--cached", type=_parse_lengths, required=True,
                        help="tokens each sequence already has in the KV cache, e.g. 3,0,5")
    parser.add_argument("--new", type=_parse_lengths, required=True,
                        help="tokens each sequence feeds this step, e.g. 1,4,1 (prefill > 1, decode = 1)")
    parser.add_argument("--layout", choices=LAYOUTS, default="concat",
                        help="key order: concat = [all cached | all new], paged = [each sequence's "
                             "cached|new] (default: concat)")
    parser.add_argument("--png", metavar="FILE", help="also save the heatmap to this PNG file")
    args = parser.parse_args(argv)
    if len(args.cached) != len(args.new):
        parser.error(f"--cached has {len(args.cached)} entries but --new has {len(args.new)}; "
                     "give one of each per sequence")
    print(mask_ascii(cached=args.cached, new=args.new, layout=args.layout))
    if args.png:
        # A bare Agg figure: no pyplot, no GUI backend, works on a headless machine.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        q, k = sum(args.new), sum(args.cached) + sum(args.new)
        fig = Figure(figsize=(max(5.0, min(14.0, 0.35 * k + 2.5)), max(3.5, min(10.0, 0.35 * q + 2.5))))
        FigureCanvasAgg(fig)
        mask_heatmap(cached=args.cached, new=args.new, layout=args.layout, ax=fig.add_subplot())
        try:
            fig.savefig(args.png, dpi=120, bbox_inches="tight")
        except OSError as e:
            parser.error(f"cannot write {args.png}: {e}")
        print(f"heatmap saved to {args.png}")
    return 0
