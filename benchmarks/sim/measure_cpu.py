"""Measure bierce on this machine for the simulator's validation.

    python benchmarks/sim/measure_cpu.py [--runs validation|held-out] [--out PATH] [--threads N]

Runs the real engine over ``cbteach.sim.measure.RUNS`` (``--runs validation``, written by default to
``cbteach/sim/data/bierce_cpu_runs.json``) or ``cbteach.sim.measure.HELD_OUT`` (``--runs held-out``:
decode-heavy, prefill-heavy, mixed lengths under a token budget, batch 64, Poisson arrivals), round-robin,
and writes every step's plan and duration, every request's arrival, lengths, TTFT, TPOT and E2E, and the
machine (platform, torch, threads, clock, load before and after). Then
`python -m cbteach simulate validate --data PATH` reports the held-out error of a fit on its training runs,
and `python -m cbteach simulate calibrate --shape-of PATH --out dev.json` followed by
`python -m cbteach simulate validate --device dev.json --data PATH` the error of a calibration made on the
same occasion (same machine, load, threads and clock) and covering the runs' shape.
"""
import argparse
import json
import os

import torch

DEFAULT = os.path.join(os.path.dirname(__file__), "..", "..", "cbteach", "sim", "data", "bierce_cpu_runs.json")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", choices=("validation", "held-out"), default="validation")
    p.add_argument("--out", default=None, help="default: the shipped validation runs (--runs validation only)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="step durations in wall seconds (as any Engine records them) or process CPU seconds")
    p.add_argument("--repeats", type=int, default=10, help="round-robin repeats")
    p.add_argument("--keep", choices=("fastest", "median"), default="fastest",
                   help="which repeat of each run is kept (median: the machine's typical speed, as calibrate takes it)")
    a = p.parse_args()
    if a.out is None and a.runs != "validation":
        p.error("--out PATH is needed with --runs held-out (the default file is the shipped validation runs)")
    torch.set_num_threads(a.threads)
    from cbteach import load_model
    from cbteach.sim.measure import HELD_OUT, RUNS, measure_all

    model, _ = load_model("bierce", device="cpu")
    data = measure_all(model, RUNS if a.runs == "validation" else HELD_OUT, repeats=a.repeats, clock=a.clock,
                       keep=a.keep)
    out = a.out or DEFAULT
    with open(out, "w") as f:
        json.dump(data, f)
    print(f"wrote {out}: {sum(len(r['steps']) for r in data['runs'])} steps in {len(data['runs'])} runs "
          f"(load {data['machine']['load_before']:.2f} before, {data['machine']['load_after']:.2f} after)")


if __name__ == "__main__":
    main()
