"""``python -m cbteach bench``: serving engines on one workload, one process, same tokens -- throughput and latency.

**Workloads** (:mod:`cbteach.workloads`, seeded and offline): ``headwords`` (the model stops at
EOS), ``length_variance`` (Anyscale's: exponential output lengths clipped at ``--cap``, EOS
ignored), ``poisson`` (headwords arriving at ``--rate`` requests/s) and ``chat`` (a synthetic
long-tailed mix shaped like ShareGPT). Every prompt is token ids; ``--requests`` of them.

**Engines**, all on the same requests in one process, at most ``--max-batch-size`` sequences at once:

* ``hf_generate`` -- transformers' ``model.generate``, one request at a time (the ground truth);
* ``hf_batch_generate`` -- ``model.generate`` on left-padded batches of ``--max-batch-size``
  (a batch runs until its longest request is done: static batching, as transformers does it);
* ``static`` -- :func:`cbteach.static_batching`: the same, in this package;
* ``cbteach_concat`` / ``cbteach_paged`` -- our continuous-batching engine with each KV cache;
* ``cbteach_paged_budget`` -- the paged engine with a ``--token-budget`` (chunked prefill);
* ``transformers_cb`` -- transformers' own continuous batching (``generate_batch``'s manager),
  sized like ours: 16-token pages, the same batch size, a pool just big enough.

With arrival times (``poisson``), the continuous engines admit a request once it has arrived;
the batch engines (``hf_*``, ``static``) serve in waves: a wave takes up to a batch of the
requests that have arrived when the previous wave ends (waiting for the first if none has).

**Hygiene.** One process, one thread (``--threads``), every engine warmed up first (the whole
workload, untimed: lazy imports, allocator growth, kernel selection), then ``--repeat`` timed runs
interleaved across engines, the run of median wall time reported. Greedy fp32: every engine must
produce the tokens of per-prompt ``generate`` (``matched``), else a speed-up is meaningless.

**Metrics** per engine (vLLM's definitions, :mod:`cbteach.metrics`, times in seconds): TTFT,
TPOT, ITL, E2E (mean, p50, p90, p99); output tokens/s and requests/s over first arrival -> last
finish; goodput (requests/s meeting ``--ttft-target`` and ``--tpot-target``); for our engines the
forward steps, preemptions and largest batch, and for paged ones the KV utilisation of the warm-up
run (tokens stored / slots set aside, beside what a contiguous ``prompt + max_new_tokens``
reservation would give).

**Ideal vs measured speed-up.** A step produces one token per busy slot. Static batching keeps a
slot until the wave's longest request is done, so it needs ``sum over waves of the longest output``
steps; continuous batching refills a slot as soon as it frees, so it needs about
``max(total tokens / batch size, longest output)``. *Ideal speed-up* = static steps / continuous
steps, what slot arithmetic predicts if every step cost the same. *Measured* = static seconds /
continuous seconds. The gap is what the engine's steps cost beyond static's: packing, metadata,
paged attention's gather, a bigger prefill mixed into a decode step.

**Step time vs history** (``--history``). A fixed batch decodes long outputs (``ignore_eos``). Per
step: forward time, ``kv_bytes_copied`` (concat: the history gathered and scattered every step --
it grows) and ``kv_bytes_read`` (paged: what attention reads through the block tables).

**Targets** (CPU, reference configuration ``--reference`` = 64 headwords, 300 new tokens, batch 16):
``cbteach_paged`` measured speed-up >= 0.9 x ideal, and ``cbteach_paged`` >= 1.5 x
``transformers_cb`` tokens/s. Printed as met / not met, never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import replace
from pathlib import Path

from . import workloads as wl
from .metrics import summarize
from .models import load_model
from .bench_engines import (MEMORY_KEYS, PAGE, TOKEN_BUDGET, run_cbteach, run_hf_batch_generate,  # noqa: F401
                            run_hf_generate, run_static, run_transformers_cb, runners, transformers_cb_config)
from .bench_experiments import (contiguous_batch_size, decode_step_times, headword_requests,  # noqa: F401
                                kv_bytes_per_token, machine_info, memory_bound, random_llama, step_time_vs_history)

ENGINES = ("static", "cbteach_concat", "cbteach_paged", "transformers_cb")  # what tools/gpu_check.py compares
ALL_ENGINES = ("hf_generate", "hf_batch_generate", "static", "cbteach_concat", "cbteach_paged",
               "cbteach_paged_budget", "transformers_cb")
REFERENCE = {"requests": 64, "max_new_tokens": 300, "batch_size": 16}
TARGET_VS_IDEAL = 0.9  # cbteach_paged measured speed-up over static >= this x the ideal one
TARGET_VS_TRANSFORMERS = 1.5  # cbteach_paged tokens/s >= this x transformers_cb's
METRICS = ("ttft", "tpot", "itl", "e2e")


# -- slot arithmetic and targets (pure; tested on hand-made numbers) ---------------------------
def ideal_speedup(static_steps: int, continuous_steps: int) -> float:
    """Static steps / continuous steps: the speed-up if every step cost the same."""
    return static_steps / continuous_steps if continuous_steps else math.nan


def slot_steps(lengths: list[int], batch_size: int) -> dict:
    """Steps each strategy needs for outputs of ``lengths`` (prefill makes the first token).

    Static: each wave of ``batch_size`` runs as long as its longest output. Continuous: at least
    ``ceil(total / batch_size)`` steps (one token per slot per step), and at least the longest output.
    """
    waves = [lengths[i:i + batch_size] for i in range(0, len(lengths), batch_size)]
    static = sum(max(w) for w in waves)
    continuous = max(math.ceil(sum(lengths) / batch_size), max(lengths, default=0))
    return {"static": static, "continuous": continuous, "ideal_speedup": ideal_speedup(static, continuous)}


def targets(rows: dict) -> dict:
    """The two targets on a throughput result: value, goal and met (None when not measurable)."""
    st, pg, tf = (rows.get(k, {}) for k in ("static", "cbteach_paged", "transformers_cb"))
    ideal = ideal_speedup(st.get("steps") or 0, pg.get("steps") or 0)
    measured = st["seconds"] / pg["seconds"] if st.get("seconds") and pg.get("seconds") else math.nan
    vs_tf = pg["tokens_per_s"] / tf["tokens_per_s"] if pg.get("tokens_per_s") and tf.get("tokens_per_s") else math.nan
    out = {"paged_vs_ideal": {"value": measured / ideal if ideal == ideal else math.nan, "goal": TARGET_VS_IDEAL,
                              "measured_speedup": measured, "ideal_speedup": ideal},
           "paged_vs_transformers_cb": {"value": vs_tf, "goal": TARGET_VS_TRANSFORMERS}}
    for t in out.values():
        t["met"] = None if t["value"] != t["value"] else bool(t["value"] >= t["goal"])
    return out


# -- measuring ---------------------------------------------------------------------------------------
def measure(completions, wall_seconds, steps, ttft_target=None, tpot_target=None) -> dict:
    """One engine's row: :func:`cbteach.metrics.summarize` (tokens, rates, goodput, latency statistics),
    ``seconds`` = its ``duration`` (first arrival -> last finish: the span every rate is over),
    ``wall_seconds`` (the whole call, building the engine included) and forward ``steps``."""
    row = summarize(completions, ttft_target=ttft_target, tpot_target=tpot_target)
    row.update(seconds=row["duration"], wall_seconds=wall_seconds, steps=steps, tokens=row["output_tokens"])
    return row


def run_engine(name, model, tok, workload, batch_size, *, first=False, ttft_target=None, tpot_target=None,
               **pool) -> tuple[dict, list]:
    """Serve ``workload`` (a :class:`~cbteach.workloads.Workload` or a request factory) once with
    engine ``name``; returns ``(row, completions)``. No warm-up: see :func:`compare`."""
    if name not in ALL_ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ALL_ENGINES)}")
    run = runners(model, tok, batch_size, **pool)[name]
    reqs = workload()
    t0 = time.perf_counter()
    extra, comps, steps = run(reqs, first)
    row = measure(comps, time.perf_counter() - t0, steps, ttft_target, tpot_target)
    row.update(extra)
    return row, comps


def _offline(make_requests, n=None, max_new=None):
    """The requests without arrival times (warm-ups do not wait for arrivals), optionally the first
    ``n`` of them with outputs capped at ``max_new``."""
    reqs = make_requests()[:n]
    return [replace(r, arrival_time=None, max_new_tokens=min(r.max_new_tokens, max_new or r.max_new_tokens))
            for r in reqs]


def compare(model, tok, make_requests, batch_size, engines=ENGINES, full_warmup=ENGINES, num_blocks=None,
            bar=None, *, repeat=1, ttft_target=None, tpot_target=None, token_budget=TOKEN_BUDGET,
            kv_memory_bytes=None, outputs=None) -> dict:
    """Warm up and time each engine on ``make_requests()`` (a workload or any request factory); one row each.

    Engines in ``full_warmup`` first run the whole workload untimed (without arrival times; its seconds:
    ``first_run_seconds``); the others warm up on one short wave. Then ``repeat`` timed runs,
    interleaved across engines; the run of median wall time is reported (``repeats``: every run's
    seconds). ``matched``: the engine's tokens equal the reference engine's (``hf_generate`` when it
    ran, else ``static``; ``reference_engine`` in every row); ``identical_to_static`` as well.
    A failing engine gets ``{"error": ...}`` and the rest still run. Pass a dict as ``outputs`` to
    get every engine's completions (of the reported run) back in it.
    """
    run = runners(model, tok, batch_size, token_budget=token_budget, num_blocks=num_blocks,
                  kv_memory_bytes=kv_memory_bytes)
    unknown = set(engines) - set(run)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from {', '.join(ALL_ENGINES)}")
    rows, first, runs = {}, {}, {name: [] for name in engines}
    for name in engines:  # warm-up: first-run effects stay out of the timed runs
        bar is not None and bar.set_postfix_str(f"{name} (warm-up)")
        try:
            reqs = _offline(make_requests) if name in full_warmup else _offline(make_requests, batch_size, 8)
            t0 = time.perf_counter()
            extra, _, _ = run[name](reqs, True)
            first[name] = {"first_run_seconds": time.perf_counter() - t0,
                           **{k: v for k, v in extra.items() if k in MEMORY_KEYS}}
        except Exception as err:  # noqa: BLE001  (a benchmark reports a broken engine and goes on)
            rows[name] = _failed(err)
        bar is not None and bar.update(1)
    for _ in range(repeat):
        for name in engines:
            if name in rows:
                continue
            bar is not None and bar.set_postfix_str(name)
            try:
                reqs = make_requests()
                t0 = time.perf_counter()
                extra, comps, steps = run[name](reqs, False)
                runs[name].append((time.perf_counter() - t0, extra, comps, steps))
            except Exception as err:  # noqa: BLE001
                rows[name] = _failed(err)
            bar is not None and bar.update(1)
    outs = {}
    for name in engines:
        if name in rows:
            continue
        measured = []
        for wall, extra, comps, steps in runs[name]:
            row = measure(comps, wall, steps, ttft_target, tpot_target)
            row.update(extra)
            measured.append((row, comps))
        row, comps = sorted(measured, key=lambda x: x[0]["seconds"])[(len(measured) - 1) // 2]  # the median run
        row.update(first[name])  # the warm-up's memory figures (it kept records) win over the timed run's
        row["repeats"] = [m[0]["seconds"] for m in measured]
        rows[name] = row
        outs[name] = [c.output_ids for c in comps]
        if outputs is not None:
            outputs[name] = comps
    ref = "hf_generate" if "hf_generate" in outs else "static" if "static" in outs else None
    for name in outs:
        rows[name]["reference_engine"] = ref
        rows[name]["matched"] = None if ref is None else outs[name] == outs[ref]
        if "static" in outs and name != "static":
            rows[name]["identical_to_static"] = outs[name] == outs["static"]
    return {name: rows[name] for name in engines}


def _failed(err) -> dict:
    return {"error": f"{type(err).__name__}: {err}", "tokens_per_s": None, "seconds": None, "steps": None}


def sweep(model, tok, workloads, batch_size, engines=ALL_ENGINES, bar=None, outputs=None, **kw) -> list[dict]:
    """:func:`compare` on each workload in turn (a cap sweep, a rate sweep): ``[{"workload", "engines"}]``.
    Only the first point warms up on the whole workload; the engines are warm after it. Pass a list
    as ``outputs`` to get each point's completions (``{engine: completions}``) appended to it."""
    out = []
    for k, w in enumerate(workloads):
        got: dict = {}
        rows = compare(model, tok, w, batch_size, engines, full_warmup=engines if k == 0 else (), bar=bar,
                       outputs=got, **kw)
        out.append({"workload": w.summary(), "engines": rows})
        if outputs is not None:
            outputs.append(got)
    return out


