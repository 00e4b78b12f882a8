"""Slot timelines: who occupied each batch slot on each step, and how much of it was wasted.

A batch has ``max_batch_size`` *slots*. Draw one row per slot and one column per forward step,
and every cell -- a **slot-step** -- is in exactly one state:

* ``"prefill"`` -- the slot fed prompt tokens (or recomputed them after a preemption);
* ``"decode"``  -- the slot fed its last sampled token to get the next one;
* ``"idle"``    -- a request holds the slot but does no useful work. In **static** batching it has
  finished and waits for the batch barrier, and its row still computes a throw-away token every
  step (drawn hatched, like padding). In **continuous** batching it is a running sequence the
  token budget left out of this step: nothing is computed for it (drawn plain);
* ``"empty"``   -- no request holds the slot, and nothing is computed for it.

**Padding** is not a whole-cell state: a static prefill row is as wide as its wave's longest
prompt, so a short prompt's prefill cell is partly pad tokens, drawn hatched (on the left, where
static batching pads) and counted as that fraction of a slot-step. Continuous batching packs
without padding.

**Wasted fraction** = (idle + empty slot-steps + padding shares) / (steps × slots): the share of
the picture that did no useful work (``StaticResult.waste()`` counts *tokens* instead; both tell
the same story).

Reading aids: successive requests in a slot are split by a thin white line and alternate between
two blues; dashed lines mark a static run's batch barriers; ``steps=(start, stop)`` zooms in.
"""
from __future__ import annotations

from matplotlib.colors import to_rgb
from matplotlib.ticker import MaxNLocator

from ..core.validation import check_positive_int
from .style import STATE_COLORS, STATE_HATCH, get_axes, label_if_fits, step_window, text_color_on

STATES = ("prefill", "decode", "idle", "empty")
USEFUL = ("prefill", "decode")
_DARKER_DECODE = 0.3  # every other request's decode span in a slot is drawn this much darker
_IDLE_HATCH_EDGE = "#c97676"  # hatch lines of a static idle cell (matplotlib hatches in the edge colour)
_BARRIER = {"color": "#222222", "linestyle": (0, (4, 3)), "linewidth": 0.9}


def _is_static(source) -> bool:
    return hasattr(source, "steps") and hasattr(source, "batch_size")


def slot_states_static(result) -> list[list[tuple[str, object]]]:
    """Per step, per slot, ``(state, request_id)`` of a :class:`~cbteach.StaticResult` (id None if empty)."""
    if not _is_static(result):
        raise ValueError(f"expected a StaticResult from cbteach.static_batching, got {type(result).__name__}")
    return [[(slot.state, slot.request_id) for slot in step.slots] for step in result.steps]


def padding_shares_static(result) -> list[list[float]]:
    """Per step, per slot, the fraction of the slot's row that was padding (non-zero only in prefill)."""
    slot_states_static(result)  # validates
    return [[slot.num_pad / (slot.num_pad + slot.num_tokens)
             if slot.state == "prefill" and slot.num_pad + slot.num_tokens else 0.0
             for slot in step.slots] for step in result.steps]


def num_slots(records) -> int:
    """The smallest batch size these continuous-batching records fit in (highest slot + 1)."""
    return max((s.slot + 1 for r in records for s in r.seqs), default=0)


def slot_states_continuous(records, max_batch_size: int) -> list[list[tuple[str, object]]]:
    """Per step, per slot, ``(state, request_id)`` rebuilt from a list of :class:`~cbteach.StepRecord`.

    A slot is ``prefill``/``decode`` when a sequence ran in it (``SeqStep.slot``), ``idle`` when a
    sequence still holds it -- it ran before and has neither finished nor been preempted -- but
    was not scheduled this step, and ``empty`` otherwise.
    """
    check_positive_int("max_batch_size", max_batch_size)
    holders: dict = {}  # request id -> slot, for every sequence that holds a slot right now
    out = []
    for rec in records:
        for rid in rec.preempted:  # preemption happens at scheduling, before this step's forward pass
            holders.pop(rid, None)
        row: list[tuple[str, object]] = [("empty", None)] * max_batch_size
        ran = set()
        for s in rec.seqs:
            if not 0 <= s.slot < max_batch_size:
                raise ValueError(f"step {rec.step}: request {s.request_id!r} ran in slot {s.slot}, outside "
                                 f"0..{max_batch_size - 1}; pass the engine's max_batch_size")
            if row[s.slot][0] != "empty":
                raise ValueError(f"step {rec.step}: slot {s.slot} used twice; these records are inconsistent")
            row[s.slot] = (s.kind, s.request_id)
            holders[s.request_id] = s.slot
            ran.add(s.request_id)
        for rid, slot in holders.items():
            if rid not in ran and row[slot][0] == "empty":
                row[slot] = ("idle", rid)
        for rid in rec.finished:
            holders.pop(rid, None)
        out.append(row)
    return out


