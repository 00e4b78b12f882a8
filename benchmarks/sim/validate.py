"""The simulator's error on held-out measured runs, stored (benchmarks/sim/results/validation.json).

    python benchmarks/sim/validate.py [--data cbteach/sim/data/bierce_cpu_runs.json]

Fits the CPU on the training runs of the shipped measurements, predicts the held-out runs and writes
the per-run and worst errors; tests/test_sim.py checks the stored numbers are what the code computes.
"""
import argparse
import json
import os
from dataclasses import asdict

from cbteach.sim.validate import load, validation_report

HERE = os.path.dirname(__file__)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", default=None)
    a = p.parse_args()
    rep = validation_report(load(a.data) if a.data else None)
    out = {"fitted_cpu": asdict(rep["device"]), "train": rep["train"], "held_out": rep["held_out"],
           "worst": rep["worst"], "mae": rep["mae"], "machine": rep["machine"]}
    path = os.path.join(HERE, "results", "validation.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    for run in rep["held_out"]:
        print(f"{run['run']:28s} step {run['step_mape']:.1%}  duration {run['duration_error']:.1%}  "
              f"TTFT {run['ttft_error']:.1%}  TPOT {run['tpot_error']:.1%}  E2E {run['e2e_error']:.1%}  "
              f"throughput {run['throughput_error']:.1%}")
    print("worst:", {k: f"{v:.1%}" for k, v in rep["worst"].items()}, "->", path)


if __name__ == "__main__":
    main()
