"""Latency pictures: one request's TTFT, ITLs and E2E; stalls; preemptions on a slot timeline.

Everything here reads what the engine hands back -- :class:`~cbteach.Completion` objects (their
``arrival_time``, ``first_token_time``, ``token_times`` and ``finish_time``, all on the engine's
clock) and :class:`~cbteach.StepRecord` lists -- and the metrics come from
:mod:`cbteach.serving.metrics`, so a picture shows the same numbers a benchmark would report.

* :func:`plot_request_anatomy` -- one request on a time axis: TTFT, the inter-token gaps, E2E;
* :func:`plot_itl_timeline` -- every request's inter-token latency against time (a stall is a spike);
* :func:`plot_budget_tradeoff` -- chunked prefill: worst stall against the long prompt's TTFT;
* :func:`plot_preemptions` -- a slot timeline with preemptions and swap-ins marked, above the KV
  pool's fill; :func:`preemption_events` and :func:`recomputed_tokens` are the numbers behind it;
* :func:`plot_lanes` -- latency percentiles per priority lane, per policy.
"""
from __future__ import annotations

from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from ..serving.metrics import request_metrics
from .style import get_axes, palette_color, request_colors
from .timeline import plot_timeline

PREEMPT_MARK = dict(marker="X", color="#d62728", markersize=9, markeredgecolor="black", linestyle="none")
RESUME_MARK = dict(marker="^", color="#2ca02c", markersize=8, markeredgecolor="black", linestyle="none")


def _ms(seconds: float) -> float:
    return 1e3 * seconds


def run_start(completions) -> float:
    """The earliest arrival among ``completions``: time zero of a run's plots."""
    completions = list(completions)
    if not completions:
        raise ValueError("no completions to plot")
    return min(c.arrival_time for c in completions)


def plot_request_anatomy(completion, *, ax=None, title: str | None = None):
    """One request on a time axis (ms after its arrival): arrival, every token, TTFT, one ITL, E2E.

    The definitions are :mod:`cbteach.serving.metrics`' (vLLM's benchmark ones): TTFT = first token -
    arrival; ITL = gap between consecutive tokens; TPOT = (E2E - TTFT) / (tokens - 1); E2E =
    finish - arrival. Returns the axes.
    """
    m = request_metrics(completion)
    own = ax is None
    fig, ax = get_axes(ax, figsize=(10, 2.9))
    t0 = completion.arrival_time
    times = [_ms(t - t0) for t in completion.token_times]
    e2e = _ms(m.e2e)
    ax.axhline(0, color="#999999", linewidth=1, zorder=0)
    ax.plot([0], [0], marker="o", color="black", linestyle="none", label="arrival")
    ax.vlines(times, -0.25, 0.25, color="#2f7ed8", linewidth=1.2, label="a token reaches the user")
    ax.vlines([times[0]], -0.4, 0.4, color="#e6862a", linewidth=2.5, label="first token")

    def bracket(x0, x1, y, text):
        ax.annotate("", xy=(x0, y), xytext=(x1, y), arrowprops=dict(arrowstyle="<->", color="black", lw=1))
        ax.text((x0 + x1) / 2, y + 0.08, text, ha="center", va="bottom", fontsize=9)

    bracket(0, times[0], 0.55, f"TTFT {m.ttft * 1e3:.0f} ms")
    bracket(0, e2e, 1.05, f"E2E latency {e2e:.0f} ms")
    if len(times) > 1:
        i = max(range(len(times) - 1), key=lambda k: times[k + 1] - times[k])  # the widest gap reads best
        bracket(times[i], times[i + 1], -0.6, f"an ITL: {times[i + 1] - times[i]:.1f} ms")
        tpot = f"TPOT = (E2E - TTFT) / ({len(times)} - 1) = {m.tpot * 1e3:.1f} ms"
        ax.text(0.99, 0.03, tpot, transform=ax.transAxes, ha="right", va="bottom", fontsize=9)
    ax.set_ylim(-1.0, 1.5)
    ax.set_yticks([])
    ax.set_xlim(-0.03 * e2e, 1.03 * e2e)
    ax.set_xlabel("ms after the request arrived")
    ax.set_ylabel("request " + str(completion.request_id), fontsize=8)
    ax.set_title(title or f"Anatomy of one request: {len(times)} tokens", fontsize=11)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    if own:
        fig.tight_layout()
    return ax


