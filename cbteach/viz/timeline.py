"""Slot timelines: who occupied each batch slot on each step, and how much of it was wasted.

A batch has ``max_batch_size`` *slots*. Draw one row per slot and one column per forward step,
and every cell -- a **slot-step** -- is in exactly one state:

* ``"prefill"`` -- the slot fed prompt tokens (or recomputed them after a preemption);
* ``"decode"``  -- the slot fed its last sampled token to get the next one;
* ``"idle"``    -- a request holds the slot but does no useful work: in static batching it has
  finished and waits for the batch barrier (computing a throw-away token); in continuous
  batching it is a running sequence the token budget left out of this step;
* ``"empty"``   -- no request holds the slot.

**Padding** is not a whole-cell state. A static prefill row is as wide as the longest prompt of
its wave, so a short prompt's prefill cell is partly pad tokens. We draw that share of the cell
hatched (on the left: static batching pads on the left) and count it as that fraction of a
slot-step. Continuous batching packs without padding, so its share is always 0.

**Wasted fraction** = (idle slot-steps + empty slot-steps + padding shares) / all slot-steps,
where all slot-steps = steps × slots. It is the share of the timeline's area that did no
useful work. (``StaticResult.waste()["wasted_fraction"]`` counts *tokens* instead: a long
prefill weighs more there. Both tell the same story; this one is what the picture shows.)
"""
from __future__ import annotations

from matplotlib.ticker import MaxNLocator

from ..request import check_positive_int
from .style import STATE_COLORS, STATE_HATCH, get_axes, label_if_fits, text_color_on

STATES = ("prefill", "decode", "idle", "empty")
USEFUL = ("prefill", "decode")


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


def waste_breakdown(source, max_batch_size: int | None = None) -> dict:
    """Slot-step counts by state, the padding share, and the wasted fraction (see the module doc).

    ``source`` is a :class:`~cbteach.StaticResult` or a list of :class:`~cbteach.StepRecord`
    (then ``max_batch_size`` is the engine's; by default the highest slot used + 1).
    """
    states, pads, _ = _states_and_pads(source, max_batch_size)
    counts = {s: 0 for s in STATES}
    for row in states:
        for state, _ in row:
            counts[state] += 1
    padding = sum(map(sum, pads))
    total = sum(len(row) for row in states)
    wasted = counts["idle"] + counts["empty"] + padding
    return {**counts, "padding": padding, "slot_steps": total, "useful": total - wasted,
            "wasted": wasted, "wasted_fraction": wasted / total if total else 0.0}


def wasted_fraction(source, max_batch_size: int | None = None) -> float:
    """(idle + empty + padding share) / all slot-steps, for a static result or continuous records."""
    return waste_breakdown(source, max_batch_size)["wasted_fraction"]


def _segments(column):
    """Runs of consecutive steps with the same ``(state, request_id)`` in one slot: ``(start, length, key)``."""
    runs = []
    for step, key in enumerate(column):
        if runs and runs[-1][2] == key and key[2] == 0.0:
            runs[-1][1] += 1
        else:
            runs.append([step, 1, key])
    return runs


def _draw(ax, source, max_batch_size, name, num_steps=None):
    states, pads, slots = _states_and_pads(source, max_batch_size)
    if not states:
        raise ValueError(f"{name}: there are no steps to draw")
    num_steps = num_steps or len(states)
    for slot in range(slots):
        column = [(states[t][slot][0], states[t][slot][1], pads[t][slot]) for t in range(len(states))]
        for start, length, (state, rid, pad) in _segments(column):
            ax.barh(slot, length, left=start, height=0.8, color=STATE_COLORS[state],
                    edgecolor="#bbbbbb" if state == "empty" else "#555555", linewidth=0.6)
            if pad:  # the left-padded part of a static prefill row
                ax.barh(slot, pad * length, left=start, height=0.8, color=STATE_COLORS["padding"],
                        hatch=STATE_HATCH["padding"], edgecolor="#777777", linewidth=0.6)
    ax.set_xlim(0, num_steps)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(slots - 0.5, -0.5)  # slot 0 on top
    ax.set_yticks(range(slots), [str(s) for s in range(slots)])
    ax.set_xlabel("step")
    ax.set_ylabel("slot")
    w = waste_breakdown(source, max_batch_size)
    ax.set_title(f"{name}: {w['wasted_fraction']:.0%} of slot-steps wasted\n"
                 f"idle {w['idle']} + empty {w['empty']} + padding {w['padding']:.1f} "
                 f"of {w['slot_steps']} slot-steps", fontsize=10)
    return states, pads, slots


def _label(ax, states, pads, slots):
    """Each request's id once per stay in a slot (after the layout is final): on its useful bar if
    the id fits there, else on its idle bar -- never twice, and never where it would spill over."""
    for slot in range(slots):
        column = [(states[t][slot][0], states[t][slot][1], pads[t][slot]) for t in range(len(states))]
        stays: dict = {}  # (request id, first step of the stay) -> its segments
        stay = None
        for start, length, (state, rid, pad) in _segments(column):
            if rid is None:
                stay = None
                continue
            if stay is None or stay[0] != rid:
                stay = (rid, start)
            stays.setdefault(stay, []).append((start + pad * length, start + length, state))
        for (rid, _), segments in stays.items():
            ordered = [s for s in segments if s[2] in USEFUL] + [s for s in segments if s[2] not in USEFUL]
            for x0, x1, state in ordered:
                if label_if_fits(ax, x0, x1, slot, str(rid), color=text_color_on(STATE_COLORS[state])):
                    break


def _legend(ax):
    from matplotlib.patches import Patch

    handles = [Patch(facecolor=STATE_COLORS[s], edgecolor="#555555", hatch=STATE_HATCH.get(s),
                     label=s + {"idle": " (holds slot, no work)", "padding": " (static prefill)",
                                "empty": " (no request)"}.get(s, ""))
               for s in ("prefill", "decode", "padding", "idle", "empty")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, title="slot state",
              title_fontsize=8)


def _run_name(source):
    return "Static batching" if _is_static(source) else "Continuous batching"


def plot_timeline(source, max_batch_size: int | None = None, *, ax=None, title: str | None = None):
    """Gantt chart of one run (a ``StaticResult`` or a list of ``StepRecord``); returns the axes."""
    states, _, slots = _states_and_pads(source, max_batch_size)
    own = ax is None
    fig, ax = get_axes(ax, figsize=(min(16.0, max(7.0, 0.3 * len(states) + 4)), 1.6 + 0.45 * slots))
    drawn = _draw(ax, source, max_batch_size, title or _run_name(source))
    _legend(ax)
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

        slots = max(static_result.batch_size, max_batch_size)
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(min(16.0, max(8.0, 0.3 * n + 4)), 2.6 + 0.9 * slots))
        own = True
    else:
        if len(axes) != 2:
            raise ValueError(f"axes must be a pair (static, continuous), got {len(axes)}")
        fig, own = axes[0].figure, False
    drawn = [_draw(axes[0], static_result, None, "Static batching", n),
             _draw(axes[1], records, max_batch_size, "Continuous batching", n)]
    axes[0].tick_params(labelbottom=True)  # sharex hides them; both runs read better with their own
    _legend(axes[0])
    fig.suptitle(f"The same {sum(1 for _ in static_result)} requests, {max_batch_size} slots: "
                 "batch barrier vs iteration-level scheduling", fontsize=11)
    if own:
        fig.tight_layout()
    for ax, d in zip(axes, drawn):
        _label(ax, *d)
    return fig
