"""``python -m cbteach bench``: serving engines on one workload, one process, same tokens -- throughput and latency.

**Workloads** (:mod:`cbteach.serving.workloads`, seeded and offline): ``headwords`` (the model stops at
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

**Metrics** per engine (vLLM's definitions, :mod:`cbteach.serving.metrics`, times in seconds): TTFT,
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
``cbteach_paged`` measured speed-up >= 0.95 x ideal (:data:`TARGET_VS_IDEAL`), ``cbteach_paged`` >= 1.5 x
``transformers_cb`` tokens/s, paged no slower than static, and async scheduling's time outside the
forward within its share. Printed as met / not met, never asserted.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

from ..serving.metrics import summarize
from .engines import (MEMORY_KEYS, PAGE, TOKEN_BUDGET, run_cbteach, run_hf_batch_generate,  # noqa: F401
                            run_hf_generate, run_static, run_transformers_cb, runners, transformers_cb_config)
from .experiments import (contiguous_batch_size, decode_step_times, headword_requests,  # noqa: F401
                          kv_bytes_per_token, machine_info, random_llama, step_time_vs_history)

ENGINES = ("static", "cbteach_concat", "cbteach_paged", "transformers_cb")  # what tools/gpu_check.py compares
ALL_ENGINES = ("hf_generate", "hf_batch_generate", "static", "cbteach_concat", "cbteach_paged",
               "cbteach_paged_budget", "cbteach_paged_async", "transformers_cb")
REFERENCE = {"requests": 64, "max_new_tokens": 300, "batch_size": 16}
TARGET_VS_IDEAL = 0.95  # cbteach_paged measured speed-up over static >= this x the ideal one
TARGET_VS_TRANSFORMERS = 1.5  # cbteach_paged tokens/s >= this x transformers_cb's
TARGET_VS_STATIC = 1.0  # cbteach_paged no slower than static batching
TARGET_HOST_FRACTION = 0.05  # with async scheduling, at most this share of the serving loop outside the forward
METRICS = ("ttft", "tpot", "itl", "e2e")


# -- slot arithmetic and targets (pure; tested on hand-made numbers) ---------------------------
def ideal_speedup(static_steps: int, continuous_steps: int) -> float:
    """Static steps / continuous steps: the speed-up if every step cost the same (NaN when either
    engine did not run)."""
    return static_steps / continuous_steps if continuous_steps and static_steps else math.nan


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
    """The targets on a throughput result: value, goal and met (None when not measurable). Higher is
    better for each, but ``async_host_fraction`` (the share of the async engine's loop spent outside
    the model's forward), which must stay at or under its goal."""
    st, pg, tf = (rows.get(k, {}) for k in ("static", "cbteach_paged", "transformers_cb"))
    asy = rows.get("cbteach_paged_async", {})
    ideal = ideal_speedup(st.get("steps") or 0, pg.get("steps") or 0)
    measured = st["seconds"] / pg["seconds"] if st.get("seconds") and pg.get("seconds") else math.nan
    vs_tf = pg["tokens_per_s"] / tf["tokens_per_s"] if pg.get("tokens_per_s") and tf.get("tokens_per_s") else math.nan
    out = {"paged_vs_ideal": {"value": measured / ideal if ideal == ideal else math.nan, "goal": TARGET_VS_IDEAL,
                              "measured_speedup": measured, "ideal_speedup": ideal},
           "paged_vs_transformers_cb": {"value": vs_tf, "goal": TARGET_VS_TRANSFORMERS},
           "paged_vs_static": {"value": measured, "goal": TARGET_VS_STATIC},
           "async_host_fraction": {"value": asy.get("host_fraction", math.nan), "goal": TARGET_HOST_FRACTION}}
    for name, t in out.items():
        v = t["value"]
        t["met"] = None if v != v else bool(v <= t["goal"] if name == "async_host_fraction" else v >= t["goal"])
    return out


# -- measuring ---------------------------------------------------------------------------------------
def measure(completions, wall_seconds, steps, ttft_target=None, tpot_target=None) -> dict:
    """One engine's row: :func:`cbteach.serving.metrics.summarize` (tokens, rates, goodput, latency statistics),
    ``seconds`` = its ``duration`` (first arrival -> last finish: the span every rate is over),
    ``wall_seconds`` (the whole call, building the engine included) and forward ``steps``."""
    row = summarize(completions, ttft_target=ttft_target, tpot_target=tpot_target)
    row.update(seconds=row["duration"], wall_seconds=wall_seconds, steps=steps, tokens=row["output_tokens"])
    return row


def run_engine(name, model, tok, workload, batch_size, *, first=False, ttft_target=None, tpot_target=None,
               **pool) -> tuple[dict, list]:
    """Serve ``workload`` (a :class:`~cbteach.serving.workloads.Workload` or a request factory) once with
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


def memory_bound(model, tok, workload, kv_tokens: int, reserve_new_tokens: int, max_batch_size: int = 64,
                 block_size: int = PAGE) -> dict:
    """vLLM's memory-bound comparison on one KV budget of ``kv_tokens`` tokens.

    ``contiguous`` emulates a system that reserves ``prompt + reserve_new_tokens`` per request at
    admission (Orca with a maximum-length reservation): our paged engine with the same pool, its batch
    capped at the number of reservations that fit (:func:`contiguous_batch_size`), so the pool is never
    the limit -- the reservation arithmetic is. ``paged`` is the same pool handed out block by block,
    up to ``max_batch_size`` sequences (preempting when it runs out). Returns ``{"contiguous": row,
    "paged": row}`` (rows of :func:`run_engine`, with ``kv_tokens`` and ``max_batch_size`` added)."""
    budget = kv_tokens * kv_bytes_per_token(model)
    out = {}
    for label, b in (("contiguous", contiguous_batch_size(kv_tokens, workload, reserve_new_tokens)),
                     ("paged", max_batch_size)):
        row, _ = run_engine("cbteach_paged", model, tok, workload, b, kv_memory_bytes=budget)
        out[label] = {**row, "kv_tokens": kv_tokens, "max_batch_size": b}
    return out


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
    if isinstance(engines, str):
        engines = [e for e in engines.split(",") if e]
    if not isinstance(repeat, int) or isinstance(repeat, bool) or repeat < 1:
        raise ValueError(f"repeat must be an integer >= 1 (timed runs per engine), got {repeat!r}")
    run = runners(model, tok, batch_size, token_budget=token_budget, num_blocks=num_blocks,
                  kv_memory_bytes=kv_memory_bytes)
    unknown = set(engines) - set(run)
    if unknown:
        raise ValueError(f"unknown engine(s) {sorted(unknown)}; choose from {', '.join(ALL_ENGINES)}")
    rows: dict = {}  # engine -> its row; a failing engine gets {"error": ...} and drops out
    first = _warm_up(run, engines, make_requests, batch_size, full_warmup, bar, rows)
    runs = _timed_runs(run, engines, make_requests, repeat, bar, rows)
    outs = {}
    for name in engines:
        if name in rows:
            continue
        row, comps = _median_run(runs[name], ttft_target, tpot_target)
        row.update(first[name])  # the warm-up's memory figures (it kept records) win over the timed run's
        rows[name] = row
        outs[name] = [c.output_ids for c in comps]
        if outputs is not None:
            outputs[name] = comps
    ref = "hf_generate" if "hf_generate" in outs else "static" if "static" in outs else None
    if ref is None and outs:  # neither ran timed: per-prompt generate once, untimed, so exactness is still checked
        ref = "hf_generate (untimed)"
        try:
            outs[ref] = [c.output_ids for c in run["hf_generate"](make_requests(), False)[1]]
        except Exception as err:  # noqa: BLE001 -- then nothing to compare with, and the rows say so
            ref = f"nothing (hf_generate failed: {type(err).__name__})"
    for name in [n for n in outs if n in rows]:
        rows[name]["reference_engine"] = ref
        rows[name]["matched"] = outs[name] == outs[ref] if ref in outs else None
        if "static" in outs and name != "static":
            rows[name]["identical_to_static"] = outs[name] == outs["static"]
    return {name: rows[name] for name in engines}


def _warm_up(run, engines, make_requests, batch_size, full_warmup, bar, rows) -> dict:
    """One untimed run per engine, so first-run effects (allocations, kernel set-up) stay out of the
    timed ones: the whole workload for engines in ``full_warmup``, one short wave for the others."""
    first = {}
    for name in engines:
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
    return first


def _timed_runs(run, engines, make_requests, repeat, bar, rows) -> dict:
    """``repeat`` timed runs per engine, interleaved across engines (a slow spell of the machine
    then hits every engine alike); each run: (wall seconds, extra figures, completions, steps)."""
    runs = {name: [] for name in engines}
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
    return runs


def _median_run(runs, ttft_target, tpot_target) -> tuple[dict, list]:
    """The row and completions of the run of median wall time; ``repeats``: every run's seconds."""
    measured = []
    for wall, extra, comps, steps in runs:
        row = measure(comps, wall, steps, ttft_target, tpot_target)
        row.update(extra)
        measured.append((row, comps))
    row, comps = sorted(measured, key=lambda x: x[0]["seconds"])[(len(measured) - 1) // 2]
    row["repeats"] = [m[0]["seconds"] for m in measured]
    return row, comps


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