# -- the command -------------------------------------------------------------------------------
def clean(x):
    """NaN -> None, recursively, so the JSON is strict."""
    if isinstance(x, (dict, list, tuple)):
        return {k: clean(v) for k, v in x.items()} if isinstance(x, dict) else [clean(v) for v in x]
    return None if isinstance(x, float) and x != x else x


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
    print(f"  speed-up of cbteach_paged over static: measured {_fmt(a['measured_speedup'], '.2f')}x, "
          f"ideal (static steps / continuous steps) {_fmt(a['ideal_speedup'], '.2f')}x")
    if lengths and batch_size:
        s = slot_steps(lengths, batch_size)
        print(f"  slot arithmetic on the output lengths: static {s['static']} steps, continuous >= {s['continuous']}"
              f" -> ideal speed-up <= {s['ideal_speedup']:.2f}x")
    verdict = {True: "met", False: "NOT met", None: "not measured"}
    print(f"  target: paged speed-up >= {a['goal']} x ideal: {_fmt(a['value'], '.2f')} x -> {verdict[a['met']]}")
    print(f"  target: paged >= {b['goal']} x transformers_cb tok/s: {_fmt(b['value'], '.2f')} x -> {verdict[b['met']]}")


def _floats(text):
    return [float(x) for x in text.split(",") if x]


