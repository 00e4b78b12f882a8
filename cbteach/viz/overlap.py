"""Where a step's time goes: the CPU's work and the forward pass, serial or overlapped (async scheduling).

Each :class:`~cbteach.StepRecord` carries ``timings``: when the step's ``schedule``, ``forward``
(the model runner's whole ``execute``: pack the batch, the forward pass, sample) and ``update``
(``update_from_output``) began and ended, in ``time.perf_counter()`` seconds. A synchronous engine
runs them one after another, so the accelerator waits while the CPU schedules and updates; with
``Engine(..., async_scheduling=True)`` (vLLM V1's ``async_scheduling``) step N+1 is planned while step
N's forward pass runs, and step N's update runs during step N+1's forward.

:func:`overlap_stats` counts what the records show; :func:`plot_overlap` draws a window of steps as
two lanes -- the CPU's scheduling and updates, and the forward passes -- one panel per run.
"""
from __future__ import annotations

from .style import label_if_fits, palette_color

PHASES = ("schedule", "forward", "update")
LANES = {"schedule": 1, "update": 1, "forward": 0}  # the forward on the lower lane, the CPU's work above
COLORS = {"schedule": palette_color(1), "update": palette_color(2), "forward": palette_color(0)}


def _timed(records) -> list:
    """The records that carry all three timings, in step order; a ValueError if none does."""
    timed = [r for r in records if all(p in (getattr(r, "timings", None) or {}) for p in PHASES)]
    if not timed:
        raise ValueError("no step record carries timings for schedule, forward and update: run an engine with "
                         "keep_records=True (the default)")
    return timed


def _overlap(x, y) -> bool:
    """Whether the time intervals ``x`` and ``y`` share a moment."""
    return x[0] < y[1] and y[0] < x[1]


def overlap_stats(records) -> dict:
    """What a run's step records show about overlap: ``steps``; ``overlapped``, the number of steps whose
    ``schedule`` ran (at least in part) while the previous step's forward pass ran; ``forward_s``, the
    forward passes' seconds; ``span_s``, from the first forward's start to the last one's end; and
    ``gaps_s``, the seconds in that span with no forward running (the accelerator idle, waiting)."""
    timed = _timed(records)
    fwd = [r.timings["forward"] for r in timed]
    overlapped = sum(_overlap(b.timings["schedule"], a.timings["forward"]) for a, b in zip(timed, timed[1:]))
    gaps = sum(max(0.0, b[0] - a[1]) for a, b in zip(fwd, fwd[1:]))
    return {"steps": len(timed), "overlapped": overlapped, "forward_s": sum(b - a for a, b in fwd),
            "span_s": fwd[-1][1] - fwd[0][0], "gaps_s": gaps}


def plot_overlap(runs: dict, steps: tuple[int, int] | None = None, *, title: str | None = None, axs=None):
    """Draw ``runs`` (``{label: records}``) as timelines of steps ``steps[0] .. steps[1] - 1`` (default: six
    steps from the middle of each run): the time from the first of those steps' forward passes to the
    end of the last, with everything that ran in it. Each panel's lower lane holds the forward passes,
    the upper one the CPU's ``schedule`` and ``update``; a bar is labelled with its step where the
    label fits. Times are milliseconds from the window's first forward pass. Returns the axes."""
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("runs: give at least one {label: records}")
    if axs is None:
        _, axs = plt.subplots(len(runs), 1, figsize=(11, 1.9 * len(runs) + 0.6), squeeze=False)
        axs = list(axs[:, 0])
    elif len(axs) != len(runs):
        raise ValueError(f"axs: one axes per run ({len(runs)}), got {len(axs)}")
    labels = []
    for ax, (label, records) in zip(axs, runs.items()):
        timed = _timed(records)
        lo, hi = steps if steps is not None else (max(0, len(timed) // 2 - 3), len(timed) // 2 + 3)
        window = [r for r in timed if lo <= r.step < hi]
        if not window:
            raise ValueError(f"{label}: no step in {lo} .. {hi - 1}")
        # the stretch of time from the window's first forward pass to its last one's end, with every
        # phase of any step that ran in it (an async engine plans a step during the one before)
        t0, t1 = window[0].timings["forward"][0], window[-1].timings["forward"][1]
        bars = [(r.step, LANES[p], p, 1e3 * (max(a, t0) - t0), 1e3 * (min(b, t1) - t0))
                for r in timed for p in PHASES for a, b in [r.timings[p]] if b > t0 and a < t1]
        end = max(b for *_, b in bars)
        for _, y, phase, a, b in bars:  # at least a hairline: a phase of microseconds still shows where it ran
            ax.barh(y, max(b - a, 0.003 * end), left=a, height=0.6, color=COLORS[phase], edgecolor="white",
                    linewidth=0.3)
        ax.set_xlim(0, end)
        ax.set_yticks([0, 1], ["forward", "CPU: schedule,\nupdate"])
        ax.set_ylim(-0.6, 1.6)
        ax.set(xlabel="milliseconds", title=label)
        ax.grid(axis="x", alpha=0.3)
        labels.append((ax, bars))
    from matplotlib.patches import Patch

    fig = axs[0].figure
    fig.legend(handles=[Patch(color=COLORS[p], label=p) for p in PHASES], fontsize=8, loc="upper right", ncol=3)
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    for ax, bars in labels:  # once the layout is final: a step number only where it fits its bar
        for step, y, _, a, b in bars:
            label_if_fits(ax, a, b, y, str(step), fontsize=7)
    return axs
