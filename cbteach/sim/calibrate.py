"""Calibrate the cost model on the machine at hand: a sweep of the real engine that covers the workload.

A fit only transfers to runs measured under the same conditions: another day, another load on a
shared machine, another number of threads, and the same code runs 1.5x faster or slower. So the
device ``"cpu"`` is not shipped as a constant but **measured where it is used**:
``python -m cbteach simulate calibrate`` runs the real engine (bierce, paged KV) over a grid of small
workloads, each several times round-robin, keeps each step's median over the repeats (the machine's
typical speed, as the runs it will predict see it), and fits :func:`cbteach.sim.validate.fit_cpu`'s
terms on them. The result is a **device file** (JSON: the :class:`Device`'s fields, plus how, where
and when it was measured) that ``simulate validate --device FILE`` and every ``CostModel`` take.

**The grid covers the workload.** A fit interpolates between the steps it measured and extrapolates
beyond them, badly: a grid that stops at 24 sequences and 1,920 tokens per step, all of one length,
under-predicts 6,000-token prefills and guesses at batches of 64. So the grid is built from the
workload's :class:`WorkloadShape` -- its largest batch, its largest step, its longest context, its
prompt and output lengths -- by :func:`covering_grid`: decode steps from one sequence to the largest
batch at short and long contexts, prefill steps up to the largest step (a few long prompts, and many
short ones), chunked steps under a token budget, all with mixed lengths, since the engine pads each
attention group to its longest member (:mod:`cbteach.sim.attention_work`). ``--shape-of RUNS.json``
reads the shape from measured runs (their plans and lengths, never their timings); the fitted device
keeps its range (:mod:`cbteach.sim.coverage`), and every prediction counts its steps beyond it.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..core.modelinfo import max_positions
from .coverage import step_size
from .devices import Device, load_device  # noqa: F401  (load_device: re-exported)
from .measure import machine_info
from .simulator import synthetic_workload


@dataclass(frozen=True)
class WorkloadShape:
    """What a calibration must cover: the most sequences in a step, the most tokens fed in one step,
    the longest context, the prompt and output lengths (lowest, highest) and the token budget."""

    max_batch: int = 16
    max_tokens: int = 960
    max_context: int = 640
    prompt_lens: tuple = (4, 600)
    output_lens: tuple = (8, 96)
    token_budget: int | None = None

    def __post_init__(self):
        for name in ("max_batch", "max_tokens", "max_context"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"the workload's {name} must be a whole number >= 1, got {v!r}")
        for name in ("prompt_lens", "output_lens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"the workload's {name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)!r}")
        if self.max_context < self.prompt_lens[1]:
            raise ValueError(f"the workload's max_context ({self.max_context}) is shorter than its longest prompt "
                             f"({self.prompt_lens[1]}): give a longer max_context or shorter prompts")


def shape_of(data: dict) -> WorkloadShape:
    """The shape of measured runs (``simulate validate``'s format): from their steps' plans and their
    requests' lengths, never from their timings."""
    runs = data["runs"] if isinstance(data, dict) else data
    sizes = [step_size(s["c"], s["n"]) for r in runs for s in r["steps"]]
    if not sizes:
        raise ValueError("the runs have no steps to take a shape from")
    prompts, outputs, budgets = [], [], []
    for r in runs:
        spec, eng = r.get("spec", {}), r.get("engine", {})
        prompts += [q["prompt_len"] for q in r["requests"] if "prompt_len" in q] or list(spec.get("prompt_lens", ()))
        outputs += [q["n"] for q in r["requests"]]
        budget = spec.get("token_budget", eng.get("token_budget"))
        budgets += [budget] if budget else []
    return WorkloadShape(max_batch=max(s["seqs"] for s in sizes), max_tokens=max(s["tokens"] for s in sizes),
                         max_context=max(s["context"] for s in sizes), prompt_lens=(min(prompts), max(prompts)),
                         output_lens=(min(outputs), max(outputs)), token_budget=max(budgets) if budgets else None)


def covering_grid(shape: WorkloadShape) -> list[tuple]:
    """Grid points ``(batch, (prompt lo, hi), (output lo, hi), token budget, spread)`` whose steps span
    ``shape``: each point is a batch of requests arriving at once with lengths drawn in the ranges."""
    B, P, C = shape.max_batch, shape.max_tokens, shape.max_context
    plo, phi = shape.prompt_lens
    budget = shape.token_budget or max(64, min(512, P // 4))
    short = (plo, max(plo, min(phi, 96)))
    long_batch = max(1, min(B, 32768 // C))  # long contexts, at most ~32k prompt tokens to prefill
    long_prompts = (max(plo, C // 2), max(plo, C // 2, C - 40))
    few = max(1, min(B, round(P / (0.75 * phi))))  # a few long prompts filling the largest step
    many = (plo, max(plo, min(phi, 2 * P // B)))  # the largest batch of prompts filling it
    grid = [(1, (16, 16), (12, 12), None, "uniform"),  # one sequence: the step's fixed cost
            (B, short, (8, 64), None, "uniform"),  # decodes at short contexts, batch shrinking from B to 1
            (long_batch, long_prompts, (8, 40), P if long_batch * C > P else None, "uniform"),  # long contexts
            (few, (max(plo, phi // 2), phi), (2, 4), None, "uniform"),  # prefills of a few long prompts
            (max(1, few // 2), (max(plo, phi // 4), max(plo, phi // 2)), (2, 4), None, "uniform"),
            (B, many, (2, 6), None, "uniform"),  # prefill of the whole batch at once
            (B, (plo, phi), (8, 48), budget, "loguniform")]  # chunked prefills mixed with decodes
    return [g for i, g in enumerate(grid) if g not in grid[:i]]


GRID = covering_grid(WorkloadShape())  # the default: the shape of cbteach.sim.measure.RUNS


def _point(p) -> tuple:
    """A grid point with every length a range (``(batch, prompt, output, budget)`` with single lengths too)."""
    batch, prompt, output, budget, *spread = p
    as_range = lambda x: (int(x), int(x)) if np.isscalar(x) else (int(x[0]), int(x[1]))  # noqa: E731
    return int(batch), as_range(prompt), as_range(output), budget, spread[0] if spread else "uniform"


def _measure_grid_point(model, point, clock: str, vocab: int, seed: int) -> list[dict]:
    from ..core.request import Request
    from ..engine.engine import Engine
    from .measure import ProcessClock

    batch, prompts, outputs, budget, spread = _point(point)
    work = synthetic_workload(batch, None, prompts, outputs, seed=seed, spread=spread)
    rng = np.random.default_rng(seed)
    tokens = sum(r.prompt_len + r.output_len for r in work)
    opts = dict(max_batch_size=batch, kv="paged", block_size=16, num_blocks=max(64, tokens // 16 + batch + 8),
                token_budget=budget)
    eng = Engine(model, None, clock=ProcessClock() if clock == "process" else None, **opts)
    reqs = [Request(rng.integers(1, vocab, r.prompt_len).tolist(), r.output_len, request_id=r.request_id,
                    ignore_eos=True) for r in work]
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
        b, p, o, budget, spread = _point(point)
        runs.append({"name": f"grid b{b} p{p[0]}-{p[1]} o{o[0]}-{o[1]} budget{budget} {spread}", "steps": steps,
                     "block_size": 16})
    return runs


def _check_positions(grid, shape: WorkloadShape, positions: int | None) -> None:
    """A grid point whose longest prompt and output do not fit the model's positions is refused, naming the
    shape's fields (and ``simulate calibrate``'s options) that set it."""
    longest = max(_point(p)[1][1] + _point(p)[2][1] for p in grid)
    if positions is not None and longest > positions:
        raise ValueError(f"the calibration's longest sequence would be {longest} tokens (from the workload's "
                         f"max_context {shape.max_context}, prompts up to {shape.prompt_lens[1]}, outputs up to "
                         f"{shape.output_lens[1]}), more than the model's {positions} positions: give a smaller "
                         "--max-context, --prompt or --output")


def calibrate(model=None, grid=None, repeats: int = 3, clock: str = "wall", threads: int | None = 1,
              shape: WorkloadShape | None = None) -> dict:
    """Measure a grid on this machine and fit the device: ``{"device": Device, "calibration": {...}}``
    (how it was measured: machine, torch, threads, clock, load, the shape and grid, the fit's own step
    error). The grid is ``grid`` if given, else :func:`covering_grid` of ``shape`` (default: the
    shape of the project's validation runs)."""
    import torch

    from .cost import CostModel
    from .validate import fit_cpu

    if threads is not None:
        torch.set_num_threads(threads)
    if model is None:
        from ..models import load_model

        model, _ = load_model("bierce", device="cpu")
    shape = shape or WorkloadShape()
    grid = grid if grid is not None else covering_grid(shape)
    _check_positions(grid, shape, max_positions(model.config))  # (before minutes of measuring)
    info = machine_info(clock)
    start = time.perf_counter()
    runs = measure_grid(model, grid, repeats, clock)
    device = fit_cpu(runs)
    cost = CostModel("bierce", device)
    steps = [s for r in runs for s in r["steps"]]
    err = float(np.mean([abs(cost.step_time(s["c"], s["n"]) - s["t"]) / s["t"] for s in steps]))
    info.update({"grid": [list(_point(p)) for p in grid], "shape": asdict(shape), "repeats": repeats,
                 "steps": len(steps), "fit_step_error": err, "seconds": time.perf_counter() - start,
                 "load_after": os.getloadavg()[0]})
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
