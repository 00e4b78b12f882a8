"""The GPU device entries against published runs: what each predicts, and the ratio.

A device entry is datasheet peaks times assumed efficiencies (:mod:`cbteach.sim.devices`); nothing
about it is believable until it predicts runs somebody measured. ``data/published_runs.json`` holds
published measurements copied from their sources (TensorRT-LLM's performance tables, vLLM's CI
benchmarks), each with its model, device, tensor-parallel size, batch and lengths, metric and value.
:func:`compare` replays each as the engine's scheduler would run it -- a static batch of ``batch``
requests arriving at once, no chunking, on the cost model -- and reports ``predicted / published``
(a ratio above 1: the simulator is too optimistic for throughput, too pessimistic for a latency).
``benchmarks/sim/published.py`` writes the table; notebook 13 prints the ratios.
"""
from __future__ import annotations

import json
from pathlib import Path

from .cost import CostModel
from .devices import get_device
from .simulator import SimRequest, simulate

DATA = Path(__file__).resolve().parent / "data" / "published_runs.json"


def load() -> dict:
    return json.loads(DATA.read_text())


def predict(row: dict, device=None) -> float:
    """The simulator's value of ``row``'s metric: ``throughput`` (output tokens/s of the batch),
    ``ttft`` or ``e2e`` (seconds; the batch's mean)."""
    cost = CostModel(row["model"], get_device(device or row["device"]), row["tp"])
    b = row["batch"]
    work = [SimRequest(i, 0.0, row["input"], row["output"]) for i in range(b)]
    blocks = cost.kv_capacity_tokens(max_num_batched_tokens=b * row["input"], max_num_seqs=b) // 16
    run = simulate(work, cost, max_batch_size=b, num_blocks=blocks, block_size=16, token_budget=None)
    if row["metric"] == "throughput":
        return run.throughput
    return sum(getattr(run, row["metric"])) / b


def compare(data: dict | None = None, devices: dict | None = None) -> list[dict]:
    """Every published row with the simulator's prediction and their ratio; ``devices`` maps a device
    name to another :class:`~cbteach.sim.devices.Device` (an assumption changed)."""
    data = load() if data is None else data
    out = []
    for row in data["rows"]:
        pred = predict(row, (devices or {}).get(row["device"]))
        out.append({**row, "predicted": pred, "ratio": pred / row["published"]})
    return out
