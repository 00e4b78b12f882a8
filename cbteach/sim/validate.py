"""Validated before it is believed: fit the cost model on some measured runs, predict the others.

A simulator is only as good as its step times. So, as Vidur does against real GPUs, we measure:
the real engine runs bierce on this machine over several workloads (:data:`RUNS`: batch sizes,
prompt and output lengths, arrival rates, token budgets, one pool small enough to preempt), and
every step's plan and duration is kept (:func:`measure_all`), timed in the process's CPU seconds so
that other programs on a shared machine do not count, each run repeated and its fastest repeat kept.
The device ``"cpu"`` is then *fitted* -- per-step and per-sequence overhead, effective FLOP/s of the
layers and of attention, effective bytes/s of reading K/V (:mod:`cbteach.sim.cost`; on this CPU the
reads and the arithmetic add up instead of overlapping) -- on the **training** runs only
(:func:`fit_cpu`), and asked to predict the **held-out** runs (:func:`validation_report`):

* each held-out step's duration from its plan (mean absolute percentage error),
* and, replaying the held-out workload through the simulator (the engine's scheduler, simulated
  time), every request's TTFT and TPOT (relative error of their means) and the run's length.

The goal is Vidur's: within 10%. The measured runs ship with the package
(``cbteach/sim/data/bierce_cpu_runs.json``, from ``benchmarks/sim/measure_cpu.py``); re-measure on
your own machine with :func:`measure_all`.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from .cost import CostModel
from .devices import Device
from .simulator import SimRequest, simulate, synthetic_workload

DATA = Path(__file__).resolve().parent / "data" / "bierce_cpu_runs.json"


@dataclass(frozen=True)
class RunSpec:
    """One measured workload: requests, lengths, arrivals and the engine's settings."""

    name: str
    num_requests: int
    prompt_lens: tuple
    output_lens: tuple
    rate: float | None  # requests per second (Poisson), None: all at once
    max_batch_size: int
    token_budget: int | None = None
    block_size: int = 16
    num_blocks: int = 512
    seed: int = 0
    train: bool = True  # fitted on (True) or held out (False)


RUNS = [  # training and held-out runs alternate, so a drift of the machine's speed during the measurement
    # (warming up, another program starting) does not land on one side only
    RunSpec("batch4-mixed", 16, (16, 160), (8, 64), None, 4, seed=1),
    RunSpec("batch6-budget64", 16, (32, 256), (8, 48), None, 6, token_budget=64, seed=5, train=False),
    RunSpec("batch12-short-prompts", 24, (4, 32), (32, 96), None, 12, seed=2),
    RunSpec("batch16-mixed", 32, (8, 96), (16, 80), None, 16, seed=6, train=False),
    RunSpec("batch8-long-prompts-chunked", 12, (200, 600), (8, 32), None, 8, token_budget=128, seed=3),
    RunSpec("poisson-tight-pool", 24, (32, 160), (24, 72), 16.0, 8, num_blocks=28, seed=7, train=False),
    RunSpec("poisson-batch8", 24, (16, 128), (16, 64), 12.0, 8, seed=4),
]


def workload_of(spec: RunSpec):
    return synthetic_workload(spec.num_requests, spec.rate, spec.prompt_lens, spec.output_lens, seed=spec.seed)


class ProcessClock:
    """The engine's clock in this process's CPU seconds (``time.process_time``): a step costs what the
    machine spent on it, not the wall time other programs on a shared machine stole from it. Waiting
    for an arrival moves the clock without spending anything (:class:`~cbteach.core.clock.VirtualClock`'s
    ``advance``); a step moves it by itself, so ``advance_step`` adds nothing."""

    def __init__(self):
        self.offset = -time.process_time()

    def __call__(self) -> float:
        return time.process_time() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += max(0.0, seconds)

    def advance_step(self, plan, measured: float) -> None:
        pass


