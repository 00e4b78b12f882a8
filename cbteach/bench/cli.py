"""The command line of ``python -m cbteach bench`` and its tables (what :mod:`.measure` measured, printed)."""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

from ..core.config import MAX_BATCH_SIZE
from ..core.modelinfo import max_positions
from ..models import load_model
from ..serving import workloads as wl
from . import measure
from .experiments import machine_info, step_time_vs_history
from ..argtypes import POSITIVE, POSITIVE_INT, at_most, number, threads, unwritable
from .measure import (ALL_ENGINES, METRICS, REFERENCE, TOKEN_BUDGET, clean, compare, slot_steps, sweep,
                      targets)


def _fmt(x, spec):
    return "-" if x is None or x != x else format(x, spec)


def _ms(row, key):
    v = row.get(key)
    return "-" if v is None else f"{1e3 * v:.0f}" if v >= 0.1 else f"{1e3 * v:.1f}"


def print_table(rows: dict, ttft_target=None, tpot_target=None) -> None:
    """The short table: rates, latency p50/p99 (ms), goodput, steps, same tokens."""
    ref = next((r.get("reference_engine") for r in rows.values() if "reference_engine" in r), None)
    print(f"  {'engine':20s} {'tok/s':>7s} {'req/s':>6s} {'TTFT p50/p99':>13s} {'TPOT p50/p99':>13s} "
          f"{'ITL p50/p99':>12s} {'E2E p50/p99':>13s} {'goodput':>7s} {'steps':>6s}  same tokens as {ref}")
    for name, r in rows.items():
        if "error" in r:
            print(f"  {name:20s} FAILED: {r['error']}")
            continue
        lat = [f"{_ms(r, m + '_p50')}/{_ms(r, m + '_p99')}" for m in METRICS]
        print(f"  {name:20s} {_fmt(r['tokens_per_s'], '7.0f')} {_fmt(r['requests_per_s'], '6.1f')} {lat[0]:>13s} "
              f"{lat[1]:>13s} {lat[2]:>12s} {lat[3]:>13s} {_fmt(r['goodput'], '7.1f')} {_fmt(r['steps'], '6d'):>6s}  "
              f"{'(reference)' if name == ref else r.get('matched')}")
    wanted = " and ".join(f"{k} <= {v:g} s" for k, v in (("TTFT", ttft_target), ("TPOT", tpot_target)) if v is not None)
    print(f"  (latencies in ms; goodput: requests/s {'with ' + wanted if wanted else 'of every request: no targets'})")
    for name, r in rows.items():
        if "paged_utilisation" in r:
            print(f"  {name}: KV utilisation {r['paged_utilisation']:.1%} (a contiguous prompt + max_new_tokens "
                  f"reservation: {r['contiguous_utilisation']:.1%}), {r['preemptions']} preemption(s), "
                  f"largest batch {r['peak_batch']}")


def print_targets(rows: dict, tg: dict, lengths=None, batch_size=None) -> None:
    a, b = tg["paged_vs_ideal"], tg["paged_vs_transformers_cb"]
    # One "ideal": the ratio of forward steps the two engines actually ran. The slot arithmetic below
    # is a bound on that ratio from the output lengths alone, so it is named a bound, not an ideal.
    print(f"  speed-up of cbteach_paged over static: measured {_fmt(a['measured_speedup'], '.2f')}x wall time; "
          f"ideal {_fmt(a['ideal_speedup'], '.2f')}x (static steps / continuous steps)")
    if lengths and batch_size:
        s = slot_steps(lengths, batch_size)
        print(f"  (slot arithmetic on the output lengths: static {s['static']} steps, continuous >= "
              f"{s['continuous']}, so the step ratio can be at most {s['ideal_speedup']:.2f}x)")
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    print(f"  target: paged speed-up >= {a['goal']} x ideal: {_fmt(a['value'], '.2f')} x -> {verdict[a['met']]}")
    print(f"  target: paged >= {b['goal']} x transformers_cb tok/s: {_fmt(b['value'], '.2f')} x -> {verdict[b['met']]}")
    c, d = tg["paged_vs_static"], tg["async_host_fraction"]
    print(f"  target: paged no slower than static (>= {c['goal']} x): {_fmt(c['value'], '.2f')} x -> {verdict[c['met']]}")
    print(f"  target: async scheduling, time outside the forward <= {d['goal']:.0%} of the loop: "
          f"{_fmt(d['value'], '.1%')} -> {verdict[d['met']]}")