def plot_itl_timeline(completions, *, ax=None, title: str | None = None, skip=(), events=None, t0=None):
    """Inter-token latency (ms) of every request against time (s from ``t0``, by default the run's
    first arrival), each gap drawn as a step across the interval it lasted. ``skip``: request ids
    left out (say, the long prompt itself). ``events``: ``{label: time on the engine clock}`` drawn
    as vertical lines."""
    completions = list(completions)
    t0 = run_start(completions) if t0 is None else t0
    fig, ax = get_axes(ax, figsize=(8, 3.4))
    colors = request_colors(c.request_id for c in completions)
    for c in completions:
        if c.request_id in skip or len(c.token_times) < 2:
            continue
        # Each gap drawn across the interval it lasted: a stall is a wide, tall step, not a ramp.
        edges = [t - t0 for t in c.token_times]
        gaps = [_ms(b - a) for a, b in zip(c.token_times, c.token_times[1:])]
        ax.stairs(gaps, edges, baseline=None, color=colors[c.request_id], linewidth=1.2, label=str(c.request_id))
    for k, (label, t) in enumerate((events or {}).items()):
        ax.axvline(t - t0, color=["#d62728", "#555555", "#9467bd"][k % 3], linestyle="--", linewidth=1, label=label)
    ax.set_xlabel("seconds since the first arrival")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title(title or "Inter-token latency of every request", fontsize=11)
    ax.legend(fontsize=7, loc="upper right")
    return ax


def plot_budget_tradeoff(rows, *, ax=None, title: str | None = None):
    """Chunked prefill's trade-off: ``rows`` of ``{"budget", "worst_itl", "ttft"}`` (seconds), one per
    token budget (``None`` = no budget). x: the others' worst inter-token gap; y: the long prompt's
    TTFT. Returns the axes."""
    rows = list(rows)
    if not rows or not all(isinstance(r, dict) and {"budget", "worst_itl", "ttft"} <= set(r) for r in rows):
        raise ValueError('give one row per token budget, each {"budget": ..., "worst_itl": s, "ttft": s}')
    fig, ax = get_axes(ax, figsize=(6.5, 4))
    xs, ys = [_ms(r["worst_itl"]) for r in rows], [_ms(r["ttft"]) for r in rows]
    ax.plot(xs, ys, "-", color="#999999", zorder=1)
    for i, (r, x, y) in enumerate(zip(rows, xs, ys)):
        ax.plot([x], [y], "o", color=palette_color(i), markersize=8, zorder=2)
        label = "no budget" if r["budget"] is None else f"budget {r['budget']}"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 5), fontsize=8)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("others' worst inter-token latency (ms, log scale)")
    ax.set_ylabel("long prompt's TTFT (ms)")
    ax.set_title(title or "Chunked prefill: a shorter stall for a later first token", fontsize=11)
    ax.grid(alpha=0.3)
    return ax


def preemption_events(records) -> list[tuple[int, str, object, int]]:
    """``(index, kind, request_id, slot)`` for every preemption (``kind="preempted"``, the slot it was
    taken from) and every return (``"swapped in"``, or ``"readmitted"`` after a recompute preemption,
    the slot it came back to). ``index`` is the record's position in ``records``."""
    last_slot: dict = {}
    out_of_batch: set = set()
    events = []
    for i, rec in enumerate(records):
        for rid in rec.preempted:
            events.append((i, "preempted", rid, last_slot.get(rid, 0)))
            out_of_batch.add(rid)
        slots = {s.request_id: s.slot for s in rec.seqs}
        for rid in getattr(rec, "swapped_in", ()):  # (V0's records only)
            events.append((i, "swapped in", rid, slots.get(rid, 0)))
            out_of_batch.discard(rid)
        for rid in rec.admitted:
            if rid in out_of_batch:
                events.append((i, "readmitted", rid, slots.get(rid, 0)))
                out_of_batch.discard(rid)
        last_slot.update(slots)
    return events


