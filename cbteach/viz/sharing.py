"""Pictures for notebooks 08-09: shared KV blocks, a speculative verify step, and token gaps over time.

* :func:`draw_block_tables` -- every sequence's block table as a row of cells, one per block, with
  the blocks that several sequences share (prefix caching) marked and their reference counts;
* :func:`draw_verify_step` -- the attention mask of a speculative-decoding verify step, where a
  sequence feeds its last token plus ``k`` guesses (``1 + k`` queries) and the model checks them
  all in one pass; each query row says what became of the token it predicted;
* :func:`plot_token_gaps` -- every inter-token gap of a run against the time it ended, to see
  when decodes stall (a long prefill in the same step) and when they do not.

As everywhere in :mod:`cbteach.viz`, nothing is worked out here that the engine did not record:
block tables come from ``Engine.kv_usage()`` (or a step record's ``kv_usage``), the mask from
:meth:`cbteach.StepRecord.mask` (the packing function the engine called), token times from the
completions.
"""
from __future__ import annotations

import math
from collections import Counter

from .mask import key_groups, mask_legend
from .style import (BLOCKED_COLOR, CACHED_KEY_COLOR, NEW_KEY_COLOR, get_axes, palette_color, seq_letter,
                    text_color_on, tint)

SHARED_COLOR = "#f1c40f"  # a block in more than one block table
HIT_COLOR = "#333333"  # the bar on a block a sequence found in the prefix cache


def shared_blocks(block_tables: dict) -> dict:
    """Block id -> number of block tables holding it, for blocks held by more than one."""
    owners = Counter(b for table in block_tables.values() for b in table)
    return {b: n for b, n in owners.items() if n > 1}


