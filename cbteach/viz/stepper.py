"""Step through an engine run, one forward pass at a time.

For each :class:`~cbteach.StepRecord` :func:`draw_step` draws the three things that make a
continuous-batching step:

1. **the packed row** -- every token the model sees this step, in order, one box per token,
   coloured by what it does, in the colours of every other picture (:data:`~cbteach.viz.style.STATE_COLORS`):
   hatched orange boxes are prefill tokens (a prompt, or a chunk of one), blue boxes decode tokens
   (one per running sequence); the band under each sequence is its request's colour, the same as
   in the block-pool pictures. No padding anywhere;
2. **the attention mask** that keeps the packed sequences apart (:func:`cbteach.viz.mask.mask_heatmap`);
3. **the slots** -- which request held each batch slot, and what it did.

:func:`step_through` wraps it in a slider with a play button for notebooks, and
:func:`mask_explorer` lets a learner type any step's lengths and see its mask in every layout.
"""
from __future__ import annotations

from matplotlib.ticker import MaxNLocator

from .mask import DEFAULT_BLOCK_SIZE, LAYOUTS, figsize, mask_heatmap, resolve
from .style import (STATE_COLORS, fits, get_axes, label_if_fits, record_request_colors, seq_letter, step_records,
                    text_color_on)
from .timeline import num_slots, slot_states_continuous


def _check_index(records, index) -> list:
    records = step_records(records)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(records):
        raise ValueError(f"step index must be an integer in 0..{len(records) - 1}, got {index!r}")
    return records


def _what(rec) -> str:
    if not rec.seqs:
        return f"nothing ran: preempted {rec.preempted}" if rec.preempted else "nothing to run (waiting for requests)"
    if rec.is_fused:
        return f"fuses prefill ({rec.num_prefill_tokens} tokens) and decode ({rec.num_decode_tokens}) in one pass"
    return "prefill only" if rec.num_decode_tokens == 0 else "decode only"