def measure(spec: RunSpec, model, vocab_size: int | None = None, repeats: int = 3, clock: str = "wall") -> dict:
    """Run ``spec`` on the real engine ``repeats`` times, timed in CPU seconds (:class:`ProcessClock`),
    and keep the fastest run's every step (plan and duration) and every request's TTFT and TPOT.
    Other work on a shared machine still slows a run down a little (caches, memory bandwidth), so the
    fastest is the closest to the machine's own speed."""
    runs = [_measure_once(spec, model, vocab_size, clock) for _ in range(repeats)]
    return min(runs, key=lambda r: r["duration"])


def _measure_once(spec: RunSpec, model, vocab_size: int | None, clock: str = "wall") -> dict:
    from ..core.request import Request
    from ..engine.engine import Engine

    vocab = vocab_size or model.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(spec.seed + 1000)
    opts = dict(max_batch_size=spec.max_batch_size, kv="paged", block_size=spec.block_size,
                num_blocks=spec.num_blocks, token_budget=spec.token_budget)
    Engine(model, None, **opts).run([Request([1, 2, 3], 4, ignore_eos=True)])  # warm up this process
    eng = Engine(model, None, clock=ProcessClock() if clock == "process" else None, **opts)
    reqs = [Request(rng.integers(1, vocab, r.prompt_len).tolist(), r.output_len, request_id=r.request_id,
                    arrival_time=r.arrival_time if spec.rate else None, ignore_eos=True) for r in workload_of(spec)]
    comps = eng.run(reqs)
    steps = [{"c": rec.num_computed_tokens, "n": rec.num_scheduled_tokens, "t": rec.duration}
             for rec in eng.records if rec.seqs]
    requests = [{"ttft": c.first_token_time - c.arrival_time,
                 "tpot": (c.token_times[-1] - c.token_times[0]) / (len(c.token_times) - 1)
                 if len(c.token_times) > 1 else None, "n": len(c.output_ids)} for c in comps]
    return {"spec": asdict(spec), "steps": steps, "requests": requests,
            "duration": eng.records[-1].start_time + eng.records[-1].duration - eng.records[0].start_time}


def measure_all(model, runs=RUNS, repeats: int = 10, clock: str = "wall") -> dict:
    """Every run of ``runs``, measured ``repeats`` times round-robin (so a slow spell of the machine hits
    all runs alike), keeping each run's fastest repeat."""
    import os
    import platform

    import torch

    rounds = [[_measure_once(spec, model, None, clock) for spec in runs] for _ in range(repeats)]
    best = [min((r[i] for r in rounds), key=lambda m: m["duration"]) for i in range(len(runs))]
    return {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                        "torch": torch.__version__,
                        "clock": "process CPU seconds" if clock == "process" else "wall"},
            "model": "bierce", "runs": best}


def load(path=DATA) -> dict:
    return json.loads(Path(path).read_text())


def _spec(run: dict) -> RunSpec:
    d = dict(run["spec"])
    d["prompt_lens"], d["output_lens"] = tuple(d["prompt_lens"]), tuple(d["output_lens"])
    return RunSpec(**d)


