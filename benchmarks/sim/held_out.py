"""Issue 46's check, end to end on one occasion: held-out workloads measured, a calibration that covers
their shape, and the simulator's error on them.

    python benchmarks/sim/held_out.py [--out benchmarks/sim/results/held_out] [--repeats 3]

Takes about 4 minutes on the 2-core reference machine (quiet: ~2 minutes of measured runs, ~1 minute of
calibration sweep, ~30 s of simulation). Run it on a quiet machine (load < 1, nothing else running): it
records the load (``uptime``) before and after each part, and ``simulate validate`` warns when the
calibration's occasion and the runs' differ. It does, one after the other:

1. ``benchmarks/sim/measure_cpu.py --runs held-out --repeats 3 --keep median`` -- the real engine (bierce,
   wall clock, 1 thread) over ``cbteach.sim.measure.HELD_OUT``: decode-heavy, prefill-heavy (prompts of
   900-2,200 tokens, four to a step), mixed lengths under a 512-token budget, a batch of 64, Poisson
   arrivals near the engine's saturation and below it -> ``runs.json``;
2. ``python -m cbteach simulate calibrate --shape-of runs.json --out device.json`` -- a sweep whose grid
   covers those runs' largest batch, step and context and their length spread (it reads the plans and
   lengths of the runs, never their timings) -> ``device.json``;
3. ``python -m cbteach simulate validate --device device.json --data runs.json`` -> ``validation.txt``
   (per run and mean absolute error of TTFT, TPOT, E2E and throughput, warnings) and ``validation.json``.

tests/test_sim.py recomputes the stored errors from the stored files.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def _run(args: list, log: list, out_file: str | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{done.stderr}")
    log.append({"command": " ".join(["python", *args]), "seconds": round(time.perf_counter() - start, 1),
                "uptime_after": _uptime()})
    if out_file:
        with open(out_file, "w") as f:
            f.write(done.stdout)
    return done.stdout


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.path.join(HERE, "results", "held_out"))
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    runs, device = os.path.join(a.out, "runs.json"), os.path.join(a.out, "device.json")
    log = [{"uptime_before": _uptime()}]
    start = time.perf_counter()
    _run([os.path.join(HERE, "measure_cpu.py"), "--runs", "held-out", "--out", runs, "--repeats", str(a.repeats),
          "--keep", "median"], log)
    _run(["-m", "cbteach", "simulate", "calibrate", "--shape-of", runs, "--out", device], log)
    _run(["-m", "cbteach", "simulate", "validate", "--device", device, "--data", runs], log,
         os.path.join(a.out, "validation.txt"))
    report = json.loads(_run(["-m", "cbteach", "simulate", "--json", "validate", "--device", device, "--data", runs],
                             log))
    log.append({"total_seconds": round(time.perf_counter() - start, 1)})
    with open(os.path.join(a.out, "validation.json"), "w") as f:
        json.dump({"mean_abs_error": report["mean_abs_error"], "worst": report["worst"],
                   "held_out": report["held_out"], "warnings": report.get("warnings", []),
                   "steps_outside_calibration": report["steps_outside_calibration"], "log": log}, f, indent=1)
    print(f"{'run':26s} {'TTFT':>7s} {'TPOT':>7s} {'E2E':>7s} {'thr':>7s}")
    for r in report["held_out"]:
        print(f"{r['run']:26s} " + " ".join(f"{r[m + '_error']:7.1%}" for m in ("ttft", "tpot", "e2e", "throughput")))
    mae = report["mean_abs_error"]
    print("mean absolute error: " + ", ".join(f"{m} {mae[m + '_error']:.1%}" for m in ("ttft", "tpot", "e2e", "throughput")))
    for w in report.get("warnings", []):
        print("warning:", w)
    for entry in log:
        print(entry)


if __name__ == "__main__":
    main()
