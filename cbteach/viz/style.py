"""One place for the look of every picture: sequence letters, colours, and labels that fit.

Every visualiser in :mod:`cbteach.viz` takes its colours from here, so request ``req-3`` is the
same colour in the packed row, the slot timeline and the block pool, and a state such as
"idle" looks the same in every figure. Keeping this in one module is what makes the pictures
comparable side by side.
"""
from __future__ import annotations

from matplotlib.colors import to_rgb

# Twenty distinguishable colours (matplotlib's tab20, dark shades first): enough for the small
# workloads of the course; beyond twenty the cycle repeats, which the legends make clear.
_TAB20 = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
          "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
          "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"]

# Slot states (see cbteach.viz.timeline). Useful work is saturated, waste is pale or hatched.
STATE_COLORS = {
    "prefill": "#e6862a",  # orange: prompt tokens going through the model
    "decode": "#2f7ed8",   # blue: one new token per step
    "padding": "#d9d9d9",  # light grey (drawn hatched): pad tokens computed and thrown away
    "idle": "#f4a6a6",     # pale red: finished, but the slot is held (batch barrier / stalled)
    "empty": "#ffffff",    # white: no request in the slot at all
}
STATE_HATCH = {"padding": "////"}

# The two "may attend" shades of a mask heatmap: keys from the cache, keys made this step.
CACHED_KEY_COLOR = "#7fb3d5"
NEW_KEY_COLOR = "#1a5276"
BLOCKED_COLOR = "#ffffff"


def seq_letter(index: int) -> str:
    """Spreadsheet-style letter for the ``index``-th sequence of a step: A..Z, then AA, AB, ..."""
    if not isinstance(index, int) or index < 0:
        raise ValueError(f"sequence index must be an integer >= 0, got {index!r}")
    letters = ""
    index += 1  # bijective base 26: there is no "zero" letter, which is why Z is followed by AA
    while index:
        index, rem = divmod(index - 1, 26)
        letters = chr(ord("A") + rem) + letters
    return letters


def palette_color(index: int) -> str:
    """The ``index``-th colour of the shared palette (cycling)."""
    return _TAB20[index % len(_TAB20)]


def request_colors(request_ids) -> dict:
    """Map request ids to colours in order of first appearance, so colours stay put across steps.

    ``request_ids`` is any iterable (repeats are fine); pass every id of a whole run to get one
    mapping for all its pictures.
    """
    colors: dict = {}
    for rid in request_ids:
        if rid not in colors:
            colors[rid] = palette_color(len(colors))
    return colors


def record_request_colors(records) -> dict:
    """:func:`request_colors` for every request that appears in a list of step records."""
    return request_colors(s.request_id for r in records for s in r.seqs)


def tint(color, amount: float = 0.6) -> tuple:
    """``color`` mixed with white (``amount`` = 1 is white): a paler shade of the same hue."""
    r, g, b = to_rgb(color)
    return (r + (1 - r) * amount, g + (1 - g) * amount, b + (1 - b) * amount)


def text_color_on(color) -> str:
    """Black or white, whichever reads better on a background of ``color``."""
    r, g, b = to_rgb(color)
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "white"


def get_axes(ax, figsize):
    """Return ``(figure, axes)``: the given axes, or a new pyplot figure so notebooks show it."""
    if ax is not None:
        return ax.figure, ax
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    return fig, ax


def fits(ax, span: float, text: str, fontsize: float = 8) -> bool:
    """Whether ``text`` fits across ``span`` data units of ``ax``'s x axis, at its current size.

    The text width is estimated from the font size (0.6 em per character) and compared with the
    span's width on screen. Call it once the axes limits and the figure layout are final.
    """
    bbox = ax.get_window_extent()  # axes size in display pixels, no renderer needed
    xmin, xmax = ax.get_xlim()
    if bbox.width <= 0 or xmax == xmin or not text:
        return False
    span_px = abs(span) / abs(xmax - xmin) * bbox.width
    longest = max(len(line) for line in text.split("\n"))
    return 0.6 * fontsize * longest * ax.figure.dpi / 72 <= 0.92 * span_px


def label_if_fits(ax, x0: float, x1: float, y: float, text: str, *, fontsize: float = 8, **kwargs):
    """Write ``text`` centred in the data span ``[x0, x1]`` at height ``y`` -- only if it :func:`fits`.

    Labels that would spill over their bar are left out rather than overlap their neighbours.
    """
    if not fits(ax, x1 - x0, text, fontsize):
        return None
    return ax.text((x0 + x1) / 2, y, text, ha="center", va="center", fontsize=fontsize, clip_on=True, **kwargs)


def step_records(records) -> list:
    """``records`` (``engine.records``) as a list of step records, or a ``ValueError`` saying what was
    passed instead -- a static batching result or completions are drawn by other functions."""
    from ..core.records import StepRecord

    if isinstance(records, (str, bytes)) or not hasattr(records, "__iter__"):
        raise ValueError(f"expected the engine's step records (engine.records), got {type(records).__name__}")
    records = list(records)
    wrong = next((r for r in records if not isinstance(r, StepRecord)), None)
    if wrong is not None:
        raise ValueError(f"expected the engine's step records (engine.records), got a list of "
                         f"{type(wrong).__name__}")
    if not records:
        raise ValueError("there are no step records to draw: run the engine first, with keep_records=True "
                         "(the default)")
    return records


def step_window(steps, num_steps: int) -> tuple[int, int]:
    """``steps=(start, stop)`` checked against a run of ``num_steps`` steps (stop is clipped to it)."""
    if steps is None:
        return 0, num_steps
    try:
        lo, hi = steps
    except (TypeError, ValueError):
        raise ValueError(f"steps should be a pair (start, stop), got {steps!r}") from None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)) or not 0 <= lo < hi:
        raise ValueError(f"steps should be whole numbers 0 <= start < stop, got {steps!r}")
    if lo >= num_steps:
        raise ValueError(f"steps={steps!r} starts after the run's last step ({num_steps - 1})")
    return lo, min(hi, num_steps)