def _packed_row(rec, colors, ax):
    """Draw the packed row's boxes on ``ax``; return the labels to place once the layout is final.

    Labels come back as ``(token labels, group labels)``: ``(x, text, background)`` for each
    token (``A\\np3``: sequence A, position 3) and ``(x0, x1, letter, long text)`` for each sequence.
    """
    from matplotlib.patches import Patch, Rectangle

    n = rec.num_tokens
    ax.set_title(f"Packed row: {n} tokens, one forward pass, no padding", fontsize=10)
    ax.set_xlabel("index in the packed row")
    ax.set_ylabel("tokens")
    ax.set_yticks([])
    if n == 0:
        ax.text(0.5, 0.5, "(no tokens this step)", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        return [], []
    ax.set_xlim(0, n)
    ax.set_ylim(-0.35, 1.7)
    if n <= 40:  # a tick under each box while they stay readable
        ax.set_xticks([i + 0.5 for i in range(n)], [str(i) for i in range(n)], fontsize=7)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    tokens, groups, x = [], [], 0
    for i, s in enumerate(rec.seqs):
        # The two kinds of work one pass mixes, in the colours every picture uses: prefill tokens
        # orange and hatched, decode tokens blue. The request shows as the band underneath.
        face = STATE_COLORS["prefill" if s.kind == "prefill" else "decode"]
        for j in range(s.num_scheduled_tokens):
            ax.add_patch(Rectangle((x + j, 0), 1, 1, facecolor=face, hatch="//" if s.kind == "prefill" else None,
                                   edgecolor="white", linewidth=0.8, gid="token"))
            tokens.append((x + j, f"{seq_letter(i)}\np{s.num_computed_tokens + j}", face))
        ax.add_patch(Rectangle((x, 0), s.num_scheduled_tokens, 1, fill=False, edgecolor="black", linewidth=1.2))
        ax.add_patch(Rectangle((x + 0.05, -0.3), s.num_scheduled_tokens - 0.1, 0.22, linewidth=0,
                               facecolor=colors.get(s.request_id, "#888888"), gid="request"))
        groups.append((x, x + s.num_scheduled_tokens, seq_letter(i), f"{seq_letter(i)} = {s.request_id}: {s.kind} {s.num_scheduled_tokens}"))
        x += s.num_scheduled_tokens
    ax.legend(handles=[Patch(facecolor=STATE_COLORS["prefill"], hatch="//", edgecolor="white", label="prefill token"),
                       Patch(facecolor=STATE_COLORS["decode"], label="decode token"),
                       Patch(facecolor="#999999", label="band: the request's colour")],
              loc="upper right", fontsize=7, ncol=3, frameon=False)
    return tokens, groups


def _label_row(ax, tokens, groups):
    """Token and sequence labels, only where they fit (a sequence falls back to its letter alone)."""
    # All token labels or none: a row labelled only up to p9 would look like p10 onwards were different.
    if tokens and fits(ax, 1, max((t[1] for t in tokens), key=len), fontsize=7):
        for x, text, face in tokens:
            label_if_fits(ax, x, x + 1, 0.5, text, fontsize=7, color=text_color_on(face))
    for x0, x1, letter, text in groups:
        if label_if_fits(ax, x0, x1, 1.3, text) is None:
            label_if_fits(ax, x0, x1, 1.3, letter)


def draw_slots(states, *, ax=None, title="Slots this step", colors=None, letters=None):
    """One bar per batch slot (``states`` is ``[(state, request_id), ...]``).

    Bars are coloured by state, as in every timeline (prefill orange and hatched, decode blue);
    with ``colors`` (request id -> colour, as in the packed row) a band at the bar's left edge
    shows its request's colour, so the same request is recognisable in every panel. ``letters``
    (request id -> the step's sequence letter) prefixes the label.
    """
    from matplotlib.patches import Rectangle

    fig, ax = get_axes(ax, figsize=(3, 2))
    for slot, (state, rid) in enumerate(states):
        face = STATE_COLORS[state]
        ax.barh(slot, 1, height=0.8, color=face, hatch="//" if state == "prefill" else None,
                edgecolor="#bbbbbb" if state == "empty" else "#555555")
        if colors and rid in colors:
            ax.add_patch(Rectangle((0.02, slot - 0.3), 0.06, 0.6, facecolor=colors[rid], linewidth=0, gid="request"))
        name = f"{letters[rid]} = {rid}" if letters and rid in letters else rid
        text = state if rid is None else f"{name}: {state}"
        ax.text(0.5, slot, text, ha="center", va="center", fontsize=8, color=text_color_on(face))
    ax.set_xlim(0, 1)
    ax.set_ylim(len(states) - 0.5, -0.5)
    ax.set_yticks(range(len(states)))
    ax.set_xticks([])
    ax.set_xlabel("state this step")
    ax.set_ylabel("slot")
    ax.set_title(title, fontsize=10)
    return ax


def draw_step(records, index: int, *, fig=None, max_batch_size: int | None = None):
    """Draw step ``index`` of an engine run (packed row, mask, slots) and return the figure.

    ``records`` is the engine's ``records`` list (the whole run: colours and slot history need it).
    ``max_batch_size`` defaults to the highest slot the run used + 1. Pass ``fig`` to redraw in place.
    """
    records = _check_index(records, index)
    rec = records[index]
    slots = num_slots(records) if max_batch_size is None else max_batch_size
    states = slot_states_continuous(records[: index + 1], max(slots, 1))[index]
    if fig is None:
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(12, 7.5))
    else:
        fig.clear()
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 3.2], width_ratios=[3, 1])
    ax_row, ax_mask, ax_slots = fig.add_subplot(grid[0, :]), fig.add_subplot(grid[1, 0]), fig.add_subplot(grid[1, 1])
    ax_row.set_gid("packed_row")  # names for code (and tests) that look the panels up
    ax_mask.set_gid("mask")
    ax_slots.set_gid("slots")
    colors = record_request_colors(records)
    labels = _packed_row(rec, colors, ax_row)
    mask_heatmap(rec, ax=ax_mask)
    letters = {s.request_id: seq_letter(i) for i, s in enumerate(rec.seqs)}
    draw_slots(states, ax=ax_slots, title=f"Slots ({len(states)})", colors=colors, letters=letters)
    events = [f"{name}: {', '.join(map(str, ids))}" for name, ids in
              (("admitted", rec.admitted), ("finished", rec.finished), ("preempted", rec.preempted)) if ids]
    events.append(f"waiting: {rec.num_waiting}")
    fig.suptitle(f"Step {rec.step} (of 0..{len(records) - 1}): {rec.num_tokens} tokens -- {_what(rec)}\n"
                 + " · ".join(events), fontsize=11)
    fig.tight_layout()
    fig.tight_layout()  # again: the square mask cells move its legend after the first pass
    _label_row(ax_row, *labels)
    return fig


