"""Validated before it is believed: fit the cost model on some measured runs, predict the others.

A simulator is only as good as its step times. So, as Vidur does against real GPUs, we measure:
the real engine runs bierce on this machine over several workloads (:data:`RUNS`: batch sizes,
prompt and output lengths, arrival rates, token budgets, one pool small enough to preempt), and
every step's plan and duration is kept (:func:`measure_all`), timed in the process's CPU seconds so
that other programs on a shared machine do not count, each run repeated and its fastest repeat kept.
The device ``"cpu"`` is then *fitted* -- per-step, per-sequence and per-attention-group overhead,
effective FLOP/s of the layers and of attention, effective bytes/s of reading K/V, attention charged for
the padded groups the engine computes (:mod:`cbteach.sim.cost`, :mod:`cbteach.sim.attention_work`; on
this CPU the reads and the arithmetic add up instead of overlapping) -- on the **training** runs only
(:func:`fit_cpu`), and asked to predict the **held-out** runs (:func:`validation_report`):

* each held-out step's duration from its plan (mean absolute percentage error),
* and, replaying the held-out workload through the simulator (the engine's scheduler, simulated
  time), every request's TTFT and TPOT (relative error of their means) and the run's length.

The goal is Vidur's: within 10%. The measured runs ship with the package
(``cbteach/sim/data/bierce_cpu_runs.json``, from ``benchmarks/sim/measure_cpu.py``); re-measure on
your own machine with :func:`cbteach.sim.measure.measure_all`. With a calibrated device
(:mod:`cbteach.sim.calibrate`) every run is predicted, and each run's steps beyond the device's
calibrated range are counted (:mod:`cbteach.sim.coverage`).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .cost import CostModel
from .coverage import range_of
from .devices import Device
from .measure import (HELD_OUT, RUNS, ProcessClock, RunSpec, machine_info, measure, measure_all,  # noqa: F401
                      record_run, workload_of)
from .simulator import SimRequest, simulate

DATA = Path(__file__).resolve().parent / "data" / "bierce_cpu_runs.json"


def load(path=DATA) -> dict:
    return json.loads(Path(path).read_text())


def _spec(run: dict) -> RunSpec:
    d = dict(run["spec"])
    d["prompt_lens"], d["output_lens"] = tuple(d["prompt_lens"]), tuple(d["output_lens"])
    return RunSpec(**d)


# -- fitting ---------------------------------------------------------------------------------------
def fit_cpu(runs: list[dict], model="bierce", layout: str = "groups", charge_scores: bool = True) -> Device:
    """The device ``"cpu"``: the step overhead, per-sequence and per-attention-group overheads,
    effective FLOP/s of the dense layers and of attention, and effective bytes/s of reading K/V and of
    the score tensors too large for the caches (when the runs have any), that
    best predict the measured step durations of ``runs`` (least absolute relative error). Attention
    is charged for what the engine computes and reads (``layout``: its padded groups,
    :mod:`cbteach.sim.attention_work`). On this CPU reading and computing do not overlap (the engine
    gathers K/V blocks, then attends), so the fitted device adds the two times (``overlap=False``) and
    the fit is linear in the seven numbers. The device keeps the range of the steps it was fitted on.
    ``charge_scores=False`` fits the cost model as it was before score tensors were charged (no
    ``score_bandwidth``: benchmarks/sim/spill_before_after.py compares the two)."""
    unit_device = Device("unit", 1e30, 1.0, 1.0, 1.0, mfu=1.0, mbu=1.0, step_overhead=0.0, seq_overhead=0.0,
                         dtype_bytes=4, attention_layout=layout)
    rows, t, steps = [], [], []
    for run in runs:
        unit = CostModel(model, unit_device, block_size=_block_size(run))
        weights = unit.weight_bytes_per_device
        for step in run["steps"]:
            cost = unit.step(step["c"], step["n"])
            rows.append((1.0, len(step["n"]), cost.flops - cost.attn_flops, cost.attn_flops, cost.bytes - weights,
                         cost.attn_groups, cost.score_bytes if charge_scores else 0.0))
            t.append(step["t"])
            steps.append(step)
    x, t = np.array(rows), np.array(t)
    overhead, per_seq, per_flop, per_attn_flop, per_kv_byte, per_group, per_score_byte = _robust_fit(x / t[:, None])
    # Reading the weights costs the same every step: it is part of the fitted step overhead (mem_bandwidth
    # is set so high that the cost model adds nothing more for it); K/V reads have their own bandwidth.
    return Device("cpu", memory_bytes=8e9, mem_bandwidth=1e18, kv_bandwidth=1.0 / per_kv_byte, peak_flops=1.0 / per_flop,
                  link_bandwidth=5e9, link_latency=50e-6, mfu=1.0, mbu=1.0, step_overhead=float(overhead),
                  seq_overhead=float(per_seq), attn_flops=1.0 / per_attn_flop, overlap=False, dtype_bytes=4,
                  attention_layout=layout, group_overhead=float(per_group), calibrated_range=range_of(steps),
                  score_bandwidth=1.0 / per_score_byte if x[:, 6].any() else 0.0,
                  source=f"fitted on {len(steps)} measured steps of bierce "
                         f"({', '.join(_name(r) for r in runs)}); its step overhead includes reading the weights")


def _block_size(run: dict) -> int:
    return int(run.get("spec", {}).get("block_size") or run.get("engine", {}).get("block_size") or
               run.get("block_size", 16))


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
    and of the throughput (output tokens over the run's length). ``ttft_per_step_error`` says how
    ill-conditioned the TTFT answer is: the relative change of the simulated mean TTFT per relative
    change of every step's time (about 1 for a run without a queue; near saturation 10 or more, so a
    step-time error of 2% -- this CPU's run-to-run noise -- moves TTFT by 20%). ``step_bias`` is the
    signed error of the steps' total time (+0.1: predicted 10% slower than measured)."""
    work, settings, name = _workload_and_settings(run)
    cost = CostModel(model, device, block_size=settings["block_size"])
    measured = np.array([s["t"] for s in run["steps"]])
    predicted = np.array([cost.step_time(s["c"], s["n"]) for s in run["steps"]])
    coverage = cost.coverage.report()  # the measured steps beyond the device's calibrated range
    sim = simulate(work, cost, **settings)
    reqs = run["requests"]
    ttft = float(np.mean([r["ttft"] for r in reqs]))
    tpot = float(np.mean([r["tpot"] for r in reqs if r["tpot"] is not None]))
    e2e = float(np.mean([r["e2e"] if r.get("e2e") is not None else r["ttft"] + (r["tpot"] or 0.0) * (r["n"] - 1)
                         for r in reqs]))
    thr = sum(r["n"] for r in reqs) / run["duration"]
    out = {"run": name, "steps": len(measured), "simulated_steps": len(sim.step_times),
           "step_mape": float(np.mean(np.abs(predicted - measured) / measured)),
           "step_bias": float(predicted.sum() / measured.sum() - 1.0),
           "duration_measured": float(run["duration"]), "duration_simulated": sim.makespan,
           "duration_error": _rel(sim.makespan, run["duration"]),
           "steps_outside_calibration": coverage.get("outside", 0)}
    for metric, true, pred in (("ttft", ttft, float(np.mean(sim.ttft))), ("tpot", tpot, float(np.nanmean(sim.tpot))),
                               ("e2e", e2e, float(np.mean(sim.e2e))), ("throughput", thr, sim.throughput)):
        out.update({f"{metric}_measured": true, f"{metric}_simulated": pred, f"{metric}_error": _rel(pred, true)})
    # How much the answer hangs on the step times: the same replay with every step SLOWER (2%) longer.
    # Near saturation a queue forms, and its wait grows many times faster than the steps' cost.
    slower = simulate(work, lambda plan: cost(plan) * (1 + SLOWER), **settings)
    out["ttft_per_step_error"] = _rel(float(np.mean(slower.ttft)), float(np.mean(sim.ttft))) / SLOWER
    return out


