"""``python -m cbteach simulate``: the engine's scheduler on a cost model, from the command line.

    python -m cbteach simulate validate                 # the cost model's error on held-out bierce runs
    python -m cbteach simulate calibrate --out cpu.json  # sweep the real engine here, fit, write a device file
    python -m cbteach simulate validate --device cpu.json --data runs.json   # its error on other runs
    python -m cbteach simulate run --model llama-3-8b --device a100-80gb --rate 8
    python -m cbteach simulate capacity --model llama-3-70b --device h100 --tp 4 --ttft 1 --tpot 0.05
    python -m cbteach simulate static                   # continuous vs static, OPT-13B on an A100
    python -m cbteach simulate devices | models

Every number it prints is simulated (except ``validate``'s measured columns).
"""
from __future__ import annotations

import argparse
import json

from ..argtypes import POSITIVE, POSITIVE_INT
from .cli_measured import calibrate_args, calibrate_command, validate_command
from .devices import DEVICES
from .shapes import MODELS


def _pair(text: str) -> tuple:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (two token counts), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 1 <= LO <= HI, got {text!r}")
    return lo, hi


def _deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="llama-3-8b", help=f"one of {', '.join(MODELS)}")
    p.add_argument("--device", default="a100-80gb", help=f"one of {', '.join(DEVICES)}")
    p.add_argument("--tp", type=POSITIVE_INT, default=1, help="tensor-parallel devices per replica")
    p.add_argument("--prompt", type=_pair, default=(128, 1024), help="prompt lengths LO,HI")
    p.add_argument("--output", type=_pair, default=(32, 512), help="output lengths LO,HI")
    p.add_argument("--requests", type=POSITIVE_INT, default=200,
                   help="requests per simulated run (capacity: the shortest; runs grow to 10x their concurrency)")
    p.add_argument("--batch", type=POSITIVE_INT, default=256, help="max_batch_size")
    p.add_argument("--budget", type=POSITIVE_INT, default=2048, help="token budget per step")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cbteach simulate",
                                description="the engine's scheduler on a cost model: every number it prints is simulated",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub = p.add_subparsers(dest="what", required=True, help="what to simulate (each has its own --help)")
    v = sub.add_parser("validate", help="the cost model's error on measured bierce runs (TTFT, TPOT, E2E, throughput)",
                       description="Predict measured runs and report each metric's error. --data: a JSON object "
                       "{\"runs\": [...]}, each run either as benchmarks/sim/measure_cpu.py writes it ({\"spec\", "
                       "\"steps\", \"requests\", \"duration\"}) or as cbteach.sim.validate.record_run writes an "
                       "Engine's (records on): {\"engine\": {max_batch_size, token_budget, block_size, num_blocks}, "
                       "\"steps\": [{\"c\", \"n\", \"t\"}], \"requests\": [{arrival_time, prompt_len, n, "
                       "ttft, tpot, e2e}], \"duration\"}, and optionally the machine it ran on (\"machine\": platform, torch, "
                       "torch_threads, clock, load_before/load_after, when), which a device file's occasion is compared "
                       "with. Without --device the CPU is fitted on the runs marked "
                       "train and the others are predicted; with --device every run is predicted.")
    v.add_argument("--data", default=None, help="measured runs (default: the shipped ones)")
    v.add_argument("--device", default=None, help="a device file from `simulate calibrate` (default: fit on --data's "
                                                  "training runs)")
    k = sub.add_parser("calibrate", help="sweep the real engine (bierce) over a grid that covers a workload; write a "
                                         "device file", formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="Sweep the real engine here over a grid that covers the workload's shape and fit the "
                       "cost model: a device file for this machine, this torch, these threads and this load -- this "
                       "occasion. A prediction of runs from another occasion carries the machine's drift on top of the "
                       "model's error; `simulate validate` warns when the occasions differ.")
    calibrate_args(k, _pair)
    r = sub.add_parser("run", help="one simulated run")
    _deployment_args(r)
    r.add_argument("--rate", type=POSITIVE, default=4.0, help="requests per second (Poisson)")
    c = sub.add_parser("capacity", help="highest rate meeting TTFT/TPOT targets; GPUs for N users; $/M tokens")
    _deployment_args(c)
    c.add_argument("--ttft", type=POSITIVE, default=1.0, help="TTFT target, seconds (at --quantile)")
    c.add_argument("--tpot", type=POSITIVE, default=0.05, help="TPOT target, seconds (at --quantile)")
    c.add_argument("--quantile", type=float, default=0.9, choices=(0.5, 0.9))
    c.add_argument("--users", type=POSITIVE_INT, default=None, help="also: devices for this many users")
    c.add_argument("--rate-per-user", type=POSITIVE, default=None,
                   help="requests per second per user, with --users (default 1/30: one every 30 s)")
    c.add_argument("--price", type=POSITIVE, default=None, help="price per device-hour (default: the device's)")
    s = sub.add_parser("static", help="continuous vs static batching and the factors of the gap")
    s.add_argument("--model", default="opt-13b")
    s.add_argument("--device", default="a100-40gb")
    sub.add_parser("devices", help="the device table, with sources")
    sub.add_parser("models", help="the shipped model shapes, with sources")
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # (what a missing one's error names, rather than 'what')
    return p


def _names(a) -> None:
    """A --model or --device it does not know, named as the user typed it."""
    if a.model.lower() not in MODELS:
        raise ValueError(f"--model {a.model}: not a shipped shape; one of {', '.join(MODELS)}")
    if a.device.lower() not in DEVICES and not a.device.lower().endswith(".json"):
        raise ValueError(f"--device {a.device}: unknown; one of {', '.join(DEVICES)}, or a device file (*.json) "
                         "from `python -m cbteach simulate calibrate`")


