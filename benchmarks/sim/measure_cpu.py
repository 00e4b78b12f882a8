"""Measure bierce on this machine for the simulator's validation (cbteach/sim/data/bierce_cpu_runs.json).

    python benchmarks/sim/measure_cpu.py [--out PATH] [--threads N]

Runs the real engine over cbteach.sim.validate.RUNS (wall clock by default; --clock process for process CPU
seconds) and writes every step's plan and duration and every request's TTFT/TPOT. Then
`python -m cbteach simulate validate --data PATH` reports the held-out error of a fit on its training runs,
and `python -m cbteach simulate calibrate --out dev.json` followed by
`python -m cbteach simulate validate --device dev.json --data PATH` the error of a calibration made on the
same occasion (same machine, load, threads and clock) on every run.
"""
import argparse
import json
import os

import torch


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "..", "cbteach", "sim", "data",
                                                 "bierce_cpu_runs.json"))
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier timings)")
    p.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="step durations in wall seconds (as any Engine records them) or process CPU seconds")
    p.add_argument("--repeats", type=int, default=10, help="round-robin repeats (each run's fastest kept)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from cbteach import load_model
    from cbteach.sim.validate import measure_all

    model, _ = load_model("bierce", device="cpu")
    data = measure_all(model, repeats=a.repeats, clock=a.clock)
    data["load_before"] = os.getloadavg()
    with open(a.out, "w") as f:
        json.dump(data, f)
    print(f"wrote {a.out}: {sum(len(r['steps']) for r in data['runs'])} steps in {len(data['runs'])} runs")


if __name__ == "__main__":
    main()