def player(num_steps: int, draw, *, interval_ms: int = 1200):
    """A ``step`` slider with a play button over ``0..num_steps-1`` that shows ``draw(i)``'s figure.

    Shared by :func:`step_through` and :func:`cbteach.viz.pool.pool_slider`. The slider is also
    reachable as ``widget.slider``.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    slider = widgets.IntSlider(value=0, min=0, max=num_steps - 1, description="step", continuous_update=False)
    play = widgets.Play(value=0, min=0, max=num_steps - 1, interval=interval_ms, description="play")
    widgets.jslink((play, "value"), (slider, "value"))  # the browser moves the slider while playing
    out = widgets.Output()

    def redraw(change=None):
        with out:
            out.clear_output(wait=True)
            fig = draw(slider.value)
            display(fig)
            plt.close(fig)  # shown once as an image; keeping it would pile figures up in pyplot

    slider.observe(redraw, names="value")
    redraw()
    box = widgets.VBox([widgets.HBox([play, slider]), out])
    box.slider = slider
    return box


def step_through(records, *, max_batch_size: int | None = None, interval_ms: int = 1200):
    """A notebook widget: a ``step`` slider and a play button over the run, redrawing :func:`draw_step`."""
    records = _check_index(records, 0)
    return player(len(records), lambda i: draw_step(records, i, max_batch_size=max_batch_size),
                  interval_ms=interval_ms)


def parse_pairs(text: str) -> tuple[list[int], list[int]]:
    """``"3:1, 0:4, 5:1"`` -> ``([3, 0, 5], [1, 4, 1])``: each sequence's ``cached:new`` token counts."""
    cached, new = [], []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            c, n = (int(x) for x in item.split(":"))
        except ValueError:
            raise ValueError(f"{item!r} is not cached:new -- give one pair of token counts per sequence, "
                             "separated by commas, e.g. 3:1, 0:4, 5:1") from None
        if c < 0 or n < 0:
            raise ValueError(f"{item!r}: token counts must be >= 0")
        cached.append(c)
        new.append(n)
    return cached, new


def mask_explorer(text: str = "3:1, 0:4, 5:1", layout: str = "per-sequence", block_size: int = DEFAULT_BLOCK_SIZE):
    """A notebook widget: type each sequence's ``cached:new`` lengths, pick a layout, see the mask.

    Every change redraws :func:`~cbteach.viz.mask.mask_heatmap` (a mistake is reported as ``✗ ...``
    instead). ``widget.render()`` returns the figure for the current values, so a notebook can also
    store one static picture; ``widget.lengths``, ``widget.layout_menu`` and ``widget.block_size_box``
    are the controls.
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import display

    lengths = widgets.Text(value=text, description="cached:new", continuous_update=False)
    menu = widgets.Dropdown(options=LAYOUTS, value=layout, description="layout")
    size = widgets.BoundedIntText(value=block_size, min=1, max=64, description="block_size")

    def render():
        cached, new = parse_pairs(lengths.value)
        kwargs = {"block_size": size.value} if menu.value == "paged" else {}
        fig = plt.figure(figsize=figsize(*resolve(cached=cached, new=new, layout=menu.value, **kwargs).mask.shape))
        mask_heatmap(cached=cached, new=new, layout=menu.value, ax=fig.add_subplot(), **kwargs)
        return fig

    out = widgets.Output()

    def redraw(change=None):
        with out:
            out.clear_output(wait=True)
            try:
                fig = render()
            except ValueError as e:
                print(f"✗ {e}")
                return
            display(fig)
            plt.close(fig)

    for control in (lengths, menu, size):
        control.observe(redraw, names="value")
    redraw()
    box = widgets.VBox([widgets.HBox([lengths, menu, size]), out])
    box.lengths, box.layout_menu, box.block_size_box, box.render = lengths, menu, size, render
    return box