def _states_and_pads(source, max_batch_size):
    if _is_static(source):
        return slot_states_static(source), padding_shares_static(source), source.batch_size
    records = list(source)
    mbs = num_slots(records) if max_batch_size is None else max_batch_size
    states = slot_states_continuous(records, max(mbs, 1))
    return states, [[0.0] * len(row) for row in states], max(mbs, 1)


def waste_breakdown(source, max_batch_size: int | None = None, *, steps=None) -> dict:
    """Slot-step counts by state, the padding share, and the wasted fraction (see the module doc).

    ``source`` is a :class:`~cbteach.StaticResult` or a list of :class:`~cbteach.StepRecord`
    (then ``max_batch_size`` is the engine's; by default the highest slot used + 1).
    ``steps=(start, stop)`` counts only those steps.
    """
    states, pads, _ = _states_and_pads(source, max_batch_size)
    lo, hi = step_window(steps, len(states)) if states else (0, 0)
    counts = {s: 0 for s in STATES}
    for row in states[lo:hi]:
        for state, _ in row:
            counts[state] += 1
    padding = sum(map(sum, pads[lo:hi]))
    total = sum(len(row) for row in states[lo:hi])
    wasted = counts["idle"] + counts["empty"] + padding
    return {**counts, "padding": padding, "slot_steps": total, "useful": total - wasted,
            "wasted": wasted, "wasted_fraction": wasted / total if total else 0.0}


def wasted_fraction(source, max_batch_size: int | None = None) -> float:
    """(idle + empty + padding share) / all slot-steps, for a static result or continuous records."""
    return waste_breakdown(source, max_batch_size)["wasted_fraction"]


def _slot_segments(states, pads, slot):
    """One slot's runs of equal cells, ``[start, length, state, request_id, pad, stay]``.

    A *stay* is one request's uninterrupted time in the slot; ``stay`` counts them (0, 1, 2, ...;
    None when empty) so that successive requests can be told apart by shade."""
    runs, stays = [], -1
    for step in range(len(states)):
        state, rid = states[step][slot]
        pad = pads[step][slot]
        if runs and (runs[-1][2], runs[-1][3]) == (state, rid) and not pad and not runs[-1][4]:
            runs[-1][1] += 1
            continue
        new_stay = rid is not None and (not runs or runs[-1][3] != rid)
        stays += new_stay
        runs.append([step, 1, state, rid, pad, None if rid is None else stays])
    return runs


def _color(state, stay):
    if state != "decode" or not stay or stay % 2 == 0:
        return STATE_COLORS[state]
    return tuple(c * (1 - _DARKER_DECODE) for c in to_rgb(STATE_COLORS[state]))


def _draw(ax, source, max_batch_size, name, num_steps=None, steps=None):
    states, pads, slots = _states_and_pads(source, max_batch_size)
    if not states:
        raise ValueError(f"{name}: there are no steps to draw")
    lo, hi = step_window(steps, len(states))
    static = _is_static(source)
    segments = []
    for slot in range(slots):
        runs = _slot_segments(states, pads, slot)
        segments.append(runs)
        for i, (start, length, state, rid, pad, stay) in enumerate(runs):
            x0, x1 = max(start, lo), min(start + length, hi)
            if x0 >= x1:
                continue
            hatched = static and state == "idle"  # it computes a throw-away token: wasted compute
            ax.barh(slot, x1 - x0, left=x0, height=0.8, color=_color(state, stay),
                    hatch=STATE_HATCH["padding"] if hatched else None,
                    edgecolor=_IDLE_HATCH_EDGE if hatched else "#bbbbbb" if state == "empty" else "#555555",
                    linewidth=0.6)
            if pad:  # the left-padded part of a static prefill cell (one step long)
                ax.barh(slot, pad * length, left=start, height=0.8, color=STATE_COLORS["padding"],
                        hatch=STATE_HATCH["padding"], edgecolor="#777777", linewidth=0.6)
            if i and rid is not None and runs[i - 1][3] not in (None, rid) and lo < start < hi:
                ax.vlines(start, slot - 0.4, slot + 0.4, colors="white", linewidth=1.5, zorder=3)
    if static:  # the batch barrier: wave w + 1 starts only when wave w is done
        for prev, st in zip(source.steps, source.steps[1:]):
            if st.wave != prev.wave and lo < st.step < hi:
                ax.axvline(st.step, zorder=4, **_BARRIER)
    ax.set_xlim(lo, hi if steps is not None else (num_steps or len(states)))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(slots - 0.5, -0.5)  # slot 0 on top
    ax.set_yticks(range(slots), [str(s) for s in range(slots)])
    ax.set_xlabel("step")
    ax.set_ylabel("slot")
    w = waste_breakdown(source, max_batch_size, steps=steps)
    ax.set_title(f"{name}: {w['wasted_fraction']:.0%} of slot-steps wasted\n"
                 f"idle {w['idle']} + empty {w['empty']} + padding {w['padding']:.1f} "
                 f"of {w['slot_steps']} slot-steps", fontsize=10)
    return segments, (lo, hi), static


