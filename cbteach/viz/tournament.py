"""The scheduler tournament's leaderboard as a picture (:mod:`cbteach.exercises.tournament`).

Two panels, one entrant per row or point:

* **goodput** -- requests per simulated second that met both latency targets, best at the top;
  disqualified entrants are listed at the bottom with no bar;
* **p90 TTFT against p90 TPOT** -- where each entrant's slow requests sit, with the two targets as
  dashed lines: a scheduler in the lower left corner serves most of its users within both.

The entries are plain objects with ``name``, ``rank``, ``goodput``, ``ttft_p90``, ``tpot_p90`` and
``disqualified`` (the tournament's :class:`~cbteach.exercises.tournament.Entry`); an entry's ``label``, where it has one,
marks the course's scheduler.
"""
from __future__ import annotations


def plot_tournament(entries, ttft_slo: float, tpot_slo: float, *, title: str | None = None):
    """The leaderboard figure of ``entries`` (ranked first, disqualified after); returns the figure."""
    import matplotlib.pyplot as plt

    entries = list(entries)
    if not entries:
        raise ValueError("plot_tournament needs at least one entry")
    ranked = [e for e in entries if e.disqualified is None]
    out = [e for e in entries if e.disqualified is not None]
    rows = ranked + out
    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(13, 0.9 + 0.42 * max(4, len(rows))),
                                        gridspec_kw={"width_ratios": [1.2, 1]})
    y = list(range(len(rows)))[::-1]
    colors = plt.get_cmap("tab10")
    for i, (e, yy) in enumerate(zip(rows, y)):
        if e.disqualified is None:
            bars.barh(yy, e.goodput or 0.0, color=colors(i % 10))
            bars.text(e.goodput or 0.0, yy, f" {e.goodput:.2f}", va="center", fontsize=9)
        else:
            bars.text(0, yy, "  disqualified", va="center", fontsize=9, color="firebrick")
    bars.set_yticks(y)
    bars.set_yticklabels([f"{e.rank}. {_label(e)}" if e.rank else f"DQ {_label(e)}" for e in rows], fontsize=9)
    bars.set_xlabel("goodput (requests per simulated second meeting both targets)")
    bars.set_ylabel("scheduler (rank)")
    bars.set_title("Goodput: more is better")
    for i, e in enumerate(ranked):
        scatter.scatter(e.ttft_p90, e.tpot_p90, s=60, color=colors(i % 10), zorder=3)
        scatter.annotate(_label(e), (e.ttft_p90, e.tpot_p90), textcoords="offset points", xytext=(5, 4), fontsize=8)
    scatter.axvline(ttft_slo, color="grey", linestyle="--", linewidth=1, label=f"TTFT target {ttft_slo:g} s")
    scatter.axhline(tpot_slo, color="grey", linestyle=":", linewidth=1, label=f"TPOT target {tpot_slo:g} s")
    scatter.set_xlabel("p90 time to first token (simulated s)")
    scatter.set_ylabel("p90 time per output token (simulated s)")
    scatter.set_title("Where the slow requests sit: lower left is better")
    scatter.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or "Scheduler tournament: one trace, the real engine, the same rules for everyone", fontsize=11)
    fig.tight_layout()
    return fig


def _label(entry) -> str:
    """The entry's name, the course's scheduler marked (an object without ``label``: its name)."""
    return getattr(entry, "label", entry.name)
