"""``python -m cbteach mask``: the attention mask of one packed step, in the terminal (and as a PNG).

No model is loaded. The pattern comes from the functions the engine itself calls
(:mod:`cbteach.viz.mask_view` over :mod:`cbteach.attention`), drawn by :mod:`cbteach.viz.mask`::

    python -m cbteach mask --cached 3,0,5 --new 1,4,1 --layout per-sequence
    python -m cbteach mask --cached 3,0,5 --new 1,4,1 --layout paged --block-size 4 --png mask.png

This module also holds the small argparse types the rest of the command line shares
(:func:`positive_int`); it imports nothing from :mod:`cbteach.__main__`, so there is no cycle.
"""
from __future__ import annotations

import argparse
from pathlib import Path

MAX_QUERIES, MAX_KEYS = 512, 2048  # a mask beyond this is neither readable nor cheap to draw


def lengths(text: str, what: str = "token counts") -> list[int]:
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
                                             f"give comma-separated {what} like 3,0,5") from None
        if value < 0:
            raise argparse.ArgumentTypeError(f"{value} is negative; {what} must be >= 0")
        if value > 10**6:  # (far past what can be drawn; a larger int does not even fit a tensor's int64)
            raise argparse.ArgumentTypeError(f"{value} is too large; {what} must be at most 1,000,000")
        out.append(value)
    return out


def block_tables_arg(text: str) -> list[list[int]]:
    """argparse type for ``"0,1;2;3,4"``: one comma-separated block table per sequence, ``;`` between."""
    try:
        return [lengths(part, "block ids") for part in text.split(";")]
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (block tables look like 0,1;2;3,4: block ids, ';' between "
                                         "sequences)") from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1")
    return value


def cli(argv=None) -> int:
    """``python -m cbteach mask``: print a packed step's mask, optionally save the heatmap as PNG."""
    from .mask import DEFAULT_BLOCK_SIZE, LAYOUTS, figsize, mask_ascii, mask_heatmap, resolve

    parser = argparse.ArgumentParser(
        prog="python -m cbteach mask",
        description="Print the attention mask of one packed step: one query row per new token, "
                    "one column per key, # = may attend, . = blocked.")
    parser.add_argument("--cached", type=lengths, required=True,
                        help="tokens each sequence already has in the KV cache, e.g. 3,0,5")
    parser.add_argument("--new", type=lengths, required=True,
                        help="tokens each sequence feeds this step, e.g. 1,4,1 (prefill > 1, decode = 1)")
    parser.add_argument("--layout", choices=LAYOUTS, default="concat",
                        help="key order: concat = [all cached | all new] (the concatenating cache), "
                             "per-sequence = [each sequence's cached|new] (varlen kernels), paged = each "
                             "sequence's slots read through its block table (default: concat)")
    parser.add_argument("--block-size", type=positive_int, metavar="N",
                        help=f"paged layout: tokens per block (default {DEFAULT_BLOCK_SIZE})")
    parser.add_argument("--block-tables", type=block_tables_arg, metavar="TABLES",
                        help="paged layout: each sequence's block ids, e.g. 0,1;2;3,4 (default: blocks "
                             "handed out in order)")
    parser.add_argument("--png", metavar="FILE", help="also save the heatmap to this PNG file")
    args = parser.parse_args(argv)
    if len(args.cached) != len(args.new):
        parser.error(f"--cached has {len(args.cached)} entries but --new has {len(args.new)}; "
                     "give one of each per sequence")
    if args.layout != "paged" and (args.block_size is not None or args.block_tables is not None):
        parser.error("--block-size and --block-tables apply only to --layout paged")
    queries, keys = sum(args.new), sum(args.cached) + sum(args.new)
    block = args.block_size or DEFAULT_BLOCK_SIZE
    if args.layout == "paged":  # a sequence's keys are read in whole blocks
        keys = sum(-(-(c + n) // block) * block for c, n in zip(args.cached, args.new))
    if queries > MAX_QUERIES or keys > MAX_KEYS:
        parser.error(f"this step has {queries} queries and {keys} keys; a mask to read in a terminal has at most "
                     f"{MAX_QUERIES} queries and {MAX_KEYS} keys (use fewer tokens, or a smaller --block-size)")
    taken = {}
    for seq, table in enumerate(args.block_tables or []):
        for b in table:
            if b in taken:
                parser.error(f"block {b} appears twice in the block tables (sequences {taken[b]} and {seq}): a "
                             "block holds the K/V of one sequence's tokens")
            taken[b] = seq
    if args.png is not None and not args.png.strip():  # (an empty name saved nothing and said nothing)
        parser.error("--png needs a file name, e.g. --png mask.png")
    if args.png and Path(args.png).is_dir():  # (savefig would write "FOLDER.png" beside it)
        parser.error(f"--png {args.png} is a folder: name a file in it, e.g. --png {Path(args.png) / 'mask.png'}")
    kwargs = dict(cached=args.cached, new=args.new, layout=args.layout)
    if args.layout == "paged":
        kwargs.update(block_size=args.block_size or DEFAULT_BLOCK_SIZE, block_tables=args.block_tables)
    try:
        view = resolve(**kwargs)
    except ValueError as e:  # e.g. a block table too short for its sequence
        parser.error(str(e))
    print(mask_ascii(**kwargs))
    if args.png:
        # A bare Agg figure: no pyplot, no GUI backend, works on a headless machine.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=figsize(*view.mask.shape))
        FigureCanvasAgg(fig)
        mask_heatmap(**kwargs, ax=fig.add_subplot())
        path = args.png if args.png.lower().endswith(".png") else args.png + ".png"  # what savefig writes
        try:
            fig.savefig(path, dpi=120, bbox_inches="tight", format="png")
        except OSError as e:
            parser.error(f"cannot write {path}: {e}")
        print(f"heatmap saved to {path}")
    return 0