def _floats(text):
    """argparse type for ``--sweep``: comma-separated finite numbers."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = None
    if not values or any(v != v or v in (float("inf"), float("-inf")) for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated finite numbers (e.g. 8,32,128), got {text!r}")
    return values


_floats.__name__ = "sweep values"




def plain(doc: str) -> str:
    """A docstring as terminal text: reST's ``code``, **bold**, *emphasis* and :role:`target` unmarked."""
    doc = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc)
    doc = re.sub(r"``([^`]+)``", r"\1", doc)
    doc = re.sub(r"\*\*([^*]+)\*\*", r"\1", doc)
    return re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"\1", doc)


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its paragraphs and lists), and each option's default shown
    (unless it is None or False, or the help already gives it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "default" not in text:
            text += " (default: %(default)s)"
        return text


MAX_ARRIVAL_SPAN = 3600.0  # wall seconds a poisson workload's arrivals may take, on average


def _history(text: str) -> int:
    """``--history``: 0 (skip the experiment) or at least 2 (it times the decode steps after the first)."""
    value = number(int, 0, strict=False)(text)
    if value == 1:
        raise argparse.ArgumentTypeError("1 step has no decode after the first to time: give 0 (skip) or 2 or more")
    return value


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cbteach bench", description=plain(measure.__doc__ or ""),
                                formatter_class=_Formatter)
    p.add_argument("--workload", default="headwords", choices=wl.WORKLOADS, help="which requests (see above)")
    p.add_argument("--requests", type=POSITIVE_INT, default=32, help="requests in the workload")
    p.add_argument("--max-batch-size", "--batch-size", dest="batch_size", type=at_most(POSITIVE_INT, MAX_BATCH_SIZE),
                   default=8, help="most sequences running at once")
    p.add_argument("--max-new-tokens", type=POSITIVE_INT, default=128, help="output cap of headwords and poisson")
    p.add_argument("--cap", type=POSITIVE_INT, default=64, help="length_variance: the cap on exponential output lengths")
    p.add_argument("--rate", type=POSITIVE, default=8.0, help="poisson: requests per second")
    p.add_argument("--sweep", type=_floats, default=None, metavar="V1,V2,...",
                   help="run length_variance at each cap, or poisson at each rate ('sweep' in the JSON; "
                        "'engines' holds the last point)")
    p.add_argument("--seed", type=int, default=0, help="the workload's random seed")
    p.add_argument("--model", default="bierce", help="'bierce' (embedded, offline) or a hub id such as gpt2")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps, or auto (the best this machine has)")
    p.add_argument("--reference", action="store_true",
                   help="the targets' configuration: headwords, --requests 64 --max-new-tokens 300 --batch-size 16")
    p.add_argument("--engines", default=",".join(ALL_ENGINES),
                   help="comma-separated subset of " + ", ".join(ALL_ENGINES))
    p.add_argument("--token-budget", type=POSITIVE_INT, default=TOKEN_BUDGET, help="cbteach_paged_budget's token budget")
    p.add_argument("--ttft-target", type=POSITIVE, default=1.0, help="goodput: TTFT target in seconds")
    p.add_argument("--tpot-target", type=POSITIVE, default=0.05, help="goodput: TPOT target in seconds")
    p.add_argument("--repeat", type=POSITIVE_INT, default=1, help="timed runs per engine (the median is reported)")
    p.add_argument("--history", type=_history, default=256,
                   help="decode steps for the step-time experiment (0: skip; else at least 2)")
    p.add_argument("--out", type=Path, default=None, help="folder for bench-<model>.json (default benchmarks/results)")
    p.add_argument("--json", type=Path, default=None, help="write the results to this file instead")
    p.add_argument("--threads", type=threads, default=1,
                   help="CPU threads for torch (default 1: a 2M-parameter model gains nothing from more, "
                        "and timings on a shared machine stay steady)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


WORKLOAD_OPTIONS = {"workload": "--workload", "requests": "--requests", "batch_size": "--max-batch-size/--batch-size",
                    "max_new_tokens": "--max-new-tokens", "cap": "--cap", "rate": "--rate", "sweep": "--sweep",
                    "seed": "--seed"}


def _check(p: argparse.ArgumentParser, a, argv=()) -> tuple[list[str], Path]:
    """Every argument problem found before any measuring (``p.error`` exits); the engines and the output path."""
    from ..serving.server_cli import given

    if a.reference:
        wrong = given(_parser, argv, WORKLOAD_OPTIONS)
        if wrong:
            p.error(f"--reference is the fixed reference workload (headwords, {REFERENCE['requests']} requests, "
                    f"{REFERENCE['max_new_tokens']} new tokens, batch {REFERENCE['batch_size']}): it takes no "
                    f"{', '.join(WORKLOAD_OPTIONS[d] for d in wrong)}")
        a.workload = "headwords"
        a.requests, a.max_new_tokens, a.batch_size = (REFERENCE[k] for k in ("requests", "max_new_tokens", "batch_size"))
    else:  # (an option the workload would ignore is refused)
        wrong = wl.unread(a.workload, given(_parser, argv, wl.READ_BY), sweep=bool(a.sweep))
        if wrong:
            p.error(wl.unread_error(a.workload, wrong))
    engines = list(dict.fromkeys(e for e in a.engines.split(",") if e))  # (each named once, in order)
    if not engines:
        p.error(f"--engines is empty; choose from {', '.join(ALL_ENGINES)}")
    if set(engines) - set(ALL_ENGINES):
        p.error(f"unknown engine(s) {sorted(set(engines) - set(ALL_ENGINES))}; choose from {', '.join(ALL_ENGINES)}")
    if "cbteach_paged_budget" not in engines and given(_parser, argv, ["token_budget"]):
        p.error("--token-budget is cbteach_paged_budget's token budget, and --engines does not run that engine")
    if a.sweep and a.workload not in ("length_variance", "poisson"):
        p.error("--sweep needs --workload length_variance (caps) or poisson (rates)")
    if a.sweep and (min(a.sweep) <= 0 or (a.workload == "length_variance" and min(a.sweep) < 1)):
        p.error("--sweep values must be caps >= 1 (length_variance) or rates > 0 (poisson)")
    if a.sweep and a.workload == "length_variance" and any(v != int(v) for v in a.sweep):
        p.error("--sweep caps for length_variance are whole numbers of tokens (e.g. 8,32,128)")
    slowest = min(a.sweep or [a.rate]) if a.workload == "poisson" else None
    if slowest is not None and a.requests / slowest > MAX_ARRIVAL_SPAN:  # (the run waits for them in real time)
        p.error(f"--{'sweep' if a.sweep else 'rate'}: {a.requests} requests at {slowest:g} a second arrive over about "
                f"{a.requests / slowest:,.0f} s of wall time, which the benchmark waits out: give at least "
                f"{a.requests / MAX_ARRIVAL_SPAN:g} a second")
    if a.json is not None and a.out is not None:
        p.error("--json names the results file, --out the folder for bench-<model>.json: give one, not both")
    path = a.json or (a.out or Path("benchmarks/results")) / f"bench-{a.model.replace('/', '_')}.json"
    problem = unwritable(path)  # found now, not after minutes of measuring
    if problem:
        p.error(f"cannot write the results to {path}: {problem}")
    return engines, path


def _print_history(sh: dict) -> None:
    """Step time and KV bytes per step, first tenth vs last tenth of a long decode, per cache."""
    for kv, r in sh.items():
        n = len(r["history"])
        head, tail = slice(0, max(1, n // 10)), slice(n - max(1, n // 10), n)
        avg = statistics.median  # a step now and then is slowed by something else on the machine
        key, verb = ("kv_bytes_copied", "copied") if kv == "concat" else ("kv_bytes_read", "read")
        print(f"  {kv:7s} step {avg(r['step_seconds'][head]) * 1e3:6.2f} ms -> "
              f"{avg(r['step_seconds'][tail]) * 1e3:6.2f} ms   KV {verb} {avg(r[key][head]) / 1e6:7.2f} MB -> "
              f"{avg(r[key][tail]) / 1e6:7.2f} MB per step ({key})")


def _measure(a, engines, model, tok, device):
    """Build the workload (or each sweep point), run the engines on it, print the sweep's lines.
    Returns (the last workload, its rows, the sweep's points or None, each engine's completions)."""
    build = lambda **kw: wl.build(a.workload, tok, a.requests, max_new_tokens=a.max_new_tokens,  # noqa: E731
                                  seed=a.seed, **{"cap": a.cap, "rate": a.rate, **kw})
    points = [build(**{"cap" if a.workload == "length_variance" else "rate":
                       int(v) if a.workload == "length_variance" else v}) for v in a.sweep] if a.sweep else [build()]
    workload = points[-1]
    print(f"workload: {workload.description}")
    print(f"engines: {', '.join(engines)}; at most {a.batch_size} sequences at a time; model {a.model} on "
          f"{device.type}{' (the reference configuration)' if _is_reference(a) else ''}")
    from tqdm.auto import tqdm

    kw = dict(ttft_target=a.ttft_target, tpot_target=a.tpot_target, token_budget=a.token_budget, repeat=a.repeat)
    captured: dict = {}
    points_out = None
    total = len(engines) * len(points) * (a.repeat + 1)  # (a warm-up run per engine at every point)
    with tqdm(total=total, desc="bench", unit="run", disable=a.no_progress, leave=False) as bar:
        if a.sweep:
            points_out = sweep(model, tok, points, a.batch_size, engines, bar=bar, **kw)
            rows = points_out[-1]["engines"]
        else:
            rows = compare(model, tok, workload, a.batch_size, engines, full_warmup=engines, bar=bar,
                           outputs=captured, **kw)
    if a.sweep:
        key = "cap" if a.workload == "length_variance" else "rate"
        for pt in points_out:
            cells = "  ".join(f"{n} {_fmt(r.get('tokens_per_s'), '.0f')}" for n, r in pt["engines"].items())
            print(f"  {key} {pt['workload']['params'][key]:g}: tokens/s  {cells}")
        print(f"  at {key} {points_out[-1]['workload']['params'][key]:g}:")
    return workload, rows, points_out, captured


def _is_reference(a) -> bool:
    return a.workload == "headwords" and all(getattr(a, k) == v for k, v in REFERENCE.items())


def cli(argv=None) -> int:
    p = _parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    a = p.parse_args(argv)
    engines, path = _check(p, a, argv)
    import torch

    from ..models import device_option

    try:
        device = device_option(a.device)
        model, tok = load_model(a.model, device=device)
    except ValueError as e:
        p.error(str(e))
    limit = max_positions(model.config)
    for flag, asked in (("--max-new-tokens", a.max_new_tokens), ("--history", a.history)):
        if limit is not None and asked and asked >= limit:  # (every engine would refuse every request)
            p.error(f"{flag} {asked} leaves no room for a prompt in {a.model}'s {limit} positions: at most {limit - 1}")
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    workload, rows, points_out, captured = _measure(a, engines, model, tok, device)
    print_table(rows, a.ttft_target, a.tpot_target)
    tg = targets(rows)
    done = next((captured[e] for e in ("hf_generate", "static", "cbteach_paged") if e in captured), None) \
        if not a.sweep else None
    lengths = [len(c.output_ids) for c in done] if done else None
    print_targets(rows, tg, lengths, a.batch_size)
    result = {"config": {"workload": a.workload, "model": a.model, "device": device.type, "requests": a.requests,
                         "batch_size": a.batch_size, "max_new_tokens": a.max_new_tokens, "engines": engines,
                         "token_budget": a.token_budget, "ttft_target": a.ttft_target, "tpot_target": a.tpot_target,
                         "repeat": a.repeat, "reference": _is_reference(a)},
              "workload": workload.summary(), "machine": machine_info(model), "engines": rows, "targets": tg}
    if a.sweep:
        result["sweep"] = points_out
    if a.history:
        print(f"step time vs history: {a.batch_size} sequences decoding {a.history} tokens")
        result["step_time_vs_history"] = step_time_vs_history(model, tok, a.batch_size, a.history)
        _print_history(result["step_time_vs_history"])
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(result), indent=1))
    print(f"wrote {path}")
    failed = [name for name, r in rows.items() if "error" in r]
    if failed and len(failed) == len(rows):  # (a broken engine among working ones is a result: reported, not fatal)
        print(f"every engine failed ({', '.join(failed)}): see the table above", file=sys.stderr)
        return 1
    return 0
