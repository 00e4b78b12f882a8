"""Benchmark pictures: what :mod:`cbteach.bench.measure` measured, drawn the way the papers draw it.

Every function takes the rows :func:`cbteach.bench.measure.compare` returns (one dict of metrics per
engine, times in seconds) or the points of :func:`cbteach.bench.measure.sweep` (``[{"workload": summary,
"engines": rows}]``), so a figure shows exactly the numbers the command line writes to JSON.

* :func:`plot_engines` -- throughput and latency percentiles of every engine on one workload;
* :func:`plot_variance` -- Anyscale's figure: throughput against the spread of output lengths,
  and the measured speed-up over static batching beside the one slot arithmetic predicts;
* :func:`plot_latency_vs_rate` -- TTFT and E2E latency against the offered request rate (the knee);
* :func:`plot_goodput` -- goodput against the offered rate, with the rate itself as the ceiling;
* :func:`plot_memory` -- a fixed KV budget: batch size reached and throughput, side by side;
* :func:`plot_step_vs_batch` -- the cost of one decode step against the batch size.
"""
from __future__ import annotations

import numpy as np

from .style import get_axes, palette_color

ENGINE_COLORS = {"hf_generate": "#7f7f7f", "hf_batch_generate": "#bcbd22", "static": "#d62728",
                 "cbteach_concat": "#ff7f0e", "cbteach_paged": "#1f77b4", "cbteach_paged_budget": "#17becf",
                 "transformers_cb": "#2ca02c", "contiguous": "#d62728", "paged": "#1f77b4"}


def engine_color(name: str, index: int = 0) -> str:
    return ENGINE_COLORS.get(name, palette_color(index))


def _ms(x):
    return np.nan if x is None else 1e3 * x


def _points(points, param: str) -> list:
    """Sweep points (``sweep()``'s list) that vary ``param``, checked before any figure is made."""
    ok = isinstance(points, (list, tuple)) and points and all(
        isinstance(p, dict) and param in p.get("workload", {}).get("params", {}) and isinstance(p.get("engines"), dict)
        for p in points)
    if not ok:
        sweep = {"cap": "length_variance", "rate": "poisson"}[param]
        raise ValueError(f"expected the points of a {sweep} sweep (bench.sweep()'s list, each with its '{param}'), "
                         f"got {points!r:.80}")
    return list(points)


def _rows(rows, keys) -> list:
    """The names of the engine rows that have every key in ``keys`` (and no error); at least one."""
    if not isinstance(rows, dict):
        raise ValueError(f"expected {{engine name: row}} as bench.compare() returns, got {type(rows).__name__}")
    names = [n for n, r in rows.items() if isinstance(r, dict) and "error" not in r and all(k in r for k in keys)]
    if not names:
        raise ValueError(f"no row to draw: every row failed or lacks one of {list(keys)}")
    return names


def _subplots(ncols, figsize):
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize)


def plot_engines(rows: dict, *, title: str | None = None):
    """Two panels: output tokens/s per engine, and TTFT / TPOT at p50 (bar) and p99 (tick) in ms."""
    names = _rows(rows, ("tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"))
    fig, (a1, a2) = _subplots(2, (12, 3.8))
    x = np.arange(len(names))
    a1.bar(x, [rows[n]["tokens_per_s"] for n in names], color=[engine_color(n, i) for i, n in enumerate(names)])
    a1.set(title="Throughput", ylabel="output tokens / s", xlabel="engine")
    for k, metric in enumerate(("ttft", "tpot")):
        off = 0.4 * k - 0.2
        p50 = [_ms(rows[n][f"{metric}_p50"]) for n in names]
        p99 = [_ms(rows[n][f"{metric}_p99"]) for n in names]
        a2.bar(x + off, p50, 0.4, color=["#4c72b0", "#dd8452"][k], label=f"{metric.upper()} p50")
        a2.plot(x + off, p99, "_", color="black", markersize=14, markeredgewidth=2,
                label="p99" if k == 0 else None)
    a2.set(title="Latency: p50 (bars) and p99 (ticks)", ylabel="ms (log scale)", xlabel="engine", yscale="log")
    a2.legend(fontsize=8)
    for a in (a1, a2):
        a.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(title or f"{len(names)} engines, one workload", fontsize=12)
    fig.tight_layout()
    return fig


def ideal_from_point(point: dict, batch_size: int) -> float | None:
    """Slot arithmetic's speed-up (static steps / continuous steps) of a sweep point, from measured steps."""
    rows = point["engines"]
    st = rows.get("static", {}).get("steps")
    cont = next((rows[n].get("steps") for n in ("cbteach_paged", "cbteach_concat") if rows.get(n, {}).get("steps")),
                None)
    return st / cont if st and cont else None


