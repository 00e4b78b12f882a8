"""The score term before and after, on one occasion: the held-out runs and a covering calibration sweep
measured together, fitted twice -- with score tensors past the caches charged (``cost.SPILL_BYTES``, the
cost model now) and without (``fit_cpu(..., charge_scores=False)``, the cost model before) -- and predicted.

    python benchmarks/sim/spill_before_after.py                    # the stored measurement, recomputed
    python benchmarks/sim/spill_before_after.py --measure OUT.json # measure anew (~2 minutes), then compare

The stored file (``results/other_measurements/spill_paired_2026-12-05.json``) was measured on the quiet
2-core machine on 2026-12-05 at about 02:30 UTC: ``measure_all(HELD_OUT, repeats=3, keep="median")`` and
``measure_grid(covering_grid(shape_of(runs)), 3, "wall")``, bierce, one thread.
"""
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
STORED = os.path.join(HERE, "results", "other_measurements", "spill_paired_2026-12-05.json")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--measure", metavar="OUT", help="measure runs and sweep anew into OUT, then compare")
    a = p.parse_args()
    from cbteach.sim.validate import fit_cpu, validation_report

    if a.measure:
        import torch

        from cbteach import load_model
        from cbteach.sim.calibrate import covering_grid, measure_grid, shape_of
        from cbteach.sim.measure import HELD_OUT, measure_all

        torch.set_num_threads(1)
        model, _ = load_model("bierce", device="cpu")
        runs = measure_all(model, HELD_OUT, repeats=3, keep="median")
        grid = measure_grid(model, covering_grid(shape_of(runs)), 3, "wall")
        with open(a.measure, "w") as f:
            json.dump({"runs": runs, "grid": grid}, f)
    with open(a.measure or STORED) as f:
        data = json.load(f)
    for name, charge in (("before (scores not charged)", False), ("after (scores charged)", True)):
        report = validation_report(data["runs"], fit_cpu(data["grid"], charge_scores=charge))
        mae = report["mae"]
        print(f"{name:28s} mean abs error: " + ", ".join(f"{m} {mae[m + '_error']:.1%}" for m in
                                                          ("ttft", "tpot", "e2e", "throughput")))
        for r in report["held_out"]:
            print(f"    {r['run']:24s} " + " ".join(f"{r[m + '_error']:6.1%}" for m in ("ttft", "tpot", "e2e", "throughput")))


if __name__ == "__main__":
    main()
