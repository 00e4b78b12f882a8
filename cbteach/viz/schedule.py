"""Two schedules of the same workload, side by side: who ran each step, and where they part.

A **schedule** is what the scheduler decided, step by step: when the step ran, which requests ran
in it with how many tokens from which position, who was admitted and who was preempted -- exactly
what :class:`~cbteach.StepRecord` keeps. Two schedulers given the same workload, the same clock
and the same pool make the same schedule step for step, or part at a first step; from there on
everything differs, so the first difference is where to look (notebook 06's checks report it).

* :func:`plan_of` -- one step's schedule, as a comparable tuple;
* :func:`first_difference` -- the first step where two runs' schedules differ;
* :func:`plot_schedules` -- slot timelines of several runs, one above the other on one step axis,
  with preemptions (red X) and readmissions (green triangle) marked, and the first difference
  drawn as a dashed line (named in the x axis label).
"""
from __future__ import annotations

from .latency import PREEMPT_MARK, RESUME_MARK, preemption_events
from .timeline import num_slots, plot_timeline


def plan_of(rec) -> tuple:
    """One step's schedule: (start time, ((request id, computed tokens, scheduled tokens), ...),
    admitted ids, preempted ids)."""
    return (rec.start_time, tuple((s.request_id, s.num_computed_tokens, s.num_scheduled_tokens) for s in rec.seqs),
            tuple(rec.admitted), tuple(rec.preempted))


def first_difference(reference, records) -> int | None:
    """The index of the first step whose schedule differs (one run ending earlier counts), or None."""
    reference, records = list(reference), list(records)
    for i, (a, b) in enumerate(zip(reference, records)):
        if plan_of(a) != plan_of(b):
            return i
    return None if len(reference) == len(records) else min(len(reference), len(records))


def plot_schedules(runs: dict, max_batch_size: int | None = None, *, title: str | None = None):
    """Slot timelines of ``runs`` (``{name: records}``, the first one the reference), stacked on one
    step axis; each marks its preemptions and readmissions, and every run after the first a dashed
    line where its schedule first differs from the first's. Returns the figure."""
    import matplotlib.pyplot as plt

    if not isinstance(runs, dict) or not runs or not all(len(list(r)) for r in runs.values()):
        raise ValueError("plot_schedules needs a dict {name: records} of runs with at least one step each")
    runs = {name: list(recs) for name, recs in runs.items()}
    slots = max_batch_size or max(num_slots(r) for r in runs.values())
    n = max(len(r) for r in runs.values())
    fig, axes = plt.subplots(len(runs), 1, sharex=True, squeeze=False,
                             figsize=(min(16.0, max(8.0, 0.25 * n + 4)), 0.9 + (1.0 + 0.45 * slots) * len(runs)))
    reference = next(iter(runs.values()))
    for ax, (name, recs) in zip(axes[:, 0], runs.items()):
        plot_timeline(recs, slots, ax=ax, title=name)
        for kind, style in (("preempted", PREEMPT_MARK), ("readmitted", RESUME_MARK)):
            pts = [(i + 0.5, slot) for i, k, _, slot in preemption_events(recs) if k == kind]
            if pts:
                ax.plot(*zip(*pts), label=kind, **style)
        diff = first_difference(reference, recs) if recs is not reference else None
        if diff is not None:
            ax.axvline(diff, color="black", linestyle="--", linewidth=1.2, zorder=5)
            ax.set_xlabel(f"step (dashed line: step {diff}, the first where this schedule differs from the first one)")
        ax.set_xlim(0, n)
        ax.tick_params(labelbottom=True)
    fig.suptitle(title or "Two schedulers, one workload: who ran each step (X preempted, ▲ readmitted)", fontsize=11)
    fig.tight_layout()
    return fig