def recomputed_tokens(records) -> tuple[int, float]:
    """Tokens computed a second time because of recompute preemptions, and an estimate of their cost:
    each step's forward time shared among its tokens, summed over the recomputed ones. (Every
    prefill token of a request after its first preemption was computed before.)"""
    preempted: set = set()
    tokens, seconds = 0, 0.0
    for rec in records:
        preempted.update(rec.preempted)
        for s in rec.seqs:
            if s.kind == "prefill" and s.request_id in preempted and rec.num_tokens:
                tokens += s.num_scheduled_tokens
                seconds += rec.forward_time * s.num_scheduled_tokens / rec.num_tokens
    return tokens, seconds


def plot_preemptions(records, max_batch_size: int, *, title: str | None = None, axes=None):
    """A slot timeline with every preemption (red X, in the slot it was taken from) and every return
    (green triangle), above the KV pool's used blocks per step. Needs a paged engine's records.
    Returns the figure."""
    records = list(records)
    if not records or records[0].kv_usage is None:
        raise ValueError("plot_preemptions needs the records of a paged engine run with keep_records=True")
    import matplotlib.pyplot as plt

    if axes is None:
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(min(16.0, 0.05 * len(records) + 8), 5.2),
                                 gridspec_kw={"height_ratios": [max(max_batch_size, 2), 2.2]})
    fig = axes[0].figure
    plot_timeline(records, max_batch_size, ax=axes[0], title=title or "Slots under memory pressure")
    events = preemption_events(records)
    for kind, style in (("preempted", PREEMPT_MARK), ("swapped in", RESUME_MARK), ("readmitted", RESUME_MARK)):
        pts = [(i + 0.5, slot) for i, k, _, slot in events if k == kind]
        if pts:
            axes[0].plot(*zip(*pts), label=kind, **style)
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    used = [r.kv_usage["num_blocks"] - r.kv_usage["num_free_blocks"] for r in records]
    total = records[0].kv_usage["num_blocks"]
    xs = [i + 0.5 for i in range(len(records))]
    axes[1].fill_between(xs, used, step="mid", color="#7fb3d5", alpha=0.8, label="blocks in use")
    axes[1].axhline(total, color="black", linewidth=1, label=f"pool: {total} blocks")
    for i, k, _, _ in events:
        if k == "preempted":
            axes[1].axvline(i + 0.5, color="#d62728", linewidth=0.8, alpha=0.7)
    axes[1].set_ylim(0, total * 1.15)
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("KV blocks")
    axes[1].set_title("KV pool after each step (red: a preemption)", fontsize=10)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    axes[0].tick_params(labelbottom=True)
    fig.tight_layout()
    return fig


def plot_lanes(stats, *, ax=None, title: str | None = None, metric: str = "TTFT"):
    """Grouped bars: ``stats[policy][lane] = (p50, p90)`` in seconds. Solid bar p50, pale bar up to
    p90. Returns the axes."""
    if not isinstance(stats, dict) or not stats or not all(isinstance(v, dict) for v in stats.values()):
        raise ValueError("give stats[policy][lane] = (p50, p90) in seconds, at least one policy")
    policies = list(stats)
    lanes = list(dict.fromkeys(lane for p in policies for lane in stats[p]))
    missing = [(p, lane) for p in policies for lane in lanes if lane not in stats[p]]
    if missing:
        raise ValueError(f"every policy needs the same lanes; {missing[0][0]!r} has no {missing[0][1]!r}")
    fig, ax = get_axes(ax, figsize=(7, 3.6))
    width = 0.8 / max(len(lanes), 1)
    for j, lane in enumerate(lanes):
        xs = [i + (j - (len(lanes) - 1) / 2) * width for i in range(len(policies))]
        p50 = [_ms(stats[p][lane][0]) for p in policies]
        p90 = [_ms(stats[p][lane][1]) for p in policies]
        color = palette_color(j)
        ax.bar(xs, p90, width * 0.9, color=color, alpha=0.3, edgecolor=color)
        ax.bar(xs, p50, width * 0.9, color=color, label=f"{lane}: p50 (pale: p90)")
    ax.set_xticks(range(len(policies)), [f"policy={p!r}" for p in policies])
    ax.set_xlabel("scheduling policy")
    ax.set_ylabel(f"{metric} (ms)")
    ax.set_title(title or f"{metric} per lane", fontsize=11)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return ax