# -- fitting ---------------------------------------------------------------------------------------
def fit_cpu(runs: list[dict], model="bierce") -> Device:
    """The device ``"cpu"``: the step overhead, per-sequence overhead, effective FLOP/s of the dense
    layers and of attention, and effective bytes/s of reading K/V, that best predict the
    measured step durations of ``runs`` (least absolute relative error). On this CPU reading and
    computing do not overlap (the engine gathers K/V blocks, then attends), so the fitted device adds
    the two times (``overlap=False``) and the fit is linear in the five numbers."""
    unit = CostModel(model, Device("unit", 1e30, 1.0, 1.0, 1.0, mfu=1.0, mbu=1.0, step_overhead=0.0,
                                   seq_overhead=0.0, dtype_bytes=4))
    weights = unit.weight_bytes_per_device
    rows, t = [], []
    for run in runs:
        for step in run["steps"]:
            cost = unit.step(step["c"], step["n"])
            rows.append((1.0, len(step["n"]), cost.flops - cost.attn_flops, cost.attn_flops, cost.bytes - weights))
            t.append(step["t"])
    x, t = np.array(rows), np.array(t)
    overhead, per_seq, per_flop, per_attn_flop, per_kv_byte = _robust_fit(x / t[:, None])
    # Reading the weights costs the same every step: it is part of the fitted step overhead (mem_bandwidth
    # is set so high that the cost model adds nothing more for it); K/V reads have their own bandwidth.
    return Device("cpu", memory_bytes=8e9, mem_bandwidth=1e18, kv_bandwidth=1.0 / per_kv_byte, peak_flops=1.0 / per_flop,
                  link_bandwidth=5e9, link_latency=50e-6, mfu=1.0, mbu=1.0, step_overhead=float(overhead),
                  seq_overhead=float(per_seq), attn_flops=1.0 / per_attn_flop, overlap=False, dtype_bytes=4,
                  source=f"fitted on {sum(len(r['steps']) for r in runs)} measured steps of bierce "
                         f"({', '.join(_name(r) for r in runs)}); its step overhead includes reading the weights")


def _name(run: dict) -> str:
    return run.get("spec", {}).get("name") or run.get("name") or "run"


def _robust_fit(x: np.ndarray, rounds: int = 30) -> np.ndarray:
    """Coefficients ``c >= 0`` with ``x @ c`` close to 1 in the least-absolute-deviation sense
    (iteratively reweighted least squares): a step slowed down by other work on the machine is an
    outlier, and an absolute-error fit lets a few of them pull far less than a squared-error fit."""
    w = np.ones(len(x))
    coef = np.zeros(x.shape[1])
    for _ in range(rounds):
        sw = np.sqrt(w)[:, None]
        coef = np.clip(np.linalg.lstsq(x * sw, sw[:, 0], rcond=None)[0], 1e-15, None)
        w = 1.0 / np.maximum(np.abs(x @ coef - 1.0), 1e-3)
    return coef


# -- predicting --------------------------------------------------------------------------------------
def _rel(pred: float, true: float) -> float:
    return abs(pred - true) / true if true else math.nan