def deployment(a):
    """The :class:`~cbteach.sim.capacity.Deployment` parsed arguments describe (names checked first)."""
    from .capacity import Deployment
    from .cost import CostModel

    _names(a)
    CostModel(a.model, a.device, a.tp)  # a model, device or --tp it cannot use: named before anything runs
    dep = Deployment(model=a.model, device=a.device, tensor_parallel_size=a.tp, prompt_lens=a.prompt,
                     output_lens=a.output, num_requests=a.requests, max_batch_size=a.batch, token_budget=a.budget)
    dep.check_lengths()  # (before a progress bar starts)
    return dep


def _device_warnings(a, result) -> list:
    """For a device file: how this machine differs from its calibration's, and steps beyond its range."""
    if not str(a.device).lower().endswith(".json"):
        return []
    from .calibrate import load_calibration
    from .measure import machine_info
    from .occasion import occasion_warnings

    here = {k: v for k, v in machine_info().items() if k not in ("torch_threads", "clock")}  # not measuring now
    out = occasion_warnings(load_calibration(a.device), here, what="this machine now")
    warning = None
    if result is not None and result.coverage:
        from .coverage import WARN_FRACTION

        c = result.coverage
        if c["fraction"] > WARN_FRACTION:
            warning = (f"{c['outside']} of {c['steps']} simulated steps ({c['fraction']:.0%}) lie outside the device's "
                       f"calibrated range {c['range']}: extrapolated (calibrate with this workload's shape)")
    return out + ([warning] if warning else [])


def _capacity(a) -> dict:
    if a.rate_per_user is not None and a.users is None:
        raise ValueError("--rate-per-user sizes the devices for --users: give --users too, or drop --rate-per-user")
    from tqdm.auto import tqdm

    from .capacity import cost_per_million_tokens, gpus_for_users, max_rate

    dep = deployment(a)
    with tqdm(desc="simulated runs", unit="run", disable=a.json) as bar:
        def progress(rate):
            bar.set_postfix_str(f"{rate:.3g} req/s")
            bar.update(1)

        cap = max_rate(dep, a.ttft, a.tpot, a.quantile, progress=progress)
    roof = cap.roofline
    out = {"simulated": True, "roofline_req_s": roof["rate"], "roofline_bound": roof["bound"],
           "max_rate_req_s": cap.rate, "probes": len(cap.probes)}
    if cap.rate > 0:
        st = cap.steady
        out.update({"run_requests": st["requests"], "first_run_requests": cap.first["requests"],
                    "measured_requests": st["measured"], "steady_window_s": st["window_s"],
                    "concurrency": st["concurrency"], "reached_steady_state": st["steady"],
                    "queue_first_third": st["queue_first"], "queue_last_third": st["queue_last"],
                    "stability_test": cap.test, "served_output_tokens_s": st["served_tokens_per_s"],
                    "cost_per_million_output_tokens": cost_per_million_tokens(dep, cap, a.price)})
        out.update({k: v for k, v in st.items() if k.startswith(("ttft", "tpot"))})
        if a.users is not None:
            out["devices_for_users"] = gpus_for_users(a.users, a.rate_per_user or 1 / 30, cap.rate, a.tp)
    if cap.result is not None and cap.result.coverage:
        out["steps_outside_calibration"] = f"{cap.result.coverage['outside']} of {cap.result.coverage['steps']}"
    warnings = _device_warnings(a, cap.result)
    if warnings:
        out["warnings"] = warnings
    return out


def _run(a) -> dict:
    result = deployment(a).run(a.rate)
    out = {"simulated": True, **result.summary()}
    if result.coverage:
        out["steps_outside_calibration"] = f"{result.coverage['outside']} of {result.coverage['steps']}"
    warnings = _device_warnings(a, result)
    if warnings:
        out["warnings"] = warnings
    return out


def _static(a) -> dict:
    from .static import compare_batching

    _names(a)
    rep = compare_batching(a.model, a.device)
    return {"simulated": True, **{k: v for k, v in rep.items() if k != "runs"}}


def cli(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.what == "devices":
        out = {k: {"memory_GiB": d.memory_bytes / 2**30, "bandwidth_GB_s": d.mem_bandwidth / 1e9,
                   "peak_TFLOPS": d.peak_flops / 1e12, "link_GB_s": d.link_bandwidth / 1e9, "link": d.link,
                   "price_per_hour": d.price_per_hour, "source": d.source} for k, d in DEVICES.items()}
    elif a.what == "models":
        out = {k: {"params_B": m.num_params / 1e9, "layers": m.num_layers, "heads": m.num_heads,
                   "kv_heads": m.num_kv_heads, "source": m.source} for k, m in MODELS.items()}
    else:
        out = {"validate": validate_command, "calibrate": calibrate_command, "run": _run, "capacity": _capacity,
               "static": _static}[a.what](a)
    if a.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        _print(out)
    return 0


def _print(out: dict, indent: str = "") -> None:
    for key, value in out.items():
        if isinstance(value, dict):
            print(f"{indent}{key}:")
            _print(value, indent + "  ")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            print(f"{indent}{key}:")
            for item in value:
                print(f"{indent}  - " + ", ".join(f"{k}={_fmt(v)}" for k, v in item.items()))
        elif isinstance(value, list) and value and all(isinstance(v, str) for v in value):
            print(f"{indent}{key}:")
            for item in value:
                print(f"{indent}  - {item}")
        else:
            print(f"{indent}{key}: {_fmt(value)}")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
