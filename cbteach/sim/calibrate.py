"""Calibrate the cost model on the machine at hand: a short sweep of the real engine, fitted.

A fit only transfers to runs measured under the same conditions: another day, another load on a
shared machine, another number of threads, and the same code runs 1.5x faster or slower. So the
device ``"cpu"`` is not shipped as a constant but **measured where it is used**:
``python -m cbteach simulate calibrate`` runs the real engine (bierce, paged KV) over a small grid
of steps -- batch sizes, tokens fed per sequence (whole prompts, chunks, single decode tokens) and
contexts (:data:`GRID`) -- each workload several times round-robin, keeps each step's median
over the repeats (the machine's typical speed, as the runs it will predict see it: the fastest repeat
would be an idle machine's), and fits :func:`cbteach.sim.validate.fit_cpu`'s terms (step overhead, per-sequence
overhead, FLOP/s of the dense layers, FLOP/s of prefill attention, bytes/s of the K/V decode
attention reads) on them. The result is a **device file** (JSON: the :class:`Device`'s fields,
plus how it was measured) that ``simulate validate --device FILE`` and every ``CostModel`` take.

It takes a few seconds on a laptop CPU; its error on runs of another occasion is what
``simulate validate`` reports (notebook 13 shows a same-day and an other-day error).
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from .devices import Device, load_device  # noqa: F401  (load_device: re-exported)

# (batch, prompt tokens, output tokens, token budget): every request arrives at once, with exactly these
# lengths, so the steps fall on a grid -- prefills of 1..12 x 16..512 tokens, chunks of a long prompt,
# decode steps of 1..24 sequences at contexts from 16 to 520 tokens.
GRID = [(1, 16, 12, None), (1, 256, 8, None), (4, 64, 12, None), (4, 384, 6, 128), (12, 32, 16, None),
        (12, 160, 8, None), (24, 24, 16, None), (6, 512, 6, 512)]


def _measure_grid_point(model, point, clock: str, vocab: int, seed: int) -> list[dict]:
    from ..core.request import Request
    from ..engine.engine import Engine
    from .validate import ProcessClock

    batch, prompt, output, budget = point
    rng = np.random.default_rng(seed)
    opts = dict(max_batch_size=batch, kv="paged", block_size=16, num_blocks=max(64, batch * (prompt + output) // 16 + 8),
                token_budget=budget)
    eng = Engine(model, None, clock=ProcessClock() if clock == "process" else None, **opts)
    reqs = [Request(rng.integers(1, vocab, prompt).tolist(), output, request_id=i, ignore_eos=True)
            for i in range(batch)]
    eng.run(reqs)
    return [{"c": [s.num_computed_tokens for s in r.seqs], "n": [s.num_scheduled_tokens for s in r.seqs],
             "t": r.duration} for r in eng.records if r.seqs]


def measure_grid(model, grid=GRID, repeats: int = 3, clock: str = "wall") -> list[dict]:
    """Each grid point's steps, measured ``repeats`` times round-robin; each step's median kept (every
    repeat runs the same schedule, so step ``i`` is the same plan in each)."""
    if clock not in ("wall", "process"):
        raise ValueError(f"clock must be 'wall' or 'process', got {clock!r}")
    from ..core.request import Request
    from ..engine.engine import Engine

    vocab = model.get_input_embeddings().num_embeddings
    Engine(model, None, max_batch_size=2, kv="paged").run([Request([1, 2, 3], 4, ignore_eos=True)])  # warm up
    rounds = [[_measure_grid_point(model, p, clock, vocab, seed=k) for k, p in enumerate(grid)] for _ in range(repeats)]
    runs = []
    for k, point in enumerate(grid):
        steps = [dict(step, t=float(np.median([r[k][i]["t"] for r in rounds]))) for i, step in enumerate(rounds[0][k])]
        runs.append({"name": "grid b{} p{} o{} budget{}".format(*point), "steps": steps})
    return runs


def calibrate(model=None, grid=GRID, repeats: int = 3, clock: str = "wall", threads: int | None = 1) -> dict:
    """Measure ``grid`` on this machine and fit the device: ``{"device": Device, "calibration": {...}}``
    (how it was measured: machine, threads, clock, grid, steps, the fit's own step error)."""
    import torch

    from .cost import CostModel
    from .validate import fit_cpu

    if threads is not None:
        torch.set_num_threads(threads)
    if model is None:
        from ..models import load_model

        model, _ = load_model("bierce", device="cpu")
    start = time.perf_counter()
    runs = measure_grid(model, grid, repeats, clock)
    device = fit_cpu(runs)
    cost = CostModel("bierce", device)
    steps = [s for r in runs for s in r["steps"]]
    err = float(np.mean([abs(cost.step_time(s["c"], s["n"]) - s["t"]) / s["t"] for s in steps]))
    info = {"machine": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "clock": clock, "grid": [list(p) for p in grid], "repeats": repeats,
            "steps": len(steps), "fit_step_error": err, "seconds": time.perf_counter() - start,
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_before": os.getloadavg()}
    return {"device": device, "calibration": info}


def save_device(calibrated: dict, path) -> Path:
    """Write a device file: ``{"device": {Device's fields}, "calibration": {how it was measured}}``."""
    path = Path(path)
    path.write_text(json.dumps({"device": asdict(calibrated["device"]), "calibration": calibrated.get("calibration", {})},
                               indent=1, default=str))
    return path


def load_calibration(path) -> dict:
    """How a device file's device was measured (its ``"calibration"`` part; empty if none)."""
    return json.loads(Path(path).read_text()).get("calibration", {})