def _label(ax, segments, window, static):
    """Each request's id once per stay in a slot (after the layout is final): on its widest useful
    bar if it fits, else on its idle bar; failing both, in a smaller font, then cut to three
    characters. Never twice, never where it would spill over, only inside ``window``."""
    lo, hi = window
    for slot, runs in enumerate(segments):
        stays: dict = {}
        for start, length, state, rid, pad, stay in runs:
            x0, x1 = max(start + pad * length, lo), min(start + length, hi)
            if rid is not None and x0 < x1:
                stays.setdefault((rid, stay), []).append((x0, x1, state, stay))
        for (rid, _), segs in stays.items():
            ordered = sorted(segs, key=lambda s: (s[2] not in USEFUL, s[0] - s[1]))  # useful, widest first
            text = str(rid)
            for label, size in [(text, 8), (text, 6.5)] + ([(text[:3] + "…", 6.5)] if len(text) > 4 else []):
                if any(label_if_fits(ax, x0, x1, slot, label, fontsize=size, color=text_color_on(_color(state, stay)),
                                     bbox={"facecolor": _color(state, stay), "edgecolor": "none", "pad": 1.0}
                                     if static and state == "idle" else None)  # readable over the hatch
                       for x0, x1, state, stay in ordered):  # any() stops at the first label written
                    break


def _legend(ax, static: bool):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    def patch(state, label, stay=0, hatch=None, edge="#555555"):
        return Patch(facecolor=_color(state, stay), edgecolor=edge, hatch=hatch, label=label)

    hatch = STATE_HATCH["padding"]
    handles = [patch("prefill", "prefill"), patch("decode", "decode"),
               patch("decode", "decode, next request\nin the same slot", stay=1)]
    handles += ([patch("padding", "padding (computed,\nthrown away)", hatch=hatch, edge="#777777"),
                 patch("idle", "idle: finished, still\ncomputes a throw-away\ntoken", hatch=hatch,
                       edge=_IDLE_HATCH_EDGE)]
                if static else [patch("idle", "idle: holds its slot,\nnot scheduled (no\ncompute)")])
    handles.append(patch("empty", "empty: no request,\nnothing computed", edge="#bbbbbb"))
    handles += [Line2D([], [], label="batch barrier\n(next wave starts)", **_BARRIER)] if static else []
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, title="slot state",
              title_fontsize=8)


def plot_timeline(source, max_batch_size: int | None = None, *, ax=None, title: str | None = None, steps=None):
    """Gantt chart of one run (a ``StaticResult`` or a list of ``StepRecord``); returns the axes.

    ``steps=(start, stop)`` draws only steps ``start .. stop - 1`` (a zoom) and counts the waste of
    those steps in the title.
    """
    states, _, slots = _states_and_pads(source, max_batch_size)
    lo, hi = step_window(steps, len(states)) if states else (0, 0)
    if title is None:
        title = "Static batching" if _is_static(source) else "Continuous batching"
        title += f", steps {lo}-{hi - 1}" if steps is not None else ""
    own = ax is None
    fig, ax = get_axes(ax, figsize=(min(16.0, max(7.0, 0.3 * (hi - lo) + 4)), 1.6 + 0.55 * max(slots, 4)))
    drawn = _draw(ax, source, max_batch_size, title, steps=steps)
    _legend(ax, _is_static(source))
    if own:
        fig.tight_layout()
    _label(ax, *drawn)
    return ax


def plot_timelines(static_result, records, max_batch_size: int, *, axes=None):
    """Static and continuous runs of the same workload, one above the other on one step axis.

    Returns the figure. ``axes`` may be a pair of axes to draw into; by default a new figure.
    """
    if not _is_static(static_result):
        raise ValueError("plot_timelines needs a StaticResult first, then the engine's records")
    records = list(records)
    n = max(len(static_result.steps), len(records))
    if axes is None:
        import matplotlib.pyplot as plt

        slots = max(static_result.batch_size, max_batch_size, 4)
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(min(16.0, max(8.0, 0.3 * n + 4)), 2.6 + 1.1 * slots))
        own = True
    else:
        if len(axes) != 2:
            raise ValueError(f"axes must be a pair (static, continuous), got {len(axes)}")
        fig, own = axes[0].figure, False
    drawn = [_draw(axes[0], static_result, None, "Static batching", n),
             _draw(axes[1], records, max_batch_size, "Continuous batching", n)]
    axes[0].tick_params(labelbottom=True)  # sharex hides them; both runs read better with their own
    _legend(axes[0], True)
    _legend(axes[1], False)
    fig.suptitle(f"The same {sum(1 for _ in static_result)} requests, {max_batch_size} slots: "
                 "batch barrier vs iteration-level scheduling", fontsize=11)
    if own:
        fig.tight_layout()
    for ax, d in zip(axes, drawn):
        _label(ax, *d)
    return fig
