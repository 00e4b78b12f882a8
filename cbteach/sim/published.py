"""The GPU device entries against published runs: what each predicts, the ratio, and why a row is off.

A device entry is datasheet peaks times assumed efficiencies (:mod:`cbteach.sim.devices`); nothing
about it is believable until it predicts runs somebody measured. ``data/published_runs.json`` holds
published measurements copied from their sources, each with its model, device, tensor-parallel size
and workload, metric and value:

* ``rows`` -- static batches (TensorRT-LLM's performance tables, vLLM's CI latency tests): ``batch``
  requests arriving at once, replayed as the engine's scheduler would run them, no chunking;
* ``serving`` -- runs with **arrivals** (SGLang's and vLLM's online benchmark: Poisson arrivals at
  ``rate`` requests/s, medians of TTFT, TPOT and end-to-end latency), replayed with the workload the
  data file describes (``serving_workload``: ShareGPT's lengths are not published, so they are an
  assumption, stated there).

:func:`compare` and :func:`compare_serving` report ``predicted / published`` (above 1: too optimistic
for a throughput, too pessimistic for a latency), and :func:`cause` names, with numbers computed from
the cost model, why a row is off by more than 25%. ``benchmarks/sim/published.py`` writes the table;
notebook 13 prints the ratios.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from .cost import CostModel
from .devices import get_device
from .simulator import SimRequest, simulate, synthetic_workload

DATA = Path(__file__).resolve().parent / "data" / "published_runs.json"
OFF = 0.25  # a row is "off" when its ratio is outside 1 +- 25%


def load() -> dict:
    return json.loads(DATA.read_text())


def predict(row: dict, device=None) -> float:
    """The simulator's value of a static ``row``'s metric: ``throughput`` (output tokens/s of the
    batch), ``ttft`` or ``e2e`` (seconds; the batch's mean)."""
    cost = CostModel(row["model"], get_device(device or row["device"]), row["tp"])
    b = row["batch"]
    work = [SimRequest(i, 0.0, row["input"], row["output"]) for i in range(b)]
    blocks = cost.kv_capacity_tokens(max_num_batched_tokens=b * row["input"], max_num_seqs=b) // 16
    run = simulate(work, cost, max_batch_size=b, num_blocks=blocks, block_size=16, token_budget=None)
    if row["metric"] == "throughput":
        return run.throughput
    return sum(getattr(run, row["metric"])) / b


def compare(data: dict | None = None, devices: dict | None = None) -> list[dict]:
    """Every published static row with the simulator's prediction and their ratio; ``devices`` maps a
    device name to another :class:`~cbteach.sim.devices.Device` (an assumption changed)."""
    data = load() if data is None else data
    out = []
    for row in data["rows"]:
        pred = predict(row, (devices or {}).get(row["device"]))
        out.append({**row, "predicted": pred, "ratio": pred / row["published"]})
    return out


_SERVING: dict = {}  # (model, device, tp, rate, prompts, workload) -> the simulated run


def serving_run(row: dict, workload: dict, device=None):
    """The simulated run behind a serving row: ``num_prompts`` requests with Poisson arrivals at
    ``rate``, lengths as ``workload`` says, vLLM's memory budget for the K/V pool."""
    key = (row["model"], device or row["device"], row["tp"], row["rate"], row["num_prompts"],
           json.dumps(workload, sort_keys=True))
    if key not in _SERVING:
        cost = CostModel(row["model"], get_device(device or row["device"]), row["tp"])
        w = workload
        blocks = cost.kv_capacity_tokens(w["gpu_memory_utilization"], w["token_budget"], w["max_batch_size"]) // 16
        work = synthetic_workload(row["num_prompts"], row["rate"], tuple(w["prompt_lens"]), tuple(w["output_lens"]),
                                  seed=w["seed"], spread=w["spread"])
        _SERVING[key] = simulate(work, cost, max_batch_size=w["max_batch_size"], num_blocks=blocks, block_size=16,
                                 token_budget=w["token_budget"])
    return _SERVING[key]


def compare_serving(data: dict | None = None, devices: dict | None = None) -> list[dict]:
    """Every published serving row (a run with arrivals) with the simulator's median and the ratio."""
    data = load() if data is None else data
    out = []
    for row in data.get("serving", []):
        run = serving_run(row, data["serving_workload"], (devices or {}).get(row["device"]))
        pred = run.quantile(row["metric"].removesuffix("_p50"), 0.5)
        out.append({**row, "predicted": pred, "ratio": pred / row["published"]})
    return out


def cause(row: dict, rows: list[dict], data: dict | None = None) -> str:
    """Why ``row`` (a compared row, static or serving) is off by more than 25%, with the numbers that say
    so; ``rows`` are all compared rows (a serving row's siblings give the published TTFT and TPOT)."""
    data = load() if data is None else data
    return _serving_cause(row, rows, data) if "rate" in row else _static_cause(row)


def _serving_cause(row: dict, rows: list[dict], data: dict) -> str:
    def sibling(metric, rate=row["rate"]):
        return next(r for r in rows if r.get("rate") == rate and r["model"] == row["model"]
                    and r["engine"] == row["engine"] and r["metric"] == metric)

    ttft, tpot, e2e = (sibling(m)["published"] for m in ("ttft_p50", "tpot_p50", "e2e_p50"))
    if row["metric"] == "ttft_p50" and "scheduler steps" in row["engine"]:
        steps = int(row["engine"].split(", ")[1].split()[0])
        return (f"multi-step scheduling: the engine plans {steps} decode steps at a time, so an arriving request waits "
                f"for the steps in flight, about {steps} x TPOT / 2 = {steps * tpot / 2 * 1e3:.0f} ms at the published "
                f"TPOT; the simulated scheduler plans every step ({row['predicted'] * 1e3:.0f} ms predicted)")
    if row["metric"] == "ttft_p50":
        return (f"costs outside the steps: the published median is {(ttft - row['predicted']) * 1e3:.0f} ms more than the "
                "simulated one, which has the engine's steps only -- not the online benchmark's HTTP request, "
                "tokenizing or streaming of the first token (not measured apart in the source)")
    if row["metric"] == "e2e_p50":
        run = serving_run(row, data["serving_workload"])
        return (f"output lengths assumed: the published medians imply about (E2E - TTFT) / TPOT + 1 = "
                f"{(e2e - ttft) / tpot + 1:.0f} tokens for the median request, the assumed log-uniform outputs' median "
                f"is {float(np.median(run.output_lens)):.0f} (ShareGPT's lengths are not published with the run)")
    others = sorted({r["rate"] for r in rows if r.get("rate") and r["model"] == row["model"]} - {row["rate"]})
    low = sibling("tpot_p50", others[0]) if others else row
    return (f"a growing batch: from {low['rate']} to {row['rate']} requests/s the published median TPOT grows "
            f"{tpot / low['published'] - 1:.0%}, the simulated one {row['predicted'] / low['predicted'] - 1:.0%}: each "
            "added sequence (and each prefill that joins a step of decodes) costs the real engine more than the model's "
            "per-sequence overhead and K/V reads charge")


def _static_cause(row: dict) -> str:
    cost = CostModel(row["model"], row["device"], row["tp"])
    d = cost.device
    if row["metric"] == "throughput":
        context = row["input"] + row["output"] / 2
        step = cost.step([int(context)] * row["batch"], [1] * row["batch"])
        kv = cost.kv_bytes_per_token_per_device * (context + 1) * row["batch"] / (d.mem_bandwidth * d.mbu * d.tp_efficiency(cost.tp))
        share = kv / step.total
        return (f"decode at long contexts: the published throughput implies each decode step took about "
                f"{row['ratio'] - 1:.0%} longer than the predicted {step.total * 1e3:.1f} ms (at the mean context of "
                f"{context:,.0f} tokens); the K/V reads are {share:.0%} of that step, so they alone would have to take "
                f"{1 + (row['ratio'] - 1) / share:.1f}x their predicted time -- not explained by one term of the model "
                "(the same batch with 128 output tokens is within 25%)")
    step = cost.step([0], [row["input"]])
    if row["ratio"] < 1:
        return (f"fixed costs: the predicted prefill is {step.total * 1e3:.1f} ms ({step.bound}-bound, "
                f"{step.overhead * 1e3:.0f} ms of it the assumed step overhead); the "
                f"{(row['published'] - step.total) * 1e3:.0f} ms more it took is per-request work outside the step "
                "(launch, sampling, host) that the model does not have")
    achieved = step.flops / (row["published"] - step.comm - step.overhead)
    return (f"a compute-bound prefill charged at mfu x TP efficiency = {d.mfu:.2f} x {cost.tp}^-{d.tp_gemm_exponent:g} = "
            f"{d.mfu * d.tp_efficiency(cost.tp):.2f} of peak, plus {step.comm * 1e3:.0f} ms of all-reduces not overlapped; "
            f"the published time implies {achieved / d.peak_flops:.2f} of peak per GPU beside them")


def off(rows: list[dict]) -> list[dict]:
    """The rows whose ratio is outside 1 +- :data:`OFF`."""
    return [r for r in rows if not math.isfinite(r["ratio"]) or abs(r["ratio"] - 1) > OFF]