def record_run(engine, completions, name: str = "run", **settings) -> dict:
    """A run measured by any :class:`~cbteach.Engine` (records on, ``keep_records=True``) as
    ``simulate validate`` reads it: its steps (plan and duration), every request's arrival, lengths
    and latencies, and the engine settings the simulator replays it with (``max_batch_size``,
    ``token_budget``, ``block_size``, ``num_blocks``: read from ``engine.config`` unless given)."""
    sched = getattr(getattr(engine, "config", None), "scheduler", None)
    kv = getattr(engine, "kv_cache", None) or getattr(getattr(engine, "runner", None), "kv_cache", None)
    defaults = {"max_batch_size": getattr(sched, "max_batch_size", None), "token_budget": getattr(sched, "token_budget", None),
                "block_size": getattr(kv, "block_size", 16), "num_blocks": getattr(kv, "num_blocks", None)}
    eng = {**defaults, **settings}
    if eng["max_batch_size"] is None or eng["num_blocks"] is None:
        raise ValueError("record_run needs the engine's max_batch_size and num_blocks: pass them")
    steps = [{"c": [s.num_computed_tokens for s in r.seqs], "n": [s.num_scheduled_tokens for s in r.seqs],
              "t": r.duration} for r in engine.records if r.seqs]
    requests = []
    for c in completions:
        tt = c.token_times
        requests.append({"arrival_time": c.arrival_time, "prompt_len": len(c.prompt_ids), "n": len(c.output_ids),
                         "ttft": c.first_token_time - c.arrival_time,
                         "tpot": (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None,
                         "e2e": tt[-1] - c.arrival_time})
    spans = [r for r in engine.records if r.seqs]
    return {"name": name, "engine": eng, "steps": steps, "requests": requests,
            "duration": spans[-1].start_time + spans[-1].duration - spans[0].start_time}


def _workload_and_settings(run: dict):
    """A run's workload and engine settings: from its ``spec`` (benchmarks/sim/measure_cpu.py) or its
    ``engine`` and ``requests`` (:func:`record_run`)."""
    if "spec" in run:
        spec = _spec(run)
        return workload_of(spec), {"max_batch_size": spec.max_batch_size, "num_blocks": spec.num_blocks,
                                   "block_size": spec.block_size, "token_budget": spec.token_budget}, spec.name
    eng, reqs = run["engine"], run["requests"]
    t0 = min(r["arrival_time"] for r in reqs)
    work = [SimRequest(i, r["arrival_time"] - t0, r["prompt_len"], r["n"]) for i, r in enumerate(reqs)]
    return work, {k: eng[k] for k in ("max_batch_size", "num_blocks", "block_size", "token_budget")}, _name(run)


def predict_run(run: dict, device: Device, model="bierce") -> dict:
    """A measured run predicted: each step from its plan, and the whole workload replayed through the
    simulator (the engine's scheduler); the relative error of the mean TTFT, TPOT and E2E latency
    and of the throughput (output tokens over the run's length)."""
    cost = CostModel(model, device)
    measured = np.array([s["t"] for s in run["steps"]])
    predicted = np.array([cost.step_time(s["c"], s["n"]) for s in run["steps"]])
    work, settings, name = _workload_and_settings(run)
    sim = simulate(work, cost, **settings)
    reqs = run["requests"]
    ttft = float(np.mean([r["ttft"] for r in reqs]))
    tpot = float(np.mean([r["tpot"] for r in reqs if r["tpot"] is not None]))
    e2e = float(np.mean([r["e2e"] if r.get("e2e") is not None else r["ttft"] + (r["tpot"] or 0.0) * (r["n"] - 1)
                         for r in reqs]))
    thr = sum(r["n"] for r in reqs) / run["duration"]
    out = {"run": name, "steps": len(measured), "simulated_steps": len(sim.step_times),
           "step_mape": float(np.mean(np.abs(predicted - measured) / measured)),
           "duration_measured": float(run["duration"]), "duration_simulated": sim.makespan,
           "duration_error": _rel(sim.makespan, run["duration"])}
    for metric, true, pred in (("ttft", ttft, float(np.mean(sim.ttft))), ("tpot", tpot, float(np.nanmean(sim.tpot))),
                               ("e2e", e2e, float(np.mean(sim.e2e))), ("throughput", thr, sim.throughput)):
        out.update({f"{metric}_measured": true, f"{metric}_simulated": pred, f"{metric}_error": _rel(pred, true)})
    return out


METRICS = ("step_mape", "duration_error", "ttft_error", "tpot_error", "e2e_error", "throughput_error")


def validation_report(data: dict | None = None, device: Device | None = None) -> dict:
    """Predict measured runs and report the errors, per run, their mean (``mae``) and worst.

    Without ``device``: fit on the training runs of ``data`` (default: the shipped measurements) and
    predict the held-out ones (a same-occasion check). With ``device`` (a calibrated device, e.g.
    from ``simulate calibrate``): predict every run of ``data`` -- runs the fit never saw, typically
    measured on another occasion."""
    data = load() if data is None else data
    runs = data["runs"]
    if device is None:
        train = [r for r in runs if r.get("spec", {}).get("train", False)]
        test = [r for r in runs if not r.get("spec", {}).get("train", False)]
        if not train or not test:
            raise ValueError("validation needs at least one training run and one held-out run (or a calibrated "
                             "device: --device FILE from `simulate calibrate`)")
        device = fit_cpu(train)
        train_names = [_name(r) for r in train]
    else:
        test, train_names = runs, []
    per_run = [predict_run(r, device) for r in test]
    worst = {k: max(p[k] for p in per_run) for k in METRICS}
    mae = {k: float(np.mean([p[k] for p in per_run])) for k in METRICS}
    return {"device": device, "train": train_names, "held_out": per_run, "worst": worst, "mae": mae,
            "machine": data.get("machine", {})}
