"""Measured runs of the real engine: the workloads, how they are timed, and what is kept of them.

A cost model is judged by runs it did not see, so the project keeps two sets of workloads for bierce
on a CPU (:class:`RunSpec`: requests, lengths, arrivals and the engine's settings):

* :data:`RUNS` -- seven small workloads, four to fit on and three held out (``simulate validate``);
* :data:`HELD_OUT` -- six workloads of other shapes that no calibration grid contains: decode-heavy,
  prefill-heavy (prompts of thousands of tokens, several in one step), mixed lengths under a token
  budget, a batch of 64, and Poisson arrivals near and below the engine's saturation. A calibration
  that covers their shape (``simulate calibrate --shape-of RUNS.json``) is asked to predict them.

:func:`measure_all` runs a list of them round-robin (a slow spell of a shared machine hits every run
alike) and keeps, of each run, its every step (plan and duration), every request's arrival, lengths,
TTFT, TPOT and end-to-end latency, and the machine it ran on (:func:`machine_info`: platform, torch,
threads, clock and the load average before and after), so that ``simulate validate`` can tell
whether a calibration and the runs come from the same occasion.
"""
from __future__ import annotations

import os
import platform
import time
from dataclasses import asdict, dataclass

import numpy as np

from .simulator import synthetic_workload


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
    spread: str = "uniform"  # lengths drawn uniformly or log-uniformly (synthetic_workload)


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

HELD_OUT = [  # shapes the seven runs above never reach; every one is predicted, none is fitted on
    RunSpec("decode-heavy", 24, (16, 96), (160, 320), None, 24, num_blocks=1024, seed=11, train=False),
    RunSpec("prefill-heavy", 8, (900, 2200), (4, 12), None, 4, num_blocks=1024, seed=12, train=False),
    RunSpec("mixed-budget512", 32, (8, 2048), (8, 160), None, 16, token_budget=512, num_blocks=2048, seed=13,
            train=False, spread="loguniform"),
    RunSpec("batch64", 96, (16, 256), (24, 96), None, 64, num_blocks=2048, seed=14, train=False),
    RunSpec("poisson-near-saturation", 96, (32, 512), (32, 128), 15.0, 16, token_budget=256, num_blocks=1024,
            seed=15, train=False),
    RunSpec("poisson-light", 64, (16, 384), (16, 96), 12.0, 16, num_blocks=1024, seed=16, train=False),
]


def workload_of(spec: RunSpec):
    return synthetic_workload(spec.num_requests, spec.rate, spec.prompt_lens, spec.output_lens, seed=spec.seed,
                              spread=spec.spread)


def machine_info(clock: str = "wall") -> dict:
    """What a measurement's speed depends on, as a calibration and a run both record it."""
    import torch

    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "clock": "process CPU seconds" if clock == "process" else "wall", "load_before": os.getloadavg()[0],
            "when": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


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


def measure(spec: RunSpec, model, vocab_size: int | None = None, repeats: int = 3, clock: str = "wall",
            keep: str = "fastest") -> dict:
    """Run ``spec`` on the real engine ``repeats`` times and keep one run (``keep``: the ``"fastest"``,
    or the ``"median"`` by duration -- the machine's typical speed, as a calibration takes it)."""
    runs = [_measure_once(spec, model, vocab_size, clock) for _ in range(repeats)]
    return _keep(runs, keep)


def _keep(runs: list[dict], keep: str) -> dict:
    if keep not in ("fastest", "median"):
        raise ValueError(f"keep must be 'fastest' or 'median', got {keep!r}")
    ordered = sorted(runs, key=lambda r: r["duration"])
    return ordered[0] if keep == "fastest" else ordered[(len(ordered) - 1) // 2]


def _measure_once(spec: RunSpec, model, vocab_size: int | None, clock: str = "wall") -> dict:
    from ..core.request import Request
    from ..engine.engine import Engine

    vocab = vocab_size or model.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(spec.seed + 1000)
    opts = dict(max_batch_size=spec.max_batch_size, kv="paged", block_size=spec.block_size,
                num_blocks=spec.num_blocks, token_budget=spec.token_budget)
    Engine(model, None, **opts).run([Request([1, 2, 3], 4, ignore_eos=True)])  # warm up this process
    eng = Engine(model, None, clock=ProcessClock() if clock == "process" else None, **opts)
    work = workload_of(spec)
    reqs = [Request(rng.integers(1, vocab, r.prompt_len).tolist(), r.output_len, request_id=r.request_id,
                    arrival_time=r.arrival_time if spec.rate else None, ignore_eos=True) for r in work]
    comps = eng.run(reqs)
    steps = [{"c": rec.num_computed_tokens, "n": rec.num_scheduled_tokens, "t": rec.duration}
             for rec in eng.records if rec.seqs]
    requests = [{"arrival_time": c.arrival_time, "prompt_len": r.prompt_len, "n": len(c.output_ids),
                 "ttft": c.first_token_time - c.arrival_time,
                 "tpot": (c.token_times[-1] - c.token_times[0]) / (len(c.token_times) - 1)
                 if len(c.token_times) > 1 else None, "e2e": c.token_times[-1] - c.arrival_time}
                for r, c in zip(work, comps)]
    return {"spec": asdict(spec), "steps": steps, "requests": requests,
            "duration": eng.records[-1].start_time + eng.records[-1].duration - eng.records[0].start_time}


def measure_all(model, runs=RUNS, repeats: int = 10, clock: str = "wall", keep: str = "fastest") -> dict:
    """Every run of ``runs``, measured ``repeats`` times round-robin (so a slow spell of the machine hits
    all runs alike), keeping each run's fastest (or median) repeat, and the machine it ran on."""
    machine = machine_info(clock)
    rounds = [[_measure_once(spec, model, None, clock) for spec in runs] for _ in range(repeats)]
    machine["load_after"] = os.getloadavg()[0]
    return {"machine": machine, "model": "bierce", "runs": [_keep([r[i] for r in rounds], keep) for i in range(len(runs))]}


def record_run(engine, completions, name: str = "run", **settings) -> dict:
    """A run measured by any :class:`~cbteach.Engine` (records on, ``keep_records=True``) as
    ``simulate validate`` reads it: its steps (plan and duration), every request's arrival, lengths
    and latencies, and the engine settings the simulator replays it with (``max_batch_size``,
    ``token_budget``, ``block_size``, ``num_blocks``: read from ``engine.config`` unless given), and the
    machine it ran on now (:func:`machine_info`: call it right after the run)."""
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
    machine = machine_info()
    machine["load_after"] = machine.pop("load_before")  # recorded after the run
    return {"name": name, "engine": eng, "machine": machine, "steps": steps, "requests": requests,
            "duration": spans[-1].start_time + spans[-1].duration - spans[0].start_time}
