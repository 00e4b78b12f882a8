"""The roofline figure: where a model's prefill and decode steps sit against each device's roof.

A roofline plot (Williams, Waterman and Patterson, 2009) has arithmetic intensity (FLOPs per byte)
on the x axis and attainable FLOP/s on the y axis, both logarithmic. Each device is a roof: a
slanted part, ``bandwidth * intensity`` (memory cannot feed the arithmetic faster), meeting a flat
part, the peak FLOP/s, at the ridge point. A step is a point at its intensity *on* the roof of the
device it runs on: left of the ridge it is bandwidth-bound, right of it compute-bound.

The points come from :mod:`cbteach.perf.roofline`'s counts, so the picture is the arithmetic,
drawn; nothing here is timed.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ..perf.roofline import Device, ModelShape, decode_step, prefill_step

ROOF_COLORS = ("#7f7f7f", "#2ca02c", "#1f77b4", "#9467bd", "#8c564b")


def _roof(ax, device: Device, x, color):
    y = np.minimum(device.peak_flops, device.bandwidth * x)
    ax.plot(x, y, color=color, lw=1.6, label=f"{device.name}: ridge at {device.ridge:,.0f} FLOP/B")
    ax.plot([device.ridge], [device.peak_flops], "|", color=color, ms=12)


def _points(ax, costs, device: Device, marker, color, label, annotate=()):
    xs = np.array([c.intensity for c in costs])
    ys = np.minimum(device.peak_flops, device.bandwidth * xs)
    ax.plot(xs, ys, marker, color=color, ms=6, label=label, zorder=3)
    for text, x, y in zip(annotate, xs, ys):
        if text:
            ax.annotate(text, (x, y), textcoords="offset points", xytext=(-2, -13), fontsize=7, color=color)


def plot_roofline(devices, sweeps, batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), context: int = 512,
                  prompt_len: int = 512, ax=None, title: str | None = None):
    """Draw every device's roof, and for each ``(shape, device)`` in ``sweeps`` its decode steps at
    ``batches`` (``context`` tokens cached per sequence) and one prefill of ``prompt_len`` tokens,
    placed on that device's roof. Returns the axes."""
    devices = list(devices)
    sweeps = list(sweeps)
    if not devices or not all(isinstance(d, Device) for d in devices):
        raise ValueError("devices: give one or more cbteach.perf.Device")
    if not sweeps or not all(isinstance(s, ModelShape) and isinstance(d, Device) for s, d in sweeps):
        raise ValueError("sweeps: give (ModelShape, Device) pairs")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 5))
    lo = min(min(decode_step(s, 1, context).intensity for s, _ in sweeps), 0.1)
    hi = max(max(d.ridge for d in devices), max(prefill_step(s, prompt_len).intensity for s, _ in sweeps)) * 4
    x = np.logspace(np.log10(lo / 2), np.log10(hi), 200)
    for i, d in enumerate(devices):
        _roof(ax, d, x, ROOF_COLORS[i % len(ROOF_COLORS)])
    for j, (shape, device) in enumerate(sweeps):
        color = ("#d62728", "#ff7f0e", "#17becf")[j % 3]
        labels = [f"B={b}" if b in (batches[0], batches[-1]) or k % 2 == 0 else "" for k, b in enumerate(batches)]
        _points(ax, [decode_step(shape, b, context) for b in batches], device, "o", color,
                f"{shape.name}: decode, B = {batches[0]}...{batches[-1]}, {context} cached (on {device.name})",
                labels)
        _points(ax, [prefill_step(shape, prompt_len)], device, "*", color,
                f"{shape.name}: prefill of {prompt_len} tokens (on {device.name})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set(title=title or "Roofline: decode steps sit on the slope (bandwidth-bound), prefill on the flat roof",
           xlabel="arithmetic intensity (FLOPs per byte of weights and KV moved)",
           ylabel="attainable FLOP/s")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the plot: no point hidden
    ax.figure.tight_layout()
    return ax