SLOWER = 0.02  # the step-time change predict_run's sensitivity is measured with
SENSITIVE = 5.0  # a run whose mean TTFT moves more than 5% per 1% of step time is called ill-conditioned
DRIFT = 0.08  # the runs' steps off by more than 8% (median of the runs' signed step errors)


def drift_warning(per_run: list[dict]) -> str | None:
    """A sentence when the runs' steps are off by more than :data:`DRIFT` one way (the median of the
    runs' ``step_bias``): the calibration does not describe these runs' steps, most often because the
    machine ran at another speed than during the sweep -- on the reference 2-core VM the same sweep,
    repeated minutes apart with no load to show for it, ran 0.67x-0.91x as long per grid point."""
    biases = [p["step_bias"] for p in per_run if "step_bias" in p]
    typical = float(np.median(biases)) if biases else 0.0
    if abs(typical) <= DRIFT:
        return None
    off = 1.0 / (1.0 + typical) - 1.0  # measured over predicted
    how = "more" if off > 0 else "less"
    same = sum((b > 0) == (typical > 0) for b in biases)
    return (f"the runs' steps took {abs(off):.0%} {how} time than the calibration predicts (median of {len(biases)} "
            f"runs, {same} of them the same way): the machine's speed differed from the sweep's (a fast or slow spell "
            "of a shared machine shows in no load figure) or the calibration does not describe these steps; every "
            "latency error above carries it -- calibrate again right beside the runs and compare the device files")


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
            "machine": _machine(data)}


def _machine(data: dict) -> dict:
    """Where measured runs ran: the file's ``machine`` (or its first run's), with the file's load if kept apart."""
    machine = dict(data.get("machine") or data["runs"][0].get("machine") or {})
    if "load_before" not in machine and data.get("load_before") is not None:
        machine["load_before"] = data["load_before"]
    return machine
