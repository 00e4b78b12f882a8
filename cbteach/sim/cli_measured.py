"""``simulate calibrate`` and ``simulate validate``: the commands that touch measurements of this machine.

``calibrate`` sweeps the real engine over a grid that covers a workload (its shape from measured runs,
``--shape-of RUNS.json``, or from ``--max-batch``, ``--max-tokens``, ``--max-context``, ``--prompt``,
``--output``, ``--budget``) and writes a device file with its occasion and its calibrated range.
``validate`` predicts measured runs and says, beside each metric's error, whether the calibration
belongs to them (:func:`cbteach.sim.occasion.occasion_warnings`) and how many of their steps lie
outside its range (:mod:`cbteach.sim.coverage`).
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from ..argtypes import POSITIVE_INT, threads, unwritable


def calibrate_args(k: argparse.ArgumentParser, pair) -> None:
    k.add_argument("--out", default="cpu_device.json", help="the device file to write")
    k.add_argument("--repeats", type=POSITIVE_INT, default=3, help="measurements of each grid point (median kept)")
    k.add_argument("--threads", type=threads, default=1, help="torch threads (use the runs' own)")
    k.add_argument("--clock", choices=("wall", "process"), default="wall",
                   help="what a step's duration is: wall seconds (as an Engine records them) or process CPU seconds")
    k.add_argument("--shape-of", default=None, metavar="RUNS.json",
                   help="measured runs (validate's format) whose shape the grid covers: their largest batch, "
                        "largest step, longest context, prompt and output lengths, token budget (never their timings)")
    k.add_argument("--max-batch", type=POSITIVE_INT, default=None, help="the workload's most sequences in a step")
    k.add_argument("--max-tokens", type=POSITIVE_INT, default=None, help="the workload's largest step (tokens fed)")
    k.add_argument("--max-context", type=POSITIVE_INT, default=None, help="the workload's longest context (tokens)")
    k.add_argument("--prompt", type=pair, default=None, help="the workload's prompt lengths LO,HI")
    k.add_argument("--output", type=pair, default=None, help="the workload's output lengths LO,HI")
    k.add_argument("--budget", type=POSITIVE_INT, default=None, help="the workload's token budget per step")


def _shape(a):
    from dataclasses import replace

    from .calibrate import WorkloadShape, shape_of
    from .validate import load

    shape = WorkloadShape()
    if a.shape_of:
        try:
            shape = shape_of(load(a.shape_of))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"--shape-of {a.shape_of}: cannot read a workload's shape from it "
                             f"({type(err).__name__}: {err})") from None
    given = {"max_batch": a.max_batch, "max_tokens": a.max_tokens, "max_context": a.max_context,
             "prompt_lens": a.prompt, "output_lens": a.output, "token_budget": a.budget}
    return replace(shape, **{k: v for k, v in given.items() if v is not None})


def calibrate_command(a) -> dict:
    from .calibrate import calibrate, save_device

    problem = "it names no file" if not a.out.strip() else unwritable(Path(a.out))
    if problem:  # found now, not after the measuring
        raise ValueError(f"--out {a.out!r}: cannot write the device file there: {problem}")
    shape = _shape(a)
    cal = calibrate(repeats=a.repeats, clock=a.clock, threads=a.threads, shape=shape)
    path = save_device(cal, a.out)
    d, info = cal["device"], cal["calibration"]
    return {"device_file": str(path), "shape": info["shape"], "grid_points": len(info["grid"]),
            "steps_measured": info["steps"], "seconds": info["seconds"], "fit_step_error": info["fit_step_error"],
            "calibrated_range": dict(d.calibrated_range), "step_overhead_s": d.step_overhead,
            "seq_overhead_s": d.seq_overhead, "group_overhead_s": d.group_overhead, "flops": d.peak_flops,
            "attn_flops": d.attn_flops, "kv_bytes_per_s": d.kv_bandwidth, "score_bytes_per_s": d.score_bandwidth,
            "attention_layout": d.attention_layout,
            "occasion": {k: info.get(k) for k in ("platform", "processor", "cpus", "torch", "torch_threads", "clock",
                                                  "load_before", "load_after", "when")},
            "next": f"python -m cbteach simulate validate --device {path} --data RUNS.json (runs of this occasion: an "
                    "error measured against another occasion's runs includes the machine's drift)"}


def validate_command(a) -> dict:
    from .calibrate import load_calibration, load_device
    from .coverage import WARN_FRACTION
    from .occasion import occasion_warnings
    from .validate import SENSITIVE, drift_warning, load, validation_report

    data = None
    if a.data is not None:  # ("" is a path that names nothing, not the shipped runs)
        try:
            data = load(a.data)
        except (OSError, ValueError) as err:
            raise ValueError(f"--data {a.data}: cannot read it as measured runs ({err})") from None
        if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
            raise ValueError(f"--data {a.data}: expected a JSON object with a non-empty list 'runs' (see "
                             "`python -m cbteach simulate validate --help` for the format)")
        bad = next(((i, what, t) for i, r in enumerate(data["runs"]) if isinstance(r, dict)
                    for what, t in [("duration", r.get("duration")), *(("a step's t", s.get("t")) for s in
                                                                       r.get("steps", ()) if isinstance(s, dict))]
                    if not (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0)),
                   None)
        if bad is not None:
            raise ValueError(f"--data {a.data}: run {bad[0]} has {bad[1]} = {bad[2]!r}; measured times must be finite "
                             "numbers of seconds > 0")
    device = load_device(a.device) if a.device else None
    try:
        rep = validation_report(data, device)
    except (KeyError, TypeError, IndexError) as err:
        raise ValueError(f"--data {a.data}: a run lacks what the prediction needs ({type(err).__name__}: {err})") from None
    d = rep["device"]
    out = {"fitted_cpu": {"step_overhead_s": d.step_overhead, "seq_overhead_s": d.seq_overhead,
                          "group_overhead_s": d.group_overhead, "flops": d.peak_flops, "attn_flops": d.attn_flops,
                          "kv_bytes_per_s": d.kv_bandwidth, "score_bytes_per_s": d.score_bandwidth,
                          "attention_layout": d.attention_layout},
           "train": rep["train"] or f"none: the device of {a.device}", "held_out": rep["held_out"],
           "mean_abs_error": rep["mae"], "worst": rep["worst"]}
    warnings = []
    if a.device:
        warnings += occasion_warnings(load_calibration(a.device), rep["machine"])
    steps = sum(p["steps"] for p in rep["held_out"])
    outside = sum(p["steps_outside_calibration"] for p in rep["held_out"])
    out["steps_outside_calibration"] = f"{outside} of {steps}"
    if steps and outside / steps > WARN_FRACTION:
        runs = ", ".join(p["run"] for p in rep["held_out"] if p["steps_outside_calibration"])
        warnings.append(f"{outside} of the runs' {steps} steps ({outside / steps:.0%}) lie outside the calibrated range "
                        f"({runs}): calibrate with their shape (simulate calibrate --shape-of {a.data or 'RUNS.json'})")
    drift = drift_warning(rep["held_out"]) if a.device else None
    warnings += [drift] if drift else []
    if warnings:
        out["what_the_errors_mean"] = ("errors of a calibration from another occasion, or beyond its range: they include "
                                       "the machine's drift or the extrapolation, not only the model's error")
    for p in rep["held_out"]:
        if p.get("ttft_per_step_error", 0.0) > SENSITIVE:
            warnings.append(f"{p['run']}: a 1% error in step time moves its simulated mean TTFT by "
                            f"{p['ttft_per_step_error']:.0f}% (a queue near saturation): its TTFT error measures the "
                            f"run's sensitivity more than the model (its step error is {p['step_mape']:.1%})")
    if warnings:
        out["warnings"] = warnings
    return out