def plot_variance(points, *, batch_size: int, title: str | None = None):
    """Anyscale's experiment. Left: tokens/s of each engine against the cap on output lengths (the
    x labels give the lengths' standard deviation). Right: each engine's measured speed-up over
    static batching, and the ideal one (static steps / continuous steps)."""
    points = _points(points, "cap")
    caps = [p["workload"]["params"]["cap"] for p in points]
    stds = [p["workload"]["max_new_tokens"]["std"] for p in points]
    names = [n for n in points[0]["engines"]]
    fig, (a1, a2) = _subplots(2, (12, 4))
    for i, n in enumerate(names):
        tps = [p["engines"][n].get("tokens_per_s") for p in points]
        a1.plot(caps, [np.nan if t is None else t for t in tps], "o-", color=engine_color(n, i), label=n)
        if n != "static":
            up = [p["engines"][n]["tokens_per_s"] / p["engines"]["static"]["tokens_per_s"]
                  if p["engines"][n].get("tokens_per_s") and p["engines"].get("static", {}).get("tokens_per_s")
                  else np.nan for p in points]
            a2.plot(caps, up, "o-", color=engine_color(n, i), label=f"{n} (measured)")
    a2.plot(caps, [ideal_from_point(p, batch_size) or np.nan for p in points], "k--", marker="s",
            label="ideal: static steps / continuous steps")
    a2.axhline(1.0, color="#999999", linewidth=1)
    labels = [f"{c}\n(std {s:.0f})" for c, s in zip(caps, stds)]
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_xticks(caps, labels, fontsize=8)
        a.set_xlabel("cap on output length (standard deviation of the lengths)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    a1.set(title="Throughput", ylabel="output tokens / s")
    a2.set(title="Speed-up over static batching", ylabel="x static's tokens / s")
    fig.suptitle(title or "Throughput as the variance of output lengths grows (Anyscale's experiment)", fontsize=12)
    fig.tight_layout()
    return fig


def _rates(points):
    return [p["workload"]["params"]["rate"] for p in points]


def _log_ticks(ax, axis="y"):
    """Labelled ticks at 1, 2 and 5 of each decade, so a log axis spanning less than a decade still
    reads (matplotlib labels only powers of ten, and a short range has none)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    a = ax.yaxis if axis == "y" else ax.xaxis
    a.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    a.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    a.set_minor_formatter(NullFormatter())


def _unit(unit: str):
    """How a sweep's times are shown: ``"ms"`` (measured seconds, times 1000) or ``"steps"`` (counts, as is)."""
    if unit not in ("ms", "steps"):
        raise ValueError(f"unit must be 'ms' or 'steps', got {unit!r}")
    return (_ms, "requests / s") if unit == "ms" else ((lambda x: np.nan if x is None else x), "requests / step")


def plot_latency_vs_rate(points, *, capacity: dict | None = None, title: str | None = None, unit: str = "ms"):
    """TTFT (p50 solid, p99 dotted) and E2E p50 against the offered rate (log scale), per engine;
    ``capacity`` (``{engine: requests/s}``) draws each engine's capacity as a dashed vertical line.
    ``unit="steps"``: the points count time in forward steps and load in requests per step
    (:func:`cbteach.bench.experiments.latency_vs_load_in_steps`)."""
    points = _points(points, "rate")
    conv, per = _unit(unit)
    rates = _rates(points)
    names = list(points[0]["engines"])
    fig, (a1, a2) = _subplots(2, (12, 4))
    for i, n in enumerate(names):
        c = engine_color(n, i)
        get = lambda key: [conv(p["engines"][n].get(key)) for p in points]  # noqa: E731
        a1.plot(rates, get("ttft_p50"), "o-", color=c, label=f"{n} p50")
        a1.plot(rates, get("ttft_p99"), "o:", color=c, label=f"{n} p99")
        a2.plot(rates, get("e2e_p50"), "o-", color=c, label=f"{n} p50")
        for a in (a1, a2):
            if capacity and n in capacity:
                a.axvline(capacity[n], color=c, linestyle="--", linewidth=1)
    a1.set(title="Time to first token", ylabel=f"TTFT ({unit}, log scale)", yscale="log")
    a2.set(title="End-to-end latency", ylabel=f"E2E ({unit}, log scale)", yscale="log")
    for a in (a1, a2):
        a.set_xscale("log")
        a.set_xticks(rates, [f"{r:.2g}" for r in rates], fontsize=8)
        a.minorticks_off()
        _log_ticks(a)
        a.set_xlabel(f"offered load ({per}, log scale)" + ("; dashed: capacity" if capacity else ""))
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.suptitle(title or "Latency against request rate (Poisson arrivals)", fontsize=12)
    fig.tight_layout()
    return fig


def plot_goodput(points, *, title: str | None = None, ax=None, unit: str = "ms", arrived=None):
    """Goodput (requests that met the targets, per second -- or per step with ``unit="steps"``) against
    the offered rate, per engine, on log axes (a goodput of 0 is left out); the dashed line is what a
    server meeting every target would reach: the offered rate itself, or -- given ``arrived``, one rate
    per point -- the rate at which that point's requests really arrived (a Poisson draw of a few dozen
    requests comes faster or slower than its rate)."""
    points = _points(points, "rate")
    per = _unit(unit)[1]
    rates = _rates(points)
    if arrived is not None and len(arrived) != len(points):
        raise ValueError(f"arrived needs one rate per point ({len(points)}), got {len(arrived)}")
    fig, ax = get_axes(ax, figsize=(6.5, 4))
    shown = []
    for i, n in enumerate(points[0]["engines"]):
        good = [p["engines"][n].get("goodput") or np.nan for p in points]
        shown += [g for g in good if g == g]
        ax.plot(rates, good, "o-", color=engine_color(n, i), label=n)
    line = rates if arrived is None else list(arrived)
    shown += line
    ax.plot(rates, line, "--", color="#999999", label="offered rate" if arrived is None else "arrival rate of the draw")
    ax.set(xlabel=f"offered load ({per}, log scale)", ylabel=f"goodput ({per}, log scale)",
           xscale="log", yscale="log")
    ax.set_ylim(0.5 * min(shown + rates), 1.5 * max(shown + rates))
    ax.set_xticks(rates, [f"{r:.2g}" for r in rates], fontsize=8)
    ax.minorticks_off()
    _log_ticks(ax)
    ax.set_title(title or "Goodput: requests that met their latency targets", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def plot_memory(rows: dict, *, title: str | None = None):
    """A fixed KV budget, two ways of using it. ``rows``: ``{label: row}`` with ``peak_batch``, ``steps``,
    ``tokens`` and ``tokens_per_s``. Left: the largest and the mean batch (tokens / steps); right: tokens/s."""
    names = _rows(rows, ("peak_batch", "steps", "tokens", "tokens_per_s"))
    if any(not rows[n]["steps"] for n in names):
        raise ValueError("a row ran no steps: nothing to average a batch over")
    fig, (a1, a2) = _subplots(2, (10, 3.6))
    x = np.arange(len(names))
    colors = [engine_color(n, i) for i, n in enumerate(names)]
    from matplotlib.patches import Patch

    a1.bar(x - 0.2, [rows[n]["peak_batch"] for n in names], 0.4, color=colors)
    a1.bar(x + 0.2, [rows[n]["tokens"] / rows[n]["steps"] for n in names], 0.4, color=colors, alpha=0.5, hatch="//")
    a1.set(title="Sequences in a step", ylabel="sequences", xlabel="KV cache")
    a1.legend(handles=[Patch(facecolor="#777777", label="largest batch"),
                       Patch(facecolor="#bbbbbb", hatch="//", label="mean batch (tokens / steps)")], fontsize=8)
    a2.bar(x, [rows[n]["tokens_per_s"] for n in names], color=colors)
    a2.set(title="Throughput", ylabel="output tokens / s", xlabel="KV cache")
    for a in (a1, a2):
        a.set_xticks(x, names)
    fig.suptitle(title or "The same KV memory: contiguous reservations against a paged pool", fontsize=12)
    fig.tight_layout()
    return fig


def plot_step_vs_batch(batch_sizes, step_seconds, *, title: str | None = None, ax=None):
    """Median decode-step time (ms) against the number of sequences in the step, and tokens/s on a
    second axis: flat step times mean batching is almost free."""
    batch_sizes, step_seconds = list(batch_sizes), list(step_seconds)
    if not batch_sizes or len(batch_sizes) != len(step_seconds) or min(step_seconds) <= 0:
        raise ValueError("give one positive step time per batch size (at least one of each)")
    fig, ax = get_axes(ax, figsize=(6.5, 3.8))
    ms = [1e3 * s for s in step_seconds]
    ax.plot(batch_sizes, ms, "o-", color="#1f77b4", label="step time")
    ax.set(xlabel="sequences decoding in the step", ylabel="median step time (ms)", xscale="log")
    ax.set_xticks(batch_sizes, [str(b) for b in batch_sizes])
    ax.set_ylim(0, 1.15 * max(ms))
    ax2 = ax.twinx()
    ax2.plot(batch_sizes, [b / s for b, s in zip(batch_sizes, step_seconds)], "s--", color="#2ca02c",
             label="tokens / s")
    ax2.set_ylabel("output tokens / s")
    ax.set_title(title or "The cost of a decode step against the batch size", fontsize=11)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], fontsize=8, loc="upper left")
    ax.grid(alpha=0.3)
    return ax