def cli(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cbteach bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="headwords", choices=wl.WORKLOADS)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-batch-size", "--batch-size", dest="batch_size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128, help="output cap of headwords and poisson")
    p.add_argument("--cap", type=int, default=64, help="length_variance: the cap on exponential output lengths")
    p.add_argument("--rate", type=float, default=8.0, help="poisson: requests per second")
    p.add_argument("--sweep", type=_floats, default=None, metavar="V1,V2,...",
                   help="run length_variance at each cap, or poisson at each rate ('sweep' in the JSON; "
                        "'engines' holds the last point)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="bierce")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, mps, or auto (the best there is)")
    p.add_argument("--reference", action="store_true",
                   help="the targets' configuration: headwords, --requests 64 --max-new-tokens 300 --batch-size 16")
    p.add_argument("--engines", default=",".join(ALL_ENGINES),
                   help="comma-separated subset of " + ", ".join(ALL_ENGINES))
    p.add_argument("--token-budget", type=int, default=TOKEN_BUDGET, help="cbteach_paged_budget's token budget")
    p.add_argument("--ttft-target", type=float, default=1.0, help="goodput: TTFT target in seconds")
    p.add_argument("--tpot-target", type=float, default=0.05, help="goodput: TPOT target in seconds")
    p.add_argument("--repeat", type=int, default=1, help="timed runs per engine (the median is reported)")
    p.add_argument("--history", type=int, default=256, help="decode steps for the step-time experiment (0: skip)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for bench-<model>.json")
    p.add_argument("--json", type=Path, default=None, help="write the results here instead")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: a 2M-parameter model gains nothing from more, "
                        "and timings on a shared machine stay steady)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    if a.reference:
        a.workload = "headwords"
        a.requests, a.max_new_tokens, a.batch_size = (REFERENCE[k] for k in ("requests", "max_new_tokens", "batch_size"))
    engines = [e for e in a.engines.split(",") if e]
    if set(engines) - set(ALL_ENGINES):
        p.error(f"unknown engine(s) {sorted(set(engines) - set(ALL_ENGINES))}; choose from {', '.join(ALL_ENGINES)}")
    if a.repeat < 1 or a.requests < 1 or a.batch_size < 1:
        p.error("--repeat, --requests and --max-batch-size must be >= 1")
    if a.sweep and a.workload not in ("length_variance", "poisson"):
        p.error("--sweep needs --workload length_variance (caps) or poisson (rates)")
    import torch

    from .models import pick_device

    device = pick_device(None if a.device == "auto" else a.device)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, device=device)
    build = lambda **kw: wl.build(a.workload, tok, a.requests, max_new_tokens=a.max_new_tokens,  # noqa: E731
                                  seed=a.seed, **{"cap": a.cap, "rate": a.rate, **kw})
    points = [build(**{"cap" if a.workload == "length_variance" else "rate":
                       int(v) if a.workload == "length_variance" else v}) for v in a.sweep] if a.sweep else [build()]
    workload = points[-1]
    ref = a.workload == "headwords" and all(getattr(a, k) == v for k, v in REFERENCE.items())
    print(f"workload: {workload.description}")
    print(f"engines: {', '.join(engines)}; at most {a.batch_size} sequences at a time; model {a.model} on "
          f"{device.type}{' (the reference configuration)' if ref else ''}")
    from tqdm.auto import tqdm

    kw = dict(ttft_target=a.ttft_target, tpot_target=a.tpot_target, token_budget=a.token_budget, repeat=a.repeat)
    total = len(engines) * (len(points) * a.repeat + 1)
    with tqdm(total=total, desc="bench", unit="run", disable=a.no_progress, leave=False) as bar:
        if a.sweep:
            points_out = sweep(model, tok, points, a.batch_size, engines, bar=bar, **kw)
            rows = points_out[-1]["engines"]
        else:
            captured: dict = {}
            rows = compare(model, tok, workload, a.batch_size, engines, full_warmup=engines, bar=bar,
                           outputs=captured, **kw)
    if a.sweep:
        key = "cap" if a.workload == "length_variance" else "rate"
        for pt in points_out:
            cells = "  ".join(f"{n} {_fmt(r.get('tokens_per_s'), '.0f')}" for n, r in pt["engines"].items())
            print(f"  {key} {pt['workload']['params'][key]:g}: tokens/s  {cells}")
        print(f"  at {key} {points_out[-1]['workload']['params'][key]:g}:")
    print_table(rows, a.ttft_target, a.tpot_target)
    tg = targets(rows)
    done = next((captured[e] for e in ("hf_generate", "static", "cbteach_paged") if e in captured), None) \
        if not a.sweep else None
    lengths = [len(c.output_ids) for c in done] if done else None
    print_targets(rows, tg, lengths, a.batch_size)
    result = {"config": {"workload": a.workload, "model": a.model, "device": device.type, "requests": a.requests,
                         "batch_size": a.batch_size, "max_new_tokens": a.max_new_tokens, "engines": engines,
                         "token_budget": a.token_budget, "ttft_target": a.ttft_target, "tpot_target": a.tpot_target,
                         "repeat": a.repeat, "reference": ref},
              "workload": workload.summary(), "machine": machine_info(model), "engines": rows, "targets": tg}
    if a.sweep:
        result["sweep"] = points_out
    if a.history:
        print(f"step time vs history: {a.batch_size} sequences decoding {a.history} tokens")
        sh = result["step_time_vs_history"] = step_time_vs_history(model, tok, a.batch_size, a.history)
        for kv, r in sh.items():
            n = len(r["history"])
            head, tail = slice(0, max(1, n // 10)), slice(n - max(1, n // 10), n)
            avg = statistics.median  # a step now and then is slowed by something else on the machine
            key, verb = ("kv_bytes_copied", "copied") if kv == "concat" else ("kv_bytes_read", "read")
            print(f"  {kv:7s} step {avg(r['step_seconds'][head]) * 1e3:6.2f} ms -> "
                  f"{avg(r['step_seconds'][tail]) * 1e3:6.2f} ms   KV {verb} {avg(r[key][head]) / 1e6:7.2f} MB -> "
                  f"{avg(r[key][tail]) / 1e6:7.2f} MB per step ({key})")
    path = a.json or a.out / f"bench-{a.model.replace('/', '_')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean(result), indent=1))
    print(f"wrote {path}")
    return 0