def draw_block_tables(usage: dict, *, ax=None, ref_counts=None, cached_tokens: dict | None = None,
                      colors: dict | None = None, title: str | None = None, max_blocks: int = 40):
    """Draw each sequence's block table as a row of cells; return the axes.

    ``usage`` is ``Engine.kv_usage()`` or a paged step record's ``kv_usage`` (``block_tables``,
    ``block_size`` and, for the fill of each last block, ``seq_num_tokens``). Cell ``i`` of a row is
    ``block_table[i]``, labelled with its block id. Blocks held by more than one sequence are drawn
    in yellow with a thick edge and the number of holders below the id -- or, with ``ref_counts``
    (``engine.kv.manager.allocator.ref_counts``), that block's reference count, which counts the
    same owners. ``cached_tokens`` (request id -> ``num_cached_prompt_tokens``) marks, with a dark bar
    along the top of the cell, the blocks each sequence found in the prefix cache instead of
    computing them. ``max_blocks`` caps the cells drawn per row (the rest is summarised as "+n").
    """
    from matplotlib.patches import Patch, Rectangle
    from matplotlib.transforms import offset_copy

    if not isinstance(usage, dict) or "block_tables" not in usage or "block_size" not in usage:
        raise ValueError("usage must be the dict Engine.kv_usage() returns with kv='paged' "
                         "(it needs 'block_tables' and 'block_size')")
    tables = {rid: list(t) for rid, t in usage["block_tables"].items()}
    bs = usage["block_size"]
    tokens = usage.get("seq_num_tokens") or {}
    shared = shared_blocks(tables)
    colors = colors or {rid: palette_color(i) for i, rid in enumerate(tables)}
    width = max([min(len(t), max_blocks) for t in tables.values()] + [1])
    fig, ax = get_axes(ax, figsize=(min(14.0, 0.42 * width + 3.5), 0.55 * max(len(tables), 1) + 1.6))
    hits = {rid: (cached_tokens or {}).get(rid, 0) // bs for rid in tables}
    for row, (rid, table) in enumerate(tables.items()):
        n = tokens.get(rid)
        for i, block in enumerate(table[:max_blocks]):
            is_shared = block in shared
            face = SHARED_COLOR if is_shared else tint(colors.get(rid, "#888888"), 0.35)
            ax.add_patch(Rectangle((i + 0.05, row + 0.08), 0.9, 0.84, facecolor=face, gid=f"block {block}",
                                   edgecolor="black" if is_shared else colors.get(rid, "#888888"),
                                   linewidth=1.8 if is_shared else 0.8))
            if i < hits[rid]:  # found in the prefix cache: a dark bar along the top of the cell
                ax.add_patch(Rectangle((i + 0.05, row + 0.08), 0.9, 0.12, facecolor=HIT_COLOR, linewidth=0, gid="hit"))
            if n is not None and i == len(table) - 1 and n < len(table) * bs:  # the last, partly filled block
                fill = n - i * bs
                ax.text(i + 0.5, row + 0.86, f"{fill}/{bs}", ha="center", va="bottom", fontsize=5.5, color="#333333")
            label = str(block)
            if is_shared:
                count = ref_counts[block] if ref_counts is not None else shared[block]
                label += f"\n×{count}"
            ax.text(i + 0.5, row + 0.5, label, ha="center", va="center", fontsize=6.5 if is_shared else 7,
                    color=text_color_on(face))
        if len(table) > max_blocks:
            ax.text(max_blocks + 0.1, row + 0.5, f"+{len(table) - max_blocks}", va="center", fontsize=7)
    ax.set_xlim(0, width + (1 if any(len(t) > max_blocks for t in tables.values()) else 0))
    ax.set_ylim(max(len(tables), 1), 0)
    ax.set_yticks([r + 0.5 for r in range(len(tables))],
                  [f"{rid} ({tokens[rid]} tok)" if rid in tokens else str(rid) for rid in tables], fontsize=8)
    step = max(1, math.ceil(width / 20))
    ax.set_xticks([i + 0.5 for i in range(0, width, step)], [str(i) for i in range(0, width, step)], fontsize=7)
    ax.set_xlabel(f"index i in the block table (tokens i*{bs} ... i*{bs}+{bs - 1} of the sequence)")
    ax.set_ylabel("sequence")
    counted = "reference count" if ref_counts is not None else "holders"
    ax.set_title(title or f"Block tables: {len(shared)} blocks shared, each cell = one block id "
                          f"(×n = {counted})", fontsize=10)
    handles = [Patch(facecolor=SHARED_COLOR, edgecolor="black", label="in several block tables (shared)"),
               Patch(facecolor=tint("#1f77b4", 0.35), edgecolor="#1f77b4", label="in one block table (its colour)")]
    if cached_tokens:
        handles.append(Patch(facecolor=HIT_COLOR, label="bar: found in the prefix cache, not computed"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0), ncol=3, fontsize=7, frameon=False,
              bbox_transform=offset_copy(ax.transAxes, fig=ax.figure, y=-34, units="points"))
    return ax


def verify_rows(record) -> list[tuple[str, str]]:
    """``(row label, what happened)`` for every query of a step: a verify step's queries are the
    sequence's last token and its guesses ``d1..dk``; query ``j`` predicts the token after it.

    Row ``j`` of a sequence that fed ``k`` guesses and had ``a`` accepted: ``j < a`` predicted guess
    ``d{j+1}`` (accepted), ``j == a`` gave the model's own token (after a rejected guess, or the
    bonus token after the last guess when all were accepted), ``j > a`` came after a wrong guess and
    is thrown away."""
    rows = []
    for i, s in enumerate(record.seqs):
        letter, k = seq_letter(i), s.num_draft_tokens
        if not k:
            what = "plain decode: no guess this step" if s.kind == "decode" else "prefill"
            rows += [(f"{letter} p{p}", what) for p in s.positions]
            continue
        a = len(s.new_token_ids) - 1  # guesses accepted
        for j in range(s.num_scheduled_tokens):
            name = f"{letter} last" if j == 0 else f"{letter} d{j}"
            if j < a:
                what = f"predicts d{j + 1}: accepted"
            elif j == a:
                what = "bonus token (all accepted)" if a == k else f"d{j + 1} rejected: model's own token kept"
            else:
                what = "after a rejected guess: discarded"
            rows.append((name, what))
    return rows


def draw_verify_step(record, *, ax=None, context: int = 3):
    """Draw the attention mask of a verify step; return the axes.

    Each speculating sequence has ``1 + k`` queries: its last real token and its ``k`` guesses,
    attending causally to each other and to all of the sequence's cached keys. Only the last
    ``context`` cached keys of each sequence are drawn (the rest are allowed too, like the ones
    drawn); the step's own keys are all drawn. Rows are annotated with what became of each guess.
    """
    from matplotlib.colors import ListedColormap

    if not getattr(record, "seqs", None) or not hasattr(record, "mask"):
        raise ValueError("record must be a cbteach.StepRecord of a step that ran (engine.records[i])")
    if not any(s.num_draft_tokens for s in record.seqs):
        raise ValueError(f"step {record.step} verified no guesses; pick a record with num_draft_tokens > 0 "
                         "(run the engine with speculative='ngram')")
    cached, new = record.num_computed_tokens, record.num_scheduled_tokens
    mask = record.mask()
    cols, shade_of, bounds = [], [], []  # bounds: (sequence, part, tick label, end column)
    for s, part, start, stop in key_groups(cached, new, record.kv_kind):
        keep = list(range(max(start, stop - context), stop) if part == "cached" else range(start, stop))
        cols += keep
        shade_of += [1 if part == "cached" else 2] * len(keep)
        label = (f"{seq_letter(s)} cached\n(last {len(keep)} of {stop - start})" if part == "cached"
                 else f"{seq_letter(s)} fed")
        bounds.append((s, part, label, len(cols)))
    shown = mask[:, cols].to(int).numpy() * [shade_of]
    rows = verify_rows(record)
    nq, nk = shown.shape
    fig, ax = get_axes(ax, figsize=(min(14.0, 0.38 * nk + 6.5), min(10.0, 0.34 * nq + 2.2)))
    ax.imshow(shown, cmap=ListedColormap([BLOCKED_COLOR, CACHED_KEY_COLOR, NEW_KEY_COLOR]), vmin=0, vmax=2,
              interpolation="nearest", aspect="equal")
    ax.set_xticks([x - 0.5 for x in range(nk + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(nq + 1)], minor=True)
    ax.grid(which="minor", color="#dddddd", linewidth=0.6)
    ax.tick_params(which="minor", length=0)
    for s, part, _, end in bounds:  # sequence boundaries solid, cached | new dashed
        if end < nk:
            ax.axvline(end - 0.5, color="black" if part == "cached" else "#555555",
                       linestyle="--" if part == "cached" else "-", linewidth=1.2)
    q = 0
    for n in new[:-1]:
        q += n
        ax.axhline(q - 0.5, color="#555555", linewidth=1.0)
    starts = [0] + [end for *_, end in bounds[:-1]]
    ax.set_xticks([(a + b[-1] - 1) / 2 for a, b in zip(starts, bounds)], [b[2] for b in bounds], fontsize=6.5)
    ax.set_yticks(range(nq), [name for name, _ in rows], fontsize=8)
    for y, (_, what) in enumerate(rows):
        if what:
            color = "#1e8449" if "accepted" in what and "rejected" not in what else (
                "#b03a2e" if "rejected" in what or "discarded" in what else "#1a5276")
            ax.annotate(what, xy=(1.01, y), xycoords=("axes fraction", "data"), va="center", fontsize=7,
                        color=color, annotation_clip=False)
    k = max(s.num_draft_tokens for s in record.seqs)
    ax.set_title(f"Verify step {record.step}: {len(record.seqs)} sequences, up to 1 + {k} queries each "
                 f"({record.num_tokens} in the packed row)", fontsize=10)
    ax.set_xlabel(f"key (each sequence: its last {context} cached keys | the keys fed this step)")
    ax.set_ylabel("query (packed row: last token, then guesses)")
    mask_legend(ax, "attend: key fed this step", below_points=44)
    return ax


def token_gaps(completions) -> tuple[list[float], list[float]]:
    """``(end times, gaps)`` of every inter-token gap of every completion, in seconds."""
    ends, gaps = [], []
    for c in completions:
        for a, b in zip(c.token_times, c.token_times[1:]):
            ends.append(b)
            gaps.append(b - a)
    return ends, gaps


def plot_token_gaps(runs: dict, *, ax=None, marks=None, title: str = "Inter-token gaps over time"):
    """Scatter every inter-token gap (ms) against the time it ended, one colour per run; return the axes.

    ``runs`` maps a label to a list of completions; ``marks`` is an optional list of times to draw
    as dotted vertical lines (say, the arrivals of long prompts).
    """
    fig, ax = get_axes(ax, figsize=(9, 3.6))
    for i, (label, completions) in enumerate(runs.items()):
        ends, gaps = token_gaps(completions)
        ax.scatter(ends, [1e3 * g for g in gaps], s=9, alpha=0.6, color=palette_color(i), label=label)
    for j, t in enumerate(marks or []):
        ax.axvline(t, color="#888888", linestyle=":", linewidth=1.0, label="long prompt arrives" if j == 0 else None)
    ax.set_yscale("log")
    ax.set_xlabel("time the token arrived (simulated seconds)")
    ax.set_ylabel("gap since the previous token (ms, log)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    return ax
